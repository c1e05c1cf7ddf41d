#!/usr/bin/env bash
# 8 ViPE parity runs (GPU preset, 1500 steps) by train.py --jobs 8: on GPU 0 alone, then on both GPUs
cd "$(dirname "$0")/../../.."   # the repository root; OUT: a folder for the logs
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
for G in 0 0,1; do
  tic=$SECONDS
  CUDA_VISIBLE_DEVICES=$G timeout -k 10 150 python train.py --task parity --method vipe --seeds 0,1,2,3,4,5,6,7 --jobs 8 \
    --steps 1500 --n-eval 8 --test-lengths 16 --out /tmp/j$G > $OUT/log_$G.txt 2>&1
  echo "rc=$? wall=$((SECONDS - tic)) s" >> $OUT/log_$G.txt
  python - "$G" >> $OUT/log_$G.txt <<'PY'
import json, glob, re, sys
G = sys.argv[1]; rates = []
for p in sorted(glob.glob(f"/tmp/j{G}/parity/vipe/seed*/metrics.json")):
    m = json.load(open(p)); log = open(p.replace("metrics.json", "train.log")).read()
    dev = re.search(r"CUDA_VISIBLE_DEVICES=(\S+?),? ", log)
    rates.append(m["steps_per_s"]); print(p.split("/")[-2], m["steps_per_s"], dev.group(1) if dev else "-", m["git"])
print(f"GPUs {G}: {len(rates)} runs, {sum(rates):.1f} steps/s in all")
PY
done

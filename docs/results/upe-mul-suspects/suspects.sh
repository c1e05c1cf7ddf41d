# usage: bash gpu_cmds/suspects.sh LIMIT_S [--resume]
set -x
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d
git log --oneline | head -1
B="python train.py --task mul_padded --method upe --preset gpu --seeds 0 --steps 30000 --batch-size 64 --lr 0.0001 --weight-decay 0.0001 --min-lr-ratio 1.0 --train-set 500000 --eval-every 10000 --d-model 768 --n-layers 9 --n-heads 8 --dropout 0.1 --out runs --workers 3 --task-opt multiplier_digits=3"
(timeout -s INT $1 $B --tag m3-post-30k --norm post $2 > $OUT/post.txt 2>&1) &
(timeout -s INT $1 $B --tag m3-fp32-30k --precision fp32 $2 > $OUT/fp32.txt 2>&1) &
(timeout -s INT $1 $B --tag m3-low1-30k --task-opt multiplier_low=1 $2 > $OUT/low1.txt 2>&1) &
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
wait
for t in post fp32 low1; do grep -E "step|exact|stopped|checkpoint" $OUT/$t.txt | tail -4; done
ls -la runs/mul_padded/upe-m3-*-30k/seed0/
tar czf $OUT/suspects.tgz runs/mul_padded/upe-m3-*-30k/seed0/train.log $(ls runs/mul_padded/upe-m3-*-30k/seed0/metrics.json 2>/dev/null)

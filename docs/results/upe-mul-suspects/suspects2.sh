set -x
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
pgrep -f nvidia-cuda-mps-control >/dev/null || { mkdir -p /tmp/mps-pipe /tmp/mps-log; nvidia-cuda-mps-control -d; }
B="python train.py --task mul_padded --method upe --preset gpu --seeds 0 --steps 30000 --batch-size 64 --lr 0.0001 --weight-decay 0.0001 --min-lr-ratio 1.0 --train-set 500000 --eval-every 10000 --d-model 768 --n-layers 9 --n-heads 8 --dropout 0.1 --out runs --workers 3 --task-opt multiplier_digits=3"
(timeout -s INT $1 $B --tag m3-post-30k --norm post --resume > $OUT/post2.txt 2>&1) &
(timeout -s INT $1 $B --tag m3-low1-30k --task-opt multiplier_low=1 --resume > $OUT/low1_2.txt 2>&1) &
sleep 45; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
wait
for t in post2 low1_2; do grep -v "^  step" $OUT/$t.txt | tail -8; grep "^  step" $OUT/$t.txt | tail -2; done
tar czf $OUT/suspects2.tgz $(ls runs/mul_padded/upe-m3-*-30k/seed0/metrics.json runs/mul_padded/upe-m3-*-30k/seed0/train.log 2>/dev/null) /dev/null

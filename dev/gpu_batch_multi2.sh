#!/usr/bin/env bash
# Multi-GPU batch 2 of 2 (issue #13; 2 x H200, NCCL; one device call, < 9 min): GPT-2 124M fp32 (global B=16,
# T=1024, 25 steps, 5 warm-up) tokens/s and peak memory per GPU: BluTrain single (B=8 per GPU: DDP scaling
# efficiency), DDP, FSDP, TP sync/async (4 chunks), CP p2p beside PyTorch single/DDP/FSDP2/context parallel; then
# the BluTrain DDP bucket sweep (5-100 MB). Results: $OUT/dtms_gpt2_bench_h200.json, $OUT/dtms_gpt2_sweep_h200.json.
source dev/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # machine rule: never NVLink multicast
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}
echo "== snap $(cat SNAP_COMMIT 2>/dev/null) gpus: $(nvidia-smi -L 2>/dev/null | wc -l)"
(timeout 330 python3 benchmarks/dtms_gpt2.py --part bench --nproc 2 --batch 16 --seq 1024 --steps 25 --warmup 5 \
  --tp-chunks 4 --timeout 75 --out $OUT/dtms_gpt2_bench_h200.json 2>&1 | grep -v Warning | cut -c1-400 | tail -14)
(timeout 180 python3 benchmarks/dtms_gpt2.py --part sweep --nproc 2 --batch 16 --seq 1024 --steps 20 --warmup 5 \
  --buckets 5,10,25,50,100 --timeout 45 --out $OUT/dtms_gpt2_sweep_h200.json 2>&1 | cut -c1-400 | tail -7)

#!/usr/bin/env bash
# Multi-GPU batch 1 of 2 (issue #13; 2 x H200, NCCL; one device call, < 9 min): a 2-rank NCCL sanity run of the dtms
# collectives, then GPT-2 124M fp32 (global B=8, T=1024, 50 steps) under BluTrain DDP, FSDP, TP sync/async and CP
# (p2p/allgather/alltoall) vs the single-GPU run (CP also at T=16384, 5 steps), then the orchestrator's
# kill-a-rank recovery over NCCL (clean vs rank 1 SIGKILLed: losses and final state must be ==).
# Results: $OUT/dtms_gpt2_equivalence_h200.json, $OUT/dtms_gpt2_recovery_h200.json (copy to benchmarks/results/).
source dev/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # machine rule: never NVLink multicast
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}
mkdir -p $OUT/nccl
echo "== snap $(cat SNAP_COMMIT 2>/dev/null) gpus: $(nvidia-smi -L 2>/dev/null | wc -l)"
(timeout 45 python3 -m dtms.run --nproc-per-node 2 --log-dir $OUT/nccl/logs packages/dtms/dev/nccl_worker.py $OUT/nccl \
  2>&1 | tail -3; cat $OUT/nccl/nccl_rank*.json 2>/dev/null; echo)
(timeout 320 python3 benchmarks/dtms_gpt2.py --part equivalence --nproc 2 --batch 8 --seq 1024 --steps 50 \
  --long-seq 16384 --long-batch 1 --long-steps 5 --timeout 100 --out $OUT/dtms_gpt2_equivalence_h200.json \
  2>&1 | grep -v Warning | cut -c1-400 | tail -16)
(timeout 140 python3 benchmarks/dtms_gpt2.py --part recovery --nproc 2 --timeout 65 \
  --out $OUT/dtms_gpt2_recovery_h200.json 2>&1 | cut -c1-700 | tail -3)

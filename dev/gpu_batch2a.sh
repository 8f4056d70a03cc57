#!/usr/bin/env bash
# GPU batch 2a: blutensor CUDA tests + fused kernels, BluBLAS, dtms NCCL.
source dev/gpu_env.sh
mkdir -p $OUT/bt $OUT/kern $OUT/blas $OUT/dtms
(timeout 200 python3 packages/blutensor/dev/gpu_check.py $OUT/bt 2>&1 | tail -25) 
(timeout 230 python3 packages/blutensor/dev/gpu_check_kernels.py $OUT/kern 2>&1 | tail -60)
(timeout 90 python3 packages/dtms/dev/gpu_check.py $OUT/dtms 2>&1 | tail -15)
(BLUBLAS_CHECK_QUICK=1 timeout 60 python3 packages/blublas/dev/gpu_check.py $OUT/blas 2>&1 | tail -20)

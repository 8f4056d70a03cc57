#!/usr/bin/env bash
# GPU batch 4: memory-lean runs (80 layers with a small lr; 124M lean vs PyTorch), TF32 with cuBLAS, kernel re-check.
source dev/gpu_env.sh
mkdir -p $OUT/mem $OUT/mema $OUT/e2e $OUT/kern
(timeout 120 python3 benchmarks/memory_gpt2.py --only c --layers-c 80 --lr 2e-5 --out $OUT/mem/memory_c.json 2>&1 | tail -3)
(timeout 150 python3 benchmarks/memory_gpt2.py --only a --out $OUT/mema/memory_a.json 2>&1 | tail -12)
(BLUTRAIN_GEMM=cublas timeout 60 python3 benchmarks/e2e_gpt2.py --steps 7 --warmup 2 --only blutrain_tf32 \
   --out $OUT/e2e/e2e_tf32.json 2>&1 | tail -3)
(BLU_CHECK_ONLY=1 BLU_BUDGET_S=100 timeout 110 python3 packages/blutensor/dev/gpu_check_kernels.py $OUT/kern 2>&1 | tail -6)

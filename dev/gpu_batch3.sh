#!/usr/bin/env bash
# GPU batch 3: compiler vs eager, blutensor CUDA re-check, e2e GEMM providers, the 80-layer memory-lean run.
source dev/gpu_env.sh
mkdir -p $OUT/comp $OUT/e2e $OUT/mem $OUT/bt
(timeout 175 python3 packages/blucompiler/dev/gpu_check.py $OUT/comp 2>&1 | tail -25)
(timeout 70 python3 -m pytest -m cuda -q -p no:cacheprovider packages/blutensor/tests/test_random.py \
   packages/blutensor/tests/test_creation.py packages/blutensor/tests/test_utils_memory.py 2>&1 | tail -4)
(timeout 170 python3 benchmarks/e2e_gpt2.py --steps 7 --warmup 2 \
   --only torch_eager_fp32,torch_compile_fp32,blutrain_fp32_cublas,blutrain_fp32_blublas \
   --out $OUT/e2e/e2e_gpt2_h200.json 2>&1 | tail -8)
(timeout 150 python3 benchmarks/memory_gpt2.py --only c --layers-c 80 --out $OUT/mem/memory_gpt2_h200.json 2>&1 | tail -6)

#!/usr/bin/env bash
# GPU batch 2b: GPT-2 124M trains + resumes (blumodels), profiler trace, e2e benchmark, blublas diagnosis.
source dev/gpu_env.sh
mkdir -p $OUT/models $OUT/prof $OUT/e2e
(timeout 30 python3 dev/blas_diag.py 2>&1 | tail -20)
(timeout 170 python3 packages/blumodels/dev/gpu_check.py $OUT/models 2>&1 | tail -20)
(timeout 150 python3 packages/bluprofiler/dev/gpu_check.py $OUT/prof 2>&1 | tail -20)
(timeout 230 python3 benchmarks/e2e_gpt2.py --steps 8 --warmup 2 \
   --only torch_eager_fp32,torch_compile_fp32,blutrain_fp32,torch_compile_tf32,blutrain_tf32,torch_eager_bf16 \
   --out $OUT/e2e/e2e_gpt2_h200.json 2>&1 | tail -12)

#!/usr/bin/env bash
# GPU batch 9 (session 2, final): e2e GPT-2 124M (50 steps, all precision modes), profiler overhead, 3xTF32 GEMM
# accuracy/speed, 80-layer case c at a constant small lr. Run from .snap (dev/snap.sh).
source dev/gpu_env.sh
mkdir -p $OUT/e2e $OUT/prof $OUT/x3 $OUT/memc
(timeout 330 python3 benchmarks/e2e_gpt2.py --steps 50 --warmup 5 \
  --only torch_eager_fp32,torch_compile_fp32,blutrain_fp32_cublas,blutrain_fp32_3xtf32,blutrain_fp32_3xtf32_graph,torch_compile_tf32,blutrain_tf32_graph,torch_eager_bf16,blutrain_bf16,blutrain_bf16_graph \
  --out $OUT/e2e/e2e_gpt2_h200.json 2>&1 | grep -v Warning | tail -14)
(timeout 150 python3 packages/bluprofiler/dev/gpu_check_overhead.py $OUT/prof 2>&1 | tail -8)
(GPU3X_TRAIN=0 timeout 60 python3 packages/blublas/dev/gpu_check_3xtf32.py $OUT/x3 2>&1 | tail -25)
(timeout 60 python3 benchmarks/memory_gpt2.py --only c --lr-c 1e-6 --warmup-c 0 --steps-c 6 \
  --out $OUT/memc/memory_c_h200.json 2>&1 | tail -4)
rm -f $OUT/prof/trace_b16/trace.json

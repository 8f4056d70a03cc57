#!/usr/bin/env bash
# GPU batch 26 (session 5, final): GPT-2 124M fp32 end to end (50 steps, B=16, T=1024) with PyTorch eager, torch.compile
# and PyTorch on cuBLASLt (the reference's own noise floor) beside BluTrain's default fp32 (strict SGEMM, tf32x3
# attention with the fused backward), the SIMT attention and the fp32-accurate 3xTF32 mode; memory case b
# (T=16384, B=2) for the default and the 3xTF32 mode; then the cuda-marked blutensor and blumodels tests.
source dev/gpu_env.sh
mkdir -p $OUT/e $OUT/m
echo "== snap $(cat SNAP_COMMIT)"
(timeout 300 python3 benchmarks/e2e_gpt2.py --steps 50 --warmup 5 \
  --only torch_eager_fp32,torch_eager_fp32_lt,torch_compile_fp32,blutrain_fp32_graph,blutrain_fp32_simt_attn_graph,blutrain_fp32_x3_graph \
  --out $OUT/e/e2e_gpt2_fp32_h200.json 2>&1 | grep -v Warning | tail -9)
(timeout 130 python3 benchmarks/memory_gpt2.py --only b --runs torch_eager,blutrain,blutrain_x3 --timeout 90 \
  --out $OUT/m/memory_gpt2_b_h200.json 2>&1 | tail -12)
(timeout 150 python3 -m pytest -q -x -m cuda packages/blutensor/tests packages/blumodels/tests 2>&1 | tail -4)

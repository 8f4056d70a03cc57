#!/usr/bin/env bash
# GPU batch 22 (session 4): GPT-2 124M (B=16, T=1024, 20 steps) with the whole step in a CUDA graph on BluBLAS's own
# GEMM kernels beside the cuBLASLt provider and PyTorch eager, tf32 and bf16, one run.
source dev/gpu_env.sh
mkdir -p $OUT/e
echo "== snap $(cat SNAP_COMMIT)"
(timeout 400 python3 benchmarks/e2e_gpt2.py --steps 20 --warmup 3 \
  --only torch_eager_tf32,blutrain_tf32_graph,blutrain_tf32_graph_blublas,torch_eager_bf16,blutrain_bf16_graph,blutrain_bf16_graph_blublas \
  --out $OUT/e/e2e_gpt2_blublas_h200.json 2>&1 | grep -v Warning | tail -14)

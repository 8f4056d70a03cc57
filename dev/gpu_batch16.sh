#!/usr/bin/env bash
# GPU batch 16 (session 3, final): e2e GPT-2 124M (50 steps; fp32 graph with tf32x3 and with SIMT attention, tf32
# graph, bf16 graph; PyTorch eager/compile beside), then memory case b (T=16384, B=2: BluTrain vs PyTorch eager).
source dev/gpu_env.sh
mkdir -p $OUT/e2e $OUT/mem
echo "== snap $(cat SNAP_COMMIT)"
(timeout 60 python3 -m pytest -q -p no:cacheprovider packages/blutensor/tests/test_cuda_kernels.py \
  packages/blutensor/tests/test_memkern_kernels.py packages/blutensor/tests/test_sdpa_mma.py -m cuda 2>&1 | tail -4)
(timeout 330 python3 benchmarks/e2e_gpt2.py --steps 50 --warmup 5 \
  --only torch_eager_fp32,torch_compile_fp32,blutrain_fp32_graph,blutrain_fp32_simt_attn_graph,torch_compile_tf32,blutrain_tf32_graph,torch_eager_bf16,blutrain_bf16_graph \
  --out $OUT/e2e/e2e_gpt2_h200.json 2>&1 | grep -v Warning | tail -12)
(timeout 85 python3 benchmarks/memory_gpt2.py --only b --runs torch_eager,blutrain --timeout 80 \
  --out $OUT/mem/memory_b_h200.json 2>&1 | tail -6)

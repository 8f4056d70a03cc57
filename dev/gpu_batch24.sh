#!/usr/bin/env bash
# GPU batch 24 (session 5): kernel-by-kernel GPU time of one GPT-2 124M fp32 step (B=16, T=1024): BluTrain (strict
# SGEMM, tf32x3 attention, CUDA graph) next to PyTorch eager and torch.compile (dev/kernel_profile.py).
source dev/gpu_env.sh
mkdir -p $OUT/p
echo "== snap $(cat SNAP_COMMIT)"
for w in blutrain torch_compile torch_eager; do
  timeout 150 python3 dev/kernel_profile.py $OUT/p/profile_$w.json $w 2 2>&1 | grep -v Warning | tail -28
done

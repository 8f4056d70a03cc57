#!/usr/bin/env bash
# GPU batch 21 (session 4): blublas's CUDA tests at this snapshot (TMA-store epilogue, launch memo, float4
# split-K reduction), then blutensor's pytest-benchmark kernel suite (issue 5's Appendix-B shapes).
source dev/gpu_env.sh
mkdir -p $OUT/k
echo "== snap $(cat SNAP_COMMIT)"
(timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda packages/blublas/tests 2>&1 | tail -4)
(timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda benchmarks/kernels/bench_kernels.py \
  --benchmark-json=$OUT/k/kernels_raw.json --benchmark-columns=median 2>&1 | tail -3)

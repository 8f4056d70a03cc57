#!/usr/bin/env bash
# GPU batch 19 (session 4): the BluBLAS pytest-benchmark suite (fp32/tf32/bf16, BluBLAS autotuned and cuBLASLt,
# kernel time inside CUDA graphs + eager per call) summarized into blublas_gemm_h200.json.
source dev/gpu_env.sh
mkdir -p $OUT/g
echo "== snap $(cat SNAP_COMMIT)"
(timeout 420 python3 -m pytest -q -p no:cacheprovider -m cuda benchmarks/blublas/bench_gemm.py \
  --benchmark-json=$OUT/g/bench_gemm_raw.json --benchmark-columns=median 2>&1 | tail -5)
python3 benchmarks/blublas/summarize_gemm.py $OUT/g/bench_gemm_raw.json $OUT/g/blublas_gemm_h200.json "$(cat SNAP_COMMIT)"

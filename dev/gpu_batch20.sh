#!/usr/bin/env bash
# GPU batch 20 (session 4): wgmma correctness + A/B (validates the float4 split-K reduction and the TMA-store
# epilogue once more), then the BluBLAS benchmark suite summarized into blublas_gemm_h200.json.
source dev/gpu_env.sh
mkdir -p $OUT/g $OUT/w
echo "== snap $(cat SNAP_COMMIT)"
(timeout 200 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/w 2>&1 | grep -E "section|geomean|FAIL|rror|fail [1-9]" | tail -20)
(timeout 380 python3 -m pytest -q -p no:cacheprovider -m cuda benchmarks/blublas/bench_gemm.py \
  --benchmark-json=$OUT/g/bench_gemm_raw.json --benchmark-columns=median 2>&1 | tail -2)
python3 benchmarks/blublas/summarize_gemm.py $OUT/g/bench_gemm_raw.json $OUT/g/blublas_gemm_h200.json "$(cat SNAP_COMMIT)"

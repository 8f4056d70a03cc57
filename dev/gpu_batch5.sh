#!/usr/bin/env bash
# GPU batch 5 (session 2): BluBLAS per-shape benchmark vs cuBLAS, orchestrator NVML check, step probes.
source dev/gpu_env.sh
mkdir -p $OUT/blas $OUT/orch $OUT/probe
(timeout 230 python3 packages/blublas/dev/gpu_check.py $OUT/blas 2>&1 | tail -40)
(timeout 60 python3 packages/dtms/dev/gpu_check_orchestrator.py $OUT/orch 2>&1 | tail -8)
(CUPY_TF32=1 timeout 80 python3 dev/step_probe.py $OUT/probe tf32 16 2>&1 | tail -45)
(timeout 80 python3 dev/step_probe.py $OUT/probe fp32 16 2>&1 | tail -12)
rm -rf $OUT/blas/blublas_cache

#!/usr/bin/env bash
# First GPU batch: core smoke, allocator, blublas, data loader checks.
export PYTHONPATH=$(ls -d packages/*/src | paste -sd:) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
mkdir -p $OUT/smoke $OUT/alloc $OUT/blas $OUT/data
timeout 200 python3 dev/gpu_smoke.py $OUT/smoke 2>&1 | tail -40
timeout 150 python3 packages/bluallocator/dev/gpu_check.py $OUT/alloc 2>&1 | tail -25
timeout 200 python3 packages/blublas/dev/gpu_check.py $OUT/blas 2>&1 | tail -40
timeout 60 python3 packages/blumodels/dev/gpu_check_data.py $OUT/data 2>&1 | tail -10

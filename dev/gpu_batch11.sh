#!/usr/bin/env bash
# GPU batch 11 (session 3, first): A/B of the TF32 step between 8d49097 and HEAD (.snapA/.snapB from dev/ab_snap.sh),
# then HEAD's unverified checks: whole-step graph incl. bf16 + Trainer graph path, bluallocator on the GPU.
for s in .snapA .snapB; do
  (cd $s && source dev/gpu_env.sh && echo "== $s $(cat SNAP_COMMIT)" && \
   CUPY_TF32=1 timeout 100 python3 dev/step_probe.py $OUT/$s tf32 16 2>&1 | grep -v Warning | tail -40)
done
cd .snapB && source dev/gpu_env.sh
mkdir -p $OUT/graph $OUT/alloc
(timeout 200 python3 packages/blumodels/dev/gpu_check_graph.py $OUT/graph 2>&1 | grep -v Warning | tail -40)
(timeout 90 python3 packages/bluallocator/dev/gpu_check.py $OUT/alloc 2>&1 | tail -15)
rm -f $OUT/alloc/*.xml $OUT/graph/*.xml

#!/usr/bin/env bash
# GPU batch 12 (session 3): attention check (tf32x3 + speed), step probes tf32/fp32 at HEAD, whole-step graph
# check (Thrust inside the capture), first wgmma (TMA) check. Run from .snap (dev/snap.sh).
source dev/gpu_env.sh
L=$OUT/all.log
mkdir -p $OUT/attn $OUT/p $OUT/graph $OUT/wg
echo "== snap $(cat SNAP_COMMIT)" | tee -a $L
(timeout 200 python3 packages/blutensor/dev/gpu_check_attn.py $OUT/attn 2>&1 | grep -v Warning | tee -a $L | tail -60)
for prec in tf32 fp32; do
  (CUPY_TF32=$([ $prec = tf32 ] && echo 1 || echo 0) timeout 120 python3 dev/step_probe.py $OUT/p $prec 16 2>&1 \
     | grep -v Warning | tee -a $L | head -30)
done
(timeout 150 python3 packages/blumodels/dev/gpu_check_graph.py $OUT/graph 2>&1 | grep -v Warning | tee -a $L | tail -12)
(timeout 170 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/wg 2>&1 | tee -a $L | tail -40)
find $OUT -name "*.xml" -delete; rm -rf $OUT/wg/cache; rm -rf $OUT/p/prof_*/summary.json $OUT/p/prof_*/*.jsonl

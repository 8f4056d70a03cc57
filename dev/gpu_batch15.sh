#!/usr/bin/env bash
# GPU batch 15 (session 3): attention check 4 (quick), memkern check 2, wgmma check 3. Run from .snap.
source dev/gpu_env.sh
mkdir -p $OUT/attn $OUT/wg $OUT/mk
echo "== snap $(cat SNAP_COMMIT)"
(BLU_ATTN_VARIANTS=tf32,tf32x3,bf16 BLU_ATTN_SKIP=torch,determinism BLU_ATTN_REPS=3 timeout 130 \
  python3 packages/blutensor/dev/gpu_check_attn.py $OUT/attn 2>&1 | grep -v Warning > $OUT/attn/stdout.txt)
(timeout 75 python3 packages/blutensor/dev/gpu_check_memkern.py $OUT/mk > $OUT/mk/stdout.txt 2>&1)
(timeout 110 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/wg > $OUT/wg/stdout.txt 2>&1)
find $OUT -name "*.xml" -delete; rm -rf $OUT/wg/cache
for f in $OUT/*/stdout.txt; do echo "#### $f"; tail -22 $f; done

#!/usr/bin/env bash
# GPU batch 14 (session 3): simt check 1, wgmma check 2, memkern check 1, attention check 3. Run from .snap.
source dev/gpu_env.sh
mkdir -p $OUT/simt $OUT/wg $OUT/mk $OUT/attn
echo "== snap $(cat SNAP_COMMIT)"
(timeout 170 python3 packages/blublas/dev/gpu_check_simt.py $OUT/simt > $OUT/simt/stdout.txt 2>&1)
(timeout 170 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/wg > $OUT/wg/stdout.txt 2>&1)
(timeout 100 python3 packages/blutensor/dev/gpu_check_memkern.py $OUT/mk > $OUT/mk/stdout.txt 2>&1)
(timeout 160 python3 packages/blutensor/dev/gpu_check_attn.py $OUT/attn 2>&1 | grep -v Warning > $OUT/attn/stdout.txt)
find $OUT -name "*.xml" -delete; rm -rf $OUT/wg/cache $OUT/simt/cache
for f in $OUT/*/stdout.txt; do echo "#### $f"; tail -25 $f; done

#!/usr/bin/env bash
# GPU batch 13 (session 3): wgmma TMA check 1, attention check 2. Run from .snap (dev/snap.sh).
source dev/gpu_env.sh
L=$OUT/all.log
mkdir -p $OUT/attn $OUT/wg
echo "== snap $(cat SNAP_COMMIT)" | tee -a $L
(timeout 200 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/wg > $OUT/wg/stdout.txt 2>&1; tail -50 $OUT/wg/stdout.txt >> $L)
(timeout 200 python3 packages/blutensor/dev/gpu_check_attn.py $OUT/attn 2>&1 | grep -v Warning > $OUT/attn/stdout.txt; tail -45 $OUT/attn/stdout.txt >> $L)
find $OUT -name "*.xml" -delete; rm -rf $OUT/wg/cache

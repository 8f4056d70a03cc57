#!/usr/bin/env bash
# GPU batch 27 (prepared in session 5 for the next session, ~5 min): the cuda tests touched in session 5 that did
# not run on a GPU yet (test_errors with sync index checks, both embedding backward modes), then the fp32 step's
# kernel profile with the default and the balanced ('pieces') embedding backward.
source dev/gpu_env.sh
mkdir -p $OUT/p
echo "== snap $(cat SNAP_COMMIT)"
(timeout 120 python3 -m pytest -q -m cuda packages/blutensor/tests/test_errors.py packages/blutensor/tests/test_sort.py \
  packages/blutensor/tests/test_sdpa_mma.py 2>&1 | tail -3)
for mode in runs pieces; do
  BLUTRAIN_EMBEDDING_BWD=$mode timeout 120 python3 dev/kernel_profile.py $OUT/p/profile_blutrain_emb_$mode.json blutrain 2 \
    2>&1 | grep -E "total|embedding" | head -4
done

#!/usr/bin/env bash
# GPU batch 23 (session 5): the fused flash-attention backward (atomic dQ) for tf32 / tf32x3: correctness of both
# backward modes vs float64, determinism under bt.use_deterministic_algorithms, speed next to PyTorch (GPT-2 layer
# and T=16384), and the cuda-marked sdpa tests.
source dev/gpu_env.sh
mkdir -p $OUT/a
echo "== snap $(cat SNAP_COMMIT)"
BLU_ATTN_VARIANTS=f32,tf32,tf32x3,bf16 timeout 330 python3 packages/blutensor/dev/gpu_check_attn.py $OUT/a 2>&1 \
  | grep -v "^   .*dense\|^   .*strided" | tail -70
grep -c PASS $OUT/a/attn_check.json; python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/a/attn_check.json"))
bad = [c for c in d["correct"] if not c["passed"]]
print("correct", len(d["correct"]) - len(bad), "/", len(d["correct"]), "failures:", [(c["variant"], c.get("mode"), c["kind"], c["L"], c["hd"], c["causal"], c.get("errs"), c.get("error")) for c in bad][:8])
PY
timeout 90 python3 -m pytest -q -m cuda packages/blutensor/tests/test_sdpa_mma.py packages/blutensor/tests/test_sdpa_qkv.py 2>&1 | tail -3

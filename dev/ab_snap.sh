#!/usr/bin/env bash
# A/B two commits on the device: `dev/ab_snap.sh REV_A REV_B` writes .snapA/ and .snapB/ (git archive + wheels
# built from that tree). Then run on the device with carry [".snapA", ".snapB"], e.g.
#   for s in .snapA .snapB; do (cd $s && source dev/gpu_env.sh && CUPY_TF32=1 python3 dev/step_probe.py $OUT/$s tf32 16); done
# (dev/step_probe.py must exist in both revisions; copy it in otherwise). Used to find what slowed the TF32 step
# between 8d49097 (83 ms eager) and db4ac21 (89 ms).
set -e
cd "$(dirname "$0")/.."
for pair in "A $1" "B $2"; do
  set -- $pair
  d=.snap$1
  rm -rf "$d" && mkdir "$d" && git archive "$2" | tar -x -C "$d"
  [ -f "$d/dev/step_probe.py" ] || cp dev/step_probe.py "$d/dev/"
  mkdir -p "$d/.whl" && /work/venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$d/.whl" "$d"/packages/* >/dev/null
  cp .whl/xdsl-*.whl .whl/immutabledict-*.whl .whl/ordered_set-*.whl "$d/.whl/" 2>/dev/null || true
  git rev-parse --short "$2" > "$d/SNAP_COMMIT"
done

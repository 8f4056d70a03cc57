#!/usr/bin/env bash
# The checkpoint benchmark on one CUDA GPU: benchmarks/checkpoint_cuda.sh OUT.json [checkpoint_bench.py args]
# (default sizes 774m,1.5b; checkpoints go to /tmp/ckpt). On a machine without a package index, wheels in .whl/
# (dev/gpu_wheels.sh builds them) are installed into a private directory first, as benchmarks/gpu_suite.sh does.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/blutrain-site \
      .whl/*.whl || exit 1
  export PYTHONPATH=$(ls -d packages/*/src | paste -sd:):/tmp/blutrain-site
fi
mkdir -p /tmp/ckpt
result=$1; shift
python3 benchmarks/checkpoint_bench.py --device cuda --dir /tmp/ckpt --out "$result" ${@:---sizes 774m,1.5b}

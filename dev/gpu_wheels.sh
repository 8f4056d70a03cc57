#!/usr/bin/env bash
# Build the wheels a GPU machine needs beside its own packages: every BluTrain package (their dist-info carries
# the entry points), and blucompiler's xdsl with its two small dependencies, into .whl/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/blu*.whl .whl/dtms-*.whl
.venv/bin/python -m pip wheel -q --no-deps -w .whl packages/blutensor packages/blublas packages/bluallocator \
    packages/dtms packages/blucompiler packages/bluprofiler packages/blumodels
for w in xdsl==0.75.0 immutabledict ordered-set; do
  ls .whl | grep -qi "^${w%%=*}-" || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 -d .whl "$w"
done
ls .whl

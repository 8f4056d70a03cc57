#!/usr/bin/env bash
# Snapshot HEAD (committed work only) into .snap/ with the carried wheels, for a device run while others edit the tree.
set -e
cd "$(dirname "$0")/.."
rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap
rm -rf .whl/blu* .whl/dtms* && /work/venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl .snap/packages/* >/dev/null
cp -r .whl .snap/.whl
git rev-parse --short HEAD > .snap/SNAP_COMMIT

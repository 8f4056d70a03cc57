# Source on the GPU machine: our packages' dist-info (entry points) + carried wheels, tree sources first.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=$(ls -d packages/*/src | paste -sd:):/tmp/site PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

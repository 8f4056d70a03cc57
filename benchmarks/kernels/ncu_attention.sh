#!/usr/bin/env bash
# Nsight Compute on one GPT-2 attention layer (B=16, H=12, T=1024, HD=64, causal, fused-qkv entries): the Hopper
# bf16 kernels -- forward (pingpong schedule), the split backward (dK/dV, dQ) and the fused one-pass backward --
# and PyTorch's cuDNN SDPA, one report each into DIR (speed of light, warp states, occupancy, memory workload,
# instruction statistics), so that the stall reasons of ours and cuDNN's can be read side by side.
#
#   bash benchmarks/kernels/ncu_attention.sh DIR [--batch N]   # BluTrain installed in this environment
#   bash benchmarks/gpu_suite.sh ncu DIR [--batch N]            # on a machine without a package index (wheels)
set -uo pipefail
cd "$(dirname "$0")/../.."
dir=${1:?usage: $0 DIR [--batch N]}
shift
mkdir -p "$dir"
S="--section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis"
S="$S --section InstructionStats --section ComputeWorkloadAnalysis"
run() { local name=$1; shift; ncu --clock-control none $S "$@" > "$dir/$name.txt" 2>&1; echo "$name rc $?"; }
NCU_ATTN=packages/blutensor/dev/ncu_attn.py
BLUTRAIN_SDPA_BWD=split run ours_split -k regex:blu_sdpa_wgmma python3 $NCU_ATTN ours --variant bf16_wgmma --batch 16 "$@"
BLUTRAIN_SDPA_BWD=fused run ours_fused -k regex:'blu_sdpa_wgmma.*(fused|convert)' python3 $NCU_ATTN ours \
    --variant bf16_wgmma --batch 16 "$@"
run cudnn -k regex:'cudnn|sdpa' python3 $NCU_ATTN torch --dtype bf16 --backend CUDNN_ATTENTION --batch 16 "$@"
# the long-context forward (B=2, T=16384: no per-tile prologue to hide), ours and cuDNN's, and ours per SASS
# instruction (stall samples by reason, --page source) to find where the main loop waits
run ours_fwd_long -k regex:'blu_sdpa_wgmma.*fwd' -c 1 python3 $NCU_ATTN ours --variant bf16_wgmma --batch 2 --seq 16384
run cudnn_fwd_long -k regex:'cudnn.*fprop' -c 1 python3 $NCU_ATTN torch --dtype bf16 --backend CUDNN_ATTENTION \
    --batch 2 --seq 16384
ncu --clock-control none --set full --import-source no -o "$dir/fwd_long" -f -k regex:'blu_sdpa_wgmma.*fwd' -c 1 \
    python3 $NCU_ATTN ours --variant bf16_wgmma --batch 2 --seq 16384 > "$dir/fwd_long_full.txt" 2>&1
ncu --import "$dir/fwd_long.ncu-rep" --page source --csv --print-source sass > "$dir/fwd_long_sass.csv" 2>&1
echo "fwd_long source rc $?"
grep -hE "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Stall|Issue Slots Busy" \
    "$dir"/*.txt | cut -c1-160

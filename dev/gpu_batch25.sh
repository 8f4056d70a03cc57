#!/usr/bin/env bash
# GPU batch 25 (session 5, diagnosis): Nsight Compute on the tf32x3 flash-attention forward and fused backward
# (one GPT-2 layer, B=4) next to PyTorch's fp32 SDPA kernels (dev: packages/blutensor/dev/ncu_attn.py).
source dev/gpu_env.sh
mkdir -p $OUT/n
echo "== snap $(cat SNAP_COMMIT)"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section InstructionStats --section MemoryWorkloadAnalysis"
(timeout 200 $NCU --clock-control none $SECS -k regex:blu_sdpa python3 packages/blutensor/dev/ncu_attn.py ours > $OUT/n/ncu_ours.txt 2>&1; echo "ours rc $?")
(timeout 120 $NCU --clock-control none $SECS -k regex:fmha python3 packages/blutensor/dev/ncu_attn.py torch > $OUT/n/ncu_torch.txt 2>&1; echo "torch rc $?")
M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__inst_executed.sum,gpu__time_duration.sum,launch__registers_per_thread,smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
(timeout 100 $NCU --clock-control none --metrics $M -k regex:'blu_sdpa|fmha' python3 packages/blutensor/dev/ncu_attn.py ours > $OUT/n/ncu_metrics.txt 2>&1; echo "m rc $?")
(timeout 100 $NCU --clock-control none --metrics $M -k regex:'blu_sdpa|fmha' python3 packages/blutensor/dev/ncu_attn.py torch >> $OUT/n/ncu_metrics.txt 2>&1; echo "m2 rc $?")
grep -E "^  [a-z_]+.*\(|Duration|Issue Slots Busy|Executed Ipc A|SM Busy|Registers Per|Achieved Occupancy|Theoretical Occ|Stall|pct|bank|inst_executed|registers|duration" $OUT/n/ncu_ours.txt $OUT/n/ncu_metrics.txt | head -150
grep -E "^  [a-z_]+.*\(|Duration|Issue Slots Busy|Executed Ipc A|SM Busy|Registers Per|Achieved Occupancy" $OUT/n/ncu_torch.txt | head -40

#!/usr/bin/env bash
# GPU batch 17 (session 4, diagnosis): the wgmma check (verifies the commits after run 3: host-cost memoization,
# split-K paired stores, shipped tuned table), then Nsight Compute on bf16 TMA kernels vs cuBLAS (torch.matmul).
source dev/gpu_env.sh
mkdir -p $OUT/w
echo "== snap $(cat SNAP_COMMIT)"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
(timeout 200 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/w 2>&1 | grep -E "ratio|section|geomean|FAIL|rror" | tail -50)
SECS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis"
S=fwd_fc,fwd_fc_proj,dx_fc_proj,dx_lm_head
(timeout 150 $NCU --clock-control none $SECS -k regex:blu_gemm_wgmma \
  python3 packages/blublas/dev/ncu_wgmma.py ours bf16 $S 128x128x64_pp_s6,128x256x64_ws_s4 > $OUT/ncu_ours.txt 2>&1; echo "ncu ours rc $?")
(timeout 100 $NCU --clock-control none $SECS -k regex:'sm90|gemm|xmma|cutlass' --launch-count 8 \
  python3 packages/blublas/dev/ncu_wgmma.py torch bf16 $S > $OUT/ncu_torch.txt 2>&1; echo "ncu torch rc $?")
M=lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,gpu__time_duration.sum
(timeout 60 $NCU --clock-control none --metrics $M -k regex:blu_gemm_wgmma \
  python3 packages/blublas/dev/ncu_wgmma.py ours bf16 $S 128x128x64_pp_s6 > $OUT/ncu_metrics.txt 2>&1; echo "ncu metrics rc $?")
(timeout 60 $NCU --clock-control none --metrics $M -k regex:'sm90|gemm|xmma|cutlass' --launch-count 8 \
  python3 packages/blublas/dev/ncu_wgmma.py torch bf16 $S >> $OUT/ncu_metrics.txt 2>&1; echo "ncu metrics torch rc $?")
ls -la $OUT

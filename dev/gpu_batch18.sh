#!/usr/bin/env bash
# GPU batch 18 (session 4): the wgmma check with the TMA-store epilogue (A/B against the staged epilogue in the
# same run), then Nsight Compute metrics of the new bf16 kernels on four GPT-2 shapes.
source dev/gpu_env.sh
mkdir -p $OUT/w
echo "== snap $(cat SNAP_COMMIT)"
(timeout 220 python3 packages/blublas/dev/gpu_check_wgmma.py $OUT/w 2>&1 | grep -E "ratio|section|geomean|FAIL|rror|fail [1-9]" | tail -60)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,lts__t_bytes.sum,gpu__time_duration.sum,sm__cycles_elapsed.max,sm__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
(timeout 90 $NCU --clock-control none --metrics $M -k regex:blu_gemm_wgmma \
  python3 packages/blublas/dev/ncu_wgmma.py ours bf16 fwd_fc,fwd_lm_head,dx_fc_proj,dw_fc 128x128x64_pp_s6,128x256x64_ws_s4 > $OUT/ncu_metrics.txt 2>&1; echo "ncu metrics rc $?")

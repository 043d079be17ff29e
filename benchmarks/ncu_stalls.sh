#!/usr/bin/env bash
# Warp-stall breakdown of the decode kernel under ncu (device machine, kvgen installed):
#   bash benchmarks/ncu_stalls.sh OUTDIR scheme[:ppt:warps:stages:splits] ...
# B=32, L=4096, 64/8 heads, D=128, page 16 (benchmarks/experiments/profile_decode.py; KVGEN_PROFILE_SHAPE=B,L,Hq,Hkv,D
# for another shape). KVGEN_PROFILE_OP=prefill profiles _prefill_kernel instead (B=4, L=8192, keys from the pages;
# benchmarks/experiments/profile_prefill.py), the last field of an argument then being block_m.
op="${KVGEN_PROFILE_OP:-decode}"
out="$1"; shift
mkdir -p "$out"
for arg in "$@"; do
  IFS=: read -r s ppt w st sp <<<"$arg"
  timeout 120 ncu --clock-control none --kernel-name regex:_${op}_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,launch__grid_size,launch__registers_per_thread' \
    python3 -m benchmarks.experiments.profile_$op "$s" ${ppt:-8} ${w:-4} ${st:-3} ${sp:-1} >"$out/ncu-$s.txt" 2>&1
  echo "## $arg"
  grep -E " ms |Duration|DRAM Throughput|dram__bytes_read|lts__t_sector_hit|launch__grid_size|launch__registers|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc Active|SM Busy|Compute \(SM\) Throughput|Memory Throughput|No Eligible|Eligible Warps|Active Warps Per Scheduler|Warp Cycles Per Issued" "$out/ncu-$s.txt" | sed 's/  */ /g'
  grep -ioE "[^.]*(highest-utilized|utilization of)[^.]*" "$out/ncu-$s.txt" | head -4
  grep -E "stalled_" "$out/ncu-$s.txt" | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/  */ /g' \
    | awk '{v=$NF+0} v>=0.05' | sort -k3 -gr | head -12
done

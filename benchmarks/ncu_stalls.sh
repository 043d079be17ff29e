#!/usr/bin/env bash
# Warp-stall breakdown of the decode kernel under ncu (device machine, kvgen installed):
#   bash benchmarks/ncu_stalls.sh OUTDIR scheme[:ppt:warps:stages:splits] ...
# B=32, L=4096, 64/8 heads, D=128, page 16 (benchmarks/experiments/profile_decode.py).
out="$1"; shift
mkdir -p "$out"
for arg in "$@"; do
  IFS=: read -r s ppt w st sp <<<"$arg"
  timeout 120 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 -m benchmarks.experiments.profile_decode "$s" ${ppt:-8} ${w:-4} ${st:-3} ${sp:-1} >"$out/ncu-$s.txt" 2>&1
  echo "## $arg"
  grep -E " ms |Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Eligible Warps|Active Warps Per Scheduler|Warp Cycles Per Issued" "$out/ncu-$s.txt" | sed 's/  */ /g'
  grep -E "stalled_" "$out/ncu-$s.txt" | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/  */ /g' \
    | awk '{v=$NF+0} v>=0.05' | sort -k3 -gr | head -12
done

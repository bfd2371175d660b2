# SPDX-License-Identifier: Apache-2.0
# Shared by the shell benchmarks (sourced): the timing helper. $work must name a scratch folder;
# `measure` removes $work/out.pt and $work/out (a file or directory output) before each run.

# Runs "$@" REPEAT times; prints "median_seconds max_rss_mib".
measure() {
  local repeat=$1; shift
  local times=() rss=0
  for ((i = 0; i < repeat; ++i)); do
    rm -rf "$work/out.pt" "$work/out"
    /usr/bin/time -f "%e %M" -o "$work/time" "$@" >/dev/null
    read -r t m <"$work/time"
    times+=("$t")
    ((m > rss)) && rss=$m
  done
  printf '%s\n' "${times[@]}" | sort -n | awk -v r="$rss" '{a[NR]=$1} END {printf "%.3f %.1f\n", a[int((NR+1)/2)], r/1024}'
}

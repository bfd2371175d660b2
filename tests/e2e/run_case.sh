#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs one end-to-end case (tests/e2e/<tool>/<case>.sh) and compares its stdout, stderr and exit
# status with the <case>.stdout, <case>.stderr and <case>.exit files beside it (each optional
# except .exit). UPDATE_GOLDEN=1 rewrites them instead; read the diff before committing.
# A case that exits 77 is skipped. The environment (set by CTest) names the binaries:
# FSDP_CKPT_INSPECT, FSDP_TESTDATA_DIR, FSDP_MAN_DIR.
set -u
case_file=$1
base=${case_file%.sh}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && bash "$case_file") >"$work/.stdout" 2>"$work/.stderr"
status=$?
[[ $status == 77 ]] && { echo "skipped: $(cat "$work/.stdout")"; exit 77; }
echo "$status" >"$work/.exit"
fail=0
for kind in stdout stderr exit; do
  golden="$base.$kind"
  if [[ ${UPDATE_GOLDEN:-0} == 1 ]]; then
    if [[ $kind == exit || -s "$work/.$kind" || -f "$golden" ]]; then cp "$work/.$kind" "$golden"; fi
    continue
  fi
  if [[ -f "$golden" ]]; then
    if ! diff -u "$golden" "$work/.$kind"; then
      echo "FAIL: $kind differs from $golden"
      fail=1
    fi
  elif [[ $kind == exit ]]; then
    echo "FAIL: no $golden (run with UPDATE_GOLDEN=1 to create it)"
    fail=1
  elif [[ -s "$work/.$kind" ]]; then
    echo "FAIL: unexpected $kind:"
    cat "$work/.$kind"
    fail=1
  fi
done
exit $fail

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Every tool against every entry of the hostile-input corpus testdata/bad/ (see MANIFEST.tsv and
testdata/gen/make_bad.py). For an entry marked 'refused': `verify --deep`, `merge` and `shard`
exit 1 naming the entry, write nothing and leave no temporary file; `inspect` and `stats` exit 0
(a damaged checkpoint can still be looked at) or 1. For one marked 'bounded' (adversarial but
valid), any tool may accept it. Always: no signal, no exit status above 1, at most 60 s and
768 MiB peak RSS per run (the corpus holds a 1.5 GiB zstd bomb and a 2^32 memo index)."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--merge", required=True)
p.add_argument("--shard", required=True)
p.add_argument("--inspect", required=True)
p.add_argument("--bad", required=True)
a = p.parse_args()
TIMEOUT_S, MAX_RSS_MIB = 60, 768
failures, runs = [], [0]


def run(argv):
    """(exit status or -signal, stdout and stderr, seconds, peak RSS in MiB) of one run (verify
    reports problems on stdout, errors go to stderr)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        err, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "timed out", TIMEOUT_S, 0
    # the child's own peak RSS: wait4 has reaped it, so read it from RUSAGE_CHILDREN's growth
    return proc.returncode, err.decode(errors="replace"), time.monotonic() - start, peak_rss(proc)


_rss_seen = [0]


def peak_rss(proc):
    import resource
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    # ru_maxrss of all children is a maximum, not a sum: it grows only when this child beat them
    _rss_seen[0] = max(_rss_seen[0], rss)
    return rss


entries = []
for line in open(os.path.join(a.bad, "MANIFEST.tsv")).read().splitlines()[1:]:
    name, expect, what = line.split("\t")
    entries.append((name, expect, what))
for name, expect, what in entries:
    path = os.path.join(a.bad, name)
    if not os.path.lexists(path):
        failures.append(f"{name}: listed in MANIFEST.tsv but missing")
        continue
    out_dir = tempfile.mkdtemp(prefix="fsdp-hostile-")
    tools = [("inspect", [a.inspect, path], {0, 1}), ("stats", [a.inspect, "stats", path], {0, 1}),
             ("verify", [a.inspect, "verify", "--deep", path], {1}),
             ("merge", [a.merge, "-q", path, "-o", os.path.join(out_dir, "out.pt")], {1}),
             ("shard", [a.shard, "-q", path, "-o", os.path.join(out_dir, "out"), "-n", "2"], {1})]
    for tool, argv, allowed in tools:
        if expect == "bounded":
            allowed = {0, 1}
        rc, err, secs, rss = run(argv)
        runs[0] += 1
        where = f"{name} ({what}): {tool}"
        if rc is None:
            failures.append(f"{where}: did not finish within {TIMEOUT_S} s")
            continue
        if rc not in allowed:
            failures.append(f"{where}: exit {rc}, expected {sorted(allowed)}: {err.strip()[-300:]}")
        if rss > MAX_RSS_MIB:
            failures.append(f"{where}: peak RSS {rss:.0f} MiB")
        if rc == 1 and tool in ("verify", "merge", "shard"):
            if os.path.basename(name) not in err and name.split(".")[0] not in err:
                failures.append(f"{where}: the message does not name the input: {err.strip()[-200:]}")
        if tool in ("merge", "shard") and rc != 0 and os.listdir(out_dir):
            failures.append(f"{where}: left {os.listdir(out_dir)} behind")
        if rc == 0:
            shutil.rmtree(out_dir)
            os.makedirs(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)

for f in failures:
    print(f"FAIL {f}")
print(f"hostile inputs: {len(entries)} entries x 5 tools = {runs[0]} runs, peak RSS at most {_rss_seen[0]:.0f} MiB, "
      f"{len(failures)} problems")
print(f"{runs[0] - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)

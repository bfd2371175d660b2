#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Crash consistency of fsdp-ckpt-merge and fsdp-ckpt-shard (issue: faults). Each tool is killed
with SIGKILL at every named step of its commit protocol (FSDP_TEST_CRASH_AT: after the N-th copy
task or compressed item, before and after a file's rename into place, before .metadata, before
and after a directory replaces the old one), with and without an earlier output at the same path.
After each kill:
  - with an earlier output: the path holds it, byte for byte, or a complete new one;
  - without: the path holds nothing or a complete new one;
  'complete' meaning `fsdp-ckpt-inspect verify --deep` passes and `diff` against a clean run's
  output says equal. Then a plain rerun succeeds and leaves no temporary file beside the output
  (a killed run's leftovers are cleaned by the next one).
Then random kills, not only the named points: for --random-seconds (seeded by --seed), a scenario
at random is started (over an earlier output or none, its copy slowed by 0-3 ms a task) and its
processes, both of a cooperating pair too, are killed with SIGKILL after a random time within its
clean run's duration; the same checks follow. bench/faults runs this for longer.
Prints how many kill points were tested, how many random kills landed mid-run, and that each was
consistent."""
import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--merge", required=True)
p.add_argument("--shard", required=True)
p.add_argument("--inspect", required=True)
p.add_argument("--probe", required=True)
p.add_argument("--testdata", required=True)
p.add_argument("--random-seconds", type=float, default=40.0, help="how long to kill at random moments")
p.add_argument("--seed", type=int, default=28)
a = p.parse_args()
work = tempfile.mkdtemp(prefix="fsdp-crash-")
failures, kills, points_run = [], [0], [0]
random_runs, random_kills_landed = [0], [0]

POINTS = ["task:1", "task:2", "task:5", "task:12", "item:1", "item:4", "rename:1", "rename:2", "rename:4", "renamed:1",
          "renamed:3", "metadata", "replace", "exchanged"]


def run(argv, env=None, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def tree_hash(path):
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()
    return sorted((f, tree_hash(os.path.join(path, f))) for f in os.listdir(path))


def checkpoint_path(path):
    """What fsdp-ckpt-inspect opens: a Hugging Face shard directory through its index."""
    index = os.path.join(path, "model.safetensors.index.json")
    return index if os.path.isfile(index) else path


def complete(out, ref):
    out, ref = checkpoint_path(out), checkpoint_path(ref)
    v = run([a.inspect, "verify", "--deep", out], check=False)
    if v.returncode != 0:
        return f"verify --deep fails: {v.stdout.strip()} {v.stderr.strip()}"
    d = run([a.inspect, "diff", ref, out], check=False)
    if d.returncode != 0:
        return f"differs from a clean run's output: {d.stdout.strip()[-300:]}"
    return None


def leftovers(folder, keep):
    return sorted(f for f in os.listdir(folder) if f not in keep and (".tmp." in f or f.endswith(".partial") or ".old." in f))


class Scenario:
    """One command (args: output path -> argv), killed at each point; `previous_args` makes the
    earlier output. With processes=2 the command runs as process 0 of 2 after process 1 finished."""

    def __init__(self, name, tool, args, previous_args, processes=1):
        self.name, self.tool, self.args, self.previous_args, self.processes = name, tool, args, previous_args, processes
        self.durations = {}

    def invoke(self, out, args, env=None, check=True):
        argv = [self.tool, "-q", "-j", "1", *args(out), "--force"]
        if self.processes == 1:
            return run(argv, env, check)
        run(argv, {"RANK": "1", "WORLD_SIZE": "2"})  # process 1 has done its part
        return run(argv, {**(env or {}), "RANK": "0", "WORLD_SIZE": "2"}, check)

    def run_all(self):
        folder = os.path.join(work, self.name.replace(" ", "_"))
        os.makedirs(folder)
        single_file = self.tool == a.merge and "--max-shard-size" not in self.args("x")
        ref = os.path.join(folder, "reference" + (".pt" if single_file else ""))
        out = os.path.join(folder, "out" + (".pt" if single_file else ""))
        self.invoke(ref, self.args)
        for with_previous in (True, False):
            for point in POINTS:
                self.one(folder, out, ref, point, with_previous)

    def start(self, out, env):
        """The command's processes, started at once in a process group of their own."""
        argv = [self.tool, "-q", "-j", "1", *self.args(out), "--force"]
        ranks = [None] if self.processes == 1 else [{"RANK": "1", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "2"}]
        return [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                 env={**os.environ, **env, **(r or {})}) for r in ranks]

    def random_kill(self, rng):
        folder = os.path.join(work, "random_" + self.name.replace(" ", "_"))
        single_file = self.tool == a.merge and "--max-shard-size" not in self.args("x")
        ref = os.path.join(folder, "reference" + (".pt" if single_file else ""))
        out = os.path.join(folder, "out" + (".pt" if single_file else ""))
        env = {"FSDP_TEST_COPY_DELAY_MS": str(rng.choice([0, 1, 3]))}
        if not os.path.exists(folder):
            os.makedirs(folder)
            self.invoke(ref, self.args)
        if env["FSDP_TEST_COPY_DELAY_MS"] not in self.durations:  # a clean run's time: the window to kill in
            t0 = time.monotonic()
            self.invoke(out, self.args, env)
            self.durations[env["FSDP_TEST_COPY_DELAY_MS"]] = time.monotonic() - t0
        with_previous = rng.random() < 0.5
        where = f"{self.name}, random kill, {'over an earlier output' if with_previous else 'no earlier output'}"
        before = self.lay_previous(out, with_previous)
        procs = self.start(out, env)
        time.sleep(rng.uniform(0, 1.1 * self.durations[env["FSDP_TEST_COPY_DELAY_MS"]]))
        for pr in procs:
            try:
                os.killpg(pr.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        codes = [pr.wait() for pr in procs]
        random_runs[0] += 1
        if -9 in codes:
            random_kills_landed[0] += 1
        bad = [c for c in codes if c not in (0, -9)]
        if bad:
            failures.append(f"{where}: exit {bad}: {' '.join(pr.stderr.read().decode().strip() for pr in procs)}")
        for pr in procs:
            pr.stderr.close()
        self.check_after(folder, out, ref, where, with_previous, before)

    def lay_previous(self, out, with_previous):
        """Clears `out`, then writes the earlier output there when asked; returns its tree hash."""
        if os.path.isdir(out):
            shutil.rmtree(out)
        elif os.path.exists(out):
            os.remove(out)
        if with_previous:
            self.invoke(out, self.previous_args)
        return tree_hash(out)

    def check_after(self, folder, out, ref, where, with_previous, before):
        """After a kill: the earlier output, nothing (when there was none) or a complete new one;
        then a rerun completes and leaves nothing beside the output."""
        now = tree_hash(out)
        if now is None:
            if with_previous:
                failures.append(f"{where}: the earlier output is gone and no new one is there")
        elif not (with_previous and now == before):
            problem = complete(out, ref)
            if problem:
                failures.append(f"{where}: the output is neither the earlier one nor a complete new one: {problem}")
        r = self.invoke(out, self.args, check=False)
        if r.returncode != 0:
            failures.append(f"{where}: the rerun fails: {r.stderr.strip()}")
            return
        problem = complete(out, ref)
        if problem:
            failures.append(f"{where}: after the rerun: {problem}")
        left = leftovers(folder, {os.path.basename(ref)})
        if left:
            failures.append(f"{where}: the rerun left {left}")

    def one(self, folder, out, ref, point, with_previous):
        where = f"{self.name}, {'over an earlier output' if with_previous else 'no earlier output'}, crash at {point}"
        before = self.lay_previous(out, with_previous)
        r = self.invoke(out, self.args, {"FSDP_TEST_CRASH_AT": point}, check=False)
        points_run[0] += 1
        if r.returncode == -9:
            kills[0] += 1
        elif r.returncode != 0:
            failures.append(f"{where}: exit {r.returncode}: {r.stderr.strip()}")
            return
        self.check_after(folder, out, ref, where, with_previous, before)


f4 = os.path.join(a.testdata, "dcp", "torch113_4rank")
f2 = os.path.join(a.testdata, "dcp", "torch113_2rank")
zstd_in = os.path.join(work, "zstd_in")
run([a.probe, "write-dcp", zstd_in, "2", "2.x", "zstd"])
full = os.path.join(work, "full.pt")
run([a.merge, "-q", f4, "-o", full])


scenarios = [
    Scenario("merge to a torch.save file", a.merge, lambda o: [f4, "-o", o], lambda o: [f4, "-o", o, "--dtype", "bf16"]),
    Scenario("merge to Hugging Face shards", a.merge, lambda o: [f4, "-o", o, "--max-shard-size", "300B"],
             lambda o: [f4, "-o", o, "--max-shard-size", "300B", "--dtype", "bf16"]),
    Scenario("merge of zstd items, --verify", a.merge, lambda o: [zstd_in, "-o", o, "--verify"], lambda o: [zstd_in, "-o", o, "--dtype", "fp16"]),
    Scenario("shard 4 to 3 ranks", a.shard, lambda o: [f4, "-o", o, "-n", "3"], lambda o: [f2, "-o", o, "-n", "2"]),
    Scenario("shard with zstd, 2 files per rank", a.shard, lambda o: [f4, "-o", o, "-n", "3", "--compress", "zstd", "--files-per-rank", "2"],
             lambda o: [f4, "-o", o, "-n", "2"]),
    Scenario("shard a torch.save file to 4 DTensor ranks", a.shard, lambda o: [full, "-o", o, "-n", "4", "--layout", "dtensor"],
             lambda o: [full, "-o", o, "-n", "2"]),
    # process 0 killed while process 1 has finished: before its own files, before .metadata,
    # before the directory replaces the earlier one, ...
    Scenario("shard as process 0 of 2, --verify", a.shard, lambda o: [f4, "-o", o, "-n", "3", "--verify"], lambda o: [f4, "-o", o, "-n", "2"],
             processes=2),
]

for s in scenarios:
    try:
        s.run_all()
        print(f"ok   {s.name}")
    except AssertionError as e:
        failures.append(f"{s.name}: {e}")
        print(f"FAIL {s.name}: {e}")

rng = random.Random(a.seed)
deadline = time.monotonic() + a.random_seconds
while time.monotonic() < deadline:
    rng.choice(scenarios).random_kill(rng)
print(f"random kills: {random_runs[0]} runs killed at random moments (seed {a.seed}, {a.random_seconds:.0f} s), "
      f"{random_kills_landed[0]} of them mid-run, {len([f for f in failures if 'random kill' in f])} inconsistent")

shutil.rmtree(work, ignore_errors=True)
for f in failures:
    print(f"FAIL {f}")
print(f"crash consistency: {points_run[0]} runs at {len(POINTS)} named points, {kills[0]} killed mid-write, "
      f"{len(failures)} inconsistent")
print(f"{len(scenarios) - len({f.split(',')[0] for f in failures})} passed, {len({f.split(',')[0] for f in failures})} failed")
sys.exit(1 if failures else 0)

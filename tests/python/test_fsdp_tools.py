#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Python module against the tools and against other readers, under /usr/bin/python3 with
numpy, python3-torch and python3-h5py:
- each fixture (DCP of torch 1.13 and 2.x, torch.save new and legacy) and our merges of it to
  safetensors and HDF5: entries as `fsdp-ckpt-inspect --json` lists them; every tensor's values as
  torch.load reads them (the fixture itself, or a torch.save merge of it), as h5py reads the HDF5
  file, bfloat16 as its bit patterns or cast to float32, and torch=True as torch's own dtype;
- every entry of the hostile corpus testdata/bad marked 'refused' raises CheckpointError (with
  the file and, where the CLI's error has one, the same offset) or, opened, fails verify; no
  hostile pickle runs (its payload would run `echo`, we check no process was made);
- verify(deep=True) of a sound checkpoint is empty, of a truncated one names offsets;
- two threads read at once (the GIL released) and get what one thread gets;
- diff() and stats() report what the tool's --json reports;
- merge() and shard() write what the tools write, byte for byte (two merges in two threads at
  once included), with the tools' defaults and usage errors (as ValueError); a progress callback
  is called, and one that raises stops the merge with nothing left behind; Ctrl-C (SIGINT) stops a
  slowed merge with KeyboardInterrupt and nothing left behind.
Usage: test_fsdp_tools.py --python-dir BUILD/python --inspect INSPECT --merge MERGE --testdata DIR
"""
import argparse
import filecmp
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

p = argparse.ArgumentParser()
p.add_argument("--python-dir", required=True)
p.add_argument("--inspect", required=True)
p.add_argument("--merge", required=True)
p.add_argument("--testdata", required=True)
a = p.parse_args()
sys.path.insert(0, a.python_dir)

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fsdp_tools  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "interop"))
from common import flat_tensors  # noqa: E402

failures = []
counted = {"tensors": 0, "h5py": 0, "refused": 0, "offsets": 0}


def check(cond, what):
    if not cond:
        failures.append(what)


def cli_entries(path):
    r = subprocess.run([a.inspect, "--json", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["entries"]


def same_values(got, want, name):
    """`got` (numpy, bit patterns for dtypes numpy lacks) against torch's `want`."""
    if want.dtype in (torch.bfloat16,) or str(want.dtype).startswith("torch.float8"):
        bits = want.contiguous().view(torch.int16 if want.element_size() == 2 else torch.int8).numpy()
        check(np.array_equal(got.view(bits.dtype), bits), f"{name}: bit patterns differ from torch's")
    else:
        check(got.shape == tuple(want.shape) and np.array_equal(got, want.numpy()), f"{name}: values differ from torch's")


with tempfile.TemporaryDirectory(prefix="fsdp-python-") as work:
    sources = [os.path.join(a.testdata, "dcp", d) for d in ("torch113_2rank", "torch113_4rank", "torch2/torch2_world2", "torch2/torch2_world2_rank_local")]
    sources += [os.path.join(a.testdata, "torch_save", f) for f in ("tiny_state_dict.pt", "legacy_tiny_state_dict.pt")]
    for src in sources:
        base = os.path.basename(src)
        if src.endswith(".pt"):
            want = flat_tensors(torch, torch.load(src, map_location="cpu"))
        else:
            pt = os.path.join(work, base + ".pt")
            r = subprocess.run([a.merge, "-q", src, "-o", pt, "--layout", "flat"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            want = {k: v.detach() for k, v in torch.load(pt, map_location="cpu").items() if isinstance(v, torch.Tensor)}
        st = os.path.join(work, base + ".safetensors")
        h5 = os.path.join(work, base + ".h5")
        for out in (st, h5):
            r = subprocess.run([a.merge, "-q", src, "-o", out], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        for path in (src, st, h5):
            c = fsdp_tools.open(path)
            label = os.path.relpath(path, work) if path.startswith(work) else base
            check(c.entries == cli_entries(path), f"{label}: entries differ from inspect --json's")
            tensors = [e["name"] for e in c.entries if e["kind"] == "tensor"]
            check(len(c) == len(c.entries) and all(n in c for n in tensors) and "no-such-entry" not in c, f"{label}: len/in")
            check(sorted(c) == sorted(e["name"] for e in c.entries), f"{label}: iteration")
            for n in tensors:
                key = n
                if key not in want and path != src:
                    continue  # a safetensors or HDF5 output holds the model's tensors only
                check(key in want, f"{label}: {n} is not torch.load's")
                if key not in want:
                    continue
                got = c.tensor(n)
                same_values(got, want[key], f"{label}: {n}")
                counted["tensors"] += 1
                t = c.tensor(n, torch=True)
                check(t.dtype == want[key].dtype and torch.equal(t, want[key]), f"{label}: {n} torch=True differs")
                if want[key].dtype == torch.bfloat16:
                    f32 = c.tensor(n, float32=True)
                    check(f32.dtype == np.float32 and np.array_equal(f32, want[key].float().numpy()), f"{label}: {n} float32=True")
            if path == h5:
                with h5py.File(h5, "r") as f:
                    def visit(name, obj):
                        if isinstance(obj, h5py.Dataset) and obj.dtype.kind in "fiub" and obj.name.lstrip("/").replace("/", ".") in c:
                            mine = c.tensor(obj.name.lstrip("/").replace("/", "."))
                            counted["h5py"] += 1
                            check(np.array_equal(mine.view(obj.dtype) if mine.dtype != obj.dtype else mine, obj[()]),
                                  f"{label}: {name} differs from h5py's")
                    f.visititems(visit)
        check(fsdp_tools.verify(src, deep=True) == [], f"{base}: verify --deep found problems")
        check(fsdp_tools.open(src).verify() == [], f"{base}: ckpt.verify() found problems")

    # The hostile corpus: refused entries raise or fail verify; nothing of theirs runs.
    bad = os.path.join(a.testdata, "bad")
    before = set(os.listdir("/proc"))
    for line in open(os.path.join(bad, "MANIFEST.tsv")).read().splitlines()[1:]:
        name, expect, _ = line.split("\t")
        if expect != "refused":
            continue
        counted["refused"] += 1
        path = os.path.join(bad, name)
        try:
            c = fsdp_tools.open(path)
            problems = fsdp_tools.verify(path, deep=True)
            check(problems, f"bad/{name}: opened and verified sound")
            continue
        except fsdp_tools.CheckpointError as e:
            r = subprocess.run([a.inspect, path], capture_output=True, text=True)
            m = re.search(r"offset (\d+)", r.stderr)
            check(isinstance(e.path, str) and e.message and e.kind, f"bad/{name}: an error without path, message or kind")
            if m and r.returncode == 1:
                check(e.offset == int(m.group(1)), f"bad/{name}: offset {e.offset}, the CLI says {m.group(1)}")
                counted["offsets"] += 1
    # Hostile payloads would have run `echo` through os.system; that makes a child process.
    children = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "comm="], capture_output=True, text=True).stdout.split()
    check("echo" not in children and "sh" not in children, f"a hostile pickle made a process: {children}")

    try:
        fsdp_tools.open(os.path.join(work, "nothing-here"))
        check(False, "opening a missing path did not raise")
    except fsdp_tools.CheckpointError as e:
        check("nothing-here" in str(e) and e.kind, f"a missing path's error: {e}")
    try:
        fsdp_tools.open(sources[0]).tensor("no.such.tensor")
        check(False, "a missing tensor did not raise")
    except fsdp_tools.CheckpointError as e:
        check("no.such.tensor" in str(e), f"a missing tensor's error: {e}")
    truncated = fsdp_tools.verify(os.path.join(bad, "dcp_truncated_distcp"), deep=True)
    check(truncated and all(p["offset"] is not None for p in truncated), f"a truncated checkpoint's problems: {truncated}")

    # Two threads at once, each the whole checkpoint's tensors, against one thread.
    c = fsdp_tools.open(sources[1])
    names = [e["name"] for e in c.entries if e["kind"] == "tensor"]
    alone = {n: c.tensor(n) for n in names}
    results = [None, None]

    def read_all(i):
        mine = fsdp_tools.open(sources[1])
        results[i] = {n: mine.tensor(n) for n in names for _ in range(20)}

    threads = [threading.Thread(target=read_all, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(all(r is not None and all(np.array_equal(r[n], alone[n]) for n in names) for r in results), "two threads read other values")

check(counted["tensors"] > 50 and counted["h5py"] > 5 and counted["refused"] > 50 and counted["offsets"] > 20, f"too little checked: {counted}")

def cli(*args):
    tool = a.merge if args[0] == "merge" else os.path.join(os.path.dirname(a.merge), "fsdp-ckpt-shard")
    r = subprocess.run([tool, "-q", *args[1:]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


def tree_equal(x, y):
    """Byte for byte, but for the random save_id (a UUID) of a DCP .metadata."""
    if os.path.basename(x) == ".metadata":
        uuid = rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
        return re.sub(uuid, b"", open(x, "rb").read()) == re.sub(uuid, b"", open(y, "rb").read())
    if os.path.isfile(x):
        return filecmp.cmp(x, y, shallow=False)
    names = sorted(os.listdir(x))
    return names == sorted(os.listdir(y)) and all(tree_equal(os.path.join(x, n), os.path.join(y, n)) for n in names)


with tempfile.TemporaryDirectory(prefix="fsdp-python-write-") as work:
    src = os.path.join(a.testdata, "dcp", "torch113_4rank")
    # The module's outputs in work/, the tools' of the same names in work/cli/ (a torch.save
    # archive's records are named after the file).
    out = lambda n: os.path.join(work, n)  # noqa: E731
    theirs = lambda n: os.path.join(work, "cli", n)  # noqa: E731
    os.makedirs(theirs("."))
    calls = []
    r = fsdp_tools.merge(src, out("py.pt"), progress=lambda done, total: calls.append((done, total)))
    cli("merge", src, "-o", theirs("py.pt"))
    check(tree_equal(out("py.pt"), theirs("py.pt")), "merge() to torch.save differs from fsdp-ckpt-merge's")
    check(r["files"][0]["path"] == out("py.pt") and r["entries"], f"merge()'s result: {r}")
    check(calls and calls[-1][0] == calls[-1][1] > 0, f"progress calls: {calls}")
    fsdp_tools.merge(src, out("py-hf"), max_shard_size="300B", dtype="bf16", exclude=["optim*"], model_only=True)
    cli("merge", src, "-o", theirs("py-hf"), "--max-shard-size", "300B", "--dtype", "bf16", "--exclude", "optim*", "--model-only")
    check(tree_equal(out("py-hf"), theirs("py-hf")), "merge() to safetensors shards differs from fsdp-ckpt-merge's")
    fsdp_tools.shard(src, out("py-w3"), 3, compress="zstd")
    cli("shard", src, "-o", theirs("py-w3"), "-n", "3", "--compress", "zstd")
    check(tree_equal(out("py-w3"), theirs("py-w3")), "shard() differs from fsdp-ckpt-shard's")
    check(fsdp_tools.merge(src, out("dry.pt"), dry_run=True)["dry_run"] and not os.path.exists(out("dry.pt")), "dry_run wrote")
    check(fsdp_tools.merge(src, out("py.pt"), force=True)["files"], "force=True")
    for bad, words in ((dict(dst=out("x.pt"), max_shard_size="5GB"), "max_shard_size"), (dict(dst=out("py.pt")), "exists"),
                       (dict(dst=out("y.pt"), dtype="int3"), "dtype")):
        try:
            fsdp_tools.merge(src, **bad)
            check(False, f"merge({bad}) did not raise")
        except (ValueError, fsdp_tools.CheckpointError) as e:
            check(words in str(e), f"merge({bad}): {e}")

    # diff() and stats() report what the tool's --json does.
    def cli_json(*args):
        r = subprocess.run([a.inspect, *args, "--json"], capture_output=True, text=True)
        return json.loads(r.stdout)

    check(fsdp_tools.diff(src, out("py.pt")) == cli_json("diff", src, out("py.pt")), "diff() is not diff --json's report")
    fsdp_tools.merge(src, out("bf16.pt"), dtype="bf16")
    check(not fsdp_tools.diff(src, out("bf16.pt"))["equal"] and fsdp_tools.diff(src, out("bf16.pt"), rtol=1e-2)["equal"],
          "diff() of a bfloat16 merge: unequal exactly, equal within rtol 1e-2")
    check(fsdp_tools.stats(src, tensor="model.*") == cli_json("stats", src, "--tensor", "model.*"), "stats() is not stats --json's")

    def stop(done, total):
        raise RuntimeError("enough")

    try:
        fsdp_tools.merge(src, out("stopped.pt"), progress=stop)
        check(False, "a raising callback did not stop the merge")
    except RuntimeError as e:
        check(str(e) == "enough", f"the callback's exception: {e!r}")
    left = [n for n in os.listdir(work) if n.startswith("stopped")]
    check(not left, f"a stopped merge left {left}")

    # Two merges at once, each as the CLI's.
    def merge_to(name):
        fsdp_tools.merge(src, out(name), format="safetensors")

    threads = [threading.Thread(target=merge_to, args=(f"t{i}.safetensors",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cli("merge", src, "-o", theirs("t.safetensors"))
    check(all(tree_equal(out(f"t{i}.safetensors"), theirs("t.safetensors")) for i in range(2)), "two merges at once differ from the CLI's")

    # Ctrl-C in the interpreter: a merge slowed to 300 ms a copy, interrupted after 0.8 s.
    code = (f"import sys, os; sys.path.insert(0, {a.python_dir!r}); import fsdp_tools\n"
            f"try:\n    fsdp_tools.merge({src!r}, {out('interrupted.pt')!r})\n"
            "except KeyboardInterrupt:\n    print('interrupted'); sys.exit(3)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, FSDP_TEST_COPY_DELAY_MS="300"))
    time.sleep(0.8)
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=60)
    left = [n for n in os.listdir(work) if n.startswith("interrupted")]
    check(child.returncode == 3 and "interrupted" in stdout and not left, f"Ctrl-C: exit {child.returncode}, {stdout!r} {stderr[-300:]!r}, left {left}")

for f in failures:
    print("FAIL", f)
if failures:
    sys.exit(1)
print(f"fsdp_tools: {len(sources)} fixtures and their safetensors and HDF5 merges: {counted['tensors']} tensors read as torch reads "
      f"them, {counted['h5py']} as h5py does; {counted['refused']} hostile entries refused, {counted['offsets']} errors at the CLI's offset; "
      "verify; two threads at once; merge() and shard() as the tools, with a progress callback, a raising one and Ctrl-C")

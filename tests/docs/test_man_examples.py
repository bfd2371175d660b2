#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Every example of every man page's EXAMPLES section runs, as written, with the built tools first on
PATH, and exits 0 (the exit its page describes: none describes a failure). Each page's examples run
in order in a directory of their own, laid out with the files they name:

  checkpoints/step-1000, ckpt   a sharded checkpoint of fsdp-train's Llama (model.layers.0.* ...)
                                with its optimizer, saved by the built fsdp-train
  merged.pt, model.safetensors  that checkpoint merged, and its model alone, by the built merge
  model.safetensors.index.json  its model as a Hugging Face index and shards (model.* names)
  book.txt                      testdata/text/fsdp-tools-docs.txt

An example that needs what no test machine has (SLURM's srun, a shared file system) is listed in
NEEDS with the reason, and reported as not run; an example in NEEDS that the pages no longer hold
fails the test, so the list cannot go stale.
Usage: test_man_examples.py --bin BUILD/tools --man MAN_DIR --text TEXT
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

NEEDS = {
    "srun -N 4 -n 4 fsdp-ckpt-shard /shared/ckpt -o /shared/ckpt-w64 -n 64": "SLURM's srun and a shared file system",
}

# Fixtures a page's examples write themselves (fsdp-train's merge writes model.safetensors).
UNUSED = {"fsdp-train.1": ["model.safetensors"]}


def unescape(line):
    line = re.sub(r"\\f[BIRP]", "", line)
    return line.replace("\\-", "-").replace("\\(aq", "'").replace("\\e", "\\").strip()


def examples(page):
    """The commands of the page's EXAMPLES section: each `.B` line after `.TP`, and each line of a
    `.nf` … `.fi` block."""
    text = open(page).read()
    m = re.search(r"^\.SH EXAMPLES\n(.*?)(?=^\.SH |\Z)", text, re.M | re.S)
    if not m:
        return []
    out, verbatim, after_tp = [], False, False
    for line in m.group(1).splitlines():
        if line.startswith(".nf"):
            verbatim = True
        elif line.startswith(".fi"):
            verbatim = False
        elif verbatim and line.strip():
            out.append(unescape(line))
        elif line.startswith(".TP"):
            after_tp = True
            continue
        elif after_tp and line.startswith(".B "):
            out.append(unescape(line[3:]))
        after_tp = False
    return out


def run(cmd, cwd, env, timeout=600):
    return subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--man", required=True)
    p.add_argument("--text", required=True)
    a = p.parse_args()
    env = dict(os.environ, PATH=os.path.abspath(a.bin) + os.pathsep + os.environ["PATH"])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    pages = sorted(os.path.join(a.man, f) for f in os.listdir(a.man) if f.endswith(".1"))
    failed, ran, skipped, seen = [], 0, [], set()
    with tempfile.TemporaryDirectory(prefix="fsdp-man-examples-") as work:
        # The fixtures, made once by the built tools.
        fixtures = os.path.join(work, "fixtures")
        os.makedirs(os.path.join(fixtures, "checkpoints"))
        shutil.copy(a.text, os.path.join(fixtures, "book.txt"))
        setup = [
            "fsdp-train -q --model llama --n-layer 2 --n-embd 32 --n-head 4 --block-size 32 --data book.txt --steps 2 "
            "--ckpt-dir runs --save-every 2",
            "mv runs/step-00000002 checkpoints/step-1000 && rm -rf runs && cp -r checkpoints/step-1000 ckpt",
            "fsdp-ckpt-merge -q checkpoints/step-1000 -o merged.pt",
            "fsdp-ckpt-merge -q checkpoints/step-1000 --model-only -o model.safetensors",
            "fsdp-ckpt-merge -q checkpoints/step-1000 --include 'model.*' -o hub --max-shard-size 20KB && mv hub/* . && rmdir hub",
        ]
        for cmd in setup:
            r = run(cmd, fixtures, env)
            if r.returncode != 0:
                sys.exit(f"setting the examples' files up: `{cmd}` exited {r.returncode}: {r.stderr}")
        for page in pages:
            name = os.path.basename(page)
            cwd = os.path.join(work, name)
            shutil.copytree(fixtures, cwd, symlinks=True)
            for f in UNUSED.get(name, []):
                os.remove(os.path.join(cwd, f))
            for cmd in examples(page):
                seen.add(cmd)
                if cmd in NEEDS:
                    skipped.append(f"{name}: `{cmd}` (needs {NEEDS[cmd]})")
                    continue
                r = run(cmd, cwd, env)
                ran += 1
                if r.returncode != 0:
                    failed.append(f"{name}: `{cmd}` exited {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}")
            shutil.rmtree(cwd)
    stale = [c for c in NEEDS if c not in seen]
    for f in failed:
        print("FAIL", f)
    for s in skipped:
        print("not run:", s)
    if stale:
        print("FAIL: NEEDS lists examples no page holds:", stale)
    if failed or stale or ran == 0:
        return 1
    print(f"{ran} examples of {len(pages)} man pages ran and exited 0; {len(skipped)} not run (named above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

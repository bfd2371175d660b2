#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The README's libfsdp example runs (a world of one), its loss falls, its checkpoint passes
`fsdp-ckpt-inspect verify --deep`, and the README shows exactly the example's code."""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap

p = argparse.ArgumentParser()
p.add_argument("--example", required=True)
p.add_argument("--inspect", required=True)
a = p.parse_args()
root = os.path.join(os.path.dirname(__file__), "..", "..")
source = open(os.path.join(os.path.dirname(__file__), "readme_example.cpp")).read()
blocks = re.findall(r"// README begin\n(.*?)\n *// README end", source, re.S)
code = "\n\n".join(textwrap.dedent(b) for b in blocks)
readme = open(os.path.join(root, "README.md")).read()
if code.strip() not in readme:
    sys.exit("README.md does not show tests/fsdp/readme_example.cpp's code (between its README markers, one part after the other) as it is")
with tempfile.TemporaryDirectory(prefix="fsdp-readme-") as d:
    ckpt = os.path.join(d, "ckpt")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    r = subprocess.run([a.example, ckpt], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        sys.exit(f"the example exited {r.returncode}: {r.stderr}")
    losses = [float(x) for x in re.findall(r"loss ([0-9.e+-]+)", r.stdout)]
    if len(losses) != 2 or not losses[1] < losses[0]:
        sys.exit(f"expected two falling losses, got: {r.stdout}")
    v = subprocess.run([a.inspect, "verify", "--deep", ckpt], capture_output=True, text=True)
    if v.returncode != 0:
        sys.exit(f"its checkpoint does not verify: {v.stdout}{v.stderr}")
print(f"readme example: losses {losses}, checkpoint verified, README in step with the code")

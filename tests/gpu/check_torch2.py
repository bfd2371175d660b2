#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch 2.x reads what libfsdp saved on a GPU (tests/gpu/run.sh).

    check_torch2.py device DIR       # fsdp_device_test's kept checkpoints: {32-true,bf16-mixed,16-mixed}-{sharded,full.pt}
    check_torch2.py train CKPT PT    # an fsdp-train checkpoint and fsdp-ckpt-merge's file of it

Every tensor of a DCP directory is loaded with dcp.load (no process group), every full file with
torch.load(weights_only=True); the two of a pair must hold the same values."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "interop"))

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from common import flat_tensors  # noqa: E402


def load_dcp(path):
    md = dcp.FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
          for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
    return sd


def compare(a, b, what, tol):
    keys = sorted(k for k in a if k in b)
    assert keys, f"{what}: no key in common ({sorted(a)[:5]} / {sorted(b)[:5]})"
    worst = 0.0
    for k in keys:
        x, y = a[k].float(), b[k].float()
        assert x.shape == y.shape, f"{what}: {k} {tuple(x.shape)} against {tuple(y.shape)}"
        worst = max(worst, (x - y).abs().max().item() if x.numel() else 0.0)
        assert torch.isfinite(x).all(), f"{what}: {k} is not finite"
    print(f"{what}: {len(keys)} tensors in common, largest difference {worst:g}")
    assert worst <= tol, f"{what}: differ by {worst} > {tol}"


print(f"torch {torch.__version__}")
mode = sys.argv[1]
if mode == "device":
    d = sys.argv[2]
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        if not os.path.isdir(os.path.join(d, f"{precision}-sharded")):
            continue
        sharded = load_dcp(os.path.join(d, f"{precision}-sharded"))
        full = flat_tensors(torch, torch.load(os.path.join(d, f"{precision}-full.pt"), weights_only=True))
        print(f"{precision}: dcp.load read {len(sharded)} tensors, torch.load(weights_only=True) {len(full)}")
        # Two runs of the same training on the same GPU, one saved sharded and one full.
        compare(sharded, full, precision, 1e-5)
        assert any(k.startswith("model.") for k in sharded) and any(".exp_avg" in k for k in sharded), sorted(sharded)
elif mode == "train":
    sharded = load_dcp(sys.argv[2])
    merged = flat_tensors(torch, torch.load(sys.argv[3], weights_only=True))
    print(f"dcp.load read {len(sharded)} tensors; the merged file holds {len(merged)}")
    compare(sharded, merged, "merge of the GPU's checkpoint", 0.0)
    assert len([k for k in sharded if k.startswith("model.")]) == len([k for k in merged if k.startswith("model.")])
else:
    sys.exit(f"unknown mode {mode}")
print("ok")

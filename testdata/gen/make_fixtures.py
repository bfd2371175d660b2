#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the committed fixtures under testdata/ with Debian's python3-torch (1.13.1).
Run by hand from the repository root: /usr/bin/python3 testdata/gen/make_fixtures.py
CI never runs it; a fixture changes only in a commit that also updates testdata/README.md."""
import collections
import hashlib
import os

import torch

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def tiny_state_dict():
    # Views, a shared storage, bf16, a Parameter: what docs/formats/torch_save.md describes.
    n = torch.tensor([7, 8, 9], dtype=torch.int64)
    model = collections.OrderedDict(w=torch.arange(6, dtype=torch.float32).reshape(2, 3),
                                    b=torch.tensor([1.5, -2.0], dtype=torch.bfloat16), n=n, view=n[1:])
    obj = {"model": model, "step": 3, "name": "x", "p": torch.nn.Parameter(torch.ones(2))}
    path = os.path.join(root, "torch_save", "tiny_state_dict.pt")
    torch.save(obj, path)
    return path


def legacy_tiny_state_dict():
    # The same object in the legacy format (docs/formats/torch_save.md#legacy-format); its storage
    # keys are the storages' addresses, so each run writes other bytes.
    path = os.path.join(root, "torch_save", "legacy_tiny_state_dict.pt")
    torch.save(torch.load(tiny_state_dict()), path, _use_new_zipfile_serialization=False)
    return path


for p in [tiny_state_dict(), legacy_tiny_state_dict()]:
    data = open(p, "rb").read()
    print(f"{os.path.relpath(p, root)}  {len(data)} bytes  sha256 {hashlib.sha256(data).hexdigest()}  torch {torch.__version__}")

# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the interop tests: run ckpt_probe, compare with what PyTorch says."""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

FAILURES = []
PASSED = [0]
SKIPPED = [0]


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--probe", required=True)
    p.add_argument("--testdata", required=True)
    p.add_argument("--shared", required=True)
    p.add_argument("--merge", help="the fsdp-ckpt-merge binary")
    p.add_argument("--inspect", help="the fsdp-ckpt-inspect binary")
    p.add_argument("--shard", help="the fsdp-ckpt-shard binary")
    return p.parse_args()


def import_torch():
    try:
        import torch  # noqa: F401
    except Exception as e:  # the oracle must be there: fail, never skip
        print(f"FAIL: cannot import torch ({e}); install python3-torch (scripts/setup)")
        sys.exit(1)
    return torch


def probe(a, *argv, expect_ok=True):
    r = subprocess.run([a.probe, *argv], capture_output=True, text=True)
    if expect_ok and r.returncode != 0:
        raise AssertionError(f"ckpt_probe {' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def probe_json(a, *argv):
    return json.loads(probe(a, *argv).stdout)


def check(name, fn):
    only = os.environ.get("FSDP_TEST_ONLY")  # a developer's filter: comma-separated check names
    if only and name not in only.split(","):
        skip(name, "not in FSDP_TEST_ONLY")
        return
    try:
        fn()
        PASSED[0] += 1
        print(f"ok   {name}")
    except AssertionError as e:
        FAILURES.append(name)
        print(f"FAIL {name}: {e}")
    except Exception as e:  # an unexpected exception is a failure too
        FAILURES.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {e}")


def skip(name, why):
    SKIPPED[0] += 1
    print(f"skip {name}: {why}")


_TMPDIRS = []


def finish():
    import shutil
    for d in _TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)
    print(f"{PASSED[0]} passed, {len(FAILURES)} failed, {SKIPPED[0]} skipped")
    sys.exit(1 if FAILURES else 0)


def tmpdir():
    """A scratch directory, removed by finish()."""
    d = tempfile.mkdtemp(prefix="fsdp-interop-")
    _TMPDIRS.append(d)
    return d


def tensor_bytes(torch, t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def sample_bytes(s, n, is_bool):
    b = bytes(((j * 131 + s * 17 + 7) % 256) for j in range(n))
    return bytes(x % 2 for x in b) if is_bool else b


def read_safetensors(path, padded=True):
    """The header with json and struct only, and each tensor's raw bytes. `padded`: the header's
    length must be a multiple of 8, as the reference writer makes it (older writers did not pad)."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert n % 8 == 0 or not padded, "header not padded to 8"
    body = data[8 + n:]
    meta = header.pop("__metadata__", {})
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    at = 0
    for b, e, k in spans:
        assert b == at, f"{k}: hole or overlap at {b}"
        at = e
    assert at == len(body), "trailing bytes"
    return meta, {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def write_safetensors(path, tensors, metadata=None):
    """A safetensors file as huggingface/safetensors lays it out (docs/formats/safetensors.md): the
    header's length (8 bytes, little-endian), the JSON header (each tensor's dtype, shape and
    data_offsets; __metadata__) padded with spaces to a multiple of 8, then the data in the order
    given. float32 tensors only (the safetensors package is not in Debian)."""
    import torch
    header, at, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        assert t.dtype == torch.float32, (name, t.dtype)
        b = tensor_bytes(torch, t)
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        at += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def raw(t):
    """A tensor's bytes in C order (bool as one byte each)."""
    import torch
    t = t.contiguous().reshape(-1)
    return bytes((t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy())


def flat_tensors(torch, tree, prefix=""):
    """A torch.load result's tensors (detached) by their dotted key path, as the tools name them."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(torch, v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(torch, v, f"{prefix}{i}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree.detach()
    return out

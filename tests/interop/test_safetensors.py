#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""safetensors interop. Debian has no safetensors package, so the oracle is the layout itself
(docs/formats/safetensors.md, the reference writer's rules) read with Python's json and torch.frombuffer,
and the real files in ../shared/testdata-real written by the reference implementation."""
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import args, check, finish, import_torch, probe, probe_json, sample_bytes, skip, tmpdir  # noqa: E402

a = args()
torch = import_torch()
work = tmpdir()

SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
         "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8, "U64": 8}
TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
               "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64",
               "I64": "int64", "U64": "uint64", "C64": "complex64"}
ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16",
         "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]


def read_reference(path):
    """A reader written from the spec, independent of ours."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header_bytes = data[8:8 + n]
    header = json.loads(header_bytes)
    return n, header_bytes, header, data[8 + n:]


def test_our_writer_follows_the_layout():
    out = os.path.join(work, "sample.safetensors")
    probe(a, "write-safetensors-sample", out)
    manifest = json.load(open(out + ".json"))
    n, raw, header, buf = read_reference(out)
    assert n % 8 == 0 and (8 + n) % 8 == 0, f"header length {n} is not padded to 8"
    assert raw.rstrip(b" ") == json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode(), "header is not compact JSON"
    keys = list(header)
    assert keys[0] == "__metadata__" and header["__metadata__"] == manifest["metadata"]
    tensors = [(k, header[k]) for k in keys[1:]]
    want_order = sorted(tensors, key=lambda kv: (-ORDER.index(kv[1]["dtype"]), kv[0]))
    assert [k for k, _ in tensors] == [k for k, _ in want_order], "tensors are not sorted by alignment then name"
    at = 0
    by_name = {t["name"]: t for t in manifest["tensors"]}
    for k, info in tensors:
        b, e = info["data_offsets"]
        assert b == at, f"{k}: begins at {b}, expected {at}"
        numel = 1
        for d in info["shape"]:
            numel *= d
        assert e - b == numel * SIZES[info["dtype"]], f"{k}: size"
        m = by_name[k]
        assert info["dtype"] == m["dtype"] and info["shape"] == m["shape"], k
        assert buf[b:e] == sample_bytes(m["seed"], e - b, m["dtype"] == "BOOL"), f"{k}: bytes differ"
        at = e
    assert at == len(buf), "trailing bytes after the last tensor"
    # torch reads the F32 tensor back from the raw layout as the values we meant
    info = header["t_F32"]
    b, e = info["data_offsets"]
    t = torch.frombuffer(bytearray(buf[b:e]), dtype=torch.float32).reshape(info["shape"])
    want = torch.frombuffer(bytearray(sample_bytes(by_name["t_F32"]["seed"], e - b, False)), dtype=torch.float32).reshape(info["shape"])
    assert torch.equal(t.view(torch.int32), want.view(torch.int32))


def test_reader_on_reference_files():
    folder = os.path.join(a.shared, "huggingface__safetensors__samples")
    names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert len(names) == 10, names
    for f in names:
        path = os.path.join(folder, f)
        n, _, header, buf = read_reference(path)
        dump = probe_json(a, "dump-safetensors", path)
        assert dump["header_size"] == n
        assert dump["metadata"] == header.get("__metadata__", {})
        ours = {t["name"]: t for t in dump["tensors"]}
        assert set(ours) == set(header) - {"__metadata__"}, f"{f}: names"
        for k, info in header.items():
            if k == "__metadata__":
                continue
            t = ours[k]
            b, e = info["data_offsets"]
            assert t["shape"] == info["shape"], f"{f}:{k} shape"
            assert t["begin"] == 8 + n + b and t["end"] == 8 + n + e, f"{f}:{k} offsets"
            assert bytes.fromhex(t["hex"]) == buf[b:e], f"{f}:{k} bytes"
            assert t["dtype"] == TORCH_NAMES[info["dtype"]], f"{f}:{k} dtype {t['dtype']} for {info['dtype']}"


def test_round_trip_through_our_reader():
    out = os.path.join(work, "sample.safetensors")
    if not os.path.exists(out):
        probe(a, "write-safetensors-sample", out)
    dump = probe_json(a, "dump-safetensors", out)
    manifest = json.load(open(out + ".json"))
    by_name = {t["name"]: t for t in manifest["tensors"]}
    assert len(dump["tensors"]) == len(by_name)
    for t in dump["tensors"]:
        m = by_name[t["name"]]
        assert bytes.fromhex(t["hex"]) == sample_bytes(m["seed"], len(t["hex"]) // 2, m["dtype"] == "BOOL"), t["name"]


check("our safetensors writer follows the reference layout", test_our_writer_follows_the_layout)
check("our reader reads what our writer meant", test_round_trip_through_our_reader)
if os.path.isdir(os.path.join(a.shared, "huggingface__safetensors__samples")):
    check("our reader agrees with the reference files", test_reader_on_reference_files)
else:
    skip("reference safetensors files", f"{a.shared} is absent (the shared real-checkpoint folder)")
finish()

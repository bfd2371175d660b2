#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the hostile-input corpus testdata/bad/ (issue: faults): broken and malicious torch.save
files, safetensors files and DCP directories, each refused by every tool with exit 1. Run by
hand with Debian's python3-torch (its classes are needed to edit a 2.x .metadata through the
stand-ins of tests/interop/dcp_oracle.py) and the zstd tool:

    /usr/bin/python3 testdata/gen/make_bad.py build/tests/ckpt_probe testdata/bad

Every entry is listed in testdata/bad/MANIFEST.tsv with what is wrong with it."""
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile

probe, out = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
sys.path.insert(0, os.path.join(root, "..", "tests", "interop"))
import dcp_oracle  # noqa: E402

dcp_oracle.install_2x_stubs()
import torch  # noqa: E402,F401  (torch.Size and dtypes inside TensorProperties)

# TensorProperties pickles its state as a tuple (__getstate__), as torch 2.x does; the stand-in
# keeps that tuple, and must give it back.
_props = sys.modules["torch.distributed.checkpoint.metadata"].TensorProperties
_props.__getstate__ = lambda self: self.state_tuple if hasattr(self, "state_tuple") else self.__dict__

shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)
manifest = []


def entry(name, what, expect="refused"):
    """expect: 'refused' (verify, merge and shard exit 1), or 'bounded' (adversarial but valid:
    any tool may accept it, in bounded time and memory)."""
    manifest.append((name, expect, what))
    return os.path.join(out, name)


def write(name, data, what, expect="refused"):
    with open(entry(name, what, expect), "wb") as f:
        f.write(data)


# ---- torch.save (zip) ------------------------------------------------------------------------
ts = open(os.path.join(root, "torch_save", "tiny_state_dict.pt"), "rb").read()
z = zipfile.ZipFile(io.BytesIO(ts))
boundaries = {}
for info in z.infolist():
    name_len, extra_len = struct.unpack("<HH", ts[info.header_offset + 26:info.header_offset + 30])
    data = info.header_offset + 30 + name_len + extra_len
    rec = info.filename.split('/', 1)[1].replace('/', '_').replace('.', '')
    boundaries[f"{rec}_header"] = info.header_offset
    boundaries[f"{rec}_data"] = data
    boundaries[f"{rec}_mid"] = data + max(1, info.file_size // 2)
eocd = ts.rfind(b"PK\x05\x06")
eocd64 = ts.rfind(b"PK\x06\x06")
cd_offset = struct.unpack("<I", ts[eocd + 16:eocd + 20])[0]
boundaries.update({"central_directory": cd_offset, "eocd64": eocd64, "eocd": eocd, "eocd_minus_1": len(ts) - 1, "one_byte": 1,
                   "four_bytes": 4, "empty": 0})
seen = set()
for k, at in sorted(boundaries.items(), key=lambda kv: kv[1]):
    if at not in seen:
        seen.add(at)
        write(f"ts_trunc_{k}.pt", ts[:at], f"torch.save truncated at {k} (byte {at})")


def patched(data, at, fmt, value):
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


first_cd = cd_offset
write("ts_flip_local_signature.pt", patched(ts, 0, "<I", 0x04034b51), "torch.save: first local header signature flipped")
write("ts_flip_name_length.pt", patched(ts, 26, "<H", 0xffff), "torch.save: a local header's name length past the end")
write("ts_flip_cd_signature.pt", patched(ts, first_cd, "<I", 0x02014b51), "torch.save: central directory signature flipped")
write("ts_cd_size_overflow.pt", patched(ts, first_cd + 20, "<I", 0xfffffffe), "torch.save: a member's compressed size near 4 GiB")
write("ts_cd_offset_past_end.pt", patched(ts, first_cd + 42, "<I", len(ts) + 100), "torch.save: a member's header offset past the end")
write("ts_eocd_cd_offset_past_end.pt", patched(ts, eocd + 16, "<I", 0x7ffffff0), "torch.save: EOCD central directory offset past the end")
write("ts_eocd_entries_wrong.pt", patched(ts, eocd + 10, "<H", 7), "torch.save: EOCD entry count 7, the zip64 record says 6")
write("ts_compressed_member.pt", patched(ts, first_cd + 10, "<H", 8), "torch.save: a member claims deflate (PyTorch stores)")
# two central directory entries pointing at the same local header: members overlap
second_cd = ts.index(b"PK\x01\x02", first_cd + 4)
first_local = struct.unpack("<I", ts[first_cd + 42:first_cd + 46])[0]
write("ts_members_overlap.pt", patched(ts, second_cd + 42, "<I", first_local), "torch.save: two members share one local header")


def torch_save_with(pkl, what, name, expect="refused"):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zz:
        zz.writestr("archive/data.pkl", pkl)
        zz.writestr("archive/version", "3\n")
    write(name, buf.getvalue(), what, expect)


HOSTILE = {
    "os_system": b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.",
    "posix_system": b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00echo\x85R.",
    "builtins_eval": b"\x80\x02c__builtin__\neval\nX\x03\x00\x00\x001+1\x85R.",
    "subprocess_popen": b"\x80\x02csubprocess\nPopen\nX\x04\x00\x00\x00echo\x85R.",
    "stack_global_os_system": b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x04echo\x85R.",
}
for k, pkl in HOSTILE.items():
    torch_save_with(pkl, f"torch.save whose data.pkl calls {k.replace('_', '.', 1)}", f"ts_hostile_{k}.pt")
deep = b"\x80\x02" + b"(" * 20000 + b"l" * 20000 + b"."
torch_save_with(deep, "torch.save whose data.pkl nests 20000 lists", "ts_deep_nesting.pt")
memo = b"\x80\x02]r\xff\xff\xff\xff."  # LONG_BINPUT at index 4294967295
torch_save_with(memo, "torch.save whose data.pkl memoizes at index 2^32-1 (valid: must not allocate 2^32 slots)", "ts_memo_index_huge.pt",
                "bounded")
bomb = b"\x80\x02]q\x00" + b"(h\x00h\x00h\x00h\x00h\x00h\x00h\x00h\x00lq\x00" * 64 + b"."  # each level 8x the last, shared
torch_save_with(bomb, "torch.save whose data.pkl is a memo bomb (64 levels, each 8 references to the last)", "ts_memo_bomb.pt",
                "bounded")
torch_save_with(b"\x80\x02K\x01", "torch.save whose data.pkl has no STOP", "ts_no_stop.pt")
torch_save_with(b"\x80\x02h\x07.", "torch.save whose data.pkl gets an unset memo index", "ts_memo_unset.pt")

# ---- safetensors -------------------------------------------------------------------------------


def st(header, body=b"", pad=True):
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


good = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
body = bytes(range(16))
write("st_header_len_huge.safetensors", struct.pack("<Q", 1 << 63) + b"{}", "safetensors: header length 2^63")
write("st_header_len_past_end.safetensors", struct.pack("<Q", 4096) + b"{}      ", "safetensors: header length past the end")
write("st_bad_json.safetensors", struct.pack("<Q", 8) + b'{"w": [}' + body, "safetensors: header is not JSON")
write("st_offsets_past_end.safetensors", st({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 4096]}}, body),
      "safetensors: data_offsets past the end")
write("st_offsets_overlap.safetensors", st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, body[:12]),
      "safetensors: two tensors overlap")
write("st_negative_dim.safetensors", st({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, body),
      "safetensors: a negative dimension")
write("st_shape_overflow.safetensors", st({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40, 1 << 40], "data_offsets": [0, 16]}}, body),
      "safetensors: a shape whose byte count overflows 64 bits")
write("st_size_mismatch.safetensors", st({"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 16]}}, body),
      "safetensors: data_offsets disagree with shape x dtype")
write("st_unknown_dtype.safetensors", st({"w": {"dtype": "F33", "shape": [2, 2], "data_offsets": [0, 16]}}, body),
      "safetensors: unknown dtype")
write("st_truncated_body.safetensors", st(good, body[:10]), "safetensors: body shorter than the header says")

# ---- DCP directories ---------------------------------------------------------------------------
base = os.path.join(out, ".base")
subprocess.run([probe, "write-dcp", base, "2", "2.x", "none"], check=True)
os.remove(base + ".json")


def dcp_copy(name, what):
    d = entry(name, what)
    shutil.copytree(base, d)
    return d


def load_meta(d):
    return pickle.load(open(os.path.join(d, ".metadata"), "rb"))


def save_meta(d, m):
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(m, f, protocol=4)


def edit(name, what, fn):
    d = dcp_copy(name, what)
    m = load_meta(d)
    fn(m, d)
    save_meta(d, m)


meta_bytes = open(os.path.join(base, ".metadata"), "rb").read()
for k, at in {"half": len(meta_bytes) // 2, "first_10": 10, "no_stop": len(meta_bytes) - 1}.items():
    d = dcp_copy(f"dcp_trunc_metadata_{k}", f"DCP: .metadata truncated ({k}, {at} of {len(meta_bytes)} bytes)")
    open(os.path.join(d, ".metadata"), "wb").write(meta_bytes[:at])
d = dcp_copy("dcp_missing_distcp", "DCP: a data file the metadata names is missing")
os.remove(os.path.join(d, "__1_0.distcp"))
d = dcp_copy("dcp_truncated_distcp", "DCP: a data file cut short, its last items past the end")
p = os.path.join(d, "__0_0.distcp")
open(p, "r+b").truncate(os.path.getsize(p) // 2)


def tensor_fqn(m, want_chunks=2):
    for k, v in m.state_dict_metadata.items():
        if hasattr(v, "chunks") and len(v.chunks) >= want_chunks:
            return k
    raise SystemExit("no tensor with enough chunks in the sample")


def storage_of(m, fqn):
    return [v for k, v in m.storage_data.items() if k.fqn == fqn]


def item_past_end(m, d):
    s = storage_of(m, tensor_fqn(m))[0]
    s.offset = os.path.getsize(os.path.join(d, s.relative_path)) + 10


def length_overflow(m, d):
    storage_of(m, tensor_fqn(m))[0].length = (1 << 63) - 1


def chunks_overlap(m, d):
    c = m.state_dict_metadata[tensor_fqn(m)].chunks
    c[1].offsets = torch.Size([c[0].offsets[0]] + list(c[1].offsets)[1:])


def chunks_hole(m, d):
    c = m.state_dict_metadata[tensor_fqn(m)].chunks
    c.pop()


def negative_dim(m, d):
    t = m.state_dict_metadata[tensor_fqn(m)]
    t.size = torch.Size([-1] + list(t.size)[1:])


def shape_overflow(m, d):
    t = m.state_dict_metadata[tensor_fqn(m, 1)]
    t.size = torch.Size([1 << 40] * 3)


def numel_wraps(m, d):
    # (2^40, 2^40) in two chunks of (2^39, 2^40): every element count wraps 64 bits to 0, so the
    # counts agree unless they are checked.
    fqn = tensor_fqn(m)
    t, h = m.state_dict_metadata[fqn], 1 << 39
    old = t.chunks[1].offsets
    t.size = torch.Size([2 * h, 2 * h])
    t.chunks[0].offsets, t.chunks[0].sizes = torch.Size([0, 0]), torch.Size([h, 2 * h])
    t.chunks[1].offsets, t.chunks[1].sizes = torch.Size([h, 0]), torch.Size([h, 2 * h])
    for k in [k for k in m.storage_data if k.fqn == fqn and k.offset == old]:
        v = m.storage_data.pop(k)
        k.offset = t.chunks[1].offsets
        m.storage_data[k] = v


def zero_size_but_stored(m, d):
    t = m.state_dict_metadata[tensor_fqn(m)]
    t.chunks[0].sizes = torch.Size([0] + list(t.chunks[0].sizes)[1:])


def dotdot(m, d):
    storage_of(m, tensor_fqn(m))[0].relative_path = "../escape.distcp"


def absolute(m, d):
    storage_of(m, tensor_fqn(m))[0].relative_path = "/etc/passwd"


edit("dcp_item_past_end", "DCP: an item's offset past the end of its file", item_past_end)
edit("dcp_length_overflow", "DCP: an item's length 2^63-1", length_overflow)
edit("dcp_chunks_overlap", "DCP: two chunks of a tensor overlap", chunks_overlap)
edit("dcp_chunks_hole", "DCP: a tensor's chunks leave a hole", chunks_hole)
edit("dcp_negative_dim", "DCP: a tensor with a negative dimension", negative_dim)
edit("dcp_shape_overflow", "DCP: a shape whose byte count overflows 64 bits", shape_overflow)
edit("dcp_numel_wraps", "DCP: a shape (2^40, 2^40) whose element counts wrap 64 bits to agree", numel_wraps)
edit("dcp_chunk_shrunk", "DCP: a chunk's box no longer matches its item", zero_size_but_stored)
edit("dcp_path_dotdot", "DCP: relative_path '../escape.distcp'", dotdot)
edit("dcp_path_absolute", "DCP: relative_path '/etc/passwd'", absolute)

d = dcp_copy("dcp_unknown_dtype", "DCP: a tensor of an unknown dtype (torch.float32 renamed torch.floaty2)")
mb = open(os.path.join(d, ".metadata"), "rb").read()
assert b"float32" in mb
open(os.path.join(d, ".metadata"), "wb").write(mb.replace(b"float32", b"floaty2", 1))

d = dcp_copy("dcp_symlink_out", "DCP: a data file that is a symbolic link to a file outside the directory")
shutil.move(os.path.join(d, "__1_0.distcp"), os.path.join(out, "dcp_symlink_target.distcp"))
os.symlink("../dcp_symlink_target.distcp", os.path.join(d, "__1_0.distcp"))
manifest.append(("dcp_symlink_target.distcp", "refused", "the file dcp_symlink_out links to (outside it); a bare .distcp is not a checkpoint"))

# Rank-local metadata (NOTE [Rank-local metadata]): no .metadata, each rank's own __{rank}.metadata.
def rank_local_copy(name, what):
    d = dcp_copy(name, what)
    m = load_meta(d)
    os.remove(os.path.join(d, ".metadata"))
    for r in range(2):
        with open(os.path.join(d, f"__{r}.metadata"), "wb") as f:
            pickle.dump(dcp_oracle.rank_local(load_meta(base), r), f, protocol=4)
    return d, m


d, _ = rank_local_copy("dcp_rank_local_gap", "DCP: rank-local metadata of ranks 0 and 2, none of rank 1 (an unfinished save)")
os.rename(os.path.join(d, "__1.metadata"), os.path.join(d, "__2.metadata"))
d, _ = rank_local_copy("dcp_rank_local_disagree", "DCP: rank-local metadata whose ranks give one tensor two shapes")
m1 = pickle.load(open(os.path.join(d, "__1.metadata"), "rb"))
fqn = tensor_fqn(load_meta(base))
m1.state_dict_metadata[fqn].size = torch.Size([s + 1 for s in m1.state_dict_metadata[fqn].size])
with open(os.path.join(d, "__1.metadata"), "wb") as f:
    pickle.dump(m1, f, protocol=4)
d, _ = rank_local_copy("dcp_rank_local_symlink_out", "DCP: rank 1's __1.metadata is a symbolic link to a file outside the directory")
os.remove(os.path.join(d, "__1.metadata"))
os.symlink("../dcp_symlink_target.distcp", os.path.join(d, "__1.metadata"))

for k, pkl in HOSTILE.items():
    d = dcp_copy(f"dcp_hostile_{k}", f"DCP: .metadata calls {k.replace('_', '.', 1)}")
    open(os.path.join(d, ".metadata"), "wb").write(pkl)
d = dcp_copy("dcp_deep_nesting", "DCP: .metadata nests 20000 lists")
open(os.path.join(d, ".metadata"), "wb").write(deep)
d = dcp_copy("dcp_memo_bomb", "DCP: .metadata is a memo bomb")
open(os.path.join(d, ".metadata"), "wb").write(bomb)

# A zstd item that expands without bound: 1.5 GiB of zeros in one frame, where a small tensor's
# item (and, in the second, a bytes item) should be.
zbase = os.path.join(out, ".zbase")
subprocess.run([probe, "write-dcp", zbase, "1", "2.x", "zstd"], check=True)
os.remove(zbase + ".json")
frame = subprocess.run("head -c 1610612736 /dev/zero | zstd -19 -q -c", shell=True, capture_output=True, check=True).stdout
for which, pick in (("tensor", lambda k: getattr(k, "offset", None) is not None), ("bytes", lambda k: getattr(k, "offset", None) is None)):
    d = entry(f"dcp_zstd_bomb_{which}", f"DCP: a zstd {which} item that expands to 1.5 GiB ({len(frame)} bytes compressed)")
    shutil.copytree(zbase, d)
    m = load_meta(d)
    key = [k for k in m.storage_data if pick(k)][0]
    info = m.storage_data[key]
    blob = open(os.path.join(d, info.relative_path), "rb").read()
    info.offset, info.length = len(blob), len(frame)
    open(os.path.join(d, info.relative_path), "ab").write(frame)
    save_meta(d, m)
shutil.rmtree(base)
shutil.rmtree(zbase)

# ---- HDF5 (its structure read by libhdf5 in a child process) ---------------------------------
# The fuzz corpus's seed (fsdp-ckpt-merge of testdata/dcp/torch113_2rank) cut short, and the
# inputs on which fuzz_hdf5 found libhdf5 1.10 overflowing its heap.
H5 = os.path.join(here, "..", "..", "tests", "fuzz", "corpus", "hdf5")
h5seed = open(os.path.join(H5, "merged_torch113_2rank.h5"), "rb").read()
write("h5_truncated_superblock.h5", h5seed[:48], "HDF5: only the superblock")
write("h5_truncated_half.h5", h5seed[:len(h5seed) // 2], "HDF5: cut in half")
for f in sorted(x for x in os.listdir(H5) if x.startswith("libhdf5-overflow-")):
    write(f"h5_{f.replace('-', '_')}", open(os.path.join(H5, f), "rb").read(),
          f"HDF5: libhdf5 1.10 overflows its heap reading it (found by fuzz_hdf5: tests/fuzz/corpus/hdf5/{f})")

with open(os.path.join(out, "MANIFEST.tsv"), "w") as f:
    f.write("entry\texpect\twhat is wrong\n")
    for name, expect, what in manifest:
        f.write(f"{name}\t{expect}\t{what}\n")
print(f"{len(manifest)} entries in {out}")

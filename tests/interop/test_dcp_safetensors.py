#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DCP's Hugging Face storage (docs/formats/dcp.md#hugging-face-storage): directories as
HuggingFaceStorageWriter(save_sharded=True) leaves them, written by testdata/gen/hf_storage_writer.py
(which follows torch's writer and names its sources; torch 1.13 has none), read by us and by a
re-implementation of HuggingFaceStorageReader in that module; merged, verified, resharded."""
import json
import os
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import args, check, finish, import_torch, probe, raw, read_safetensors, tmpdir  # noqa: E402

a = args()
torch = import_torch()
work = tmpdir()
sys.path.insert(0, os.path.join(a.testdata, "gen"))
import dcp_oracle  # noqa: E402
import hf_storage_writer as hf  # noqa: E402


def state():
    g = torch.Generator().manual_seed(5)
    return {"model.embed_tokens.weight": torch.randn(10, 4, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "model.layers.0.steps": torch.arange(5, dtype=torch.int64),
            "model.norm.weight": torch.ones(4, dtype=torch.float16),
            "lm_head.weight": torch.randn(3, 4, generator=g)}


def save(name, world, **kw):
    path = os.path.join(work, name)
    shutil.rmtree(path, ignore_errors=True)
    hf.save_sharded(torch, state(), world, path, replicated=("model.norm.weight",), **kw)
    return path


def same(x, y, what):
    assert x.dtype == y.dtype and list(x.shape) == list(y.shape), f"{what}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
    assert torch.equal(x.to(torch.float64), y.to(torch.float64)), f"{what}: values differ"


def run(*argv, ok=True):
    r = subprocess.run(list(argv), capture_output=True, text=True)
    assert (r.returncode == 0) == ok, f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout[-800:]}{r.stderr[-800:]}"
    return r


def test_read_and_merge():
    for world, mapping in ((3, None), (4, {"model.embed_tokens.weight": 1, "model.layers.0.mlp.up_proj.weight": 2,
                                            "model.layers.0.steps": 2, "model.norm.weight": 1, "lm_head.weight": 2})):
        path = save(f"hf_{world}", world, fqn_to_index_mapping=mapping)
        want = hf.read_as_hf_storage_reader(torch, path)
        for k, v in state().items():  # the writer and the reader's re-implementation agree
            same(want[k], v, k)
        info = json.loads(run(a.inspect, "--json", path).stdout)
        assert info["format"] == "dcp-safetensors" and "HuggingFaceStorageWriter (sharded)" in info["writer"], info["format"]
        run(a.inspect, "verify", "--deep", path)
        if world == 3:  # a file that leads outside the directory is not read
            outside = os.path.join(work, "outside.safetensors")
            shutil.copyfile(os.path.join(path, "shard-00001-model-00001-of-00001.safetensors"), outside)
            os.symlink(outside, os.path.join(path, "shard-00009-model-00001-of-00001.safetensors"))
            assert len(json.loads(run(a.inspect, "--json", path).stdout)["files"]) == 3
            os.remove(os.path.join(path, "shard-00009-model-00001-of-00001.safetensors"))
        merged = os.path.join(work, f"hf_{world}.pt")
        run(a.merge, path, "-o", merged, "-q")
        got = torch.load(merged)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for k in want:
            same(got[k], want[k], k)
        st = os.path.join(work, f"hf_{world}.safetensors")
        run(a.merge, path, "-o", st, "-q")
        assert "0 differ" in run(a.inspect, "diff", path, st).stdout
        resharded = os.path.join(work, f"hf_{world}_dcp")
        run(a.shard, path, "-o", resharded, "-n", "2", "-q")
        assert "0 differ" in run(a.inspect, "diff", path, resharded).stdout


def test_replicas():
    """A replicated tensor that every rank wrote: read once, never concatenated, and said."""
    path = os.path.join(work, "hf_replicas")
    shutil.rmtree(path, ignore_errors=True)
    hf.save_sharded(torch, state(), 3, path, replicated=("model.norm.weight",), dedup=False)
    info = json.loads(run(a.inspect, "--json", path).stdout)
    norm = next(t for t in info["entries"] if t["name"] == "model.norm.weight")
    assert norm["shape"] == [4] and any("replicas" in n for n in info.get("notes", [])), (norm, info.get("notes"))
    merged = os.path.join(work, "hf_replicas.pt")
    run(a.merge, path, "-o", merged, "-q")
    same(torch.load(merged)["model.norm.weight"], state()["model.norm.weight"], "model.norm.weight")


def to_safetensors_serialization(src, out):
    """`src` (a DCP directory of torch.save items, written by ckpt_probe) as
    FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS) would have written it,
    following torch/distributed/checkpoint/filesystem.py: _write_files_from_queue writes a file's
    bytes items first, each recorded where it lands; _write_item records every tensor item at the
    stream's position (nothing is written for it: the blob's start) with length numel x element
    size; then one safetensors.torch.save of {fqn: tensor} with DCP_SHARDING_INFO, DCP_VERSION and
    format in __metadata__. .metadata keeps everything else."""
    import io
    import pickle
    dcp_oracle.install_2x_stubs()
    meta = pickle.load(open(os.path.join(src, ".metadata"), "rb"))
    by_file = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    os.makedirs(out, exist_ok=True)
    for rel, entries in by_file.items():
        data = open(os.path.join(src, rel), "rb").read()
        entries.sort(key=lambda e: e[1].offset)
        tensor = [e for e in entries if type(meta.state_dict_metadata[e[0].fqn]).__name__ == "TensorStorageMetadata"]
        blob = b""
        for index, info in entries:
            if (index, info) in tensor:
                continue
            item = data[info.offset:info.offset + info.length]
            info.offset = len(blob)
            blob += item
        at = len(blob)
        tensors, offsets = {}, {}
        for index, info in tensor:
            t = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]))
            tensors[index.fqn] = t
            offsets[index.fqn] = {"saved_offsets": list(index.offset)}
            info.offset, info.length = at, t.numel() * t.element_size()
        blob += hf.safetensors_bytes(torch, tensors, {"DCP_SHARDING_INFO": json.dumps(offsets), "DCP_VERSION": "1.0", "format": "pt"})
        open(os.path.join(out, rel), "wb").write(blob)
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(meta, f, protocol=4)


def test_safetensors_serialization():
    """DCP's SAFETENSORS serialization: the tensors read from each file's blob, equal to what
    PyTorch reads from the same checkpoint saved with torch.save items; merged, verified,
    resharded; a blob that disagrees with .metadata refused."""
    src = os.path.join(work, "ts_items")
    probe(a, "write-dcp", src, "3", "2.x", "none")
    out = os.path.join(work, "st_items")
    to_safetensors_serialization(src, out)
    assert all(b"DCP_SHARDING_INFO" in open(os.path.join(out, f), "rb").read() for f in os.listdir(out) if f.endswith(".distcp"))
    run(a.inspect, "verify", "--deep", out)
    assert "0 differ" in run(a.inspect, "diff", src, out).stdout
    os.makedirs(os.path.join(work, "a"), exist_ok=True)
    os.makedirs(os.path.join(work, "b"), exist_ok=True)
    merged, want = os.path.join(work, "a", "merged.pt"), os.path.join(work, "b", "merged.pt")  # one archive name
    run(a.merge, out, "-o", merged, "-q")
    run(a.merge, src, "-o", want, "-q")
    dcp_oracle.same(torch, torch.load(merged), dcp_oracle.dcp_to_torch_save(torch, src))
    assert open(merged, "rb").read() == open(want, "rb").read()
    resharded = os.path.join(work, "st_items_2")
    run(a.shard, out, "-o", resharded, "-n", "2", "-q")
    assert "0 differ" in run(a.inspect, "diff", src, resharded).stdout
    # a blob whose tensor is not the chunk .metadata records
    f = sorted(x for x in os.listdir(out) if x.endswith(".distcp"))[0]
    data = bytearray(open(os.path.join(out, f), "rb").read())
    marker = b'saved_offsets\\": ['  # inside the header's JSON string, its quotes escaped
    at = data.index(marker) + len(marker)
    data[at:at + 1] = b"9"
    open(os.path.join(out, f), "wb").write(bytes(data))
    r = probe(a, "dump-checkpoint", out, expect_ok=False)
    assert r.returncode == 1 and "is not the chunk .metadata records" in r.stderr and f in r.stderr, r.stderr


def test_consolidation():
    """merge of DCP's Hugging Face storage == what consolidate_safetensors_files makes of it (its
    re-implementation in hf_storage_writer.py): the same tensors, names, dtypes and bytes; and the
    integer tensors that consolidation fails on (torch.finfo of an int dtype) merge too."""
    floats = {k: v for k, v in state().items() if v.is_floating_point()}
    path = os.path.join(work, "hf_floats")
    shutil.rmtree(path, ignore_errors=True)
    hf.save_sharded(torch, floats, 3, path, replicated=("model.norm.weight",))
    theirs_dir = os.path.join(work, "consolidated")
    hf.consolidate(torch, path, theirs_dir)
    _, theirs = read_safetensors(os.path.join(theirs_dir, "model-00001-of-00001.safetensors"), padded=False)
    ours_dir = os.path.join(work, "ours_consolidated")
    run(a.merge, path, "-o", ours_dir, "--max-shard-size", "1GB", "-q")
    _, ours = read_safetensors(os.path.join(ours_dir, "model.safetensors"))
    assert ours == theirs, sorted(set(ours) ^ set(theirs))
    assert "0 differ" in run(a.inspect, "diff", path, theirs_dir).stdout
    try:
        hf.consolidate(torch, save("hf_ints", 2), os.path.join(work, "consolidated_ints"))
        raise AssertionError("the re-implemented consolidation took an int64 tensor; the source's torch.finfo would not")
    except TypeError:
        pass
    merged = os.path.join(work, "hf_ints.safetensors")
    run(a.merge, save("hf_ints", 2), "-o", merged, "-q")
    _, tensors = read_safetensors(merged)
    assert tensors["model.layers.0.steps"][0] == "I64" and tensors["model.layers.0.steps"][2] == raw(state()["model.layers.0.steps"])


def test_hostile():
    path = save("hf_bad", 2)
    f = os.path.join(path, "shard-00002-model-00001-of-00001.safetensors")
    data = open(f, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]

    def rewrite(meta):
        h = dict(header, __metadata__=meta)
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * ((8 - len(text) % 8) % 8)
        open(f, "wb").write(struct.pack("<Q", len(text)) + text + body)

    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    # rank 2's rows claim rank 1's offsets: chunks overlap and leave a hole
    rewrite(dict(header["__metadata__"], DCP_SHARDING_INFO=json.dumps({k: {"saved_offsets": [0] * len(v["saved_offsets"])} for k, v in info.items()})))
    r = run(a.inspect, "verify", path, ok=False)
    assert "overlap" in r.stdout + r.stderr or "hole" in r.stdout + r.stderr or "cover" in r.stdout + r.stderr, r.stdout + r.stderr
    run(a.merge, path, "-o", os.path.join(work, "bad.pt"), ok=False)
    assert not os.path.exists(os.path.join(work, "bad.pt"))
    # a tensor without its entry
    del info["lm_head.weight"]
    rewrite(dict(header["__metadata__"], DCP_SHARDING_INFO=json.dumps(info)))
    r = probe(a, "dump-checkpoint", path, expect_ok=False)
    assert r.returncode == 1 and "offset 8" in r.stderr and "has no entry for tensor 'lm_head.weight'" in r.stderr, r.stderr


def test_shard_writes_hf_storage():
    """fsdp-ckpt-shard --format hf-safetensors: the files HuggingFaceStorageWriter(save_sharded=True)
    writes, read back by the re-implemented HuggingFaceStorageReader as the state saved."""
    src = os.path.join(work, "state.pt")
    torch.save(state(), src)
    for world, layout in ((1, "fsdp"), (3, "fsdp"), (5, "dtensor"), (11, "fsdp")):
        out = os.path.join(work, f"ours_{world}_{layout}")
        run(a.shard, src, "-o", out, "-n", str(world), "--layout", layout, "--format", "hf-safetensors", "-q")
        names = sorted(os.listdir(out))
        assert all(n.startswith("shard-") and n.endswith("-model-00001-of-00001.safetensors") for n in names), names
        # a rank with nothing to write writes no file (fsdp: past the last torch.chunk piece)
        assert len(names) == (min(world, 10) if layout == "fsdp" else world), names
        for n in names:
            meta, _ = read_safetensors(os.path.join(out, n))
            assert meta["DCP_VERSION"] == "1.0" and meta["format"] == "pt" and isinstance(json.loads(meta["DCP_SHARDING_INFO"]), dict), meta
        got = hf.read_as_hf_storage_reader(torch, out)
        assert sorted(got) == sorted(state())
        for k, v in state().items():
            same(got[k], v, f"{world} {layout} {k}")
    # and from DCP's own Hugging Face storage, resharded from 4 ranks to 2
    out = os.path.join(work, "reshard_4_2")
    run(a.shard, save("hf_src", 4), "-o", out, "-n", "2", "--format", "hf-safetensors", "-q")
    got = hf.read_as_hf_storage_reader(torch, out)
    for k, v in state().items():
        same(got[k], v, k)


def test_shard_refusals():
    src = os.path.join(work, "with_bool.pt")
    torch.save({"w": torch.ones(4), "mask": torch.tensor([True, False])}, src)
    out = os.path.join(work, "bool_out")
    r = run(a.shard, src, "-o", out, "-n", "2", "--format", "hf-safetensors", ok=False)
    assert r.returncode == 1 and "tensor 'mask' is bool, which HuggingFaceStorageReader would read as float32" in r.stderr, r.stderr
    assert not os.path.exists(out)
    r = run(a.shard, src, "-o", out, "-n", "2", "--format", "hf-safetensors", "--files-per-rank", "2", ok=False)
    assert r.returncode == 2 and "--files-per-rank" in r.stderr, r.stderr
    src = os.path.join(work, "with_step.pt")
    torch.save({"w": torch.ones(4), "step": 7}, src)
    r = run(a.shard, src, "-o", out, "-n", "2", "--format", "hf-safetensors")
    assert "left out 1 entry that is not a tensor (first: 'step')" in r.stderr, r.stderr


check("HuggingFaceStorageWriter(save_sharded=True) at 3 and 4 ranks, one file and two per rank: read as its reader reads it, "
      "verified, merged to torch.save and safetensors, resharded to DCP", test_read_and_merge)
check("fsdp-ckpt-shard --format hf-safetensors at 1, 3, 5 and 11 ranks (fsdp, dtensor), and 4 -> 2: the writer's file names "
      "and metadata, read back by HuggingFaceStorageReader's rules as the state saved", test_shard_writes_hf_storage)
check("--format hf-safetensors refuses a bool tensor (the reader would read float32) and --files-per-rank; notes what it "
      "leaves out", test_shard_refusals)
check("a replicated tensor every rank wrote is read once, not concatenated, and noted", test_replicas)
check("FileSystemWriter(serialization_format=SAFETENSORS): tensors read from each file's blob == the same checkpoint "
      "with torch.save items, merged byte-identical, verified, resharded; a blob that disagrees refused", test_safetensors_serialization)
check("merge == consolidate_safetensors_files (re-implemented from its source) on the same storage; int tensors, "
      "which that consolidation cannot take, merge too", test_consolidation)
check("hostile sharding info: overlapping chunks refused by verify and merge; a tensor without its entry named with its offset",
      test_hostile)
finish()

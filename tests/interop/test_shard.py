#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""fsdp-ckpt-shard against PyTorch. Every output is read back by the Python oracle the way PyTorch's
DCP loader reads it: .metadata unpickled with the torch 2.x classes at their 2.x module paths
(stand-ins carrying only FORMATS.md's fields), every tensor item torch.load(weights_only=True)ed
and narrowed into place; zstd items decoded with the zstd tool, one frame each. Expected values
come from PyTorch too: torch 1.13's own load_state_dict of the 1.13 fixtures, torch.load of the
torch.save inputs, torch.chunk for the geometry."""
import io
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import args, check, finish, import_torch, raw, read_safetensors, skip, tmpdir  # noqa: E402
import dcp_oracle  # noqa: E402

a = args()
sys.path.insert(0, os.path.join(a.testdata, "gen"))
import torch113_compat  # noqa: F401,E402  (harness-only patch; see that file)

torch = import_torch()
dcp_oracle.install_2x_stubs()
work = tmpdir()
SHARED = a.shared if a.shared and os.path.isdir(a.shared) else None


def run(tool, *argv, expect=0, env=None):
    r = subprocess.run([tool, *argv], capture_output=True, text=True, env=env)
    assert r.returncode == expect, f"{os.path.basename(tool)} {' '.join(argv)}: exit {r.returncode}, stderr: {r.stderr.strip()}"
    return r


def shard(src, out, *argv):
    run(a.shard, "-q", src, "-o", out, *argv)
    run(a.inspect, "verify", "--deep", out)
    return out


def merge(src, out, *argv):
    run(a.merge, "-q", src, "-o", out, *argv)
    return out


def fixture(world):
    return os.path.join(a.testdata, "dcp", f"torch113_{world}rank")


def our_sample(world, compression="none"):
    d = os.path.join(work, f"sample_{world}_{compression}")
    if not os.path.exists(d):
        run(a.probe, "write-dcp", d, str(world), "2.x", compression)
    return d


def metadata(path):
    return pickle.load(open(os.path.join(path, ".metadata"), "rb"))


def items(path):
    """{(fqn, offsets or None): (file, item bytes after transforms)}, each zstd item checked to be one frame."""
    meta = metadata(path)
    out = {}
    for k, v in meta.storage_data.items():
        blob = open(os.path.join(path, v.relative_path), "rb").read()[v.offset:v.offset + v.length]
        assert len(blob) == v.length, f"{k.fqn}: item passes the end of {v.relative_path}"
        if getattr(v, "transform_descriptors", None):
            assert v.transform_descriptors == ["stream.zstd/1"], v.transform_descriptors
            with tempfile.NamedTemporaryFile(suffix=".zst") as f:
                f.write(blob)
                f.flush()
                listing = subprocess.run(["zstd", "-l", f.name], capture_output=True, text=True, check=True).stdout
                frames = int(listing.splitlines()[1].split()[0])
                assert frames == 1, f"{k.fqn}: item holds {frames} zstd frames"
            blob = subprocess.run(["zstd", "-d", "-c"], input=blob, capture_output=True, check=True).stdout
        off = tuple(k.offset) if getattr(k, "offset", None) is not None else None
        out[(k.fqn, off)] = (v.relative_path, blob)
    return out


def load_items(path):
    """Every item loaded as PyTorch's loader loads it: tensors with weights_only=True, bytes items
    with weights_only=True too unless they hold a Python float (torch 1.13 refuses BINFLOAT)."""
    out = {}
    for key, (file, blob) in items(path).items():
        try:
            value = torch.load(io.BytesIO(blob), weights_only=True)
        except pickle.UnpicklingError:
            value = torch.load(io.BytesIO(blob))
            assert key[1] is None and holds_float(value), f"{key}: refused by weights_only=True and holds no float"
        out[key] = (file, value)
    return out


def holds_float(v):
    if isinstance(v, float):
        return True
    if isinstance(v, dict):
        return any(holds_float(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(holds_float(x) for x in v)
    return False


def plain(v):
    """A torch.load tree as DCP gives it back: OrderedDicts as dicts, int dict keys as str."""
    if isinstance(v, dict):
        return {str(k) if isinstance(k, int) else k: plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v


def sorted_top(d):
    return {k: d[k] for k in sorted(d)}


def expected_of(src):
    """What PyTorch makes of `src`, as dcp_to_torch_save (plus Lightning's meta.pt update) nests it."""
    if os.path.isdir(src):
        torch113 = type(metadata(src)).__module__.startswith("torch.distributed._shard")
        want = dcp_oracle.load_113(torch, src) if torch113 else dcp_oracle.dcp_to_torch_save(torch, src)
        if os.path.exists(os.path.join(src, "meta.pt")):
            want.update(torch.load(os.path.join(src, "meta.pt")))
        return want
    return plain(torch.load(src))


def got_of(out):
    got = dcp_oracle.dcp_to_torch_save(torch, out)
    if os.path.exists(os.path.join(out, "meta.pt")):
        got.update(torch.load(os.path.join(out, "meta.pt")))
    return got


def chunk_sizes_torch(n0, world):
    """torch.chunk's rule, from torch itself."""
    return [p.shape[0] for p in torch.empty(n0).chunk(world)] if n0 else [0]


def check_geometry(out, world, layout="fsdp", replicated=()):
    meta = metadata(out)
    for fqn, e in meta.state_dict_metadata.items():
        if type(e).__name__ != "TensorStorageMetadata":
            continue
        size = list(e.size)
        boxes = sorted((list(c.offsets), list(c.sizes)) for c in e.chunks)
        if not size or fqn in replicated or size[0] == 0:
            assert boxes == [([0] * len(size), size)], f"{fqn}: a replicated tensor is written once whole, got {boxes}"
            continue
        if layout == "fsdp":
            want, at = [], 0
            for s in chunk_sizes_torch(size[0], world):
                want.append(([at] + [0] * (len(size) - 1), [s] + size[1:]))
                at += s
        else:  # DTensor Shard(0): every rank, empty shards at dim-0 size, equal ones deduplicated
            want = []
            for r in range(world):
                n0 = size[0]
                if n0 % world == 0:
                    b, s = r * n0 // world, n0 // world
                else:
                    c = -(-n0 // world)
                    b, s = (n0, 0) if r * c >= n0 else (r * c, min(n0, r * c + c) - r * c)
                box = ([b] + [0] * (len(size) - 1), [s] + size[1:])
                if box not in want:
                    want.append(box)
            want.sort()
        assert boxes == want, f"{fqn}: chunks {boxes}, torch.chunk's rule gives {want}"
        # FSDP's rank r holds piece r: the item of the chunk at row b sits in rank (b / chunk)'s file
        if layout == "fsdp":
            for c in e.chunks:
                info = [v for k, v in meta.storage_data.items() if k.fqn == fqn and list(k.offset) == list(c.offsets)][0]
                rank = list(c.offsets)[0] // -(-size[0] // world)
                assert info.relative_path.startswith(f"__{rank}_"), f"{fqn} at {list(c.offsets)}: in {info.relative_path}, not rank {rank}'s"


def roundtrip(src, world, *extra, layout="fsdp", compare_merge=True, replicated=()):
    """shard(src, world): verify --deep passes, every item loads in PyTorch, PyTorch's reading of
    it equals PyTorch's reading of src, the geometry is torch.chunk's, and (DCP input) our merge of
    it is byte for byte our merge of src. Files beside .metadata (meta.pt, common.pt,
    metadata.json) come along unchanged."""
    def body():
        name = re.sub(r"\W", "_", os.path.basename(src.rstrip("/"))) + f"_{world}_{layout}_{len(extra)}"
        out = shard(src, os.path.join(work, name), "-n", str(world), "--layout", layout, *extra)
        load_items(out)  # every item loads in PyTorch
        dcp_oracle.same(torch, sorted_top(got_of(out)), sorted_top(expected_of(src)))
        check_geometry(out, world, layout, replicated)
        for extra_file in ("meta.pt", "common.pt", "metadata.json"):
            if os.path.isdir(src) and os.path.exists(os.path.join(src, extra_file)):
                assert open(os.path.join(out, extra_file), "rb").read() == open(os.path.join(src, extra_file), "rb").read(), extra_file
        if compare_merge and os.path.isdir(src):
            # the same file name: the archive folder inside is named after it
            os.makedirs(os.path.join(work, name + ".a"))
            os.makedirs(os.path.join(work, name + ".b"))
            a_pt, b_pt = merge(out, os.path.join(work, name + ".a", "m.pt")), merge(src, os.path.join(work, name + ".b", "m.pt"))
            assert open(a_pt, "rb").read() == open(b_pt, "rb").read(), "merge(shard(x)) differs from merge(x) byte for byte"
    return body


def tensor_chunks(path):
    """{fqn: [(offsets, sizes, file, tensor)]} from the output's own items."""
    meta = metadata(path)
    loaded = load_items(path)
    out = {}
    for fqn, e in meta.state_dict_metadata.items():
        if type(e).__name__ == "TensorStorageMetadata":
            out[fqn] = sorted(((list(c.offsets), list(c.sizes), *loaded[(fqn, tuple(c.offsets))]) for c in e.chunks),
                              key=lambda x: x[0])
    return out


def reshard(m, n):
    def body():
        direct = shard(fixture(m), os.path.join(work, f"re_{m}_{n}"), "-n", str(n))
        full = merge(fixture(m), os.path.join(work, f"re_{m}_{n}.pt"))
        via = shard(full, os.path.join(work, f"re_{m}_{n}_via_full"), "-n", str(n))
        a_, b_ = tensor_chunks(direct), tensor_chunks(via)
        assert list(a_) == list(b_), f"tensors {list(a_)} vs {list(b_)}"
        for fqn in a_:
            assert [(o, s, f) for o, s, f, _ in a_[fqn]] == [(o, s, f) for o, s, f, _ in b_[fqn]], f"{fqn}: grids differ"
            for (o, _, _, x), (_, _, _, y) in zip(a_[fqn], b_[fqn]):
                dcp_oracle.same(torch, x, y, f"{fqn}@{o}")
    return body


def layout_fidelity(world):
    # The fixture's dim-0 ShardedTensors were chunked by PyTorch for `world` ranks; sharding their
    # merged file back to `world` must give the same boxes in the same ranks' files. head.weight
    # is chunked on dim 1 there (not an FSDP layout) and the plain tensors were replicated.
    def body():
        full = merge(fixture(world), os.path.join(work, f"fid_{world}.pt"))
        out = shard(full, os.path.join(work, f"fid_{world}"), "-n", str(world), "--replicate", "model.head.bias",
                    "--replicate", "model.buffer.count")
        theirs, ours = metadata(fixture(world)), metadata(out)
        compared = 0
        for fqn, e in theirs.state_dict_metadata.items():
            if not hasattr(e, "chunks") or fqn == "model.head.weight":
                continue
            want = sorted((list(c.offsets), list(c.sizes)) for c in e.chunks)
            got = sorted((list(c.offsets), list(c.sizes)) for c in ours.state_dict_metadata[fqn].chunks)
            assert got == want, f"{fqn}: ours {got}, PyTorch's {want}"
            if len(want) > 1:
                for k, v in theirs.storage_data.items():
                    if k.fqn == fqn:
                        mine = [i for kk, i in ours.storage_data.items() if kk.fqn == fqn and list(kk.offset) == list(k.offset)][0]
                        assert mine.relative_path == v.relative_path, f"{fqn}@{list(k.offset)}: {mine.relative_path} vs {v.relative_path}"
            compared += 1
        assert compared >= 5, compared
    return body


def test_zstd():
    src = fixture(4)
    plain_out = shard(src, os.path.join(work, "z_plain"), "-n", "3")
    z = shard(src, os.path.join(work, "z_zstd"), "-n", "3", "--compress", "zstd:5", "--files-per-rank", "2")
    assert any(getattr(v, "transform_descriptors", None) for v in metadata(z).storage_data.values())
    dcp_oracle.same(torch, got_of(z), got_of(plain_out))
    # with K files per rank, every rank has its K files
    names = sorted(f for f in os.listdir(z) if f.endswith(".distcp"))
    assert names == sorted(f"__{r}_{k}.distcp" for r in range(3) for k in range(2)), names


def test_dtype():
    # The model's floating tensors are cast (torch 1.13's flat FQNs: those under 'model.'), the
    # optimizer state keeps its dtype (issue 28 item 6); --cast-include casts it too.
    want = dcp_oracle.load_113(torch, fixture(2))
    assert any(k.startswith("optim.") and isinstance(v, torch.Tensor) and v.is_floating_point() for k, v in want.items())
    for name, extra, cast in [("cast", [], lambda k: k.startswith("model.")), ("cast_all", ["--cast-include", "*"], lambda k: True)]:
        out = shard(fixture(2), os.path.join(work, name), "-n", "3", "--dtype", "bf16", *extra)
        got = got_of(out)
        for k, v in want.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and cast(k):
                dcp_oracle.same(torch, got[k], v.to(torch.bfloat16), k)
            else:
                dcp_oracle.same(torch, got[k], v, k)


def test_filters_and_lightning():
    # A Lightning folder: meta.pt carried byte for byte, or rewritten without the keys filtered out.
    src = os.path.join(work, "lightning")
    shutil.copytree(fixture(2), src)
    torch.save({"epoch": 9, "hparams": {"name": "tiny"}, "rng": torch.arange(5)}, os.path.join(src, "meta.pt"))
    out = shard(src, os.path.join(work, "lightning_4"), "-n", "4")
    assert open(os.path.join(out, "meta.pt"), "rb").read() == open(os.path.join(src, "meta.pt"), "rb").read()
    dcp_oracle.same(torch, got_of(out), expected_of(src))
    out = shard(src, os.path.join(work, "lightning_f"), "-n", "2", "--exclude", "rng", "--exclude", "optim.*")
    got = torch.load(os.path.join(out, "meta.pt"), weights_only=True)
    assert list(got) == ["epoch", "hparams"], list(got)
    assert not [k for k in metadata(out).state_dict_metadata if k.startswith("optim.")]


def test_lightning_full_file():
    # A Lightning full checkpoint: model and optimizer into DCP (optimizer moments chunked like
    # their parameter), the rest into meta.pt; consolidating it gives the file back.
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    osd = {"state": {names[i]: s for i, s in osd["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    for g in osd["param_groups"]:  # float-free, so that torch 1.13's weights_only loader can read it
        for k in list(g):
            if isinstance(g[k], float):
                g[k] = int(g[k] * 1000)
            if isinstance(g[k], tuple):
                g[k] = tuple(int(x * 1000) for x in g[k])
    full = {"model": model.state_dict(), "optimizer": osd, "epoch": 3, "loops": {"fit": [1, 2]}}
    src = os.path.join(work, "lightning_full.pt")
    torch.save(full, src)
    out = shard(src, os.path.join(work, "lightning_full"), "-n", "3")
    meta = metadata(out)
    assert sorted(torch.load(os.path.join(out, "meta.pt"), weights_only=True)) == ["epoch", "loops"]
    sd = meta.state_dict_metadata
    for n in names:
        grid = sorted(list(c.offsets) for c in sd["model." + n].chunks)
        for moment in ("exp_avg", "exp_avg_sq"):
            assert sorted(list(c.offsets) for c in sd[f"optimizer.state.{n}.{moment}"].chunks) == grid, n
        assert [list(c.sizes) for c in sd[f"optimizer.state.{n}.step"].chunks] == [[]], "step is written once"
    assert tuple(meta.planner_data["optimizer.param_groups.0.params"]) == ("optimizer", "param_groups", 0, "params")
    dcp_oracle.same(torch, sorted_top(got_of(out)), sorted_top(plain(torch.load(src))))


def test_distributed():
    # Two cooperating processes write the same bytes as one process.
    single = shard(fixture(4), os.path.join(work, "dist_single"), "-n", "5")
    out = os.path.join(work, "dist_two")
    procs = [subprocess.Popen([a.shard, "-q", fixture(4), "-o", out, "-n", "5"], env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in (1, 0)]
    for p in procs:
        assert p.wait(60) == 0, p.stderr.read()
    run(a.inspect, "verify", "--deep", out)
    for f in sorted(os.listdir(single)):
        if f.endswith(".distcp"):
            assert open(os.path.join(single, f), "rb").read() == open(os.path.join(out, f), "rb").read(), f
    assert sorted(os.listdir(out)) == sorted(os.listdir(single)), "markers or leftovers remain"
    dcp_oracle.same(torch, got_of(out), got_of(single))


def test_torchtune():
    src = os.path.join(SHARED, "pytorch__torchtune__tiny-fair-checkpoint", "tiny_fair_checkpoint.pt")
    for w in (1, 2, 3, 4, 7):
        out = shard(src, os.path.join(work, f"torchtune_{w}"), "-n", str(w), "--key", "model")
        assert all(k.startswith("model.") for k in metadata(out).state_dict_metadata)
        dcp_oracle.same(torch, got_of(out), {"model": plain(torch.load(src))})
        check_geometry(out, w)


ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "F64": torch.float64, "I32": torch.int32, "I16": torch.int16,
             "I8": torch.int8, "U8": torch.uint8, "I64": torch.int64, "BOOL": torch.bool, "BF16": torch.bfloat16}


def test_safetensors():
    folder = os.path.join(SHARED, "huggingface__safetensors__samples")
    done = 0
    for f in sorted(os.listdir(folder)):
        _, tensors = read_safetensors(os.path.join(folder, f), padded=False)
        if any(d not in ST_DTYPES for d, _, _ in tensors.values()):
            continue  # uint16 and uint32 (H, I): torch 1.13 has no such dtype to read them back with
        for w in (1, 2, 3, 4, 7):
            out = shard(os.path.join(folder, f), os.path.join(work, f"st_{w}_{os.path.splitext(f)[0]}"), "-n", str(w))
            got = got_of(out)
            assert sorted(got) == sorted(tensors), (sorted(got), sorted(tensors))
            for k, (dtype, shape, data) in tensors.items():
                assert got[k].dtype == ST_DTYPES[dtype] and list(got[k].shape) == shape, (k, got[k].dtype, dtype)
                assert raw(got[k]) == data, f"{f}: {k} bytes differ"
            check_geometry(out, w)
        done += 1
    assert done >= 7, done


for w in (1, 2, 3, 4, 7):
    check(f"torch 1.13 4-rank fixture -> {w} ranks (fsdp): PyTorch reads it back equal; merge(shard(x)) == merge(x)",
          roundtrip(fixture(4), w))
    check(f"torch 1.13 2-rank fixture -> {w} ranks (fsdp)", roundtrip(fixture(2), w))
    check(f"our 2.x-layout 3-rank DCP -> {w} ranks (dtensor)", roundtrip(our_sample(3), w, layout="dtensor"))
    check(f"torch.save file (tiny_state_dict.pt) -> {w} ranks", roundtrip(os.path.join(a.testdata, "torch_save", "tiny_state_dict.pt"), w))
check("our 2.x-layout 2-rank zstd DCP -> 3 ranks", roundtrip(our_sample(2, "zstd"), 3))


def test_renames():
    """--rename on shard: every FQN renamed as the rule says (PyTorch reads the output nested by its
    renamed planner_data), the number of '.'-parts kept within nested paths; a rule that changes it
    for a nested path is refused, and so are two FQNs made one."""
    import re as regex

    def flat(tree, prefix=""):
        out = {}
        items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
        if items is None:
            return {prefix: tree}
        for k, v in items:
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    src = our_sample(3)
    want = flat(expected_of(src))
    out = shard(src, os.path.join(work, "renamed_3"), "-n", "2", "--rename", "s/^model\\.embed\\./model.tok./", "--rename", "s/weight$/w/")
    got = flat(got_of(out))

    def renamed(k):
        return regex.sub(r"weight$", "w", regex.sub(r"^model\.embed\.", "model.tok.", k, count=1), count=1)
    assert set(got) == {renamed(k) for k in want}, (sorted(got), sorted(want))
    for k, v in want.items():
        dcp_oracle.same(torch, got[renamed(k)], v, k)
    r = subprocess.run([a.shard, "-q", src, "-o", os.path.join(work, "renamed_bad"), "-n", "2", "--strip-prefix", "model."],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "nests its parts" in r.stderr, r.stderr
    # torch 1.13's flat FQNs have no nesting to keep: any rename goes
    out = shard(fixture(2), os.path.join(work, "renamed_113"), "-n", "3", "--strip-prefix", "model.")
    want = dcp_oracle.load_113(torch, fixture(2))
    got = got_of(out)
    assert set(got) == {k[len("model."):] if k.startswith("model.") else k for k in want}, sorted(got)


check("--rename and --strip-prefix: FQNs and planner_data renamed, read back by PyTorch; a nested path whose "
      "parts would change refused", test_renames)


def legacy_file():
    """tiny_state_dict.pt re-saved by torch.save in the legacy (pre-1.6) format."""
    path = os.path.join(work, "tiny_legacy.pt")
    torch.save(torch.load(os.path.join(a.testdata, "torch_save", "tiny_state_dict.pt")), path, _use_new_zipfile_serialization=False)
    return path


check("legacy torch.save file (torch < 1.6 format) -> 3 ranks", roundtrip(legacy_file(), 3))
for m, n in ((2, 3), (4, 2), (2, 4), (4, 7)):
    check(f"reshard {m} -> {n} equals sharding the merged tensors directly", reshard(m, n))
check("layout fidelity: 2-rank fixture's merged file -> 2 ranks reproduces PyTorch's chunks and files", layout_fidelity(2))
check("layout fidelity: 4-rank fixture's merged file -> 4 ranks reproduces PyTorch's chunks and files", layout_fidelity(4))
check("stream.zstd/1 items, 2 files per rank: one frame each, decoded by the zstd tool, equal", test_zstd)
check("--dtype bf16 equals Tensor.to(torch.bfloat16) on the model's tensors, --cast-include on more", test_dtype)
check("Lightning folder: meta.pt carried byte for byte; filters rewrite it", test_filters_and_lightning)
check("Lightning full file: model and optimizer sharded alike, the rest into meta.pt; consolidates back", test_lightning_full_file)
check("two cooperating processes (RANK/WORLD_SIZE) write what one process writes", test_distributed)
if SHARED:
    mega = os.path.join(SHARED, "LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt")
    for w in (1, 2, 3, 4, 7):
        check(f"real torch 2.4 Megatron checkpoint -> {w} ranks (common.pt, metadata.json carried)", roundtrip(mega, w))
    check("real torchtune torch.save file -> 1, 2, 3, 4, 7 ranks (--key model)", test_torchtune)
    check("real safetensors samples -> 1, 2, 3, 4, 7 ranks", test_safetensors)
else:
    skip("real checkpoints", "../shared/testdata-real is absent")
finish()

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DCP interop: our reader against PyTorch. The 1.13 fixtures' .metadata is unpickled with
torch 1.13's own classes (torch.distributed._shard.checkpoint, importable after the harness's
dataclass patch), the torch 2.4 Megatron checkpoint's with stand-ins at the 2.x class paths; every
item is read with torch.load from its slice, tensors assembled in Python, and the result must
equal what our reader assembles. Hostile .metadata files must be refused, never run."""
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))
from common import args, check, finish, import_torch, probe, probe_json, skip, tensor_bytes, tmpdir  # noqa: E402
import dcp_oracle  # noqa: E402
from dcp_oracle import install_2x_stubs  # noqa: E402,F401

a = args()
sys.path.insert(0, os.path.join(a.testdata, "gen"))
import torch113_compat  # noqa: F401,E402  (harness-only patch; see that file)

torch = import_torch()
from torch.distributed._shard.checkpoint import metadata as md113  # noqa: E402,F401

work = tmpdir()


def python_read(path):
    return dcp_oracle.python_read(torch, path)


def compare(path, expect_world=None):
    return compare_with(path, path, expect_world)


def compare_with(path, reference, expect_world=None):
    """Ours of `path` against Python's reading of `reference` (the same checkpoint)."""
    ours = probe_json(a, "dump-checkpoint", path)
    tensors, objects = python_read(reference)
    names = {t["name"] for t in ours["tensors"]}
    assert names == set(tensors), f"tensor names differ: ours {sorted(names ^ set(tensors))}"
    for t in ours["tensors"]:
        v = tensors[t["name"]]
        assert "torch." + t["dtype"] == str(v.dtype), f"{t['name']}: dtype {t['dtype']} vs {v.dtype}"
        assert t["shape"] == list(v.shape), f"{t['name']}: shape"
        assert t["covered"] == v.numel(), f"{t['name']}: {t['covered']} of {v.numel()} elements covered"
        assert bytes.fromhex(t["hex"]) == tensor_bytes(torch, v), f"{t['name']}: values differ from torch.load of the items"
    assert {o["name"] for o in ours["objects"]} == set(objects), "bytes item names differ"
    for o in ours["objects"]:
        v = objects[o["name"]]
        if isinstance(v, (int, str, list, dict)) and o["repr"] and not isinstance(v, bool):
            assert o["repr"] == repr(v), f"{o['name']}: {o['repr']} vs {v!r}"
    if expect_world is not None:
        assert ours["world_size"] == expect_world, ours["world_size"]
    return ours


def test_fixture(world):
    def run():
        path = os.path.join(a.testdata, "dcp", f"torch113_{world}rank")
        compare(path, world)
        # and the generator's closed-form values (testdata/gen/make_dcp_fixtures.py)
        sys.path.insert(0, os.path.join(a.testdata, "gen"))
        from make_dcp_fixtures import full
        ours = probe_json(a, "dump-checkpoint", path)
        for t in ours["tensors"]:
            if t["name"] == "optim.state.embed.step":
                continue
            want = full(t["name"], tuple(t["shape"]), getattr(torch, t["dtype"]))
            assert bytes.fromhex(t["hex"]) == tensor_bytes(torch, want), f"{t['name']}: not the generator's values"
        r = probe(a, "dump-checkpoint", path)
        assert r.returncode == 0
    return run


def test_torch2(name):
    # Saved by PyTorch 2.11's own dcp.save on the GPU machine (testdata/gen/make_pt2_fixtures.py;
    # testdata/dcp/torch2/VERSION): ours must give every value of the state it was given, which
    # the same PyTorch wrote beside it with torch.save (read here by torch 1.13; our fixture, so
    # weights_only=False is safe), and verify --deep must find nothing wrong.
    def run():
        path = os.path.join(a.testdata, "dcp", "torch2", name)
        want = torch.load(path + ".values.pt", weights_only=False)
        flat = {}

        def walk(prefix, v):
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}{k}.", x)
            elif isinstance(v, list) and any(isinstance(x, (dict, list, torch.Tensor)) for x in v):
                for i, x in enumerate(v):
                    walk(f"{prefix}{i}.", x)
            else:
                flat[prefix[:-1]] = v
        walk("", want)
        ours = probe_json(a, "dump-checkpoint", path)
        got = {t["name"]: t for t in ours["tensors"]}
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        assert set(got) == set(tensors), f"tensor names differ: {sorted(set(got) ^ set(tensors))}"
        for k, v in tensors.items():
            assert got[k]["dtype"] == str(v.dtype).replace("torch.", "") and got[k]["shape"] == list(v.shape), k
            assert got[k]["covered"] == v.numel(), f"{k}: {got[k]['covered']} of {v.numel()} elements covered"
            assert bytes.fromhex(got[k]["hex"]) == tensor_bytes(torch, v), f"{k}: values differ from PyTorch 2's"
        objects = {o["name"]: o for o in ours["objects"]}
        for k, v in flat.items():
            if not isinstance(v, torch.Tensor) and isinstance(v, (int, str)) and not isinstance(v, bool):
                assert k in objects and objects[k]["repr"] == repr(v), f"{k}: {objects.get(k)} vs {v!r}"
        assert ours["writer"].startswith("torch >= 2.4"), ours["writer"]
        if name.endswith("rank_local"):
            assert ours["writer"].endswith("rank-local metadata (2 files)"), ours["writer"]
            assert not os.path.exists(os.path.join(path, ".metadata"))
        v = subprocess.run([a.inspect, "verify", "--deep", path], capture_output=True, text=True)
        assert v.returncode == 0, v.stdout + v.stderr
    return run


def test_megatron():
    install_2x_stubs()
    path = os.path.join(a.shared, "LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt")
    ours = compare(path, 1)
    assert len(ours["tensors"]) == 17 and len(ours["objects"]) == 8
    assert any("mcore_data" in n for n in ours["notes"]), ours["notes"]


def install_plan_stubs():
    """Stand-ins for the classes a .metadata of PyTorch 2.6+ (all_local_plans) and of Megatron-Core
    hold, at their real module paths, with the fields of torch/distributed/checkpoint/planner.py
    (WriteItemType, TensorWriteData, WriteItem, SavePlan with `usable`) and of
    megatron/core/dist_checkpointing/strategies/torch.py (MCoreSavePlan adds mcore_data)."""
    import enum
    if "torch.distributed.checkpoint.planner" in sys.modules:
        return sys.modules["torch.distributed.checkpoint.planner"], sys.modules["megatron.core.dist_checkpointing.strategies.torch"]
    planner = types.ModuleType("torch.distributed.checkpoint.planner")
    planner.WriteItemType = enum.Enum("WriteItemType", {"TENSOR": 1, "SHARD": 2, "BYTE_IO": 3}, module=planner.__name__)

    def dataclass(module, name, fields, base=object):
        def init(self, **kw):
            for f in fields:
                setattr(self, f, kw.get(f))
        return type(name, (base,), {"__module__": module.__name__, "__init__": init})

    planner.TensorWriteData = dataclass(planner, "TensorWriteData", ["chunk", "properties", "size"])
    planner.WriteItem = dataclass(planner, "WriteItem", ["index", "type", "tensor_data"])
    planner.SavePlan = dataclass(planner, "SavePlan", ["items", "storage_data", "planner_data", "usable"])
    mcore = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")
    mcore.MCoreSavePlan = dataclass(mcore, "MCoreSavePlan", ["items", "storage_data", "planner_data", "usable", "mcore_data"],
                                    planner.SavePlan)
    for parent in ("megatron", "megatron.core", "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies"):
        sys.modules.setdefault(parent, types.ModuleType(parent))  # so that pickle can import the module by name
    for m in (planner, mcore):
        sys.modules[m.__name__] = m
    return planner, mcore


def with_save_plans(src, dirname, hostile=None):
    """A copy of the checkpoint `src` whose .metadata, unpickled and pickled again by CPython with the
    stand-ins, also holds the save plans (one MCoreSavePlan naming every item), as a current
    Megatron-Core save leaves it; `hostile` goes into the plan's planner_data."""
    install_2x_stubs()
    planner, mcore = install_plan_stubs()
    raw = open(os.path.join(src, ".metadata"), "rb").read()
    meta = pickle.loads(raw)
    items = []
    for k in meta.storage_data:
        entry = meta.state_dict_metadata[k.fqn]
        if getattr(k, "offset", None) is None:
            items.append(planner.WriteItem(index=k, type=planner.WriteItemType.BYTE_IO))
            continue
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(k.offset))
        data = planner.TensorWriteData(chunk=chunk, properties=entry.properties, size=entry.size)
        items.append(planner.WriteItem(index=k, type=planner.WriteItemType.SHARD, tensor_data=data))
    plan = mcore.MCoreSavePlan(items=items, usable=True, planner_data=hostile, mcore_data={"embedding.word_embeddings.weight": {}})
    meta.all_local_plans = [plan]
    d = os.path.join(work, dirname)
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(src):
        if name != ".metadata":
            shutil.copyfile(os.path.join(src, name), os.path.join(d, name))  # a link leading outside is refused
    open(os.path.join(d, ".metadata"), "wb").write(pickle.dumps(meta, protocol=raw[1]))
    return d


def test_megatron_with_save_plans():
    src = os.path.join(a.shared, "LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt")
    d = with_save_plans(src, "megatron_plans")
    raw = open(os.path.join(d, ".metadata"), "rb").read()
    assert b"torch.distributed.checkpoint.planner" in raw and b"MCoreSavePlan" in raw
    ours = compare_with(d, src, 1)
    assert "Metadata has extra attribute 'all_local_plans'" in ours["notes"], ours["notes"]
    v = subprocess.run([a.inspect, "verify", "--deep", d], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    j = subprocess.run([a.inspect, "--meta", d], capture_output=True, text=True)
    assert j.returncode == 0 and "MCoreSavePlan" in j.stdout, j.stdout[-2000:] + j.stderr
    # --json --meta: the plans as data, their class and arguments, never built
    j = subprocess.run([a.inspect, "--json", "--meta", d], capture_output=True, text=True)
    assert j.returncode == 0, j.stderr

    def classes(v):
        if isinstance(v, dict):
            yield from ([v["class"]] if isinstance(v.get("class"), str) else [])
            for x in v.values():
                yield from classes(x)
        elif isinstance(v, list):
            for x in v:
                yield from classes(x)
    found = set(classes(json.loads(j.stdout)["meta_json"][".metadata"]))
    assert any(c.endswith("MCoreSavePlan") for c in found) and "torch.distributed.checkpoint.planner.WriteItem" in found, sorted(found)
    # The same plans, one naming code: refused with its offset, never run.
    bad = with_save_plans(src, "megatron_plans_evil", hostile=Evil())
    r = probe(a, "dump-checkpoint", bad, expect_ok=False)
    assert r.returncode == 1 and "would run code" in r.stderr and "offset" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(work, "pwned")), "the hostile pickle ran"


def write_hostile(dirname, metadata_bytes):
    d = os.path.join(work, dirname)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, ".metadata"), "wb").write(metadata_bytes)
    open(os.path.join(d, "__0_0.distcp"), "wb").write(b"")
    return d


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.path.join(work, 'pwned')}",))


def test_hostile_metadata_refused():
    install_2x_stubs()
    m = sys.modules["torch.distributed.checkpoint.metadata"]
    meta = m.Metadata()
    meta.__dict__.update({"state_dict_metadata": {}, "planner_data": Evil(), "storage_data": {}})
    d = write_hostile("evil", pickle.dumps(meta, protocol=4))
    r = probe(a, "dump-checkpoint", d, expect_ok=False)
    assert r.returncode == 1, r.stderr
    assert "global 'posix.system' would run code when loaded" in r.stderr or "global 'os.system'" in r.stderr, r.stderr
    assert "offset" in r.stderr and ".metadata" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(work, "pwned")), "the hostile pickle ran"
    # eval by name
    evil2 = pickle.dumps(meta, protocol=2).replace(b"cposix\nsystem\n", b"cbuiltins\neval\n")
    d2 = write_hostile("evil2", evil2)
    r = probe(a, "dump-checkpoint", d2, expect_ok=False)
    assert r.returncode == 1 and "builtins.eval" in r.stderr, r.stderr


def test_path_escape_refused():
    install_2x_stubs()
    m = sys.modules["torch.distributed.checkpoint.metadata"]
    f = sys.modules["torch.distributed.checkpoint.filesystem"]
    meta = m.Metadata()
    idx = m.MetadataIndex()
    idx.__dict__.update({"fqn": "x", "index": None})
    info = f._StorageInfo()
    info.__dict__.update({"relative_path": "../../etc/passwd", "offset": 0, "length": 10})
    b = m.BytesStorageMetadata()
    meta.__dict__.update({"state_dict_metadata": {"x": b}, "planner_data": None, "storage_data": {idx: info}})
    d = write_hostile("escape", pickle.dumps(meta, protocol=4))
    r = probe(a, "dump-checkpoint", d, expect_ok=False)
    assert r.returncode == 1 and "leaves the checkpoint directory" in r.stderr, r.stderr


def expected_from_manifest(manifest):
    from common import sample_bytes
    out = {}
    for t in manifest["tensors"]:
        dtype = getattr(torch, t["dtype"])
        n = 1
        for d in t["shape"]:
            n *= d
        es = torch.empty(0, dtype=dtype).element_size()
        raw = bytearray(sample_bytes(t["seed"], n * es, t["dtype"] == "bool"))
        v = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if n else torch.empty(0, dtype=dtype)
        out[t["fqn"]] = v.reshape(t["shape"]).clone()
    return out


def same(a_, b_):
    return a_.dtype == b_.dtype and a_.shape == b_.shape and tensor_bytes(torch, a_) == tensor_bytes(torch, b_)


def test_our_113_layout_loads_with_torch_113(world):
    def run():
        from torch.distributed._shard.checkpoint import FileSystemReader, load_state_dict
        d = os.path.join(work, f"ours113_{world}")
        probe(a, "write-dcp", d, str(world), "1.13", "none")
        manifest = __import__("json").load(open(d + ".json"))
        want = expected_from_manifest(manifest)
        # torch 1.13's own loader fills a state dict of plain tensors from our chunks.
        sd = {k: torch.zeros_like(v) for k, v in want.items()}
        sd.update({k: None for k in manifest["objects"]})
        load_state_dict(sd, FileSystemReader(d), no_dist=True)
        for k, v in want.items():
            assert same(sd[k], v), f"{k}: torch 1.13 loaded other values than we wrote"
        for k, v in manifest["objects"].items():
            assert sd[k] == v, f"{k}: {sd[k]!r} != {v!r}"
    return run


def test_rank_local_metadata():
    # NOTE [Rank-local metadata]: what a use_collectives=False save leaves, made from our 3-rank
    # write_dcp by CPython's pickler: each rank's own Metadata (its chunks, its storage_data, its
    # planner_data) in __{rank}.metadata, and no .metadata. Ours must read the three as the whole.
    install_2x_stubs()
    whole = os.path.join(work, "rank_local_whole")
    d = os.path.join(work, "rank_local")
    probe(a, "write-dcp", whole, "3", "current", "none")
    probe(a, "write-dcp", d, "3", "current", "none")
    raw = open(os.path.join(d, ".metadata"), "rb").read()
    for r in range(3):
        with open(os.path.join(d, f"__{r}.metadata"), "wb") as f:
            pickle.dump(dcp_oracle.rank_local(pickle.loads(raw), r), f)  # as FileSystemWriter.finish: the default protocol
    os.remove(os.path.join(d, ".metadata"))
    ours = compare_with(d, whole, 3)
    assert ours["writer"].endswith(", rank-local metadata (3 files)"), ours["writer"]


def test_our_current_layout_reads_as_2x(compression):
    def run():
        install_2x_stubs()
        d = os.path.join(work, f"ours2x_{compression}")
        probe(a, "write-dcp", d, "3", "current", compression)
        manifest = __import__("json").load(open(d + ".json"))
        meta = pickle.load(open(os.path.join(d, ".metadata"), "rb"))
        assert type(meta).__module__ == "torch.distributed.checkpoint.metadata"
        assert set(vars(meta)) == {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}, vars(meta)
        assert meta.version == "1.0.0" and isinstance(meta.planner_data, dict)
        assert meta.planner_data["model.embed.weight"] == ("model", "embed.weight")
        assert meta.planner_data["optim.param_groups.0.params"] == ("optim", "param_groups", 0, "params")
        assert set(vars(meta.storage_meta)) == {"checkpoint_id", "save_id", "load_id", "modules"}
        raw = open(os.path.join(d, ".metadata"), "rb").read()
        assert raw[:2] == b"\x80\x04", "not protocol 4"
        want = expected_from_manifest(manifest)
        for k, info in meta.storage_data.items():
            assert type(info).__module__ == "torch.distributed.checkpoint.filesystem"
            blob = open(os.path.join(d, info.relative_path), "rb").read()[info.offset:info.offset + info.length]
            if compression == "zstd":
                assert info.transform_descriptors == ["stream.zstd/1"], vars(info)
                import subprocess
                blob = subprocess.run(["zstd", "-d", "-c"], input=blob, capture_output=True, check=True).stdout
            else:
                assert not hasattr(info, "transform_descriptors")
            try:
                value = torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as e:
                raise AssertionError(f"{k.fqn}: torch.load of the item failed: {e} (first bytes {blob[:8]!r})")
            if getattr(k, "offset", None) is None:
                assert value == manifest["objects"][k.fqn], f"{k.fqn}: {value!r}"
                continue
            view = want[k.fqn]
            for dim, (o, s) in enumerate(zip(k.offset, value.shape)):
                view = view.narrow(dim, o, s)
            assert same(value, view.contiguous()), f"{k.fqn} at {tuple(k.offset)}: values differ"
        compare(d, 3)
    return run


check("1.13 DCP from 2 Gloo ranks: ours == torch.load of every item", test_fixture(2))
check("1.13 DCP from 4 Gloo ranks (a rank owns no chunk): ours == torch.load of every item", test_fixture(4))
if os.path.isdir(os.path.join(a.shared, "LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt")):
    check("real torch 2.4 Megatron torch_dist checkpoint: ours == torch.load of every item", test_megatron)
    check("real Megatron checkpoint re-pickled with PyTorch 2.6's save plans and Megatron's MCoreSavePlan: opens as before, "
          "a plan that names code is refused", test_megatron_with_save_plans)
else:
    skip("real Megatron checkpoint", f"{a.shared} is absent (the shared real-checkpoint folder)")
for name in ("torch2_world1", "torch2_world2", "torch2_world2_rank_local"):
    check(f"real PyTorch 2.11 dcp.save ({name}): ours == the state it was given, verify --deep clean", test_torch2(name))
check("our write_dcp (1.13 layout, 2 ranks) loads with torch 1.13's load_state_dict", test_our_113_layout_loads_with_torch_113(2))
check("our write_dcp (1.13 layout, 4 ranks, a rank without a chunk) loads with torch 1.13's load_state_dict",
      test_our_113_layout_loads_with_torch_113(4))
check("our write_dcp (2.x layout): .metadata has the 2.x classes and fields; every item loads with weights_only=True",
      test_our_current_layout_reads_as_2x("none"))
check("our write_dcp (2.x layout, stream.zstd/1): items decode with the zstd tool and load with weights_only=True",
      test_our_current_layout_reads_as_2x("zstd"))
check("rank-local __N.metadata (use_collectives=False), pickled by CPython from the 2.x classes: ours == torch.load of every item",
      test_rank_local_metadata)
check("a .metadata that names os.system or builtins.eval is refused, never run", test_hostile_metadata_refused)
check("a relative_path that leaves the directory is refused", test_path_escape_refused)
finish()

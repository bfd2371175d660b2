#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch 2.x interop, for a machine that has torch >= 2 (the GPU machine does; this runs on CPU).
Not part of CI (Debian ships torch 1.13); run it by hand:

    python3 tests/interop/pytorch2/run.py --probe build/tests/ckpt_probe --inspect build/tools/fsdp-ckpt-inspect \
        --merge build/tools/fsdp-ckpt-merge

It writes checkpoints with torch.distributed.checkpoint.save (world size 1, and 2 with Gloo; nested
model and optimizer state; with the ZStandard extension when it imports; rank-local metadata with
use_collectives=False where this torch has it), runs our inspect --json
and verify on them and compares every value with ours, and loads our write_dcp output with
dcp.load, and our torch.save output with torch.load(weights_only=True); with --merge, our merge of
each dcp.save checkpoint must equal PyTorch's own dcp_to_torch_save of it, loaded with
torch.load(weights_only=True); with --shard, our reshard of each dcp.save checkpoint to 3 ranks
must load with dcp.load, into full tensors in one process and into DTensor Shard(0) shards of 3
Gloo ranks, with the values dcp.save was given."""
import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import check, finish, sample_bytes, tensor_bytes  # noqa: E402
import dcp_oracle  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--probe", required=True)
p.add_argument("--inspect", required=True)
p.add_argument("--merge", help="fsdp-ckpt-merge: also compare its output with PyTorch's dcp_to_torch_save")
p.add_argument("--shard", help="fsdp-ckpt-shard: also load its output with dcp.load, whole and into DTensors of 3 ranks")
a = p.parse_args()
work = tempfile.mkdtemp(prefix="fsdp-pt2-")
print(f"torch {torch.__version__}")


# The state the testdata/dcp/torch2 fixtures hold too (one generator's).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "testdata", "gen"))
from make_pt2_fixtures import state  # noqa: E402


def flat(obj, prefix=""):
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and any(isinstance(x, (dict, list, torch.Tensor)) for x in obj):
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def ours(path):
    r = subprocess.run([a.probe, "dump-checkpoint", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def compare_with_state(path, sd):
    dump = ours(path)
    expect = {k: v for k, v in flat(sd).items() if isinstance(v, torch.Tensor)}
    got = {t["name"]: t for t in dump["tensors"]}
    assert set(got) == set(expect), f"names differ: {sorted(set(got) ^ set(expect))}"
    for k, v in expect.items():
        assert bytes.fromhex(got[k]["hex"]) == tensor_bytes(torch, v), f"{k}: values differ"
    v = subprocess.run([a.inspect, "verify", "--deep", path], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    j = json.loads(subprocess.run([a.inspect, "--json", path], capture_output=True, text=True, check=True).stdout)
    assert j["format"] == "dcp" and j["schema"] == 1


def test_save_world1():
    d = os.path.join(work, "w1")
    sd = state()
    dcp.save(sd, checkpoint_id=d)
    compare_with_state(d, sd)


def _worker(rank, world, port, d, zstd):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sd = state()
    writer = None
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard
        writer = dcp.FileSystemWriter(d, _extensions=[ZStandard()])
    dcp.save(sd, checkpoint_id=d, storage_writer=writer)
    dist.destroy_process_group()


def test_save_world2(zstd):
    def run():
        d = os.path.join(work, f"w2{'z' if zstd else ''}")
        mp.spawn(_worker, args=(2, 29611 + zstd, d, zstd), nprocs=2, join=True)
        compare_with_state(d, state())
    return run


def _rank_local_worker(rank, world, port, d):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dcp.save(state(), checkpoint_id=d, use_collectives=False)
    dist.destroy_process_group()


def test_save_rank_local():
    # NOTE [Rank-local metadata]: no .metadata; each rank's __{rank}.metadata, merged by us. Both
    # ranks save the same whole tensors, so the merged index holds rank 0's copy of each.
    d = os.path.join(work, "w2local")
    mp.spawn(_rank_local_worker, args=(2, 29615, d), nprocs=2, join=True)
    assert not os.path.exists(os.path.join(d, ".metadata")), "PyTorch wrote a global .metadata"
    assert os.path.exists(os.path.join(d, "__0.metadata")) and os.path.exists(os.path.join(d, "__1.metadata"))
    compare_with_state(d, state())


def test_dcp_load_of_ours(compression):
    def run():
        d = os.path.join(work, f"ours_{compression}")
        subprocess.run([a.probe, "write-dcp", d, "2", "current", compression], check=True)
        m = json.load(open(d + ".json"))
        sd = {}
        for t in m["tensors"]:
            sd[t["fqn"]] = torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"]))
        for k in m["objects"]:
            sd[k] = None
        dcp.load(sd, checkpoint_id=d)
        for t in m["tensors"]:
            v = sd[t["fqn"]]
            raw = sample_bytes(t["seed"], v.numel() * v.element_size(), t["dtype"] == "bool")
            assert tensor_bytes(torch, v) == raw, f"{t['fqn']}: dcp.load read other values than we wrote"
        for k, v in m["objects"].items():
            assert sd[k] == v, f"{k}: {sd[k]!r} != {v!r}"
    return run


def test_torch_load_of_ours():
    out = os.path.join(work, "sample.pt")
    subprocess.run([a.probe, "write-sample", out], check=True)
    obj = torch.load(out, weights_only=True)
    assert "model" in obj and isinstance(obj["model"]["layer.0.weight"], torch.nn.Parameter)


def test_merge_equals_dcp_to_torch_save(name):
    def run():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        d = os.path.join(work, name)
        theirs, mine = os.path.join(work, name + "_theirs.pt"), os.path.join(work, name + "_ours.pt")
        dcp_to_torch_save(d, theirs)
        r = subprocess.run([a.merge, "-q", d, "-o", mine], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        dcp_oracle.same(torch, torch.load(mine, weights_only=True), torch.load(theirs, weights_only=True))
    return run


def _shard_worker(rank, world, port, d, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    want = state()["model"]
    sd = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in want.items()}}
    dcp.load(sd, checkpoint_id=d)
    for k, v in want.items():
        full = sd["model"][k].full_tensor()
        assert torch.equal(full, v), f"rank {rank}: {k} differs after dcp.load into Shard(0) ({layout})"
    dist.destroy_process_group()


def test_dcp_load_of_shard(name, layout):
    def run():
        src, out = os.path.join(work, name), os.path.join(work, f"{name}_shard3_{layout}")
        r = subprocess.run([a.shard, "-q", src, "-o", out, "-n", "3", "--layout", layout], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        want = state()
        sd = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "epoch": 0, "tag": ""}
        dcp.load(sd, checkpoint_id=out)
        for k, v in want["model"].items():
            assert torch.equal(sd["model"][k], v), f"{k} differs after dcp.load of our reshard"
        assert sd["epoch"] == 3 and sd["tag"] == "pt2", (sd["epoch"], sd["tag"])
        mp.spawn(_shard_worker, args=(3, 29631 + (layout == "dtensor"), out, layout), nprocs=3, join=True)
    return run


def zstd_module():
    """torch's ZStandard extension needs the zstandard or pyzstd module to run."""
    import importlib.util
    try:
        from torch.distributed.checkpoint._extension import ZStandard  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"no ZStandard extension: {e}"
    if not (importlib.util.find_spec("zstandard") or importlib.util.find_spec("pyzstd")):
        return "neither zstandard nor pyzstd is installed"
    return None


def main():
    check("dcp.save (world 1) read by us, verify --deep clean", test_save_world1)
    check("dcp.save (world 2, Gloo) read by us", test_save_world2(False))
    no_zstd = zstd_module()
    if no_zstd is None:
        check("dcp.save (world 2, ZStandard extension) read by us", test_save_world2(True))
    else:
        print(f"skip ZStandard: {no_zstd}")
    if "use_collectives" in inspect.signature(dcp.save).parameters:
        check("dcp.save (world 2, use_collectives=False: rank-local __N.metadata) read by us", test_save_rank_local)
    else:
        print("skip rank-local metadata: this torch's dcp.save has no use_collectives")
    check("dcp.load of our write_dcp (2.x layout)", test_dcp_load_of_ours("none"))
    if no_zstd is None:
        check("dcp.load of our write_dcp (stream.zstd/1)", test_dcp_load_of_ours("zstd"))
    else:
        print(f"skip ZStandard load: {no_zstd}")
    check("torch.load(weights_only=True) of our torch.save sample", test_torch_load_of_ours)
    if a.merge:
        for name in ("w1", "w2", "w2z"):
            if os.path.isdir(os.path.join(work, name)):
                check(f"fsdp-ckpt-merge of dcp.save ({name}) == dcp_to_torch_save", test_merge_equals_dcp_to_torch_save(name))
    if a.shard:
        for name in ("w1", "w2", "w2z"):
            if os.path.isdir(os.path.join(work, name)):
                for layout in ("fsdp", "dtensor"):
                    check(f"dcp.load of fsdp-ckpt-shard ({name} -> 3 ranks, {layout})", test_dcp_load_of_shard(name, layout))
    finish()


# mp.spawn starts each rank by importing this file again (as __mp_main__): the checks run only here.
if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the DCP fixtures under testdata/dcp/ with Debian's python3-torch 1.13.1:
torch.distributed._shard.checkpoint.save_state_dict from 2 and 4 real Gloo processes,
ShardedTensors chunked on dim 0 as FSDP writes them (torch.chunk rule), a dim-1 chunked tensor,
ranks that own no chunk, bf16/fp16/int64, optimizer state with a step, non-tensor items.
Run by hand from the repository root: /usr/bin/python3 testdata/gen/make_dcp_fixtures.py"""
import hashlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import torch113_compat  # noqa: F401,E402  (must precede the torch.distributed._shard imports)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import ShardMetadata  # noqa: E402

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dcp")


def full(name, shape, dtype):
    """The full value of a fixture tensor: a deterministic pattern both sides can recompute."""
    n = 1
    for d in shape:
        n *= d
    seed = sum(map(ord, name))
    v = (torch.arange(n, dtype=torch.float64) * 0.37 + seed) % 97 - 48
    return v.reshape(shape).to(dtype)


def sharded(name, shape, dtype, rank, world, dim=0):
    """A ShardedTensor cut with torch.chunk along `dim`; ranks past the last chunk own nothing."""
    t = full(name, shape, dtype)
    pieces = list(torch.chunk(t, world, dim=dim))
    local = []
    offset = 0
    for r in range(world):
        size = pieces[r].shape[dim] if r < len(pieces) else 0
        if r == rank and size > 0:
            offs = [0] * len(shape)
            offs[dim] = offset
            sizes = list(shape)
            sizes[dim] = size
            local.append(Shard(pieces[r].contiguous().clone(), ShardMetadata(offs, sizes, f"rank:{r}/cpu")))
        offset += size
    return ShardedTensor._init_from_local_shards(local, list(shape))


def worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sd = {
        "model.embed.weight": sharded("model.embed.weight", (10, 4), torch.float32, rank, world),
        "model.proj.weight": sharded("model.proj.weight", (3, 8), torch.bfloat16, rank, world),   # 3 rows: rank 3 of 4 owns none
        "model.head.weight": sharded("model.head.weight", (4, 6), torch.float16, rank, world, dim=1),
        "model.head.bias": full("model.head.bias", (6,), torch.float16),                          # replicated, plain tensor
        "model.buffer.count": full("model.buffer.count", (5,), torch.int64),
        "optim.state.embed.exp_avg": sharded("optim.state.embed.exp_avg", (10, 4), torch.float32, rank, world),
        "optim.state.embed.step": torch.tensor(7.0),
        "optim.param_groups": [{"lr_milli": 1, "betas_milli": (900, 999), "params": ["embed.weight"]}],
        "epoch": 3,
    }
    save_state_dict(sd, FileSystemWriter(out, single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


def make(world):
    out = os.path.join(root, f"torch113_{world}rank")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    port = 29500 + world
    mp.spawn(worker, args=(world, port, out), nprocs=world, join=True)
    return out


if __name__ == "__main__":
    for w in (2, 4):
        d = make(w)
        for f in sorted(os.listdir(d)):
            data = open(os.path.join(d, f), "rb").read()
            print(f"{os.path.relpath(os.path.join(d, f), os.path.join(root, '..'))}  {len(data)} bytes  "
                  f"sha256 {hashlib.sha256(data).hexdigest()}  torch {torch.__version__}")

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the merge benchmark's input with Debian's python3-torch 1.13: a DCP checkpoint of about
GIB GiB in about 100 float32 tensors, saved by 4 real Gloo ranks with save_state_dict, every
tensor a ShardedTensor chunked on dim 0 (torch.chunk) as FSDP writes it.
Usage: make_merge_input.py OUTDIR GIB"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata", "gen"))
import torch113_compat  # noqa: F401,E402  (harness-only patch: must precede the _shard imports)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import ShardMetadata  # noqa: E402

WORLD, TENSORS = 4, 100


def worker(rank, out, gib, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    cols = 1024
    rows = int(gib * (1 << 30) / 4 / cols / TENSORS)
    sd = {}
    g = torch.Generator().manual_seed(rank)
    for i in range(TENSORS):
        pieces = [rows // WORLD + (1 if r < rows % WORLD else 0) for r in range(WORLD)]
        off = sum(pieces[:rank])
        local = torch.randn(pieces[rank], cols, generator=g)
        shard = Shard(local, ShardMetadata([off, 0], [pieces[rank], cols], f"rank:{rank}/cpu"))
        sd[f"model.layers.{i}.weight"] = ShardedTensor._init_from_local_shards([shard], [rows, cols])
    save_state_dict(sd, FileSystemWriter(out, single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out, gib = sys.argv[1], float(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    mp.spawn(worker, args=(out, gib, 29600 + os.getpid() % 300), nprocs=WORLD, join=True)

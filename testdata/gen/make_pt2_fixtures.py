#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes testdata/dcp/torch2_* : DCP checkpoints saved by PyTorch 2.x's own
torch.distributed.checkpoint.save, for the tests that read them without a 2.x PyTorch here.
Run by hand where torch >= 2.4 is installed (the GPU machine has it; it runs on CPU):

    python3 testdata/gen/make_pt2_fixtures.py OUT_DIR

world1: one process, a nested model and Adam state, an int and a str; world2: 2 Gloo ranks, the
model's weight sharded on dim 0 as DTensors (FSDP's layout); world2_rank_local: 2 Gloo ranks
with use_collectives=False (each rank's own __{rank}.metadata). Each gets a values.pt beside it
(torch.save of the full state, weights_only-loadable) for the tests to compare with."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "tag": "pt2"}


def full(sd):
    return {"model": {k: v.clone() for k, v in sd["model"].items()}}


def worker(rank, world, port, out, local):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    sd = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state()["model"].items()}, "epoch": 3}
    if local:
        dcp.save(sd, checkpoint_id=out, use_collectives=False)
    else:
        dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    d = os.path.join(out, "torch2_world1")
    sd = state()
    dcp.save(sd, checkpoint_id=d, no_dist=True)
    torch.save(sd, os.path.join(out, "torch2_world1.values.pt"))
    for name, port, local in (("torch2_world2", 29651, False), ("torch2_world2_rank_local", 29652, True)):
        mp.spawn(worker, args=(2, port, os.path.join(out, name), local), nprocs=2, join=True)
        torch.save({"model": state()["model"], "epoch": 3}, os.path.join(out, name + ".values.pt"))
    with open(os.path.join(out, "VERSION"), "w") as f:
        f.write(f"torch {torch.__version__}\n")


if __name__ == "__main__":
    main()

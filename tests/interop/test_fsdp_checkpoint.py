#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""libfsdp's sharded checkpoints against PyTorch. The C++ test binary trains an MLP under
FULL_SHARD at world size 2, SHARD_GRAD_OP at world size 3 and HYBRID_SHARD on a 2 x 2 mesh, saves
each with fsdp::save_sharded,
and writes what single-process training reaches as a torch.save file. Here PyTorch reads them:
.metadata through the torch 2.x class stand-ins, every item with torch.load(weights_only=True);
each parameter must equal the single-process value, be chunked on dim 0 by torch.chunk's rule with
piece r in rank r's file (at world size 3 a file per unit and rank, as SaveOptions::file_bytes = 1
makes them), and fsdp-ckpt-merge's file of it must load with weights_only=True."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import check, finish, import_torch, tmpdir  # noqa: E402
import dcp_oracle  # noqa: E402

import argparse  # noqa: E402
p = argparse.ArgumentParser()
p.add_argument("--fsdp-test", required=True)
p.add_argument("--merge", required=True)
p.add_argument("--inspect", required=True)
a = p.parse_args()
torch = import_torch()
dcp_oracle.install_2x_stubs()
work = tmpdir()
r = subprocess.run([a.fsdp_test, "save", work], capture_output=True, text=True)
if r.returncode != 0:
    print(f"FAIL the C++ side could not train and save: {r.stdout} {r.stderr}")
    sys.exit(1)
reference = torch.load(os.path.join(work, "reference.pt"), weights_only=True)


def case(name, world):
    def run():
        d = os.path.join(work, name)
        v = subprocess.run([a.inspect, "verify", "--deep", d], capture_output=True, text=True)
        assert v.returncode == 0, v.stdout + v.stderr
        tensors, objects = dcp_oracle.python_read(torch, d)  # weights_only=True for every item
        assert sorted(tensors) == sorted("model." + k for k in reference), (sorted(tensors), sorted(reference))
        for k, want in reference.items():
            got = tensors["model." + k]
            assert got.dtype == want.dtype and got.shape == want.shape, k
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{k}: max difference {(got - want).abs().max()}"
        import pickle
        meta = pickle.load(open(os.path.join(d, ".metadata"), "rb"))
        for fqn, e in meta.state_dict_metadata.items():
            rows = [c for c in torch.empty(e.size[0]).chunk(world)]
            want_boxes = []
            at = 0
            for c in rows:
                want_boxes.append(([at] + [0] * (len(e.size) - 1), [c.shape[0]] + list(e.size)[1:]))
                at += c.shape[0]
            got_boxes = sorted((list(c.offsets), list(c.sizes)) for c in e.chunks)
            assert got_boxes == want_boxes, f"{fqn}: {got_boxes} vs torch.chunk's {want_boxes}"
            for k, info in meta.storage_data.items():
                if k.fqn == fqn:
                    piece = list(k.offset)[0] // -(-e.size[0] // world)
                    # Rank r's file; at world size 3 a file per unit (__r_0, __r_1, ...: the save writes them one by one).
                    assert info.relative_path.startswith(f"__{piece}_") and info.relative_path.endswith(".distcp"), \
                        (fqn, list(k.offset), info.relative_path)
                    assert world == 3 or info.relative_path == f"__{piece}_0.distcp", (fqn, info.relative_path)
            assert tuple(meta.planner_data[fqn]) == ("model", fqn[len("model."):]), meta.planner_data[fqn]
        out = os.path.join(work, name + ".pt")
        m = subprocess.run([a.merge, "-q", d, "-o", out], capture_output=True, text=True)
        assert m.returncode == 0, m.stderr
        merged = torch.load(out, weights_only=True)
        for k, want in reference.items():
            assert torch.allclose(merged["model"][k], want, rtol=1e-5, atol=1e-6), k
    return run


check("FULL_SHARD at world size 2: PyTorch reads the sharded checkpoint as single-process training's parameters", case("FULL_SHARD_w2", 2))
check("SHARD_GRAD_OP at world size 3: the same, chunked by torch.chunk's rule", case("SHARD_GRAD_OP_w3", 3))
check("HYBRID_SHARD on a 2 x 2 mesh: the same, in 2 chunks (a replica's shards) written by the first replica", case("HYBRID_SHARD_w4", 2))
finish()

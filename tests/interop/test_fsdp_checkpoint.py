#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""libfsdp's sharded checkpoints against PyTorch. The C++ test binary trains an MLP under
FULL_SHARD at world size 2, SHARD_GRAD_OP at world size 3 and HYBRID_SHARD on a 2 x 2 mesh, saves
each with fsdp::save_sharded,
and writes what single-process training reaches as a torch.save file. Here PyTorch reads them:
.metadata through the torch 2.x class stand-ins, every item with torch.load(weights_only=True);
each parameter must equal the single-process value, also through PyTorch 1.13's own
load_state_dict; each rank's chunks must be the contiguous runs of its slice of the flat buffer, in
rank r's files (at world size 3 a file per unit and rank, as SaveOptions::file_bytes = 1 makes
them); and fsdp-ckpt-merge's file of it must load with weights_only=True."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import check, finish, import_torch, tmpdir  # noqa: E402
import dcp_oracle  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "testdata", "gen"))
import torch113_compat  # noqa: F401,E402  (harness-only patch; see that file)

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
        # PyTorch 1.13's own reader and planner, fed the same .metadata in its own classes.
        own = dcp_oracle.load_113_of_2x(torch, d)
        for k, want in reference.items():
            assert torch.equal(own["model." + k], tensors["model." + k]), f"{k}: torch 1.13's load_state_dict differs"
        import pickle
        meta = pickle.load(open(os.path.join(d, ".metadata"), "rb"))
        for fqn, e in meta.state_dict_metadata.items():
            if type(e).__name__ == "BytesStorageMetadata":
                continue
            size = list(e.size)
            # Each chunk is a contiguous run of the flattened tensor (NOTE [A sharded save, as the
            # shards lie]); in flat order the runs belong to ranks 0, 1, ... in turn, each rank's
            # runs adjacent (its slice of the flat buffer), at most 2 * ndim - 1 runs a rank.
            runs = []
            for c, info in ((c, info) for c in e.chunks for k, info in meta.storage_data.items()
                            if k.fqn == fqn and list(k.offset) == list(c.offsets)):
                offsets, sizes = list(c.offsets), list(c.sizes)
                lead = next((i for i, n in enumerate(sizes) if n != 1), len(sizes))
                assert all(sizes[i] == size[i] for i in range(lead + 1, len(size))), (fqn, offsets, sizes)
                start = 0
                for o, n in zip(offsets, size):
                    start = start * n + o
                volume = 1
                for n in sizes:
                    volume *= n
                file = info.relative_path
                assert file.startswith("__") and file.endswith(".distcp"), (fqn, file)
                runs.append((start, volume, int(file[2:].split("_")[0]), file))
            runs.sort()
            at = 0
            for start, volume, r, file in runs:
                assert start == at, f"{fqn}: a run at {start}, the one before ended at {at}"
                at += volume
                # Rank r's file; at world size 3 a file per unit (__r_0, __r_1, ...: written one by one).
                assert world == 3 or file == f"__{r}_0.distcp", (fqn, file)
            assert at == max(1, torch.Size(size).numel()), (fqn, at)
            ranks = [r for _, _, r, _ in runs]
            assert ranks == sorted(ranks) and all(ranks.count(r) <= max(1, 2 * len(size) - 1) for r in ranks), (fqn, ranks)
            assert tuple(meta.planner_data[fqn])[0] == fqn.split(".")[0], meta.planner_data[fqn]
        out = os.path.join(work, name + ".pt")
        m = subprocess.run([a.merge, "-q", d, "-o", out], capture_output=True, text=True)
        assert m.returncode == 0, m.stderr
        merged = torch.load(out, weights_only=True)
        for k, want in reference.items():
            assert torch.allclose(merged["model"][k], want, rtol=1e-5, atol=1e-6), k
    return run


check("FULL_SHARD at world size 2: PyTorch reads the sharded checkpoint as single-process training's parameters", case("FULL_SHARD_w2", 2))
check("SHARD_GRAD_OP at world size 3: the same, a data file per unit and rank", case("SHARD_GRAD_OP_w3", 3))
check("HYBRID_SHARD on a 2 x 2 mesh: the same, each slice written once, by the first replica", case("HYBRID_SHARD_w4", 2))
finish()

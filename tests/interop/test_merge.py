#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""fsdp-ckpt-merge against PyTorch. Each output is read with torch.load(weights_only=True) and
must equal PyTorch's own merge of the same folder bit for bit: torch 1.13's load_state_dict
(no_dist=True) into full tensors for 1.13 input, and for 2.x-layout input the tensors assembled
from torch.load of every item, nested by planner_data as dcp_to_torch_save nests them. Casts must
equal Tensor.to(); safetensors output is checked with json and struct alone."""
import json
import os
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import args, check, finish, import_torch, probe, raw, read_safetensors, skip, tmpdir  # noqa: E402
import dcp_oracle  # noqa: E402

a = args()
sys.path.insert(0, os.path.join(a.testdata, "gen"))
import torch113_compat  # noqa: F401,E402  (harness-only patch; see that file)

torch = import_torch()
work = tmpdir()


def merge(*argv, expect=0):
    r = subprocess.run([a.merge, "-q", *argv], capture_output=True, text=True)
    assert r.returncode == expect, f"fsdp-ckpt-merge {' '.join(argv)}: exit {r.returncode}, stderr: {r.stderr.strip()}"
    return r


def load(path):
    return torch.load(path, weights_only=True)


def fixture(world):
    return os.path.join(a.testdata, "dcp", f"torch113_{world}rank")


def our_sample(world, compression="none", layout="2.x"):
    d = os.path.join(work, f"sample_{world}_{layout}_{compression}")
    if not os.path.exists(d):
        probe(a, "write-dcp", d, str(world), layout, compression)
    return d


def leftovers(directory):
    return [f for f in os.listdir(directory) if ".tmp." in f]


def test_113(world):
    def run():
        out = os.path.join(work, f"f113_{world}.pt")
        merge(fixture(world), "-o", out)
        dcp_oracle.same(torch, load(out), dcp_oracle.load_113(torch, fixture(world)))
        # and the file is a well-formed zip: torch's reader checks every CRC-32 it reads
        assert subprocess.run(["/usr/bin/python3", "-c", f"import zipfile; z = zipfile.ZipFile({out!r}); "
                               "assert z.testzip() is None"]).returncode == 0, "zipfile found a bad CRC"
    return run


def test_2x(world, compression):
    def run():
        src = our_sample(world, compression)
        out = os.path.join(work, f"s2x_{world}_{compression}.pt")
        merge(src, "-o", out)
        dcp_oracle.install_2x_stubs()
        got, want = load(out), dcp_oracle.dcp_to_torch_save(torch, src)
        assert isinstance(got["model"], dict) and "embed.weight" in got["model"], list(got)
        dcp_oracle.same(torch, got, want)
    return run


def test_lightning():
    # A Lightning sharded folder: the DCP part plus meta.pt (torch.save of the other state). Its
    # keys are merged in last, replacing DCP entries of the same key in place (dict.update), as
    # Lightning's consolidate_checkpoint does; tensors inside meta.pt come along.
    src = os.path.join(work, "lightning")
    shutil.copytree(fixture(2), src)
    meta = {"epoch": 9, "global_step": 1234, "hparams": {"name": "tiny", "layers": [2, 3]}, "rng": torch.arange(5)}
    torch.save(meta, os.path.join(src, "meta.pt"))
    out = os.path.join(work, "lightning.pt")
    merge(src, "-o", out)
    want = dcp_oracle.load_113(torch, src)
    want.update(torch.load(os.path.join(src, "meta.pt")))
    dcp_oracle.same(torch, load(out), want)


def test_flat():
    src = our_sample(3)
    out = os.path.join(work, "flat.pt")
    merge(src, "-o", out, "--layout", "flat")
    got = load(out)
    tensors, objects = dcp_oracle.python_read(torch, src)
    assert set(got) == set(tensors) | set(objects), sorted(set(got) ^ (set(tensors) | set(objects)))
    for k, v in tensors.items():
        dcp_oracle.same(torch, got[k], v, k)


def test_megatron():
    src = os.path.join(a.shared, "LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt")
    out = os.path.join(work, "megatron.pt")
    merge(src, "-o", out)
    dcp_oracle.install_2x_stubs()
    want = dcp_oracle.dcp_to_torch_save(torch, src)
    # Its bytes items hold Python floats, which torch 1.13's weights_only loader refuses (it does
    # not know BINFLOAT; 2.x accepts it): load the whole file unrestricted, and the tensors alone
    # with weights_only=True from a --model-only merge below.
    got = torch.load(out)
    dcp_oracle.same(torch, got, want)
    tensors_only = os.path.join(work, "megatron_tensors.pt")
    merge(src, "-o", tensors_only, "--layout", "flat", "--exclude", "*", "--include", "*.weight", "--include", "*.bias")
    t = load(tensors_only)
    assert t and all(isinstance(v, torch.Tensor) for v in t.values()), "a non-tensor slipped through the filters"


def test_torch_save_input():
    # PyTorch writes both files; merge must keep the str-keyed nesting of the first, and flatten the
    # second (a torch.optim state dict: int keys, a tuple) whole, never a mix.
    nested = os.path.join(work, "nested_in.pt")
    obj = {"model": {"a.weight": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
           "extra": {"deep": {"t": torch.tensor([1, 2], dtype=torch.int64)}, "name": "x"}, "epoch": 3}
    torch.save(obj, nested)
    out = os.path.join(work, "nested_out.pt")
    merge(nested, "-o", out)
    got = load(out)
    assert list(got) == list(obj) and list(got["model"]) == list(obj["model"]), list(got)
    assert torch.equal(got["model"]["a.weight"], obj["model"]["a.weight"]) and torch.equal(got["extra"]["deep"]["t"], obj["extra"]["deep"]["t"])
    assert got["extra"]["name"] == "x" and got["epoch"] == 3
    merge(nested, "-o", out, "--model-only", "--force")
    got = load(out)
    assert list(got) == ["model"] and torch.equal(got["model"]["b"], obj["model"]["b"]), got
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5, momentum=0.9)
    opt.state[opt.param_groups[0]["params"][0]] = {"momentum_buffer": torch.full((2,), 2.0)}
    flat_in = os.path.join(work, "optim_in.pt")
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": opt.state_dict()}, flat_in)
    merge(flat_in, "-o", out, "--force")
    got = torch.load(out)  # param_groups hold floats, which 1.13's restricted loader refuses
    assert "model.w" in got and torch.equal(got["optimizer.state.0.momentum_buffer"], torch.full((2,), 2.0)), sorted(got)
    assert not any(isinstance(v, dict) for v in got.values()), sorted(got)


def same_cast(got, want, where):
    """Bit for bit, except that a NaN's bits may differ: torch 1.13's own CPU cast gives a NaN
    0xFFFF in bfloat16 inside its vector loop and 0x7FC0 in the scalar tail (and keeps the payload
    in float16 only in the vector loop), so its NaN bits depend on the position. We write c10's
    scalar NaN everywhere; NaN must stay NaN at the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    if not got.is_floating_point():
        dcp_oracle.same(torch, got, want, where)
        return
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{where}: NaN at different places"
    dcp_oracle.same(torch, torch.where(gn, torch.zeros_like(got), got), torch.where(wn, torch.zeros_like(want), want), where)


def test_casts():
    src = our_sample(2)
    base = os.path.join(work, "cast_base.pt")
    merge(src, "-o", base, "--layout", "flat")
    plain = load(base)
    for flag, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32), ("fp64", torch.float64)]:
        out = os.path.join(work, f"cast_{flag}.pt")
        merge(src, "-o", out, "--layout", "flat", "--dtype", flag, "--cast-include", "*")  # every float: the cast itself
        got = load(out)
        for k, v in plain.items():
            if not isinstance(v, torch.Tensor):
                continue
            want = v.to(dtype) if v.is_floating_point() else v
            same_cast(got[k], want, f"{k} as {flag}")


def test_casts_special_values():
    # Values that exercise rounding: ties, subnormals, overflow to inf, NaN, -0.0, from every float dtype.
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4096, generator=g, dtype=torch.float64) * torch.logspace(-45, 40, 4096, base=2.0, dtype=torch.float64)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65520.0, 65519.99,
                            2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.5, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                            3.3895313892515355e38, 1e39, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], dtype=torch.float64)
    values = torch.cat([base, special, -special])
    from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict
    d = os.path.join(work, "special")
    sd = {f"t.{str(dt).split('.')[1]}": values.to(dt) for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
    save_state_dict(sd, FileSystemWriter(d), no_dist=True)
    for flag, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32), ("fp64", torch.float64)]:
        out = os.path.join(work, f"special_{flag}.pt")
        merge(d, "-o", out, "--dtype", flag)
        got = load(out)
        for k, v in sd.items():
            same_cast(got[k], v.to(dtype), f"{k} as {flag}")


def test_cast_damage():
    # A cast that turns finite values into inf or non-zeros into 0 is named per tensor with its
    # counts, which torch's own Tensor.to gives here; --strict-cast makes it an error that writes
    # nothing (issue 28 item 6). Uses test_casts_special_values's checkpoint.
    d = os.path.join(work, "special")
    sd = dcp_oracle.load_113(torch, d)
    for flag, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]:
        out = os.path.join(work, f"damage_{flag}.pt")
        r = subprocess.run([a.merge, d, "-o", out, "--dtype", flag], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        notes = {}
        for line in r.stderr.splitlines():
            if " cast to " in line:
                name = line.split("'")[1]
                over = int(line.split(" finite value")[0].rsplit(" ", 1)[1]) if "became inf" in line else 0
                flushed = int(line.split(" non-zero value")[0].rsplit(" ", 1)[1]) if "became 0" in line else 0
                notes[name] = (over, flushed)
        want = {}
        for k, v in sd.items():
            c = v.to(dtype).to(torch.float64)
            x = v.to(torch.float64)
            over = int((torch.isfinite(x) & torch.isinf(c)).sum())
            flushed = int(((x != 0) & ~torch.isnan(x) & (c == 0)).sum())
            if over or flushed:
                want[k] = (over, flushed)
        assert notes == want, (flag, notes, want)
        if want:
            strict = os.path.join(work, f"strict_{flag}.pt")
            r = subprocess.run([a.merge, "-q", d, "-o", strict, "--dtype", flag, "--strict-cast"], capture_output=True, text=True)
            assert r.returncode == 1 and "--strict-cast" in r.stderr and not os.path.exists(strict), r.stderr
            assert not leftovers(work), leftovers(work)


def test_strided_items():
    # torch 1.13 saves a view whose storage holds exactly its elements as it is, strides and all
    # (a transposed tensor): the item is not C-contiguous, and merge gathers it.
    from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict
    d = os.path.join(work, "strided")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"t": base.t(), "p": torch.arange(60, dtype=torch.int64).reshape(3, 4, 5).permute(2, 0, 1), "c": base.clone()}
    save_state_dict(sd, FileSystemWriter(d), no_dist=True)
    # the items really are strided (else this would not exercise the gather)
    import io
    import pickle
    meta = pickle.load(open(os.path.join(d, ".metadata"), "rb"))
    for k, v in meta.storage_data.items():
        blob = open(os.path.join(d, v.relative_path), "rb").read()[v.offset:v.offset + v.length]
        item = torch.load(io.BytesIO(blob), weights_only=True)
        assert (k.fqn == "c") == item.is_contiguous(), (k.fqn, item.stride())
    out = os.path.join(work, "strided.pt")
    merge(d, "-o", out)
    dcp_oracle.same(torch, load(out), dcp_oracle.load_113(torch, d))
    out16 = os.path.join(work, "strided16.pt")
    merge(d, "-o", out16, "--dtype", "fp16")
    got, want = load(out16), dcp_oracle.load_113(torch, d)
    same_cast(got["t"], want["t"].to(torch.float16), "t as fp16")


ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.bool: "BOOL", torch.float64: "F64"}


def test_safetensors_single():
    src = our_sample(3)
    out = os.path.join(work, "model.safetensors")
    merge(src, "-o", out)
    meta, tensors = read_safetensors(out)
    assert meta.get("format") == "pt" and meta.get("source"), meta
    dcp_oracle.install_2x_stubs()
    want = dcp_oracle.dcp_to_torch_save(torch, src)["model"]
    assert set(tensors) == set(want), sorted(set(tensors) ^ set(want))
    for k, v in want.items():
        dt, shape, b = tensors[k]
        assert dt == ST[v.dtype] and shape == list(v.shape) and b == raw(v), k


def test_renames():
    """--strip-prefix and --rename (sed's s command, in order): each tensor under its new name,
    equal to dcp_to_torch_save's; with --format torch they need --layout flat; two names made one,
    or a bad rule, are refused and nothing is written."""
    import re as regex
    src = fixture(4)
    dcp_oracle.install_2x_stubs()
    want = dcp_oracle.load_113(torch, src)  # {fqn: tensor}, torch 1.13's flat FQNs
    rules = ["s/^model\\.//", "s/\\.weight$/.w/"]

    def renamed(fqn):  # the same rules in Python's re
        fqn = regex.sub(r"^model\.", "", fqn, count=1)
        return regex.sub(r"\.weight$", ".w", fqn, count=1)
    out = os.path.join(work, "renamed.safetensors")
    merge(src, "-o", out, "--strip-prefix", "model.", "--rename", rules[1])
    _, tensors = read_safetensors(out)
    model = {k: v for k, v in want.items() if isinstance(v, torch.Tensor) and k.startswith("model.")}
    assert set(tensors) == {renamed(k) for k in model}, sorted(tensors)
    for k, v in model.items():
        assert tensors[renamed(k)][2] == raw(v), k
    flat = os.path.join(work, "renamed.pt")
    merge(src, "-o", flat, "--layout", "flat", *sum((["--rename", r] for r in rules), []))
    got = load(flat)
    assert set(got) == {renamed(k) for k in want}, sorted(got)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[renamed(k)], v), k
    r = merge(src, "-o", os.path.join(work, "nested.pt"), "--rename", rules[0], expect=1)
    assert "add --layout flat" in r.stderr, r.stderr
    clash = os.path.join(work, "clash.safetensors")
    r = merge(src, "-o", clash, "--rename", "s/\\..*//", expect=1)
    assert "both" in r.stderr and not os.path.exists(clash), r.stderr
    r = merge(src, "-o", clash, "--rename", "s/(/x/", expect=2)
    assert "does not compile" in r.stderr, r.stderr


def test_export_cases():
    """What users report against consolidations to safetensors: int, uint8 and bool tensors keep
    their dtypes; tied weights (two names, one storage) are each written whole, and said."""
    emb = torch.randn(6, 4)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.ids": torch.tensor([1, -2], dtype=torch.int32),
             "model.bytes": torch.arange(5, dtype=torch.uint8), "model.mask": torch.tensor([True, False, True]),
             "model.steps": torch.tensor([7], dtype=torch.int64)}
    src = os.path.join(work, "tied.pt")
    torch.save(state, src)
    out = os.path.join(work, "tied.safetensors")
    r = subprocess.run([a.merge, src, "-o", out], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "'model.embed_tokens.weight', 'lm_head.weight' share one storage (tied weights): each is written whole" in r.stderr, r.stderr
    _, tensors = read_safetensors(out)
    want_dtype = {"model.ids": "I32", "model.bytes": "U8", "model.mask": "BOOL", "model.steps": "I64"}
    assert set(tensors) == set(state), sorted(tensors)
    for k, v in state.items():
        dt, shape, b = tensors[k]
        assert dt == want_dtype.get(k, "F32") and shape == list(v.shape) and b == raw(v), k


def test_safetensors_sharded():
    src = fixture(4)
    out = os.path.join(work, "sharded")
    merge(src, "-o", out, "--max-shard-size", "200B")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 1 and all(f.startswith("model-") and f"-of-{len(files):05d}" in f for f in files), files
    want = dcp_oracle.load_113(torch, src)
    # torch 1.13 stores flat FQNs: the first component is the top-level key, so the output holds
    # the tensors under 'model', named by the rest, as for a torch 2.x checkpoint (issue 28 item 9)
    assert any(not k.startswith("model.") for k, v in want.items() if isinstance(v, torch.Tensor))
    tensors = {k[len("model."):]: v for k, v in want.items() if isinstance(v, torch.Tensor) and k.startswith("model.")}
    assert sorted(index["weight_map"]) == sorted(tensors), "the index must list every model tensor once"
    seen = {}
    for f in files:
        _, ts = read_safetensors(os.path.join(out, f))
        for k, (dt, shape, b) in ts.items():
            assert k not in seen and index["weight_map"][k] == f, k
            seen[k] = b
            assert dt == ST[tensors[k].dtype] and shape == list(tensors[k].shape) and b == raw(tensors[k]), k
    assert index["metadata"]["total_size"] == sum(len(b) for b in seen.values())


def test_hdf5():
    # Read back with h5py (Debian's python3-h5py) and h5dump, not with our reader.
    import h5py
    import numpy
    for src, want in [(fixture(4), dcp_oracle.load_113(torch, fixture(4))), (our_sample(3), None)]:
        out = os.path.join(work, os.path.basename(src) + ".h5")
        merge(src, "-o", out)
        if want is None:
            dcp_oracle.install_2x_stubs()
            want, _ = dcp_oracle.python_read(torch, src)
            # the sample's planner_data puts model.embed.weight at ("model", "embed.weight")
            assert "embed.weight" in h5py.File(out)["model"], "groups must follow planner_data"
            want = {"model/embed.weight" if k == "model.embed.weight" else k: v for k, v in want.items()}
        f = h5py.File(out, "r")
        seen = []
        f.visititems(lambda name, obj: seen.append(name) if isinstance(obj, h5py.Dataset) else None)
        tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
        assert sorted(seen) == sorted(tensors), sorted(set(seen) ^ set(tensors))
        for k, v in tensors.items():
            ds = f[k]
            assert ds.attrs["dtype"].decode() == str(v.dtype).split(".")[1], (k, ds.attrs["dtype"])
            assert list(ds.attrs["shape"]) == list(v.shape) and ds.shape == tuple(v.shape), k
            arr = numpy.asarray(ds[()])
            if v.dtype == torch.bfloat16:
                assert arr.dtype == numpy.uint16, arr.dtype
                got = torch.from_numpy(arr.copy().reshape(-1).view(numpy.int16)).view(torch.bfloat16)
            elif v.dtype == torch.bool:
                assert arr.dtype == numpy.uint8, arr.dtype
                got = torch.from_numpy(arr.copy().reshape(-1)).to(torch.bool)
            else:
                got = torch.from_numpy(arr.copy().reshape(-1))
            dcp_oracle.same(torch, got.reshape(v.shape), v, k)
        r = subprocess.run(["h5dump", "-H", out], capture_output=True, text=True)
        assert r.returncode == 0 and "DATASET" in r.stdout, r.stderr


def test_filters():
    src = fixture(2)
    out = os.path.join(work, "filtered.pt")
    merge(src, "-o", out, "--include", "model.*", "--exclude", "*.bias")
    got = load(out)
    full = dcp_oracle.load_113(torch, src)
    assert list(got) == [k for k in full if k.startswith("model.") and not k.endswith(".bias")], list(got)
    merge(src, "-o", out, "--force", "--exclude", "optim.*")
    assert list(load(out)) == [k for k in full if not k.startswith("optim.")]
    src2 = our_sample(2)
    out2 = os.path.join(work, "model_only.pt")
    merge(src2, "-o", out2, "--model-only")
    assert list(load(out2)) == ["model"], list(load(out2))
    # torch 1.13 stores flat FQNs: their first component is the top-level key (issue 28 item 9)
    merge(src, "-o", out, "--force", "--model-only")
    assert list(load(out)) == [k for k in full if k.startswith("model.")], list(load(out))


def leaves(tree, prefix=""):
    """{dotted path: tensor} of a nested state dict."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for k, v in items:
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[name] = v
        else:
            out.update(leaves(v, name))
    return out


def test_cast_scope():
    # --dtype casts the model's floating tensors only; optimizer state keeps its dtype unless
    # --cast-include names it (issue 28 item 6). Checked against Tensor.to on an uncast merge.
    src = our_sample(2)
    plain, cast, wide = (os.path.join(work, f"scope_{n}.pt") for n in ("plain", "cast", "wide"))
    merge(src, "-o", plain)
    merge(src, "-o", cast, "--dtype", "bf16")
    merge(src, "-o", wide, "--dtype", "bf16", "--cast-include", "optim.*")
    tree = load(plain)
    ref, got, got_wide = leaves(tree), leaves(load(cast)), leaves(load(wide))
    assert sorted(ref) == sorted(got) == sorted(got_wide)
    floats = {k for k, t in ref.items() if t.is_floating_point()}
    # the model's: under the top-level key 'model' (the sample also has top-level keys such as
    # 'model.head.weight', a flat state dict's, which are not under it)
    under_model = set(leaves(tree["model"], "model"))
    assert under_model & floats and floats - under_model and any(k.startswith("optim.") for k in floats), sorted(floats)
    for k, t in ref.items():
        model = k in under_model and k in floats
        dcp_oracle.same(torch, got[k], t.to(torch.bfloat16) if model else t, k)  # bytes: the sample holds NaNs
        dcp_oracle.same(torch, got_wide[k], t.to(torch.bfloat16) if k in floats and (model or k.startswith("optim.")) else t, k)


def test_refusals():
    src = fixture(2)
    out = os.path.join(work, "exists.pt")
    open(out, "wb").write(b"keep me")
    r = merge(src, "-o", out, expect=1)
    assert "exists" in r.stderr and open(out, "rb").read() == b"keep me", r.stderr
    d = os.path.join(work, "dry")
    os.makedirs(d)
    r = merge(src, "-o", os.path.join(d, "x.pt"), "--dry-run")
    assert os.listdir(d) == [] and "model.embed.weight" in r.stdout, r.stdout


def test_late_failure_leaves_nothing():
    # A compressed item is decoded while copying: corrupt one in the middle of the last file.
    src = os.path.join(work, "corrupt")
    shutil.copytree(our_sample(2, "zstd"), src)
    last = sorted(f for f in os.listdir(src) if f.endswith(".distcp"))[-1]
    p = os.path.join(src, last)
    data = bytearray(open(p, "rb").read())
    mid = len(data) // 2
    data[mid:mid + 64] = b"\xff" * 64
    open(p, "wb").write(bytes(data))
    outdir = os.path.join(work, "late")
    os.makedirs(outdir)
    r = merge(src, "-o", os.path.join(outdir, "x.pt"), expect=1)
    assert "error" in r.stderr and os.listdir(outdir) == [], (r.stderr, os.listdir(outdir))
    # and a missing file
    src2 = os.path.join(work, "missing")
    shutil.copytree(fixture(4), src2)
    os.remove(os.path.join(src2, "__2_0.distcp"))
    r = merge(src2, "-o", os.path.join(outdir, "y.pt"), expect=1)
    assert "__2_0.distcp" in r.stderr and os.listdir(outdir) == [], r.stderr
    r = merge(src2, "-o", os.path.join(outdir, "y.safetensors"), expect=1)
    assert os.listdir(outdir) == [], os.listdir(outdir)


def test_interrupt():
    # SIGINT or SIGTERM while copying: the tool stops, removes its temporary file, exits 130.
    import signal
    import time
    src = our_sample(3)
    for sig in (signal.SIGINT, signal.SIGTERM):
        outdir = os.path.join(work, f"interrupted_{int(sig)}")
        os.makedirs(outdir)
        env = dict(os.environ, FSDP_TEST_COPY_DELAY_MS="100")
        p = subprocess.Popen([a.merge, "-q", "-j", "1", src, "-o", os.path.join(outdir, "x.pt")], env=env,
                             stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 20
        while not leftovers(outdir) and time.time() < deadline and p.poll() is None:
            time.sleep(0.01)
        assert leftovers(outdir), "the copy never started"
        p.send_signal(sig)
        err = p.communicate(timeout=30)[1]
        assert p.returncode == 130 and "interrupted" in err, (p.returncode, err)
        assert os.listdir(outdir) == [], os.listdir(outdir)


def test_progress_bar_on_a_terminal():
    # With stderr on a terminal: the bar names bytes done and total, and gives no rate before
    # half a second has passed (no "0 MB/s" frame); interrupted, it clears its line before the
    # error, which starts on a clean line.
    import pty
    import signal
    import time
    src = our_sample(3)
    outdir = os.path.join(work, "bar")
    os.makedirs(outdir)
    master, slave = pty.openpty()
    env = dict(os.environ, FSDP_TEST_COPY_DELAY_MS="100")
    p = subprocess.Popen([a.merge, "-j", "1", src, "-o", os.path.join(outdir, "x.pt")], env=env, stdout=subprocess.DEVNULL,
                         stderr=slave)
    os.close(slave)
    seen = b""
    deadline = time.time() + 20
    while b"MB/s" not in seen and time.time() < deadline:
        seen += os.read(master, 4096)
    p.send_signal(signal.SIGINT)
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the other side closed
            break
        if not chunk:
            break
        seen += chunk
    p.wait(timeout=30)
    os.close(master)
    text = seen.decode(errors="replace")
    frames = [f for f in text.split("\r") if f.startswith("copying [")]
    assert frames and all(" / " in f and ("B" in f) for f in frames), text
    assert "0 MB/s" not in frames[0] and "MB/s" not in frames[0], frames[0]  # the first frame, at 0 s
    assert any("MB/s" in f and " left" in f for f in frames), frames
    at = text.index("fsdp-ckpt-merge: error:")
    assert text[:at].endswith("\r\x1b[K"), repr(text[max(0, at - 80):at + 40])
    assert p.returncode == 130, p.returncode


if not a.merge:
    print("FAIL: --merge (the fsdp-ckpt-merge binary) is required")
    sys.exit(1)
check("1.13 DCP, 2 Gloo ranks: merge == torch 1.13 load_state_dict into full tensors", test_113(2))
check("1.13 DCP, 4 Gloo ranks (dim-1 chunks, a rank without a chunk): merge == torch 1.13 load_state_dict", test_113(4))
check("our 2.x-layout DCP, 3 ranks: merge == dcp_to_torch_save's nesting of torch.load'ed items", test_2x(3, "none"))
check("our 2.x-layout DCP, 2 ranks, stream.zstd/1 items: merge == PyTorch's merge", test_2x(2, "zstd"))
check("Lightning folder: meta.pt keys merged in last, replacing in place, as consolidate_checkpoint does", test_lightning)
check("--layout flat: {fqn: value}", test_flat)
check("torch.save input: str-keyed nesting kept (and --model-only), else every entry flat", test_torch_save_input)
if os.path.isdir(a.shared):
    check("real torch 2.4 Megatron checkpoint: merge == PyTorch's merge", test_megatron)
else:
    skip("real torch 2.4 Megatron checkpoint", f"{a.shared} is absent (the shared real-checkpoint folder)")
check("--dtype bf16/fp16/fp32/fp64 == Tensor.to() bit for bit; integer tensors untouched", test_casts)
check("--dtype on ties, subnormals, overflow, NaN and -0.0 from every float dtype == Tensor.to()", test_casts_special_values)
check("--dtype names each tensor a cast damaged, with torch's counts; --strict-cast refuses", test_cast_damage)
check("items saved with strides (transposed, permuted views): merge gathers them == torch 1.13", test_strided_items)
check("safetensors: the tensors under 'model', named by their path, checked with json/struct", test_safetensors_single)
check("--strip-prefix and --rename: safetensors and --layout flat names == the rules applied to dcp_to_torch_save's; "
      "nested torch, a clash and a bad rule refused", test_renames)
check("export cases: int32, uint8, bool and int64 keep their safetensors dtypes; tied weights each written whole, "
      "and said", test_export_cases)
check("safetensors --max-shard-size: Hugging Face shards and an index listing every tensor once", test_safetensors_sharded)
check("hdf5: one dataset per tensor in groups by key path, read back with h5py and h5dump", test_hdf5)
check("--include/--exclude in order, --model-only (torch 1.13's flat FQNs too)", test_filters)
check("--dtype casts the model's floating tensors only, --cast-include more", test_cast_scope)
check("an existing output is refused without --force; --dry-run writes nothing", test_refusals)
check("a failure found while copying (corrupt zstd item) or before (missing .distcp) leaves nothing", test_late_failure_leaves_nothing)
check("SIGINT/SIGTERM while copying: exit 130, no output, no temporary file", test_interrupt)
check("the progress bar on a terminal: bytes, rate and time left, and a clean line before an error", test_progress_bar_on_a_terminal)
finish()

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""torch.save interop: our writer against torch.load(weights_only=True), our reader against
torch.save's files, and a re-save that must reproduce torch's bytes exactly."""
import collections
import io
import json
import os
import re
import subprocess
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import (args, check, finish, import_torch, probe, probe_json, sample_bytes, skip, tensor_bytes,  # noqa: E402
                    tmpdir)

a = args()
torch = import_torch()
work = tmpdir()


def walk(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def test_float_repr():
    import random
    import struct
    rng = random.Random(7)
    values = [0.003, 1e-05, 0.0001, 0.1, 100.0, 1e15, 1e16, 123456789012345678.0, -0.0, 2.5e-300, 5e-324,
              1.7976931348623157e308, 3.0000000000000004, 1 / 3, float("inf"), float("-inf"), float("nan")]
    values += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(300)]
    values += [rng.uniform(-1e6, 1e6) for _ in range(100)] + [rng.random() * 10 ** rng.randint(-8, 20) for _ in range(100)]
    path = os.path.join(work, "floats.pt")
    torch.save({f"v{i}": v for i, v in enumerate(values)}, path)
    r = subprocess.run([a.inspect, path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[2] for line in r.stdout.splitlines() if re.match(r"v\d+ ", line)}
    bad = [(i, rows.get(f"v{i}"), repr(v)) for i, v in enumerate(values) if rows.get(f"v{i}") != repr(v)]
    assert not bad, bad[:10]


def test_stats_integers_exact():
    big = {"i64": torch.tensor([2**62 + 1, -2**63, 5, 2**53 + 1], dtype=torch.int64),
           "i32": torch.tensor([-2**31, 2**31 - 1], dtype=torch.int32),
           "u8": torch.tensor([0, 255, 7], dtype=torch.uint8), "b": torch.tensor([True, False])}
    path = os.path.join(work, "ints.pt")
    torch.save(big, path)
    r = subprocess.run([a.inspect, "stats", "--json", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = {t["name"]: t for t in json.loads(r.stdout)["tensors"]}
    for name, t in big.items():
        wide = t.to(torch.int64) if t.dtype == torch.bool else t
        want_abs = max(abs(int(x)) for x in wide.tolist())
        assert (got[name]["min"], got[name]["max"], got[name]["max_abs"]) == (int(wide.min()), int(wide.max()), want_abs), (name, got[name])
    text = subprocess.run([a.inspect, "stats", path], capture_output=True, text=True).stdout
    row = next(line.split() for line in text.splitlines() if line.startswith("i64 "))
    assert row[3:5] == [str(-2**63), str(2**62 + 1)] and row[7] == str(2**63), row


def test_values():
    g = torch.Generator().manual_seed(3)
    tensors = {"f32": torch.randn(5, 7, generator=g), "bf16": torch.randn(3, 4, 6, generator=g).to(torch.bfloat16),
               "f16": torch.randn(11, generator=g).to(torch.float16), "f64": torch.randn(2, 3, generator=g, dtype=torch.float64),
               "i64": torch.tensor([[2**62 + 1, -2**63], [7, 0]]), "b": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "c128": torch.tensor([1 + 2j, -0.5 - 1j], dtype=torch.complex128)}
    path = os.path.join(work, "values.pt")
    torch.save(tensors, path)
    # The same tensors resharded to 3 ranks: values put together from several chunks.
    dcp = os.path.join(work, "values_dcp")
    r = subprocess.run([a.shard, "-q", path, "-o", dcp, "-n", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for src in (path, dcp):
        for name, t in tensors.items():
            want = t.flatten().tolist()
            if t.dtype in (torch.bfloat16, torch.float16):
                want = t.float().flatten().tolist()
            for count in (None, 4):
                args = [a.inspect, "--json", "--tensor", name, src, "--values"] + ([str(count)] if count else [])
                r = subprocess.run(args, capture_output=True, text=True)
                assert r.returncode == 0, (args, r.stderr)
                got = json.loads(r.stdout)["entries"][0]["values"]
                expect = want if count is None else want[:count]
                if t.is_complex():
                    assert got == [repr(complex(x)) for x in expect], (src, name, got)
                else:
                    assert got == expect, (src, name, count, got, expect)
    text = subprocess.run([a.inspect, "--tensor", "f32", path, "--values", "10"], capture_output=True, text=True).stdout
    assert "values: the first 10 of 35, in C order" in text, text
    import numpy
    first = [str(x) for x in tensors["f32"].numpy().flatten()[:7]]  # numpy's shortest float32 digits
    lines = [l for l in text.splitlines() if l.startswith("    [")]
    assert lines[0] == "    [0, 0]  " + " ".join(first), (lines[0], first)
    assert [l.split()[0:2] for l in lines] == [["[0,", "0]"], ["[1,", "0]"]], lines  # a row, then the next row's start
    r = subprocess.run([a.inspect, path, "--values", "3"], capture_output=True, text=True)
    assert r.returncode == 2 and "--values: needs --tensor" in r.stderr, r.stderr


def test_our_sample_loads_weights_only():
    out = os.path.join(work, "sample.pt")
    probe(a, "write-sample", out)
    manifest = __import__("json").load(open(out + ".json"))
    obj = torch.load(out, weights_only=True)
    storages = {}
    for t in manifest["tensors"]:
        path = [int(k) if isinstance(k, int) else k for k in t["path"]]
        v = walk(obj, path)
        assert isinstance(v, torch.Tensor), f"{path}: {type(v)}"
        assert str(v.dtype) == "torch." + t["dtype"], f"{path}: dtype {v.dtype}, wanted {t['dtype']}"
        assert list(v.shape) == t["shape"], f"{path}: shape {list(v.shape)} != {t['shape']}"
        assert list(v.stride()) == t["stride"], f"{path}: stride {v.stride()} != {t['stride']}"
        assert v.storage_offset() == t["offset"], f"{path}: storage_offset {v.storage_offset()}"
        assert isinstance(v, torch.nn.Parameter) == t["parameter"], f"{path}: Parameter? {type(v)}"
        st = manifest["storages"][t["storage"]]
        storage = v.storage()
        raw = bytes(storage._untyped()) if hasattr(storage, "_untyped") else bytes(storage.untyped())
        want = sample_bytes(t["storage"], st["nbytes"], st["dtype"] == "bool")
        assert raw == want, f"{path}: storage bytes differ"
        storages.setdefault(t["storage"], set()).add(storage.data_ptr())
    for s, ptrs in storages.items():
        assert len(ptrs) == 1, f"storage {s} is not shared after loading"
    for k in manifest["kinds"]:
        v = walk(obj, k["path"])
        want = {"OrderedDict": collections.OrderedDict, "list": list, "tuple": tuple, "dict": dict}[k["type"]]
        assert type(v) is want, f"{k['path']}: {type(v).__name__}, wanted {k['type']}"
    for sc in manifest["scalars"]:
        v = walk(obj, sc["path"])
        assert v == sc["value"] and type(v) is type(sc["value"]), f"{sc['path']}: {v!r} != {sc['value']!r}"
    assert "\u00e9pique/\u043a\u043b\u044e\u0447" in obj


def torch_files():
    """Files torch.save writes, covering what our reader must understand."""
    g = torch.Generator().manual_seed(0)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    longs = torch.arange(10, dtype=torch.int64)
    files = {}
    files["dtypes.pt"] = {
        n: (torch.randn(3, 2, generator=g) * 100).to(dt)
        for n, dt in [("f32", torch.float32), ("f64", torch.float64), ("f16", torch.float16),
                      ("bf16", torch.bfloat16), ("i64", torch.int64), ("i32", torch.int32),
                      ("i16", torch.int16), ("i8", torch.int8), ("u8", torch.uint8), ("bool", torch.bool),
                      ("c64", torch.complex64), ("c128", torch.complex128)]}
    files["views.pt"] = {"base": base, "t": base.t(), "slice": base[1:, 2:5], "step": longs[1::3],
                         "tail": longs[4:], "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
                         "expanded_row": base[2]}
    lin = torch.nn.Linear(3, 2)
    files["module.pt"] = {"model": lin.state_dict(), "param": torch.nn.Parameter(torch.ones(2)),
                          "frozen": torch.nn.Parameter(torch.zeros(3), requires_grad=False),
                          "epoch": 4, "lr": 0.5, "name": "run", "tags": ["a", "b"], "pair": (1, 2.5),
                          "\u00e9t\u00e9": torch.tensor([1, 2], dtype=torch.int32), "nothing": None}
    files["shared.pt"] = [base, base[0], {"again": base}]
    files["archive_name.tar.gz"] = {"w": torch.ones(2, 2)}
    return files


def compare_reader(path, obj):
    dump = probe_json(a, "dump-torch", path)
    seen = {}
    for t in dump["tensors"]:
        seen[t["name"]] = t

    def visit(v, name):
        if isinstance(v, torch.Tensor):
            t = seen.get(name)
            assert t is not None, f"{path}: our reader lists no tensor '{name}' (it has {sorted(seen)})"
            assert "torch." + t["dtype"] == str(v.dtype), f"{name}: {t['dtype']} vs {v.dtype}"
            assert t["shape"] == list(v.shape), f"{name}: shape"
            assert t["stride"] == list(v.stride()), f"{name}: stride"
            assert t["storage_offset"] == v.storage_offset(), f"{name}: offset"
            assert t["is_parameter"] == isinstance(v, torch.nn.Parameter), f"{name}: parameter"
            assert t["requires_grad"] == v.requires_grad, f"{name}: requires_grad"
            assert bytes.fromhex(t["hex"]) == tensor_bytes(torch, v), f"{name}: values differ"
            return 1
        n = 0
        if isinstance(v, dict):
            for k, x in v.items():
                n += visit(x, f"{name}.{k}" if name else str(k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                n += visit(x, f"{name}.{i}" if name else str(i))
        return n

    n = visit(obj, "")
    assert n == len(dump["tensors"]) or path.endswith("shared.pt"), f"{path}: {len(dump['tensors'])} tensors listed, torch has {n}"
    return dump


def test_reader_on_torch_files():
    for fname, obj in torch_files().items():
        path = os.path.join(work, fname)
        torch.save(obj, path)
        dump = compare_reader(path, torch.load(path))
        if fname == "archive_name.tar.gz":
            assert dump["archive_name"] == "archive_name.tar", dump["archive_name"]
        if fname == "shared.pt":
            keys = {t["storage"] for t in dump["tensors"]}
            assert len(keys) == 1, f"shared storage split into {keys}"


def test_resave_is_byte_identical_to_torch():
    # torch 1.13 writes data.pkl, data/*, version; our writer in that layout, given the tree we
    # read, must reproduce the file byte for byte (pickle, zip headers, padding, CRCs, end records).
    files = torch_files()
    # a quantized tensor: not listed as a tensor by our reader, but its storage must survive a re-save
    files["quantized.pt"] = {"q": torch.quantize_per_tensor(torch.arange(4.0), 0.5, 2, torch.qint8), "w": torch.ones(2)}
    for fname, obj in files.items():
        src = os.path.join(work, "ident_" + fname)
        buf = io.BytesIO()
        torch.save(obj, buf)  # a stream: archive name 'archive'
        open(src, "wb").write(buf.getvalue())
        out = src + ".ours"
        probe(a, "resave", src, out, "1.13", "archive")
        mine, theirs = open(out, "rb").read(), buf.getvalue()
        if mine != theirs:
            at = next((i for i in range(min(len(mine), len(theirs))) if mine[i] != theirs[i]), min(len(mine), len(theirs)))
            raise AssertionError(f"{fname}: our bytes differ from torch.save's at offset {at} "
                                 f"(sizes {len(mine)} vs {len(theirs)})")


def test_resave_current_layout_loads_weights_only():
    for fname, obj in torch_files().items():
        if fname == "module.pt":
            continue  # holds Python floats, which torch 1.13's weights_only refuses (BINFLOAT)
        src = os.path.join(work, "cur_" + fname)
        torch.save(obj, src)
        out = src + ".ours"
        probe(a, "resave", src, out, "current", "archive")
        back = torch.load(out, weights_only=True)
        compare_reader(out, back)
        compare_reader(src, back)


def test_module_file_float_free_parts_weights_only():
    # module.pt has floats (lr, a tuple member): prove weights_only on a float-free copy instead.
    obj = torch_files()["module.pt"]
    del obj["lr"], obj["pair"]
    src = os.path.join(work, "nofloat.pt")
    torch.save(obj, src)
    out = src + ".ours"
    probe(a, "resave", src, out, "current", "archive")
    compare_reader(out, torch.load(out, weights_only=True))


def test_committed_fixture():
    path = os.path.join(a.testdata, "torch_save", "tiny_state_dict.pt")
    compare_reader(path, torch.load(path))


def test_real_torchtune_checkpoint():
    path = os.path.join(a.shared, "pytorch__torchtune__tiny-fair-checkpoint", "tiny_fair_checkpoint.pt")
    dump = compare_reader(path, torch.load(path))
    assert len(dump["tensors"]) == 21, len(dump["tensors"])
    assert "byteorder" in dump["records"]


def legacy_files():
    """torch_files() as torch.save writes them in the legacy format (_legacy_save: pickles, then the
    storages), and one as Python 2 pickled it: its str keys SHORT_BINSTRING, not BINUNICODE."""
    files = {}
    for fname, obj in torch_files().items():
        path = os.path.join(work, "legacy_" + fname)
        torch.save(obj, path, _use_new_zipfile_serialization=False)
        files[path] = obj
    import pickletools
    src = os.path.join(work, "legacy_module.pt")
    data = open(src, "rb").read()
    pos, py2 = 0, bytearray()
    for _ in range(5):  # magic, protocol, system info, object, storage keys
        ops = list(pickletools.genops(data[pos:]))
        end = pos + ops[-1][2] + 1
        chunk = data[pos:end]
        for i, (op, arg, at) in enumerate(ops):
            nxt = ops[i + 1][2] if i + 1 < len(ops) else len(chunk)
            if op.name == "BINUNICODE" and arg.isascii() and len(arg) < 256:
                py2 += b"U" + bytes([len(arg)]) + arg.encode("ascii")
            else:
                py2 += chunk[at:nxt]
        pos = end
    py2 += data[pos:]
    path = os.path.join(work, "legacy_py2.pt")
    open(path, "wb").write(bytes(py2))
    assert b"U\x05model" in py2 and torch.load(path)["model"].keys() == files[src]["model"].keys()
    files[path] = files[src]
    return files


def test_legacy_files():
    """Legacy files read as torch.load reads them; merged into each output format, verified, and
    a merge loads in torch equal to torch.load of the legacy file."""
    files = legacy_files()
    for path, obj in files.items():
        dump = compare_reader(path, torch.load(path))
        if path.endswith("shared.pt"):
            assert len({t["storage"] for t in dump["tensors"]}) == 1, "shared storage split"
        r = subprocess.run([a.inspect, "verify", path], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    path = os.path.join(work, "legacy_module.pt")
    r = subprocess.run([a.inspect, "--json", path], capture_output=True, text=True)
    assert r.returncode == 0 and "legacy format" in __import__("json").loads(r.stdout)["writer"], r.stdout[-300:] + r.stderr
    for src in (path, os.path.join(work, "legacy_py2.pt"), os.path.join(work, "legacy_dtypes.pt")):
        want = torch.load(src)
        merged = src + ".merged.pt"
        r = subprocess.run([a.merge, src, "-o", merged, "-q"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        got = torch.load(merged)
        # merge names a torch.save file's leaves by their keys joined with '.'
        flat = {}

        def flatten(v, name):
            if isinstance(v, dict):
                for k, x in v.items():
                    flatten(x, f"{name}.{k}" if name else str(k))
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    flatten(x, f"{name}.{i}")
            else:
                flat[name] = v
        flatten(want, "")
        assert sorted(got) == sorted(flat), (list(got), list(flat))  # tensors first, then the other leaves
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                assert got[k].dtype == v.dtype and tensor_bytes(torch, got[k]) == tensor_bytes(torch, v), k
            else:
                assert got[k] == v, k
        for fmt in ("safetensors", "h5"):
            out = src + ".merged." + fmt
            # complex tensors: safetensors has no dtype for them
            r = subprocess.run([a.merge, src, "-o", out, "-q", "--exclude", "c64", "--exclude", "c128"], capture_output=True, text=True)
            if fmt == "h5" and r.returncode != 0 and "HDF5 is not available" in r.stderr:
                continue
            assert r.returncode == 0, r.stderr
            d = subprocess.run([a.inspect, "diff", src, out, "--exclude", "c64", "--exclude", "c128"], capture_output=True, text=True)
            assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr


def test_huggingface_folders():
    """A model folder as transformers' save_pretrained(safe_serialization=False) shards it:
    pytorch_model-0000s-of-00002.bin files of the state dict's tensors and pytorch_model.bin.index.json
    ({"metadata": {"total_size"}, "weight_map"}, indented by 2 with sorted keys). Read as one
    checkpoint, every tensor equal to torch.load of its shard; merged to safetensors and compared;
    that file as a folder's model.safetensors; an index that names the wrong shard is refused."""
    import json
    torch.manual_seed(3)
    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4),
             "model.norm.weight": torch.ones(4).to(torch.bfloat16), "lm_head.weight": torch.randn(8, 4)}
    folder = os.path.join(work, "hf_bin")
    os.makedirs(folder, exist_ok=True)
    names = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[:2], "pytorch_model-00002-of-00002.bin": names[2:]}
    weight_map = {}
    for f, keys in shards.items():
        torch.save({k: state[k] for k in keys}, os.path.join(folder, f))
        weight_map.update({k: f for k in keys})
    total = sum(v.numel() * v.element_size() for v in state.values())
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    ours = probe_json(a, "dump-checkpoint", folder)
    assert {t["name"] for t in ours["tensors"]} == set(state), sorted(t["name"] for t in ours["tensors"])
    for t in ours["tensors"]:
        v = torch.load(os.path.join(folder, weight_map[t["name"]]))[t["name"]]
        assert "torch." + t["dtype"] == str(v.dtype) and t["shape"] == list(v.shape), t["name"]
        assert bytes.fromhex(t["hex"]) == tensor_bytes(torch, v), f"{t['name']}: values differ from torch.load of its shard"
    r = subprocess.run([a.inspect, "--json", folder], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["format"] == "torch-save-index", r.stdout[-500:] + r.stderr
    merged = os.path.join(work, "hf_bin.safetensors")
    r = subprocess.run([a.merge, folder, "-o", merged], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = subprocess.run([a.inspect, "diff", folder, merged], capture_output=True, text=True)
    assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr
    st_folder = os.path.join(work, "hf_st")
    os.makedirs(st_folder, exist_ok=True)
    shutil.copyfile(merged, os.path.join(st_folder, "model.safetensors"))
    d = subprocess.run([a.inspect, "diff", folder, st_folder], capture_output=True, text=True)
    assert d.returncode == 0 and "0 differ" in d.stdout, d.stdout + d.stderr
    # The index names lm_head in the first shard, which does not hold it.
    weight_map["lm_head.weight"] = "pytorch_model-00001-of-00002.bin"
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    r = probe(a, "dump-checkpoint", folder, expect_ok=False)
    assert r.returncode == 1 and "weight_map names 'lm_head.weight' in pytorch_model-00001-of-00002.bin, which does not hold it" in r.stderr, r.stderr


def test_shared_containers():
    """torch.optim's state_dict() with two groups pickles one betas tuple, shared by both groups (a
    memo GET): it is listed under each group, and a merge keeps both. Shared lists nested 40 deep
    (2^40 paths) are refused, quickly and in little memory, instead of listed without end."""
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}])
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["betas"] is sd["param_groups"][1]["betas"]  # what makes the pickle share it
    path = os.path.join(work, "two_groups.pt")
    torch.save({"model": m.state_dict(), "optimizer": sd}, path)
    r = subprocess.run([a.inspect, "--json", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    names = {e["name"] for e in __import__("json").loads(r.stdout)["entries"]}
    for g in (0, 1):
        for i in (0, 1):
            assert f"optimizer.param_groups.{g}.betas.{i}" in names, sorted(n for n in names if "betas" in n)
    out = os.path.join(work, "two_groups_merged.pt")
    r = subprocess.run([a.merge, path, "-o", out, "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    merged = torch.load(out)
    for g, group in enumerate(sd["param_groups"]):
        for k, v in group.items():
            got = [merged[f"optimizer.param_groups.{g}.{k}.{i}"] for i in range(len(v))] if isinstance(v, (list, tuple)) \
                else merged[f"optimizer.param_groups.{g}.{k}"]
            assert got == list(v) if isinstance(v, (list, tuple)) else got == v, (g, k, got, v)
    x = [1]
    for _ in range(40):
        x = [x, x]
    bomb = os.path.join(work, "shared_40_deep.pt")
    torch.save(x, bomb)
    r = subprocess.run(["/usr/bin/time", "-f", "%M", a.inspect, bomb], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "shared containers are reached by so many paths" in r.stderr, r.stderr
    assert int(r.stderr.strip().splitlines()[-1]) < 768 * 1024, r.stderr  # peak RSS in KiB


check("floats print as Python's repr prints them (the shortest digits that read back)", test_float_repr)
check("stats gives integer tensors' min, max and max-abs exactly, as torch computes them", test_stats_integers_exact)
check("inspect --tensor --values: torch's values, from a torch.save file and from its reshard's chunks", test_values)
check("our writer's sample loads with torch.load(weights_only=True)", test_our_sample_loads_weights_only)
check("shared containers (torch.optim's betas) are listed under each path; 2^40 paths are refused", test_shared_containers)
check("our reader agrees with torch.load on torch.save files", test_reader_on_torch_files)
check("re-saving a torch.save file reproduces torch's bytes", test_resave_is_byte_identical_to_torch)
check("re-saved files (current layout) load with weights_only=True", test_resave_current_layout_loads_weights_only)
check("float-free parts of a module checkpoint load with weights_only=True", test_module_file_float_free_parts_weights_only)
if os.path.exists(os.path.join(a.testdata, "torch_save", "tiny_state_dict.pt")):
    check("committed fixture agrees with torch.load", test_committed_fixture)
else:
    check("committed fixture exists", lambda: (_ for _ in ()).throw(AssertionError("testdata/torch_save/tiny_state_dict.pt missing")))
if os.path.isdir(os.path.join(a.shared, "pytorch__torchtune__tiny-fair-checkpoint")):
    check("real torchtune checkpoint agrees with torch.load", test_real_torchtune_checkpoint)
else:
    skip("real torchtune checkpoint", f"{a.shared} is absent (the shared real-checkpoint folder)")
check("legacy (pre-1.6, non-zip) torch.save files, Python 3 and Python 2 pickles: read as torch.load reads them, "
      "verified, merged to torch.save (equal to torch.load), safetensors and HDF5", test_legacy_files)
check("Hugging Face folders (sharded pytorch_model.bin with its index; model.safetensors): ours == torch.load of each shard, "
      "merged and diffed", test_huggingface_folders)
finish()

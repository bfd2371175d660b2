#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""fsdp-train end to end, against PyTorch (python3-torch) where a claim is about PyTorch:
- the merged model of a training checkpoint loads with torch.load(weights_only=True) into the same
  GPT defined in PyTorch (tests/train/gpt.py), whose loss on the next step's batch equals ours;
- one step of torch.optim.AdamW (clip_grad_norm_ first), started from the checkpoint's model and
  optimizer state, lands on our next checkpoint's parameters;
- the same global batch gives the same loss curve at 1 rank x 8 and 2 ranks x 4 (FULL_SHARD and
  SHARD_GRAD_OP), and 4 ranks x 2 as HYBRID_SHARD on a 2 x 2 mesh (its checkpoint resumed by
  FULL_SHARD);
- 20 steps straight equal 10 steps plus a resume for 10 more, at 2 ranks, and at 1 and 4;
- --model-script: a GPT that PyTorch scripted trains from its own values (our first loss is
  PyTorch's), follows the same curve at 1 x 8 and 2 x 4, and its checkpoint loads into the script;
- launching by --nproc and by environment variables (torchrun's and SLURM's), a killed rank, SIGTERM, `latest` skipping an
  incomplete or damaged checkpoint, SIGKILL at every step of a save, bad data; under PyTorch's own torchrun too."""
import argparse
import filecmp
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "interop"))
from common import check, finish, import_torch, tmpdir  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--train", required=True)
p.add_argument("--merge", required=True)
p.add_argument("--inspect", required=True)
p.add_argument("--text", required=True)
p.add_argument("--probe", help="ckpt_probe: also hold the direct .metadata reader to the tree reader's index")
p.add_argument("--python-dir", help="BUILD/python: also merge with fsdp_tools.merge(), as the tool does")
a = p.parse_args()
torch = import_torch()
sys.path.insert(0, os.path.dirname(__file__))
import gpt  # noqa: E402

work = tmpdir()
SHAPE = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=256)
BASE = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "32", "--lr", "3e-3", "--warmup", "3",
        "--timeout", "60", "-q"]
SEED = 1337


def train(*extra, nproc=None, env=None, expect=0, quiet=True):
    data = [] if "--data" in extra else ["--data", a.text]
    base = BASE if quiet else [x for x in BASE if x != "-q"]
    cmd = [a.train, *base, *data, *extra] + (["--nproc", str(nproc)] if nproc else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == expect, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def losses(path):
    return {j["step"]: j["loss"] for j in map(json.loads, open(path)) if "loss" in j}


def merged(ckpt, name, model_only=False):
    out = os.path.join(work, name)
    r = subprocess.run([a.merge, ckpt, "-o", out, "--force"] + (["--model-only"] if model_only else []),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def verify_deep(path):
    return subprocess.run([a.inspect, "verify", "--deep", path], capture_output=True, text=True)


def verified(path):
    v = verify_deep(path)
    assert v.returncode == 0, v.stdout + v.stderr
    if a.probe and os.path.isfile(os.path.join(path, ".metadata")):
        # What fsdp-train writes is read by the direct reader (NOTE [The direct .metadata reader]),
        # into the very index the tree reader builds.
        r = subprocess.run([a.probe, "readers", path], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def close(x, y, rel):
    return abs(x - y) <= rel * max(abs(x), abs(y), 1e-12)


NO_DECAY = ("*.bias", "*norm*", "*ln_*")  # fsdp-train's default --no-decay


def decay_groups(model, frozen=()):
    """nanoGPT's groups, as fsdp-train makes them: 2-d and larger decay unless --no-decay names them;
    frozen parameters in neither."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        if name in frozen:
            continue
        (decay if p.dim() >= 2 and not any(fnmatch.fnmatchcase(name, g) for g in NO_DECAY) else rest).append(name)
    return decay, rest


def pytorch_equivalence(tied=False, freeze=(), nproc_last=1):
    """Steps 1-6 at 2 ranks, step 7 at `nproc_last` ranks (a global batch of 4 per rank, 8 at one):
    the step-6 checkpoint loaded into PyTorch's GPT and torch.optim.AdamW, built with the
    checkpoint's two param_groups (decay and no-decay), takes step 7 to our step-7 parameters;
    frozen parameters are in no group and unchanged."""
    extra = (("--tie-weights",) if tied else ()) + tuple(a for g in freeze for a in ("--freeze", g))
    d = os.path.join(work, "eq-tied" if tied else "eq-frozen" if freeze else "eq")
    train("--steps", "8", "--stop-at-step", "6", "--batch-size", "4", "--ckpt-dir", d, *extra, nproc=2)
    ck6 = os.path.join(d, "step-00000006")
    verified(ck6)
    log = d + ".jsonl"
    per_rank = 8 if nproc_last == 1 else 4
    train("--steps", "8", "--stop-at-step", "7", "--batch-size", str(per_rank), "--ckpt-dir", d, "--resume", "latest",
          "--log-jsonl", log, *extra, nproc=nproc_last if nproc_last > 1 else None)
    ours = losses(log)[7]
    # The model part holds no Python floats, so PyTorch's restricted loader takes it.
    state = torch.load(merged(ck6, os.path.basename(d) + "6-model.pt", model_only=True), weights_only=True)["model"]
    model = gpt.gpt(**SHAPE, tie_weights=tied)
    model.load_state_dict(state, strict=True)
    if tied:  # both names saved, one value (PyTorch's state dict of a tied model has both)
        assert torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])
        assert model.head.lm_head.weight is model.embed.wte.weight
    frozen = [n for n, _ in model.named_parameters() if any(fnmatch.fnmatchcase(n, g) for g in freeze)]
    assert bool(frozen) == bool(freeze), frozen
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    tokens, train_end = gpt.text_tokens(a.text)
    x, y = gpt.batch(tokens, train_end, SEED, 7, 0, per_rank * nproc_last, SHAPE["block_size"])
    theirs = gpt.loss(model, x, y)
    assert close(theirs.item(), ours, 1e-5), f"PyTorch's loss {theirs.item()!r}, ours {ours!r}"
    # The whole checkpoint (param_groups hold floats, which 1.13's weights_only loader refuses).
    full = torch.load(merged(ck6, os.path.basename(d) + "6.pt"))
    assert full["step"] == 6 and full["config"]["n_embd"] == 32, {k: full[k] for k in ("step", "config")}
    groups = full["optimizer"]["param_groups"]
    # Each parameter once, as torch.optim sees the model (a tied weight under its first name), in
    # nanoGPT's two groups; a frozen one in neither, and without state.
    decay, rest = decay_groups(model, frozen)
    assert [g["params"] for g in groups] == [decay, rest], [g["params"] for g in groups]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0], groups
    assert sorted(full["optimizer"]["state"]) == sorted(decay + rest), sorted(full["optimizer"]["state"])
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [params[n] for n in g["params"]], "weight_decay": g["weight_decay"]} for g in groups],
                            lr=groups[0]["lr"], betas=groups[0]["betas"], eps=groups[0]["eps"])
    for name in decay + rest:
        s = full["optimizer"]["state"][name]
        assert float(s["step"]) == 6.0 and s["exp_avg"].shape == params[name].shape, (name, s["step"], s["exp_avg"].shape)
        opt.state[params[name]] = {"step": s["step"].clone(), "exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone()}
    # param_groups hold the learning rate of the next step, as a LambdaLR's step() leaves it, and
    # the peak as its initial_lr (issue 28 item 10): the optimizer made from them steps as ours did.
    for g in groups:
        assert close(g["lr"], gpt.learning_rate(7, 3e-3, 8, 3), 1e-12) and g["initial_lr"] == 3e-3, g
        assert list(g)[-2:] == ["initial_lr", "params"], list(g)
    # The schedule's state is torch's LambdaLR.state_dict() after 6 steps of the same schedule
    # (epoch e is step e + 1), key for key; a LambdaLR that loads it goes on with our lr.
    for g in opt.param_groups:
        g["initial_lr"] = 3e-3  # the peak, which LambdaLR keeps as each group's base lr
    import warnings
    with warnings.catch_warnings():  # stepped without optimizer.step(): only its state is wanted
        warnings.simplefilter("ignore")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: gpt.learning_rate(e + 1, 3e-3, 8, 3) / 3e-3)
        for _ in range(6):
            sched.step()
    want = sched.state_dict()
    assert list(full["scheduler"]) == list(want), (list(full["scheduler"]), list(want))
    for k, v in want.items():
        got = full["scheduler"][k]
        if k in ("base_lrs", "_last_lr"):
            assert len(got) == len(v) and all(close(x, y, 1e-12) for x, y in zip(got, v)), (k, got, v)
        else:
            assert got == v, (k, got, v)
    sched.load_state_dict(full["scheduler"])
    sched.step()
    assert close(opt.param_groups[0]["lr"], gpt.learning_rate(8, 3e-3, 8, 3), 1e-12), opt.param_groups[0]["lr"]
    for g, saved in zip(opt.param_groups, groups):
        g["lr"] = saved["lr"]
    theirs.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    after = torch.load(merged(os.path.join(d, "step-00000007"), os.path.basename(d) + "7-model.pt", model_only=True),
                       weights_only=True)["model"]
    for name, param in model.named_parameters():
        diff = (after[name] - param.detach()).abs().max().item()
        assert diff <= 1e-5, f"{name}: our step 7 differs from torch.optim.AdamW's by {diff}"
    for name in frozen:
        assert torch.equal(after[name], state[name]), f"{name} is frozen, yet it changed"


def init_from():
    """--init-from: weights PyTorch wrote give PyTorch's loss on step 1's batch (a fresh run)."""
    d = os.path.join(work, "init")
    os.makedirs(d)
    torch.manual_seed(7)
    model = gpt.gpt(**SHAPE)
    tokens, train_end = gpt.text_tokens(a.text)
    x, y = gpt.batch(tokens, train_end, SEED, 1, 0, 8, SHAPE["block_size"])
    theirs = gpt.loss(model, x, y).item()
    state = model.state_dict()

    def first_loss(name, *init, nproc=None):
        log = os.path.join(d, name + ".jsonl")
        batch = "4" if nproc == 2 else "8"  # per rank: a global batch of 8 either way
        r = train("--steps", "1", "--batch-size", batch, *init, "--log-jsonl", log, nproc=nproc)
        ours = losses(log)[1]
        assert close(ours, theirs, 1e-5), f"{name}: PyTorch's loss {theirs!r}, ours {ours!r}\n{r.stderr}"

    # torch.save(model.state_dict()), at 2 ranks.
    raw = os.path.join(d, "raw.pt")
    torch.save(state, raw)
    first_loss("raw", "--init-from", raw, nproc=2)
    # The same weights as safetensors, written by our merge from that file.
    st = os.path.join(d, "w.safetensors")
    m = subprocess.run([a.merge, raw, "-o", st, "--format", "safetensors"], capture_output=True, text=True)
    assert m.returncode == 0, m.stderr
    first_loss("safetensors", "--init-from", st)
    # A sub-dict whose names carry a prefix: --init-key and --init-rename.
    keyed = os.path.join(d, "keyed.pt")
    torch.save({"state": {"x." + k: v for k, v in state.items()}, "epoch": 3}, keyed)
    first_loss("keyed", "--init-from", keyed, "--init-key", "state", "--init-rename", r"s/^x\.//")
    # Strict: without them every name is missing and unexpected, listed together, with where the
    # model's names are.
    r = train("--steps", "1", "--init-from", keyed, expect=1)
    assert "missing (" in r.stderr and "unexpected (" in r.stderr and "sit under 'state.x'" in r.stderr, r.stderr
    # A file lacking a parameter: strict refuses, --init-non-strict keeps its initial value.
    part = os.path.join(d, "part.pt")
    torch.save({k: v for k, v in state.items() if k != "head.ln_f.bias"}, part)
    r = train("--steps", "1", "--init-from", part, expect=1)
    assert "missing (1): head.ln_f.bias" in r.stderr, r.stderr
    train("--steps", "1", "--init-from", part, "--init-non-strict")
    # Fine-tuning with the embeddings frozen: after training they are PyTorch's values bit for bit,
    # and the rest has moved.
    ft = os.path.join(d, "frozen")
    train("--steps", "3", "--batch-size", "4", "--init-from", raw, "--freeze", "embed.*", "--ckpt-dir", ft, nproc=2)
    after = torch.load(merged(os.path.join(ft, "step-00000003"), "frozen-model.pt", model_only=True), weights_only=True)["model"]
    for name, t in state.items():
        assert torch.equal(after[name], t) == name.startswith("embed."), f"{name}: frozen {name.startswith('embed.')}, changed {not torch.equal(after[name], t)}"
    # Usage errors exit 2: with --resume, a bad rename.
    train("--init-from", raw, "--resume", "latest", expect=2)
    train("--init-from", raw, "--init-rename", "s/(/x/", expect=2)


def full_state_dict():
    sharded, full = os.path.join(work, "fs-sharded"), os.path.join(work, "fs-full")
    # A unit per block and a root unit of embed and head (the first entries and the last): the full
    # save streams each unit to rank 0's file as the file needs it (NOTE [A full save, streamed]).
    for d, kind in ((sharded, "sharded"), (full, "full")):
        train("--steps", "8", "--stop-at-step", "6", "--batch-size", "4", "--ckpt-dir", d, "--state-dict-type", kind,
              "--auto-wrap", "block", nproc=2)
    assert os.listdir(full) == ["step-00000006.pt"], os.listdir(full)
    f = os.path.join(full, "step-00000006.pt")
    ours = torch.load(f)  # param_groups hold floats: the restricted loader of 1.13 refuses them
    want = torch.load(merged(os.path.join(sharded, "step-00000006"), "fs-merged.pt"))
    assert ours["step"] == 6 and ours["config"] == want["config"], (ours["step"], ours["config"])
    assert list(ours["model"]) == list(want["model"]), (list(ours["model"]), list(want["model"]))
    for k, t in want["model"].items():
        assert torch.equal(ours["model"][k], t), k
    assert ours["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    for fqn, st in want["optimizer"]["state"].items():
        for b, t in st.items():
            assert torch.equal(ours["optimizer"]["state"][fqn][b], t), (fqn, b)
    # Its model part alone loads with weights_only=True.
    m = torch.load(merged(f, "fs-model.pt", model_only=True), weights_only=True)["model"]
    assert all(torch.equal(m[k], t) for k, t in want["model"].items())
    # Both resume alike, at another world size.
    logs = []
    for d, kind in ((sharded, "sharded"), (full, "full")):
        logs.append(d + ".jsonl")
        train("--steps", "8", "--batch-size", "8", "--ckpt-dir", d, "--state-dict-type", kind, "--resume", "latest",
              "--log-jsonl", logs[-1])
    assert losses(logs[0]) == losses(logs[1]), (losses(logs[0]), losses(logs[1]))
    assert sorted(os.listdir(full)) == ["step-00000006.pt", "step-00000008.pt"], os.listdir(full)
    # torch.optim's own keys: the state by integer ids, which number the groups' parameters in
    # order (what optimizer.state_dict() writes); re-keyed on load, the run resumes alike.
    groups = ours["optimizer"]["param_groups"]
    ids = {n: i for i, n in enumerate(n for g in groups for n in g["params"])}
    assert len(groups) == 2, groups
    int_keyed = dict(ours, optimizer={"state": {ids[n]: st for n, st in ours["optimizer"]["state"].items()},
                                      "param_groups": [dict(g, params=[ids[n] for n in g["params"]]) for g in groups]})
    d = os.path.join(work, "fs-int-keyed")
    os.makedirs(d)
    torch.save(int_keyed, os.path.join(d, "step-00000006.pt"))
    logs.append(d + ".jsonl")
    train("--steps", "8", "--batch-size", "8", "--ckpt-dir", d, "--state-dict-type", "full", "--resume", "latest",
          "--log-jsonl", logs[-1])
    assert losses(logs[2]) == losses(logs[1]), (losses(logs[2]), losses(logs[1]))
    # State for another grouping is refused, naming the parameters that moved.
    r = train("--steps", "8", "--ckpt-dir", d, "--state-dict-type", "full", "--resume", os.path.join(full, "step-00000006.pt"),
              "--no-decay", "*", expect=1)
    assert "parameter group 0 holds other parameters" in r.stderr and "there, not here: block0.attn.c_attn.weight" in r.stderr, r.stderr


def same_curve(strategy, nproc=2, extra=(), rel=1e-4):
    def run():
        one, two = os.path.join(work, f"c1-{strategy}.jsonl"), os.path.join(work, f"c{nproc}-{strategy}.jsonl")
        train("--steps", "12", "--batch-size", "8", "--sharding-strategy", strategy, "--log-jsonl", one)
        train("--steps", "12", "--batch-size", str(8 // nproc), "--sharding-strategy", strategy, *extra, "--log-jsonl", two,
              nproc=nproc)
        l1, l2 = losses(one), losses(two)
        assert sorted(l1) == list(range(1, 13)) and sorted(l2) == sorted(l1), (sorted(l1), sorted(l2))
        bad = [(s, l1[s], l2[s]) for s in l1 if not close(l1[s], l2[s], rel)]
        assert not bad, f"losses differ: {bad}"
        assert l1[12] < l1[1], f"the loss did not fall: {l1[1]} -> {l1[12]}"
    return run


def llama():
    # --model llama is Hugging Face's LlamaForCausalLM (tests/train/llama.py re-implements it from
    # transformers' source): it starts from a Hugging Face folder with that model's loss; its
    # merged safetensors load by name into it (strict), with our loss on the next batch; 1 rank x 8
    # and 2 ranks x 4 (a unit per decoder layer) follow one curve. Grouped-query attention (2
    # key-value heads for 4) and tied embeddings throughout.
    import llama as hf
    from common import read_safetensors, write_safetensors
    shape = ["--model", "llama", "--n-kv-head", "2", "--tie-embeddings", "--auto-wrap", "block"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 32,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256, "max_position_embeddings": 32,
              "tie_word_embeddings": True}
    tokens, train_end = gpt.text_tokens(a.text)
    # A Hugging Face folder (config.json, model.safetensors without the tied lm_head.weight, as
    # save_pretrained writes it) of weights large enough that attention is far from uniform:
    # started from it, our first loss is LlamaForCausalLM's on the same batch.
    torch.manual_seed(3)
    ref = hf.LlamaForCausalLM(config)
    with torch.no_grad():
        for n, p_ in ref.named_parameters():
            p_.copy_(1.0 + 0.1 * torch.randn_like(p_) if n.endswith("norm.weight") else 0.3 * torch.randn_like(p_))
    folder = os.path.join(work, "hf-llama")
    os.makedirs(folder)
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    write_safetensors(os.path.join(folder, "model.safetensors"),
                      {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}, {"format": "pt"})
    x, y = gpt.batch(tokens, train_end, SEED, 1, 0, 8, SHAPE["block_size"])
    with torch.no_grad():
        want = hf.loss(ref, x, y).item()
    for nproc in (1, 2):
        log = os.path.join(work, f"llama-init{nproc}.jsonl")
        train("--steps", "1", "--batch-size", str(8 // nproc), *shape, "--init-from", folder, "--log-jsonl", log,
              nproc=nproc if nproc > 1 else None)
        assert close(losses(log)[1], want, 1e-5), f"at {nproc} rank(s) our first loss {losses(log)[1]!r}, LlamaForCausalLM's {want!r}"
    one, two = os.path.join(work, "llama1.jsonl"), os.path.join(work, "llama2.jsonl")
    train("--steps", "8", "--batch-size", "8", *shape, "--log-jsonl", one)
    d = os.path.join(work, "llama")
    train("--steps", "8", "--batch-size", "4", *shape, "--log-jsonl", two, "--ckpt-dir", d, "--save-every", "4", nproc=2)
    l1, l2 = losses(one), losses(two)
    assert sorted(l1) == list(range(1, 9)) and sorted(l2) == sorted(l1), (sorted(l1), sorted(l2))
    bad = [(st, l1[st], l2[st]) for st in l1 if not close(l1[st], l2[st], 1e-5)]
    assert not bad, f"losses differ: {bad}"
    assert l1[8] < l1[1], f"the loss did not fall: {l1[1]} -> {l1[8]}"
    # Merged with --hf-config: config.json beside it, LlamaConfig's keys from the run's configuration.
    out = os.path.join(work, "llama4", "model.safetensors")
    os.makedirs(os.path.dirname(out))
    r = subprocess.run([a.merge, os.path.join(d, "step-00000004"), "-o", out, "--model-only", "--hf-config"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    written = json.load(open(os.path.join(work, "llama4", "config.json")))
    assert {k: written.get(k) for k in config} == config, (written, config)
    assert written["torch_dtype"] == "float32", written
    if a.python_dir:  # the same merge from Python: the same two files, config.json among those it lists
        sys.path.insert(0, a.python_dir)
        import fsdp_tools
        py_out = os.path.join(work, "llama4-py", "model.safetensors")
        os.makedirs(os.path.dirname(py_out))
        res = fsdp_tools.merge(os.path.join(d, "step-00000004"), py_out, model_only=True, hf_config=True)
        for f in ("model.safetensors", "config.json"):
            assert filecmp.cmp(os.path.join(work, "llama4", f), os.path.join(work, "llama4-py", f), shallow=False), f
        assert [os.path.basename(f["path"]) for f in res["files"]] == ["model.safetensors", "config.json"], res["files"]
    _, tensors = read_safetensors(out)
    state = {k: torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(shape_) for k, (dt, shape_, b) in tensors.items()
             if dt == "F32"}
    assert len(state) == len(tensors), sorted(tensors)
    model = hf.LlamaForCausalLM(written)
    names = sorted(n for n, _ in model.state_dict(keep_vars=True).items())
    assert sorted(state) == names, (sorted(state), names)  # Hugging Face's names, both of a tied pair
    model.load_state_dict(state, strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    x, y = gpt.batch(tokens, train_end, SEED, 5, 0, 8, SHAPE["block_size"])
    with torch.no_grad():
        theirs = hf.loss(model, x, y).item()
    assert close(theirs, l2[5], 1e-5), f"LlamaForCausalLM's loss {theirs!r} after step 4, ours {l2[5]!r}"
    # Into a Hugging Face folder of shards: config.json inside; run again with --force, it replaces the folder, config.json
    # included, but not a folder that holds anything else.
    hf_dir = os.path.join(work, "llama4-shards")
    for force in ([], ["--force"]):
        r = subprocess.run([a.merge, os.path.join(d, "step-00000004"), "-o", hf_dir, "--model-only", "--max-shard-size", "100KB", "--hf-config"]
                           + force, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert filecmp.cmp(os.path.join(hf_dir, "config.json"), os.path.join(work, "llama4", "config.json"), shallow=False)
    open(os.path.join(hf_dir, "notes.txt"), "w").write("mine")
    r = subprocess.run([a.merge, os.path.join(d, "step-00000004"), "-o", hf_dir, "--model-only", "--max-shard-size", "100KB", "--hf-config",
                        "--force"], capture_output=True, text=True)
    assert r.returncode == 1 and "'notes.txt', which is not part of a Hugging Face model folder" in r.stderr, r.stderr
    assert open(os.path.join(hf_dir, "notes.txt")).read() == "mine"
    r = subprocess.run([a.merge, os.path.join(d, "step-00000004"), "-o", os.path.join(work, "llama4.pt"), "--hf-config"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--hf-config: applies to safetensors output only" in r.stderr, r.stderr
    gpt_run = os.path.join(work, "gpt-for-hf")
    train("--steps", "1", "--ckpt-dir", gpt_run)
    r = subprocess.run([a.merge, os.path.join(gpt_run, "step-00000001"), "-o", os.path.join(work, "gpt1", "m.safetensors"), "--hf-config"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "this one is of a 'gpt' model" in r.stderr and not os.path.exists(os.path.join(work, "gpt1")), r.stderr
    r = train("--steps", "1", "--model", "gpt", "--n-kv-head", "2", expect=2)
    assert "are for --model llama" in r.stderr, r.stderr
    r = train("--steps", "1", "--model", "llama", "--n-kv-head", "3", expect=2)
    assert "--n-head 4 is not a multiple of --n-kv-head 3" in r.stderr, r.stderr


def hybrid_shard():
    # 4 ranks as 2 replicas of 2 shards: the curve of 1 rank x 8; its checkpoint (written by the
    # first replica) resumes under FULL_SHARD at 2 ranks; a mesh that does not fit is a usage error
    # before any rank starts.
    # (1e-5: the same sums in another order; a clipping norm counted once per replica misses it by 1e-4)
    same_curve("HYBRID_SHARD", nproc=4, extra=("--device-mesh", "2,2"), rel=1e-5)()
    # The clipped norm is the global one: each replica's shards counted once.
    norms = [{j["step"]: j["grad_norm"] for j in map(json.loads, open(os.path.join(work, f"c{n}-HYBRID_SHARD.jsonl")))
              if "grad_norm" in j} for n in (1, 4)]
    assert sorted(norms[0]) == list(range(1, 13)), norms[0]
    bad = [(st, norms[0][st], norms[1].get(st)) for st in norms[0] if not close(norms[0][st], norms[1].get(st, 0), 1e-5)]
    assert not bad, f"gradient norms differ: {bad}"
    d = os.path.join(work, "hy")
    train("--steps", "12", "--batch-size", "2", "--sharding-strategy", "HYBRID_SHARD", "--device-mesh", "2,2",
          "--ckpt-dir", d, "--stop-at-step", "6", nproc=4)
    step6 = os.path.join(d, "step-00000006")
    assert [os.path.getsize(os.path.join(step6, f"__{r}_0.distcp")) > 0 for r in range(4)] == [True, True, False, False]
    train("--steps", "12", "--batch-size", "4", "--ckpt-dir", d, "--resume", "latest", "--log-jsonl", d + ".jsonl", nproc=2)
    l1, lr = losses(os.path.join(work, "c1-HYBRID_SHARD.jsonl")), losses(d + ".jsonl")
    assert sorted(lr) == list(range(7, 13)), sorted(lr)
    bad = [(st, l1[st], lr[st]) for st in lr if not close(l1[st], lr[st], 1e-5)]
    assert not bad, f"resumed losses differ: {bad}"
    r = train("--steps", "2", "--sharding-strategy", "HYBRID_SHARD", "--device-mesh", "3,2", nproc=4, expect=2)
    assert "--device-mesh 3,2 does not fit 4 ranks" in r.stderr and "rank 0" not in r.stderr, r.stderr
    r = train("--steps", "2", "--device-mesh", "1,2", nproc=2, expect=2)
    assert "--device-mesh is HYBRID_SHARD's" in r.stderr, r.stderr


def sharding_is_real():
    # What rank 0 holds after training, against one unsharded copy: about 1/W of it sharded
    # (a generous bound: units are padded to a multiple of W), all of it under NO_SHARD.
    import re
    for strategy, nproc, want in (("FULL_SHARD", 2, 0.5), ("SHARD_GRAD_OP", 4, 0.25), ("NO_SHARD", 2, 1.0)):
        out = train("--steps", "2", "--batch-size", "2", "--sharding-strategy", strategy, nproc=nproc, quiet=False).stdout
        m = re.search(r"holds parameters (\d+) B, gradients (\d+) B, optimizer state (\d+) B; unsharded (\d+) / (\d+) / (\d+) B", out)
        assert m, out
        held, full = [int(x) for x in m.groups()[:3]], [int(x) for x in m.groups()[3:]]
        print(f"     {strategy} at {nproc} ranks: rank 0 holds {held} of {full} bytes (parameters, gradients, optimizer state)")
        for h, f in zip(held, full):
            assert want * f <= h <= want * f * 1.1 + 64 * 4, (strategy, nproc, held, full)


def param_dtype():
    # MixedPrecision(param_dtype=bfloat16): computed in bfloat16 (the losses are bfloat16's, close
    # to float32's but not equal), the shards, optimizer and checkpoint float32.
    ref, low = os.path.join(work, "pd32.jsonl"), os.path.join(work, "pdbf16.jsonl")
    d = os.path.join(work, "pd")
    train("--steps", "8", "--batch-size", "4", "--log-jsonl", ref, nproc=2)
    train("--steps", "8", "--batch-size", "4", "--param-dtype", "bfloat16", "--log-jsonl", low, "--ckpt-dir", d, nproc=2)
    lr, ll = losses(ref), losses(low)
    assert sorted(ll) == sorted(lr), (sorted(lr), sorted(ll))
    bad = [(s, lr[s], ll[s]) for s in lr if not close(lr[s], ll[s], 2e-2)]
    assert not bad, f"bfloat16 compute strays too far: {bad}"
    assert any(lr[s] != ll[s] for s in lr), "the losses equal float32's: the parameters were not gathered in bfloat16"
    j = json.loads(subprocess.run([a.inspect, "--json", os.path.join(d, "step-00000008")], capture_output=True, text=True, check=True).stdout)
    assert {e["dtype"] for e in j["entries"] if e["kind"] == "tensor"} == {"float32"}, {e["dtype"] for e in j["entries"]}


def accumulation():
    one, acc = os.path.join(work, "acc1.jsonl"), os.path.join(work, "acc2.jsonl")
    train("--steps", "6", "--batch-size", "8", "--log-jsonl", one)
    train("--steps", "6", "--batch-size", "2", "--accumulate", "2", "--log-jsonl", acc, nproc=2)
    l1, l2 = losses(one), losses(acc)
    bad = [(s, l1[s], l2[s]) for s in l1 if not close(l1[s], l2[s], 1e-4)]
    assert sorted(l2) == sorted(l1) and not bad, f"losses differ: {bad}"


def precision():
    curves = {}
    for prec in ("32-true", "bf16-mixed", "bf16-true"):
        log = os.path.join(work, f"p-{prec}.jsonl")
        d = os.path.join(work, f"p-{prec}")
        train("--steps", "12", "--batch-size", "4", "--precision", prec, "--log-jsonl", log, "--ckpt-dir", d,
              "--stop-at-step", "11", nproc=2)
        curves[prec] = losses(log)
        state = torch.load(merged(os.path.join(d, "step-00000011"), f"p-{prec}.pt", model_only=True), weights_only=True)["model"]
        want = torch.bfloat16 if prec == "bf16-true" else torch.float32
        assert all(t.dtype == want for t in state.values()), (prec, {t.dtype for t in state.values()})
        if prec == "bf16-true":  # the same bf16 model in PyTorch gives our next loss, to bf16's precision
            r = train("--steps", "12", "--batch-size", "8", "--precision", prec, "--ckpt-dir", d, "--resume", "latest",
                      "--log-jsonl", log)
            model = gpt.gpt(**SHAPE).to(torch.bfloat16)
            model.load_state_dict(state, strict=True)
            tokens, train_end = gpt.text_tokens(a.text)
            x, y = gpt.batch(tokens, train_end, SEED, 12, 0, 8, SHAPE["block_size"])
            theirs = gpt.loss(model, x, y).float().item()
            assert close(theirs, losses(log)[12], 2e-2), (theirs, losses(log)[12])
    for prec in ("bf16-mixed", "bf16-true"):
        bad = [(s, curves["32-true"][s], curves[prec][s]) for s in range(1, 12)
               if not close(curves["32-true"][s], curves[prec][s], 3e-2)]
        assert not bad, f"{prec} strays from 32-true: {bad}"
        assert curves[prec][11] < curves[prec][1] - 0.5, (prec, curves[prec])


def activation_checkpointing():
    for strategy, prec in (("FULL_SHARD", "32-true"), ("SHARD_GRAD_OP", "bf16-mixed")):
        logs = []
        for ac in ([], ["--activation-checkpointing"]):
            logs.append(os.path.join(work, f"ac-{strategy}-{len(ac)}.jsonl"))
            train("--steps", "5", "--batch-size", "4", "--sharding-strategy", strategy, "--precision", prec, *ac,
                  "--log-jsonl", logs[-1], nproc=2)
        plain, recomputed = losses(logs[0]), losses(logs[1])
        # Recomputing forward (under forward's autocast state) changes nothing.
        assert plain == recomputed, (strategy, prec, plain, recomputed)


def auto_wrap():
    base = None
    # Other units, or the reduce-scatter overlapped with backward: the same arithmetic.
    for name, flags in (("children", ["--auto-wrap", "children"]), ("auto", []), ("block", ["--auto-wrap", "block"]), ("40000", ["--auto-wrap", "40000"]),
                        ("overlap", ["--auto-wrap", "block", "--overlap-reduction", "on"])):
        d, log = os.path.join(work, f"aw-{name}"), os.path.join(work, f"aw-{name}.jsonl")
        r = train("--steps", "5", "--batch-size", "4", *flags, "--ckpt-dir", d, "--log-jsonl", log, nproc=2)
        if base is None:
            base = (d, losses(log))
            continue
        # The same losses and a bit-identical checkpoint.
        assert losses(log) == base[1], (name, losses(log), base[1])
        diff = subprocess.run([a.inspect, "diff", os.path.join(base[0], "step-00000005"), os.path.join(d, "step-00000005")],
                              capture_output=True, text=True)
        assert diff.returncode == 0 and "0 differ" in diff.stdout, (name, diff.stdout, diff.stderr)


def resume_equivalence():
    straight, split = os.path.join(work, "rs"), os.path.join(work, "rp")
    train("--steps", "20", "--batch-size", "4", "--ckpt-dir", straight, "--log-jsonl", straight + ".jsonl", nproc=2)
    train("--steps", "20", "--batch-size", "4", "--ckpt-dir", split, "--stop-at-step", "10", "--log-jsonl", split + ".jsonl", nproc=2)
    assert os.listdir(split) == ["step-00000010"], os.listdir(split)
    train("--steps", "20", "--batch-size", "4", "--ckpt-dir", split, "--resume", "latest", "--log-jsonl", split + ".jsonl", nproc=2)
    ls, lp = losses(straight + ".jsonl"), losses(split + ".jsonl")
    assert sorted(lp) == list(range(1, 21)), sorted(lp)
    bad = [(s, ls[s], lp[s]) for s in ls if not close(ls[s], lp[s], 1e-6)]
    assert not bad, f"losses differ after the resume: {bad}"
    want = torch.load(merged(os.path.join(straight, "step-00000020"), "rs20.pt", model_only=True), weights_only=True)["model"]
    got = torch.load(merged(os.path.join(split, "step-00000020"), "rp20.pt", model_only=True), weights_only=True)["model"]
    for k in want:
        diff = (want[k] - got[k]).abs().max().item()
        assert diff <= 1e-6, f"{k}: {diff}"
    # Another world size, the same global batch: the same run, to float tolerance.
    for nproc, b in ((1, 8), (4, 2)):
        d = os.path.join(work, f"rw{nproc}")
        os.makedirs(d)
        os.symlink(os.path.join(split, "step-00000010"), os.path.join(d, "step-00000010"))
        train("--steps", "20", "--batch-size", str(b), "--ckpt-dir", d, "--resume", "latest", "--log-jsonl", d + ".jsonl", nproc=nproc)
        lw = losses(d + ".jsonl")
        assert sorted(lw) == list(range(11, 21)), sorted(lw)
        assert close(lw[11], ls[11], 1e-5), f"nproc {nproc}: step 11 loss {lw[11]} vs {ls[11]}: not the same parameters"
        bad = [(s, ls[s], lw[s]) for s in lw if not close(ls[s], lw[s], 1e-3)]
        assert not bad, f"nproc {nproc}: {bad}"


def children_of(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def start_long(d, log):
    cmd = [a.train, *BASE, "--data", a.text, "--steps", "100000", "--batch-size", "4", "--ckpt-dir", d, "--log-jsonl", log, "--nproc", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(log) and len(open(log).read().splitlines()) >= 3):
        time.sleep(0.1)
    assert os.path.exists(log), "no step was logged"
    return proc


def killed_rank():
    d = os.path.join(work, "kill")
    proc = start_long(d, d + ".jsonl")
    ranks = children_of(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the launcher did not stop after a rank was killed")
    assert proc.returncode == 1, (proc.returncode, err)
    assert "rank" in err and "killed by signal 9" in err, err
    time.sleep(0.5)
    alive = [r for r in ranks if os.path.exists(f"/proc/{r}") and open(f"/proc/{r}/stat").read().split()[2] != "Z"]
    assert not alive, f"ranks left running: {alive}"


def sigterm_saves():
    d = os.path.join(work, "term")
    proc = start_long(d, d + ".jsonl")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (proc.returncode, out, err)
    steps = [n for n in os.listdir(d) if n.startswith("step-")]
    assert len(steps) == 1, steps
    ck = os.path.join(d, steps[0])
    verified(ck)
    at = int(steps[0][5:])
    train("--steps", str(at + 2), "--batch-size", "4", "--ckpt-dir", d, "--resume", "latest", "--log-jsonl", d + ".jsonl", nproc=2)
    assert max(losses(d + ".jsonl")) == at + 2


def interrupt_whole_group():
    # Ctrl-C in a terminal: SIGINT to the whole foreground process group (the launcher and every
    # rank, and the launcher forwards it again), or SIGTERM to every task as SLURM does: each rank
    # finishes its step, saves, and the run exits 0 (issue 28 item 2). A second interrupt later on
    # ends it at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        d = os.path.join(work, f"group-{sig.name}")
        log = d + ".jsonl"
        cmd = [a.train, *BASE, "--data", a.text, "--steps", "100000", "--batch-size", "4", "--ckpt-dir", d, "--log-jsonl", log,
               "--nproc", "2"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline and not (os.path.exists(log) and len(open(log).read().splitlines()) >= 3):
            time.sleep(0.1)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (sig.name, proc.returncode, err)
        steps = [n for n in os.listdir(d) if n.startswith("step-")]
        assert len(steps) == 1, (sig.name, steps)
        verified(os.path.join(d, steps[0]))
    # srun's way without our launcher: each rank started on its own (SLURM's variables), SIGTERM to
    # every task at once.
    import socket
    sk = socket.socket()
    sk.bind(("127.0.0.1", 0))
    port = sk.getsockname()[1]
    sk.close()
    d = os.path.join(work, "group-srun")
    log = d + ".jsonl"
    leader = None
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
        env.update(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port))
        cmd = [a.train, *BASE, "--data", a.text, "--steps", "100000", "--batch-size", "4", "--ckpt-dir", d, "--log-jsonl", log]
        group = 0 if leader is None else leader  # one process group for both tasks, as srun's job step
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=lambda g=group: os.setpgid(0, g)))
        leader = leader or procs[0].pid
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(log) and len(open(log).read().splitlines()) >= 3):
        time.sleep(0.1)
    os.killpg(leader, signal.SIGTERM)
    for pr in procs:
        out, err = pr.communicate(timeout=120)
        assert pr.returncode == 0, ("srun-like", pr.returncode, err)
    steps = [n for n in os.listdir(d) if n.startswith("step-")]
    assert len(steps) == 1, steps
    verified(os.path.join(d, steps[0]))
    d = os.path.join(work, "group-twice")
    proc = start_long(d, d + ".jsonl")
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.01)
    for r in children_of(proc.pid):
        os.kill(r, signal.SIGINT)  # the same interrupt: still a clean stop
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (proc.returncode, err)


def env_launch():
    # As torchrun sets the variables, and as srun does (SLURM's: the master is the first host of
    # the node list, the port MASTER_PORT); both the same run as --nproc 2.
    import socket
    log_nproc = os.path.join(work, "envn.jsonl")
    train("--steps", "4", "--batch-size", "4", "--log-jsonl", log_nproc, nproc=2)
    for how in ("torchrun", "srun"):
        log_env = os.path.join(work, f"env-{how}.jsonl")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs = []
        for r in range(2):
            if how == "torchrun":
                ranks = dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1")
            else:
                ranks = dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_JOB_NODELIST="localhost")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
            env.update(ranks, MASTER_PORT=str(port))
            cmd = [a.train, *BASE, "--data", a.text, "--steps", "4", "--batch-size", "4", "--log-jsonl", log_env]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for pr in procs:
            out, err = pr.communicate(timeout=120)
            assert pr.returncode == 0, (how, out, err)
        assert losses(log_env) == losses(log_nproc), (how, losses(log_env), losses(log_nproc))
    # And under PyTorch's own torchrun (python3-torch's: its redirect parsing fails on Python
    # 3.11, where iterating an IntFlag skips the zero member; mended in this harness process only).
    log_run = os.path.join(work, "env-real-torchrun.jsonl")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    launcher = ("import re, sys\n"
                "from torch.distributed.elastic.multiprocessing import api\n"
                "orig = api.Std.from_str.__func__\n"
                "api.Std.from_str = classmethod(lambda cls, vm: cls(int(vm)) if re.fullmatch(r'[0-3]', vm) else orig(cls, vm))\n"
                "from torch.distributed.run import main\n"
                "sys.argv[0] = 'torchrun'\n"
                "main()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    cmd = ["/usr/bin/python3", "-c", launcher, "--no_python", "--nproc_per_node", "2", "--master_port", str(port), a.train, *BASE,
           "--data", a.text, "--steps", "4", "--batch-size", "4", "--log-jsonl", log_run]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert losses(log_run) == losses(log_nproc), (losses(log_run), losses(log_nproc))


def latest_skips_incomplete():
    d = os.path.join(work, "inc")
    train("--steps", "3", "--batch-size", "4", "--ckpt-dir", d, "--save-every", "2")
    assert sorted(os.listdir(d)) == ["step-00000002", "step-00000003"], os.listdir(d)
    os.makedirs(os.path.join(d, "step-00000099"))  # a save that never finished
    resume = [a.train, *BASE[:-1], "--data", a.text, "--steps", "4", "--batch-size", "4", "--ckpt-dir", d, "--resume", "latest"]
    r = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "fsdp-train: warning: " in r.stderr and "step-00000099 is incomplete" in r.stderr, r.stderr
    assert "resumed from" in r.stdout and "step-00000003" in r.stdout, r.stdout
    # A damaged newest checkpoint (a data file cut short) is skipped for the one before, with a
    # warning naming the problem, and left where it is.
    shutil.rmtree(os.path.join(d, "step-00000004"))
    victim = os.path.join(d, "step-00000003", "__0_0.distcp")
    os.truncate(victim, os.path.getsize(victim) // 2)
    r = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step-00000003 is damaged (" in r.stderr and "passes the end of the file" in r.stderr, r.stderr
    assert "resumed from " + os.path.join(d, "step-00000002") + " at step 2" in r.stdout, r.stdout
    assert os.path.getsize(victim) > 0
    # When every checkpoint is damaged, it refuses to start over.
    shutil.rmtree(os.path.join(d, "step-00000004"))
    os.truncate(os.path.join(d, "step-00000002", "__0_0.distcp"), 10)
    r = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "every checkpoint in" in r.stderr and "is damaged" in r.stderr, r.stderr


def bad_data():
    f = os.path.join(work, "bad.bin")
    open(f, "wb").write(bytes([1, 0, 2, 0, 44, 1] + [0] * 200))  # token 300 at byte offset 4
    r = train("--steps", "1", "--data", f, expect=1)
    assert "bad.bin: at byte offset 4: token 300 is not below the vocabulary size 256" in r.stderr, r.stderr
    # Options that contradict each other are usage errors (exit 2), found before any rank starts.
    r = subprocess.run([a.train, "--steps", "1", "--n-embd", "30", "--n-head", "4"], capture_output=True, text=True)
    assert r.returncode == 2, r.returncode
    assert "not a multiple of --n-head" in r.stderr, r.stderr
    assert "rank 0:" not in r.stderr, r.stderr  # one rank: no rank named
    r = train("--steps", "1", "--data", os.path.join(work, "no-such.bin"), expect=1)
    assert "no-such.bin: cannot open the data file: No such file or directory" in r.stderr, r.stderr
    r = train("--steps", "1", "--resume", os.path.join(work, "nowhere"), expect=1)
    assert "nowhere: no such checkpoint" in r.stderr, r.stderr
    empty = os.path.join(work, "not-a-checkpoint")
    os.makedirs(empty)
    r = train("--steps", "1", "--resume", empty, expect=1)
    assert "not a complete checkpoint" in r.stderr, r.stderr
    # A step that is not there: the ones that are, named.
    d = os.path.join(work, "steps")
    train("--steps", "2", "--save-every", "1", "--ckpt-dir", d)
    r = train("--steps", "3", "--ckpt-dir", d, "--resume", os.path.join(d, "step-00000005"), expect=1)
    assert "step-00000005: no such checkpoint; complete ones in " + d + ": step-00000001, step-00000002" in r.stderr, r.stderr
    # -q prints errors only: nothing for a run that saves, resumes and ends well.
    q = os.path.join(work, "quiet")
    r = train("--steps", "2", "--ckpt-dir", q, "--stop-at-step", "1")
    r2 = train("--steps", "2", "--ckpt-dir", q, "--resume", "latest")
    assert (r.stdout, r.stderr, r2.stdout, r2.stderr) == ("", "", "", ""), (r.stdout, r.stderr, r2.stdout, r2.stderr)
    # The step line names each rank's peak RSS.
    r = subprocess.run([a.train, *BASE[:-1], "--data", a.text, "--steps", "1", "--nproc", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and re.search(r"peak rss \d+/\d+ MiB \(rank 0/1\)", r.stdout), r.stdout + r.stderr
    # The CUDA-only settings: 16-mixed on the CPU is refused anywhere; --device cuda where this
    # build's LibTorch or this machine has no GPU (with one, it trains).
    r = train("--steps", "1", "--precision", "16-mixed", expect=2)
    assert "precision 16-mixed (float16 autocast with a gradient scaler) needs CUDA" in r.stderr, r.stderr
    r = subprocess.run([a.train, "--steps", "1", "--device", "cuda", "-q"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        assert r.returncode == 1 and ("this build's LibTorch has no CUDA" in r.stderr or "no GPU is visible" in r.stderr), r.stderr
    # A diverging run stops at the first non-finite loss and saves nothing from then on.
    d = os.path.join(work, "diverge")
    r = subprocess.run([a.train, "--n-embd", "32", "--data", a.text, "--steps", "10", "--lr", "1e30", "--grad-clip", "0",
                        "--warmup", "0", "--ckpt-dir", d, "--save-every", "1", "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "the loss is" in r.stderr and "at step 2 (diverged" in r.stderr, r.stderr
    assert os.listdir(d) == ["step-00000001"], os.listdir(d)
    verified(os.path.join(d, "step-00000001"))


def crash_mid_save():
    """SIGKILL at each step of a save's commit protocol (FSDP_TEST_CRASH_AT): the previous
    checkpoint is untouched, the new one is either incomplete (no .metadata) or whole, `latest`
    resumes from a sound one, and the rerun leaves a whole checkpoint and no temporary files."""
    import hashlib

    def tree(path):
        return sorted((f, hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()) for f in os.listdir(path))

    d = os.path.join(work, "crash")
    train("--steps", "2", "--batch-size", "4", "--ckpt-dir", d)
    prev, new = os.path.join(d, "step-00000002"), os.path.join(d, "step-00000004")
    before = tree(prev)
    # One rank: a data file, meta.pt and .metadata are each written to a temporary name and renamed.
    cases = [(None, p) for p in ["task:1", "task:40", "rename:1", "renamed:1", "rename:2", "renamed:2", "metadata:1",
                                 "rename:3", "renamed:3"]]
    cases += [(2, "task:10"), (2, "metadata:1")]  # two ranks: both die there, the launcher reports it
    for nproc, point in cases:
        args = ["--steps", "4", "--batch-size", "4", "--ckpt-dir", d, "--resume", "latest"]
        cmd = [a.train, *BASE, "--data", a.text, *args] + (["--nproc", str(nproc)] if nproc else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, FSDP_TEST_CRASH_AT=point))
        assert r.returncode != 0, f"{point}: the crash point was never reached\n{r.stdout}"
        assert tree(prev) == before, f"{point}: the previous checkpoint changed"
        whole = os.path.exists(os.path.join(new, ".metadata"))  # the crash came after the commit
        if whole:
            assert verify_deep(new).returncode == 0, f"{point}: a checkpoint with .metadata that does not verify"
        loud = [a.train, *BASE[:-1], "--data", a.text, *args] + (["--nproc", str(nproc)] if nproc else [])  # without -q
        r = subprocess.run(loud, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (point, r.stderr)
        assert "resumed from " + (new if whole else prev) in r.stdout, (point, r.stdout)
        assert verify_deep(new).returncode == 0, f"{point}: the rerun's checkpoint does not verify"
        left = [f for f in os.listdir(new) if ".tmp." in f or ".old." in f]
        assert not left, f"{point}: temporary files left: {left}"
        shutil.rmtree(new)


def model_script():
    """--model-script: a TorchScript GPT that PyTorch scripted and saved (nanoGPT's layout, a tied
    head, a mask buffer) trains with its own initial values (our first loss is PyTorch's on the
    same batch), gives the same curve at 1 x 8 and 2 x 4, and its checkpoint's model loads strictly
    into the script, whose loss on the next batch is ours."""
    torch.manual_seed(5)
    path = os.path.join(work, "script-gpt.pt")
    torch.jit.script(gpt.ScriptGPT(**SHAPE)).save(path)
    d, one, two = (os.path.join(work, n) for n in ("script", "script-1.jsonl", "script-2.jsonl"))
    train("--model-script", path, "--steps", "8", "--stop-at-step", "6", "--batch-size", "4", "--ckpt-dir", d,
          "--log-jsonl", two, nproc=2)
    train("--model-script", path, "--steps", "8", "--stop-at-step", "6", "--batch-size", "8", "--log-jsonl", one)
    l1, l2 = losses(one), losses(two)
    bad = [(s, l1[s], l2[s]) for s in range(1, 7) if not close(l1[s], l2[s], 1e-4)]
    assert not bad, f"1 x 8 and 2 x 4 differ: {bad}"
    tokens, train_end = gpt.text_tokens(a.text)
    script = torch.jit.load(path)
    x, y = gpt.batch(tokens, train_end, SEED, 1, 0, 8, SHAPE["block_size"])
    first = gpt.loss(script, x, y).item()
    assert close(first, l1[1], 1e-5), f"PyTorch's loss of the script {first!r}, our first {l1[1]!r}"
    ck6 = os.path.join(d, "step-00000006")
    verified(ck6)
    log = d + ".jsonl"
    train("--model-script", path, "--steps", "8", "--stop-at-step", "7", "--batch-size", "8", "--ckpt-dir", d,
          "--resume", "latest", "--log-jsonl", log)
    state = torch.load(merged(ck6, "script6-model.pt", model_only=True), weights_only=True)["model"]
    names = [n for n, _ in script.state_dict().items() if "mask" not in n]
    assert sorted(state) == sorted(names), (sorted(state), sorted(names))
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    script.load_state_dict(state, strict=False)  # the masks are not persistent
    x, y = gpt.batch(tokens, train_end, SEED, 7, 0, 8, SHAPE["block_size"])
    theirs = gpt.loss(script, x, y).item()
    ours = losses(log)[7]
    assert close(theirs, ours, 1e-5), f"PyTorch's loss {theirs!r}, ours {ours!r}"
    # Refused before any rank starts: not a TorchScript file, and options a script cannot have.
    r = train("--model-script", a.text, "--steps", "1", expect=1)
    assert "not a TorchScript module" in r.stderr, r.stderr
    r = train("--model-script", path, "--steps", "1", "--activation-checkpointing", nproc=2, expect=2)
    assert "one opaque module" in r.stderr and "rank" not in r.stderr, r.stderr


def help_matches_man():
    import re
    page = os.path.join(os.path.dirname(__file__), "..", "..", "man", "fsdp-train.1")
    text = open(page).read()
    helps = subprocess.run([a.train, "--help"], capture_output=True, text=True, check=True).stdout
    for opt in sorted(set(re.findall(r"--[a-z][a-z0-9-]+", helps))):
        assert opt.replace("-", "\\-") in text or opt in text, f"{opt} is not in {page}"
    # Every default shown, none a placeholder for "not given" (issue 33).
    assert not re.search(r"(INT|FLOAT|TEXT|UINT)[^ ]*=", helps), helps
    for line in ("--nproc INT ", "--stop-at-step INT "):
        shown = next(x for x in helps.splitlines() if line in x)
        assert "(default:" not in shown, shown
    assert re.search(r"--n-layer INT .*\[1 - 1024\] \(default: 2\)", helps), helps
    assert re.search(r"--min-lr FLOAT .*\(default: --lr / 10\)$", helps, re.M), helps
    g = subprocess.run(["groff", "-man", "-ww", "-z", page], capture_output=True, text=True)
    assert g.returncode == 0 and not g.stderr, g.stderr


check("help_matches_man", help_matches_man)
check("pytorch_gpt_and_adamw_equivalence", pytorch_equivalence)
check("pytorch_tied_gpt_and_adamw_equivalence", lambda: pytorch_equivalence(tied=True, nproc_last=2))
check("pytorch_param_groups_and_frozen_adamw_equivalence", lambda: pytorch_equivalence(freeze=("block0.attn.*", "embed.wpe.*"), nproc_last=3))
check("init_from", init_from)
check("full_state_dict", full_state_dict)
check("llama_is_hugging_face_llama", llama)
check("same_curve_full_shard", same_curve("FULL_SHARD"))
check("same_curve_shard_grad_op", same_curve("SHARD_GRAD_OP"))
check("hybrid_shard", hybrid_shard)
check("sharding_is_real", sharding_is_real)
check("param_dtype", param_dtype)
check("accumulation_no_sync", accumulation)
check("precision", precision)
check("activation_checkpointing", activation_checkpointing)
check("auto_wrap", auto_wrap)
check("model_script", model_script)
check("resume_equivalence", resume_equivalence)
check("killed_rank", killed_rank)
check("sigterm_saves", sigterm_saves)
check("interrupt_whole_group", interrupt_whole_group)
check("env_launch", env_launch)
check("latest_skips_incomplete", latest_skips_incomplete)
check("crash_mid_save", crash_mid_save)
check("bad_data", bad_data)
def no_run_over_another():
    # Without --resume, a --ckpt-dir that holds an earlier run's checkpoints is refused, naming its
    # latest step; --force starts over and removes them; a step directory with a user's file in it is
    # never replaced by a save (issue 28 items 10 and 1).
    d = os.path.join(work, "over")
    train("--steps", "4", "--batch-size", "4", "--ckpt-dir", d, "--save-every", "2")
    assert sorted(os.listdir(d)) == ["step-00000002", "step-00000004"], os.listdir(d)
    r = train("--steps", "2", "--batch-size", "4", "--ckpt-dir", d, expect=1)
    assert "up to step 4" in r.stderr and "--resume latest" in r.stderr, r.stderr
    assert sorted(os.listdir(d)) == ["step-00000002", "step-00000004"], os.listdir(d)
    train("--steps", "2", "--batch-size", "4", "--ckpt-dir", d, "--force")
    assert os.listdir(d) == ["step-00000002"], os.listdir(d)
    mine = os.path.join(d, "step-00000004")
    os.makedirs(mine)
    open(os.path.join(mine, "notes.txt"), "w").write("mine")
    r = train("--steps", "4", "--batch-size", "4", "--ckpt-dir", d, "--resume", "latest", expect=1)
    assert "notes.txt" in r.stderr, r.stderr
    assert open(os.path.join(mine, "notes.txt")).read() == "mine"
    # a resume that changes the schedule or the global batch says so, in one line each
    shutil.rmtree(mine)
    r = train("--steps", "6", "--batch-size", "2", "--ckpt-dir", d, "--resume", "latest", quiet=False)
    warnings = [l for l in r.stderr.splitlines() if l.startswith("fsdp-train: warning:")]
    assert any("--steps is 6" in w for w in warnings) and any("global batch is 2" in w for w in warnings), (r.stdout, r.stderr)
    # Saving a step again over a whole checkpoint (a run resumed from an earlier one) replaces it only
    # once the new one is whole: killed in the middle of that save, the old one is intact.
    import hashlib
    step6 = os.path.join(d, "step-00000006")

    def tree(path):
        return sorted((f, hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()) for f in os.listdir(path))

    before = tree(step6)
    again = [a.train, *BASE, "--data", a.text, "--steps", "6", "--batch-size", "2", "--ckpt-dir", d, "--resume",
             os.path.join(d, "step-00000002")]
    r = subprocess.run(again, capture_output=True, text=True, timeout=300, env=dict(os.environ, FSDP_TEST_CRASH_AT="task:3"))
    assert r.returncode != 0 and tree(step6) == before, (r.returncode, r.stderr)
    verified(step6)
    train(*again[len(BASE) + 3:])
    verified(step6)
    assert tree(step6) != before and not os.path.exists(step6 + ".partial"), os.listdir(d)  # .metadata's save id differs


def random_kills_while_saving():
    # SIGKILL at random moments of a 2-rank run that saves every step (seeded, about 30 s): every
    # checkpoint with .metadata verifies --deep, the next --resume latest goes on from the newest
    # complete one, and no temporary file is left once it has saved (issue 28's proof).
    import random
    rng = random.Random(28)
    d = os.path.join(work, "randkill")
    cmd = [a.train, *BASE, "--data", a.text, "--steps", "100000", "--batch-size", "4", "--ckpt-dir", d, "--save-every", "1",
           "--keep-last", "3", "--nproc", "2"]
    kills = incomplete_seen = 0
    deadline = time.time() + 30
    while time.time() < deadline:
        proc = subprocess.Popen(cmd + (["--resume", "latest"] if os.path.isdir(d) else []), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        time.sleep(rng.uniform(0.5, 3.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        kills += 1
        steps = sorted(n for n in os.listdir(d) if n.startswith("step-")) if os.path.isdir(d) else []
        for n in steps:
            if os.path.exists(os.path.join(d, n, ".metadata")):
                v = verify_deep(os.path.join(d, n))
                assert v.returncode == 0, f"kill {kills}: {n} has .metadata and does not verify: {v.stdout}{v.stderr}"
            else:
                incomplete_seen += 1
    complete = sorted(n for n in os.listdir(d) if os.path.exists(os.path.join(d, n, ".metadata")))
    at = int(complete[-1][5:]) if complete else 0
    train("--steps", "100000", "--stop-at-step", str(at + 1), "--batch-size", "4", "--ckpt-dir", d, "--resume", "latest",
          "--save-every", "1", "--keep-last", "3", nproc=2)
    verified(os.path.join(d, f"step-{at + 1:08d}"))
    left = [os.path.join(r_, f) for r_, _, fs in os.walk(d) for f in fs if ".tmp" in f]
    assert not left, left
    print(f"     fsdp-train: {kills} random kills while saving every step, {incomplete_seen} interrupted saves seen, "
          f"every complete checkpoint verified")


check("no_run_over_another", no_run_over_another)
check("random_kills_while_saving", random_kills_while_saving)
finish()

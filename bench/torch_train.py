# SPDX-License-Identifier: Apache-2.0
"""The baseline for bench/train: the same model (the GPT of tests/train/gpt.py, or with --model
llama the LlamaForCausalLM of tests/train/llama.py), batches, AdamW, schedule and clipping as
fsdp-train, in python3-torch's own loop: one process, or DDP on Gloo at world size N
(each rank taking its contiguous part of the global batch, as fsdp-train does). Prints one JSON
line: median step time over the steps after the first `skip` (and the fastest of them: the machine's
noise only ever adds time), and each rank's peak RSS."""
import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "train"))

p = argparse.ArgumentParser()
p.add_argument("--world", type=int, default=1)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--skip", type=int, default=5)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--data", required=True)
p.add_argument("--n-layer", type=int, default=2)
p.add_argument("--n-embd", type=int, default=64)
p.add_argument("--n-head", type=int, default=4)
p.add_argument("--block-size", type=int, default=64)
p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
p.add_argument("--n-kv-head", type=int, default=0, help="llama: 0 is --n-head")
p.add_argument("--port", type=int, default=29533)
p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: the cores shared among the ranks)")
p.add_argument("--ready", help="a file to create when the model is built and the first step starts")
a = p.parse_args()
threads = a.threads or max(1, os.cpu_count() // a.world)
# Each rank's BLAS threads are its share of the cores, as fsdp-train sets them (fsdp::set_num_threads)
# and as torchrun's OMP_NUM_THREADS=1 does for its ranks; torch.set_num_threads below does not
# reach OpenBLAS's own pool. Set before torch is imported: OpenBLAS reads it when it loads.
os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
# And OpenMP's idle threads sleep, as in the ranks fsdp-train --nproc starts (unless set otherwise).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def rank_main(rank, world, out):
    import torch
    import gpt
    torch.set_num_threads(threads)
    if world > 1:
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1337)
    if a.model == "llama":
        import llama
        hidden = (2 * 4 * a.n_embd // 3 + 255) // 256 * 256  # Llama's rule, as fsdp-train's default
        model = llama.LlamaForCausalLM({"hidden_size": a.n_embd, "intermediate_size": hidden, "num_hidden_layers": a.n_layer,
                                        "num_attention_heads": a.n_head, "num_key_value_heads": a.n_kv_head or a.n_head,
                                        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256})
        loss_of = llama.loss
    else:
        model = gpt.gpt(a.n_layer, a.n_head, a.n_embd, a.block_size, 256)
        loss_of = gpt.loss
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    tokens, train_end = gpt.text_tokens(a.data)
    times = []
    if a.ready and rank == 0:
        open(a.ready, "w").close()
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = gpt.batch(tokens, train_end, 1337, step, rank * a.batch_size, a.batch_size, a.block_size)
        for g in opt.param_groups:
            g["lr"] = gpt.learning_rate(step, 1e-3, a.steps, 10)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if world > 1:
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
        loss.item()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, statistics.median(times[a.skip:]), min(times[a.skip:]), rss))


if __name__ == "__main__":
    import torch.multiprocessing as mp
    if a.world == 1:
        import queue
        q = queue.Queue()
        rank_main(0, 1, q)
        results = [q.get()]
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, a.world, q)) for r in range(a.world)]
        for pr in procs:
            pr.start()
        results = sorted(q.get() for _ in procs)
        for pr in procs:
            pr.join()
    print(json.dumps({"step_time_s": max(r[1] for r in results), "fastest_step_s": max(r[2] for r in results),
                      "peak_rss_mib": [round(r[3], 1) for r in results]}))

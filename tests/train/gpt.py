# SPDX-License-Identifier: Apache-2.0
"""fsdp-train's models and batches, written again in PyTorch from their description
(tools/fsdp-train/model.hpp, data.hpp), for the tests that check our training against PyTorch's:
the same modules under the same names, so that a merged checkpoint's `model` entry loads with
load_state_dict(strict=True), and the same batches, drawn with splitmix64."""
import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

MASK = (1 << 64) - 1


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def sample_starts(seed, step, first, count, begin, end, block):
    rng = end - begin - block
    base = mix64(seed ^ mix64(step & MASK))
    return [begin + mix64(base ^ i) % rng for i in range(first, first + count)]


def batch(tokens, train_end, seed, step, first, count, block):
    starts = sample_starts(seed, step, first, count, 0, train_end, block)
    x = torch.tensor([tokens[s:s + block] for s in starts], dtype=torch.long)
    y = torch.tensor([tokens[s + 1:s + block + 1] for s in starts], dtype=torch.long)
    return x, y


def text_tokens(path, val_fraction=0.1):
    data = open(path, "rb").read()
    tokens = list(data)
    n = len(tokens)
    return tokens, n - int(n * val_fraction)


def learning_rate(step, lr, steps, warmup, min_lr=None):
    min_lr = lr / 10 if min_lr is None else min_lr
    if step <= warmup:
        return lr * step / (warmup + 1)
    if step >= steps:
        return min_lr
    progress = (step - warmup) / (steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


class Embed(nn.Module):
    def __init__(self, vocab, block, n_embd):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[-1]))


class Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.n_head))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Mlp(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = Mlp(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, n_embd, vocab):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def gpt(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256, tie_weights=False):
    parts = [("embed", Embed(vocab_size, block_size, n_embd))]
    parts += [(f"block{i}", Block(n_embd, n_head)) for i in range(n_layer)]
    parts.append(("head", Head(n_embd, vocab_size)))
    model = nn.Sequential(OrderedDict(parts))
    if tie_weights:  # nanoGPT's weight tying: one Parameter, two names in the state dict
        model.head.lm_head.weight = model.embed.wte.weight
    return model


def loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class ScriptBlock(nn.Module):
    """A block written for torch.jit.script (no generator expressions), nanoGPT's names."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = Mlp(n_embd)

    def forward(self, x):
        B, T, C = x.shape
        h = self.ln_1(x)
        qkv = self.c_attn(h).split(C, dim=2)
        q = qkv[0].view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = qkv[1].view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = qkv[2].view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.n_head))
        att = att.masked_fill(self.mask[:T, :T] == 0, float("-inf")).softmax(-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class ScriptTransformer(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([ScriptBlock(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)


class ScriptGPT(nn.Module):
    """nanoGPT's layout (transformer.wte, transformer.h.N..., a tied lm_head, a causal-mask
    buffer), a model fsdp-train knows nothing of, for --model-script."""

    def __init__(self, n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=256):
        super().__init__()
        self.transformer = ScriptTransformer(n_layer, n_head, n_embd, block_size, vocab_size)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        mask = torch.ones(block_size, block_size, dtype=torch.uint8).tril()
        for b in self.transformer.h:
            b.register_buffer("mask", mask.clone(), persistent=False)

    def forward(self, idx):
        T = idx.shape[-1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T))
        for b in self.transformer.h:
            x = b(x)
        return self.lm_head(self.transformer.ln_f(x))

# SPDX-License-Identifier: Apache-2.0
"""Hugging Face transformers' LlamaForCausalLM in plain PyTorch (python3-torch has no transformers):
the eager computation of src/transformers/models/llama/modeling_llama.py (as of its v4.38-era
LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half/apply_rotary_pos_emb, LlamaMLP, repeat_kv,
LlamaAttention, LlamaDecoderLayer, LlamaModel, LlamaForCausalLM), with its module names, so that a
Hugging Face state dict (or our merged safetensors) loads with load_state_dict(strict=True).
Configured by the config.json keys LlamaConfig reads. No dropout, no biases, no KV cache."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotary(head_dim, theta, position_ids, dtype):
    """LlamaRotaryEmbedding.forward: cos and sin of shape [batch, seq, head_dim], in float32 first."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_heads = c["num_attention_heads"]
        self.head_dim = c["hidden_size"] // self.num_heads
        self.num_key_value_heads = c.get("num_key_value_heads") or self.num_heads
        self.rope_theta = c.get("rope_theta", 10000.0)
        self.q_proj = nn.Linear(c["hidden_size"], self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c["hidden_size"], self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c["hidden_size"], self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c["hidden_size"], bias=False)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(self.head_dim, self.rope_theta, position_ids, v.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        n_rep = self.num_heads // self.num_key_value_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = LlamaAttention(c)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([LlamaDecoderLayer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        bsz, seq = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(seq).unsqueeze(0).expand(bsz, -1)
        # The eager 4-d mask: causal, and (with an attention_mask of 1s and 0s) no padded key,
        # as the dtype's minimum added before the softmax.
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(allowed.shape, dtype=hidden_states.dtype).masked_fill(~allowed, torch.finfo(hidden_states.dtype).min)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        if config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm_head(self.model(input_ids, attention_mask, position_ids)).float()


def loss(model, x, y):
    """Next-token cross entropy with the targets given (fsdp-train's batches are x and x shifted)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

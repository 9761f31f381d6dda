"""
The Qwen3 / Qwen2.5 decoder in plain torch, with the four things RL needs from a model:

1. `model(input_ids, attention_mask)` -> logits, for padded batches (left or right padding) and for
   packed batches (attention_mask holds segment ids 1, 2, 3, ...; positions restart per segment).
2. `token_logprobs(model, input_ids, targets, ...)` -> per-token log-probs (and entropy) without ever
   holding fp32 logits for the whole batch: the lm_head + log_softmax run chunk by chunk, each chunk
   checkpointed, so forward and backward hold one chunk of logits at a time; `where=` (the loss mask)
   runs them only at the positions the loss reads.
3. `model.forward_cached(input_ids, cache, rows)` -> logits, incremental decoding against a paged
   `KVCache` where every row has its own length and page table (continuous batching, prefix sharing).
4. `load_model` / `save_model` / `shard_model` / `load_weights`: HF safetensors directories in and out
   (parameter names are HF's, so state dicts map 1:1 and transformers loads what we save), and FSDP2.

Attention runs through flash-attn when it imports and the tensors are fp16/bf16 on a GPU (CUDA or
ROCm): `flash_attn_varlen_func` for full forwards, `flash_attn_with_kvcache` with a page table
(`block_table`) for decoding. Otherwise torch SDPA with explicit boolean masks. The choice is made in
`use_flash`, nowhere else.

Loading a 14B model on many ranks without a full copy per rank:
    model = load_model(path, device="meta")         # shapes only, no memory
    shard_model(model)                                # FSDP2: params become DTensor shards (still meta)
    load_weights(model, path, device="cuda")          # each rank reads only its rows of each tensor
"""

import functools
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None


# -----------------------------------------------------------------------------
# config

@dataclass
class Config:
    model_type: str = "qwen3"  # "qwen3": q/k RMSNorm, no qkv bias; "qwen2": qkv bias, no q/k norm
    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 17408
    num_hidden_layers: int = 40
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen3 only (all four projections); qwen2 always has q/k/v bias
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None

    @classmethod
    def from_json(cls, path):
        """read a HF config.json (or the directory holding one)"""
        if os.path.isdir(path):
            path = f"{path}/config.json"
        with open(path) as f:
            d = json.load(f)
        if d.get("model_type") not in ("qwen3", "qwen2"):
            raise ValueError(f"{path}: model_type {d.get('model_type')!r} is not supported (qwen3, qwen2)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {d['hidden_act']!r} is not supported (silu)")
        if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or []):
            raise ValueError(f"{path}: sliding-window attention is not supported")
        # transformers 5 writes rope_parameters, older files rope_theta (+ rope_scaling)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{path}: rope scaling {rope} is not supported (plain rope only)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} (sizes must be stated: no 14B default)")
        # every field the file sets (null = unset: the default above), then the three whose fallback
        # follows from other fields or from HF's own default rather than from this dataclass
        fields = {k: d[k] for k in cls.__dataclass_fields__ if d.get(k) is not None}
        heads = d["num_attention_heads"]
        fields.update(num_key_value_heads=d.get("num_key_value_heads") or heads,
                      head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                      rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))))
        return cls(**fields)

    def to_dict(self, dtype):
        """the config.json that transformers (4.x and 5.x) reads back"""
        # architectures: Qwen3ForCausalLM or Qwen2ForCausalLM; use_cache and use_sliding_window are left
        # to transformers' defaults (True, False), as vLLM reads them through the same config class
        return dict(asdict(self), architectures=[f"{self.model_type.capitalize()}ForCausalLM"],
                    hidden_act="silu",
                    rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                    torch_dtype=str(dtype).removeprefix("torch."))


def use_flash(device, dtype):
    """the one place that picks the attention backend: flash-attn for half precision on a GPU"""
    return (flash_attn_varlen_func is not None and torch.device(device).type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


def paged_attention(q, k, v, seqlens, table):
    """flash-attn's paged decoding: q (B, T, H, hd) against the pools k and v through the page table (B, P), the
    keys of row b up to seqlens[b], bottom-right causal (see attend)"""
    return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, causal=True)


# The same as a torch operator, for a compiled decode step (Qwen.static_step, decode_mode "compile"). The kernel is
# a C++ extension that torch.compile cannot look into: a graph break (flash-attention issue 1386), which a step
# compiled whole (fullgraph) refuses, so "compile" failed wherever flash-attn decodes. The compiler takes the
# operator as one opaque call that returns a tensor shaped like q, and the kernel runs when the step does (in a
# CUDA graph it is captured like any kernel). An eager step calls the kernel itself: the operator would cost ~16
# us a call more (its Python dispatch, measured on the CPU), ~0.6 ms a decode step at 40 layers.
flash_decode = torch.library.custom_op(
    "nano_rstar2::flash_decode", paged_attention, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor seqlens, Tensor table) -> Tensor")
flash_decode.register_fake(lambda q, *pools_and_table: torch.empty_like(q))


@functools.cache
def paged_flash(device, dtype):
    """Whether flash-attn decodes through a page table here. Its CUDA and ROCm CK backends do; its Triton AMD
    backend (ROCm with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE) may not. Tried once on a one-page toy rather
    than guessed from versions; without it the KV cache reads its pages through SDPA (slower, same results),
    said once, instead of failing at the first decode step."""
    try:
        q, k = (torch.zeros(1, n, 1, 64, device=device, dtype=dtype) for n in (1, 256))
        one = torch.ones(1, dtype=torch.int32, device=device)
        paged_attention(q, k, k, one, one.view(1, 1) - 1)
        return True
    except Exception as e:  # noqa: BLE001 (any failure means: do not decode through it)
        print(f"model: flash-attn cannot decode through a page table here ({type(e).__name__}: {e});"
              " the KV cache is read through SDPA (slower, the same results)", flush=True)
        return False


# -----------------------------------------------------------------------------
# the decoder

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # torch's fused kernel: one op forward and one backward instead of six, and on the CPU in fp32 bitwise
        # the same values and gradients as x * rsqrt(mean(x^2) + eps) * weight written out (tests/test_model.py)
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # half precision: normalise in fp32, scale in the input dtype (as transformers does, so bf16 matches too)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_cos_sin(positions, cfg, dtype):
    """positions (B, T) -> cos, sin (B, T, 1, head_dim), computed in fp32 like transformers"""
    dims = torch.arange(0, cfg.head_dim, 2, device=positions.device).float()
    inv_freq = 1.0 / (cfg.rope_theta ** (dims / cfg.head_dim))  # (head_dim/2,)
    freqs = positions[..., None].float() * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # (B, T, 1, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # HF's rotate_half convention: the two halves of head_dim are the (real, imaginary) pairs
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def sdpa(q, k, v, mask):
    """q (B, T, H, hd), k/v (B, S, Hkv, hd), mask (B, T, S) bool (True = visible) or None = causal
    -> (B, T, H, hd)"""
    # (B, heads, T or S, hd), the layout SDPA takes
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=True).transpose(1, 2)
    B, H, T, hd = q.shape
    rep = H // k.shape[1]
    # fold the query heads of each kv group into the query axis: K/V are read in place, never repeated per head
    q = q.reshape(B, k.shape[1], rep * T, hd)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, rep, 1)[:, None])
    # reshape, not view: CUDA's kernels may return y in another memory layout (found on the first GPU)
    return y.reshape(B, H, T, hd).transpose(1, 2)


def attend(q, k, v, att, layer_idx):
    """q (B, T, H, hd), k/v (B, T, Hkv, hd) rotated -> (B, T, H, hd); att is set up once per forward"""
    B, T, H, hd = q.shape
    # flash-attn's packed training (forward set up "varlen"): drop pad tokens, every segment is one varlen
    # sequence
    if "varlen" in att:
        idx, cu, max_len = att["varlen"]
        q, k, v = (z.flatten(0, 1)[idx] for z in (q, k, v))  # (N, heads, hd)
        y = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)  # (N, H, hd)
        return q.new_zeros(B * T, H, hd).index_copy(0, idx, y).view(B, T, H, hd)
    cache = att.get("cache")
    if cache is None:
        return sdpa(q, k, v, att["mask"])
    kc, vc = cache.layers[layer_idx]  # this layer's pool (KVCache: its layouts)
    Hkv = k.shape[2]
    # 1. the real new tokens' k/v into their pages; right padding is never written (its positions may lie
    # in pages the row does not hold, which belong to other rows); real, a mask, selects them (all, decoding)
    news = [z.flatten(0, 1)[att["real"]] for z in (k, v)]  # (N, Hkv, hd) each
    # the pool's pages and their tokens as one axis of slots: (slots, Hkv, hd) flash's, (Hkv, slots, hd) SDPA's
    d = cache.page_dim
    for c, new in zip((kc, vc), news):
        c.flatten(d, d + 1).index_copy_(d, att["slots"], new.transpose(0, d))
    # 2. attend through the page table. flash: bottom-right causal, query t sees keys < seqlens - T + t + 1,
    # i.e. up to lengths + t; padding reads table entries of page 0 that only pad queries see
    if cache.flash:
        # a step being compiled takes the kernel as an operator (flash_decode), an eager one calls it directly
        kernel = flash_decode if torch.compiler.is_compiling() else paged_attention
        return kernel(q, kc, vc, att["seqlens"], att["table"])
    # SDPA: each row's pages, whole, gathered into (Hkv, B, keys, hd), contiguous (keys past a row's length
    # are masked), or kept from the last forward: its stale rows gathered again, the others' new tokens
    # written in; the B rows become the batch of each kv head, whose query heads fold into the query axis
    # prompts: causal attention over the new tokens alone, nothing read from the pages
    if att["fresh"]:
        return sdpa(q, k, v, None)
    if "where" in att:  # the kept gather: all rows afresh, or only the stale ones when att has them
        kg, vg = cache.gather(layer_idx, att["table"], att.get("stale"))
    else:
        # a static decode step (Qwen.static_step): every row's pages afresh, into fixed shapes, nothing kept
        kg, vg = (c[:, att["table"]].flatten(2, 3) for c in (kc, vc))  # (Hkv, B, P * ps, hd)
    # the kept rows take their new tokens (the stale ones got them from the pages)
    if "stale" in att:
        for buf, new in zip((kg, vg), news):
            buf.view(Hkv, -1, hd).index_copy_(1, att["where"], new.transpose(0, 1))
    qg = q.transpose(1, 2).reshape(B, Hkv, -1, hd).transpose(0, 1)  # (Hkv, B, rep * T, hd)
    # mask (1, B, rep * T, keys)
    y = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=att["mask"])
    return y.transpose(0, 1).reshape(B, H, T, hd).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        qkv_bias = cfg.model_type == "qwen2" or cfg.attention_bias
        H = cfg.num_attention_heads
        Hkv = cfg.num_key_value_heads
        hd = cfg.head_dim
        D = cfg.hidden_size
        self.q_proj = nn.Linear(D, H * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.model_type == "qwen3" and cfg.attention_bias)
        if cfg.model_type == "qwen3":
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)  # per head, over head_dim
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, att):
        # q (B, T, H, hd), k and v (B, T, Hkv, hd): each projection's last axis split into heads
        q, k, v = (proj(x).unflatten(-1, (-1, self.cfg.head_dim))
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.cfg.model_type == "qwen3":
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # packed tokens (forward_cached's prefills, forward's shared prefixes): x holds the N tokens that run,
        # (1, N); attention reads them in their rows, right-padded, (B', T'): `gather` is each place's token among
        # the N, `pick` the places whose outputs are the N's, in order
        gather = att.get("gather")
        if gather is not None:
            q, k, v = (z[0][gather] for z in (q, k, v))
        y = attend(q, k, v, att, self.layer_idx)  # (B, T, H, hd), or (B', T', H, hd) packed
        if gather is not None:
            y = y[att["pick"]][None]
        return self.o_proj(y.flatten(2))  # the heads side by side: (B, T, H * hd)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, att):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, att)
        return x + self.mlp(self.post_attention_layernorm(x))


def chunk_logprobs(h, targets, weight, entropy):
    """h (N, D), targets (N,) -> log p(target) (N,) fp32; with a list `entropy` (not None), also appends the
    entropy (N,) to it, without grad, the first time only.

    The entropy is a metric: it never joins the autograd graph. The function runs inside a checkpoint,
    which calls it again in the backward to rebuild the logits; by then the list is filled, so the
    recompute skips the entropy's softmax over the vocabulary (it used to cost ~12% of an update)."""
    logits = F.linear(h, weight).float()  # (N, V): the only full-vocab tensor, one chunk at a time
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    logp = logits.gather(1, targets[:, None]).squeeze(1) - lse
    if entropy is not None and not entropy:
        with torch.no_grad():
            entropy.append(lse - (logits.softmax(-1) * logits).sum(-1))  # H = log Z - E_p[logit]
    return logp


class Qwen(nn.Module):
    """the decoder; attribute names mirror transformers' Qwen3ForCausalLM / Qwen2ForCausalLM"""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(
            # on the meta device, no init inside nn.Embedding: there its normal_ imports torch._dynamo (~2 s)
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
                cfg.vocab_size, cfg.hidden_size) if torch.empty(0).is_meta else None),
            layers=nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        # tied: no lm_head module at all, the embedding matrix is the head (state dict has no lm_head.weight)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                       bias=False)
        self.gradient_checkpointing = False
        # one-token forwards (decode steps): "eager" (forward_cached as is) or static shapes (static_step) run
        # "static", "compile" (inductor) or "graphs" (inductor, as CUDA graphs on a GPU); the compiled functions,
        # one a mode, each made on first use
        self.decode_mode = "eager"
        self.compiled = {}
        # a fresh model (tests, the tiny model) gets HF's init; on the meta device (load_model) none at all
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif not name.endswith("norm.weight"):
                nn.init.normal_(p, std=0.02)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, attention_mask=None, targets=None, chunk_size=1024,
                with_entropy=False, where=None, shared=None, temperature=1.0):
        """logits (B, T, V); or, with targets (B, T), fp32 log-probs (B, T) [, entropy] (see token_logprobs).

        temperature, with targets: the log-probs (and entropy) of softmax(logits / temperature), the distribution
        a sampler at that temperature draws from (rollout.Engine.sample), so an RL trainer's ratio and the
        engine's log-probs are of one policy.

        shared, for right-padded rows on SDPA's path: (rows, counts), (B,) ints each: row b begins with the first
        counts[b] tokens of row rows[b] (whose own count is 0), which only that row runs through the layers; row
        b's attention reads them there. The trajectories of a prompt in an RL micro-batch share it this way, so
        the prompt's tokens go through the layers once (train_rl.micro_batch). Same values as without it."""
        B, T = input_ids.shape
        for name, z in (("attention_mask", attention_mask), ("targets", targets), ("where", where)):
            if z is not None and z.shape != input_ids.shape:
                raise ValueError(
                    f"{name} shape {tuple(z.shape)} != input_ids shape {tuple(input_ids.shape)}")
        weight = self.model.embed_tokens.weight
        t = torch.arange(T, device=weight.device)
        flash = use_flash(weight.device, weight.dtype)
        # SDPA's path with no mask, or one sequence a row, right-padded (as collate pads them): plain causal
        # attention is exact for every real token (its row's padding comes after it), and SDPA skips the blocks
        # above the diagonal (~6% of an RL update on the CPU). flash-attn's path never reads the mask's values here
        right_padded = not flash and (attention_mask is None
                                      or attention_mask.max() <= 1 and (attention_mask.diff() <= 0).all())
        if shared is not None and (attention_mask is None or not right_padded):
            raise ValueError("shared needs right-padded rows (a 0/1 attention_mask), on SDPA's path")
        if right_padded:
            positions = t.expand(B, T)
            att = dict(mask=None)
            if shared is not None:
                rows, counts = shared
                # the places whose tokens a row shares: its first counts[b]
                is_shared = t < counts[:, None]  # (B, T)
                # the tokens each row runs (its own, not shared), packed into one row (1, N) for the layers
                runs = attention_mask.bool() & ~is_shared  # (B, T)
                # each place's token among the N: for a shared place, the same place in the row that runs it
                place = torch.arange(B * T, device=t.device).view(B, T)
                place = torch.where(is_shared, place[rows], place)
                att.update(gather=(runs.flatten().cumsum(0) - 1)[place], pick=runs)
                input_ids = input_ids[runs][None]
                positions = positions[runs][None]
        else:
            m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            # a segment is a run of equal mask values (pads are a segment too, seen by no real token)
            # (B, T) True where a segment begins: each row's first token, and wherever the mask changes
            start = F.pad(m.diff() != 0, (1, 0), value=True)
            # (B, T), restarting per segment
            positions = t - torch.cummax(torch.where(start, t, 0), dim=1).values
            if flash:
                idx = m.flatten().nonzero().squeeze(1)  # (N,) flat indices of real tokens
                # where each segment begins among them
                seg_starts = start.flatten()[idx].nonzero().squeeze(1)
                # (S + 1,) cumulative lengths
                cu = F.pad(seg_starts, (0, 1), value=idx.numel()).int()
                att = dict(varlen=(idx, cu, int(cu.diff().max())))
            else:
                seg = start.cumsum(1)  # (B, T) segment number within the row
                causal = t[:, None] >= t[None, :]  # (T, T)
                # (B, T, T)
                att = dict(mask=(seg[:, :, None] == seg[:, None, :]) & causal)
        x = self.run(input_ids, positions, att)  # (B, T, D), or (1, N, D) packed
        if "gather" in att:  # every place of the rows, shared ones too
            x = x[0][att["gather"]]
        if targets is None:
            return F.linear(x, self.head_weight())  # (B, T, V)
        h = x.flatten(0, 1)  # (B * T, D)
        tg = targets.flatten().clamp(min=0)  # clamp: ignore_index -100 is fine
        if where is not None:
            # the output layer only at the positions asked for (the loss's): in an RL batch most positions are
            # prompt, tool output or padding. With none asked for, position 0 still goes through the head, so
            # its weight joins the backward on every rank (FSDP reduces it everywhere), then is zeroed below
            picked = where.flatten().nonzero().squeeze(1)  # (N,)
            picked = picked if picked.numel() else picked.new_zeros(1)
            h = h[picked]
            tg = tg[picked]
        # logits / temperature, as the hidden states divided before the output layer (at 1, nothing to do)
        if temperature != 1:
            h = h / temperature
        # chunked head: each chunk's fp32 logits live only inside its checkpoint
        starts = range(0, len(h), chunk_size)
        # one list per chunk that its entropy goes into, once (see chunk_logprobs)
        ents = [[] if with_entropy else None for _ in starts]
        out = [torch.cat([checkpoint(chunk_logprobs, h[i:i + chunk_size], tg[i:i + chunk_size],
                                     self.head_weight(), e, use_reentrant=False)
                          for i, e in zip(starts, ents)])]
        if with_entropy:
            out.append(torch.cat([e[0] for e in ents]))
        if where is not None:  # back to (B, T), 0 at every position not asked for
            asked = where.flatten()[picked]
            out = [z.new_zeros(B * T).index_copy(0, picked, torch.where(asked, z, 0.0))
                   for z in out]
        out = [z.view(B, T) for z in out]
        return tuple(out) if with_entropy else out[0]

    def run(self, input_ids, positions, att, last=None):
        """The layers, once forward or forward_cached has set up the attention (att): the final norm's output
        (B, T, D), or (B, 1, D) at each row's token `last` (B,): indices into the B x T tokens, flattened. Nothing
        in it changes shape on the Python side, so a static decode step (static_step) compiles and captures it
        whole."""
        x = self.model.embed_tokens(input_ids)  # (B, T, D)
        cos, sin = rope_cos_sin(positions, self.cfg, x.dtype)
        # activation checkpointing: only a backward needs the recompute (not eval, nor a no_grad forward)
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, att, use_reentrant=False)
            else:
                x = layer(x, cos, sin, att)
        if last is not None:
            x = x.flatten(0, 1)[last][:, None]  # (B, 1, D): each row's last real token
        return self.model.norm(x)

    @torch.no_grad()  # decoding never needs grads, and in-place cache writes must not join a graph
    def forward_cached(self, input_ids, cache, rows, last_only=False, n_new=None):
        """T new tokens for each of B cache rows -> logits (B, T, V), or (B, 1, V) with last_only.

        rows: a slice of rows, a list or a LongTensor (B,) of distinct row indices, in any order.
        Row b's tokens get positions lengths[b] + arange(T); afterwards lengths[rows] += T.
        n_new, a list of B ints, for prefilling rows of different lengths in one forward: only the first
        n_new[b] tokens of row b are real, the rest right padding (never written to the cache, never
        seen by a real token); lengths[rows] += n_new, and last_only picks each row's last real token.
        Every row must already hold pages for its real tokens (KVCache.grow: the caller decides who gets
        memory); the pool is never written outside a row's own pages.

        One-token forwards (decode steps) run as self.decode_mode says: "eager", the default, as any
        forward; or at static shapes (static_step) "static", "compile" or "graphs".
        """
        B, T = input_ids.shape
        # a slice, list or tensor of rows -> LongTensor (B,)
        rows = torch.arange(cache.num_rows)[rows]
        row_indices = rows.tolist()
        if rows.shape != (B,) or len(set(row_indices)) != B:
            raise ValueError(f"rows must be {B} distinct row indices, got {row_indices}")
        lengths = cache.lengths[rows]  # (B,) on CPU
        n = torch.full((B,), T) if n_new is None else torch.tensor(n_new)
        if n.shape != (B,) or not (1 <= n.min() and n.max() <= T):
            raise ValueError(f"n_new must be {B} counts in 1..{T}, got {n.tolist()}")
        # the rows without the pages their new tokens need
        held = torch.tensor([cache.npages[row] for row in row_indices])  # (B,) pages
        short = (lengths + n > held * cache.page_size).nonzero()[:, 0]
        if len(short):
            b = int(short[0])
            raise ValueError(f"KV cache overflow: row {int(rows[b])} holds {int(lengths[b])} tokens "
                             f"in {int(held[b])} pages, +{int(n[b])} new needs more "
                             f"(max_len {cache.max_len}): grow the row first")
        weight = self.model.embed_tokens.weight
        pool = cache.layers[0][0]
        if (pool.dtype, pool.device) != (weight.dtype, weight.device):
            raise ValueError(f"KV cache is {pool.dtype} on {pool.device}, the model runs "
                             f"{weight.dtype} on {weight.device}")
        dev = weight.device
        # a decode step at static shapes: see static_step
        static = T == 1 and self.decode_mode != "eager"
        pos = lengths[:, None] + torch.arange(T)  # (B, T)
        # the page table of the keys this forward reads, padding included: page 0 past a row's own pages
        ps = cache.page_size
        width = cache.table.shape[1]  # the pages of a whole row
        P = cache.pages(int((lengths + T).max()))
        if static:  # the pages read: a power of two, at most a whole row's
            P = min(1 << (P - 1).bit_length(), width)
        # (B, P): the rows' tables padded with page 0 to P pages, or cut to P (a negative pad cuts)
        table = F.pad(cache.table[rows], (0, P - width))
        real = torch.arange(T) < n[:, None]  # (B, T)
        # (N,) the flat pool index of each real token
        slots = (table.gather(1, pos // ps) * ps + pos % ps)[real]
        # the rows: a power of two, the padding rows' token written into the pool's spare page
        if static:
            pad = (1 << (B - 1).bit_length()) - B
            input_ids, pos, table = (F.pad(z, (0, 0, 0, pad)) for z in (input_ids, pos, table))
            slots = F.pad(slots, (0, pad), value=cache.num_pages * ps)
        att = dict(cache=cache, slots=slots.to(dev),
                   real=slice(None) if real.all() else real.flatten().to(dev),
                   # fresh: rows with nothing in the cache yet (prompts)
                   fresh=not (static or lengths.any()))
        if cache.flash:
            att.update(table=table.to(dev, torch.int32),
                       seqlens=(pos[:, -1] + 1).to(dev, torch.int32))
        elif not att["fresh"]:
            # (B, T, P * ps): key j visible to new token t
            mask = torch.arange(P * ps) <= pos[:, :, None]
            # as the additive mask SDPA makes of it, once for all layers, one copy per query head of a kv group
            # (one token per row, T = 1: the query heads share the one copy, broadcast)
            rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads if T > 1 else 1
            mask = torch.where(mask, 0.0, float("-inf")).to(weight.dtype)
            att.update(table=table.to(dev), mask=mask.repeat(1, rep, 1)[None].to(dev))
            # the keys gathered by the last forward (that went through the kept gather) are kept, but for a
            # static step (it gathers every row's pages afresh, into fixed shapes: see attend)
            if not static:
                # with as many rows and pages, a row in the same place holding what it left there reads them,
                # plus its new ones (a decode step, usually); the other rows (stale) are gathered afresh, all of
                # them when the shape changed. cache.last: those pages, and each place's (row, version, tokens):
                # a row released since holds other tokens under a new version, whatever their number
                versions = torch.tensor([cache.versions[row] for row in row_indices])  # (B,)
                now = torch.stack([rows, versions, lengths], 1)  # (B, 3)
                last_P, last = cache.last or (0, now[:0])
                if (last_P, len(last)) == (P, B):
                    att["stale"] = (last != now).any(1).nonzero()[:, 0].to(dev)
                cache.last = (P, torch.stack([rows, versions, lengths + n], 1))
                # (N,): each new token's place in the kept gather
                att["where"] = (torch.arange(B)[:, None] * P * ps + pos)[real].to(dev)
        # a prefill of rows of different lengths (to each row's last token): the layers run on the real tokens
        # alone, packed into one row (1, N) of positions pos (Attention unpacks them around attention); with no
        # padding there is nothing to gain (the unpacking costs ~9% of a prefill of 32 rows of 40 tokens)
        if last_only and not real.all():
            # the padding's places read the token before them, which no real token sees there
            att.update(gather=(real.flatten().cumsum(0) - 1).view(B, T).to(dev), pick=real.to(dev))
            input_ids = input_ids[att["pick"]][None]
            pos = pos[real][None]
        if static:
            x = self.static_step(input_ids, pos.to(dev), att)[:B]
        else:
            # each row's last real token, counted in the B x T tokens flattened (or packed: the N real ones)
            x = self.run(input_ids, pos.to(dev), att, n.cumsum(0) - 1 if last_only else None)
        cache.lengths[rows] += n
        return F.linear(x, self.head_weight())  # (B, T or 1, V)

    def static_step(self, input_ids, pos, att):
        """A one-token forward (a decode step) at fixed shapes, set up by forward_cached: the rows padded to a
        power of two (their tokens written into a spare page), the page table to a power of two pages, every
        row's pages gathered afresh (SDPA) or read through the table (flash-attn), no data-dependent branch.
        Returns the final norm's output (B, 1, D), which forward_cached passes through the head at once.
        self.decode_mode says how it runs: "static" eagerly; "compile" through inductor (torch.compile, on a
        CPU too; the first step of each shape compiles; flash-attn's kernel goes in as an operator, flash_decode);
        "graphs" the same, and on a GPU launched as CUDA graphs (torch.compile's mode "reduce-overhead": a graph
        per shape, recorded on its first steps, replayed after; vLLM's and SGLang's way of launching a step's
        hundreds of small kernels at once; on a CPU it is "compile"). The same tokens as "eager"
        (tests/test_decode.py; on flash-attn's path tests/test_model.py). "graphs" has not run on a GPU yet:
        `bench.py gpu` section 3b times it ("reduce-overhead") beside bench.py's GraphedSteps, CUDA graphs
        captured by hand (torch.cuda.graph, ~215 code tokens), against which it is to be measured."""
        if self.decode_mode == "static":
            return self.run(input_ids, pos, att)
        if self.decode_mode not in ("compile", "graphs"):
            raise ValueError(f"decode_mode {self.decode_mode!r}: eager, static, compile or graphs")
        # the KV pools at fixed addresses: a CUDA graph writes into them in place (not so marked, a step that
        # writes into its inputs would be left out of the graphs). Marked at every step, as an engine made later
        # brings pools of its own: ~28 us a step at 40 layers (CPU), against ~1.7 s of importing torch._dynamo
        # at every KVCache's start were it done there (eval.py imports it nowhere else)
        for pool in itertools.chain(*att["cache"].layers):
            torch._dynamo.mark_static_address(pool)
        # "graphs": inductor's code run as CUDA graphs (its mode "reduce-overhead"), a graph per shape
        mode = "reduce-overhead" if self.decode_mode == "graphs" else None
        if mode not in self.compiled:
            self.compiled[mode] = torch.compile(self.run, fullgraph=True, mode=mode)
        return self.compiled[mode](input_ids, pos, att)


def collate(seqs, device, packed, prompts=()):
    """Turn sequences (dicts of equal-length per-token lists or arrays) into a micro-batch of tensors
    (ints as int64, floats as float32) plus "seg", the attention mask. packed=True: one row (1, N),
    sequences told apart by segment ids 1, 2, ... (flash-attn's varlen kernel does no work across them).
    packed=False: a right-padded (n, Lmax) batch with a 0/1 mask — cheaper for SDPA, whose attention over
    one long packed row would cost O(N²). An empty bin becomes a single zero token (it still joins the
    FSDP collectives).
    prompts, with packed=False: each sequence's (prompt, count): sequences of the same prompt begin with the
    same `count` tokens, which the first of them runs through the layers for all (out["shared"], the `shared`
    of Qwen.forward)."""
    if not seqs:
        # RL's keys
        seqs = [{"ids": [0], "tgt": [0], "mask": [0], "adv": [0.0], "engine_logprobs": [0.0],
                 "traj_index": [0]}]
    lengths = [len(s["ids"]) for s in seqs]
    cols = {k: [np.asarray(s[k]) for s in seqs] for k in seqs[0]}
    if packed:
        out = {k: np.concatenate(v)[None] for k, v in cols.items()}
        out["seg"] = np.repeat(np.arange(1, len(seqs) + 1), lengths)[None]
    else:
        width = max(lengths)
        out = {k: np.stack([np.pad(x, (0, width - len(x))) for x in v]) for k, v in cols.items()}
        out["seg"] = np.arange(width)[None] < np.array(lengths)[:, None]  # True on real tokens (int64 below)
        if prompts:
            keys = [prompt for prompt, _count in prompts]
            # each row's first row of its prompt, and the tokens it takes from there (none when it is that row)
            rows = [keys.index(key) for key in keys]
            counts = [count if rows[row] != row else 0 for row, (_, count) in enumerate(prompts)]
            # a row that does not begin with what it shares would train on another row's tokens, silently
            for row, (src, count) in enumerate(zip(rows, counts)):
                if not np.array_equal(cols["ids"][row][:count], cols["ids"][src][:count]):
                    raise ValueError(f"sequence {row} does not begin with the {count} prompt tokens of sequence "
                                     f"{src}, the first of prompt {prompts[row][0]!r}")
            out["shared"] = np.array([rows, counts])
    return {k: torch.from_numpy(v).to(device, torch.float32 if v.dtype.kind == "f" else torch.long)
            for k, v in out.items()}


def token_logprobs(model, input_ids, targets, attention_mask=None, **kwargs):
    """(B, T) fp32 log p(targets[b, t] | logits at t) [, (B, T) entropy]; never holds the full fp32 logits.

    kwargs, Qwen.forward's: chunk_size=1024 (positions whose logits are held at once), with_entropy=False
    (True: the entropy too), where=None, temperature=1.0 (those of softmax(logits / temperature)).
    where (B, T) bool, optional: compute them only there (the loss mask: the output layer, the largest
    matmul of a small model, then runs on the sampled tokens alone); 0 elsewhere, with no gradient.
    Targets outside the vocabulary below 0 (ignore_index) are read as token 0: mask them yourself.
    Goes through model(...) so FSDP's hooks gather the head weights as for any forward (which checks the shapes).
    """
    return model(input_ids, attention_mask, targets=targets, **kwargs)


# -----------------------------------------------------------------------------
# KV cache for incremental decoding

class KVCache:
    """A paged KV cache: one pool of fixed-size pages shared by num_rows sequences of up to max_len tokens.

    self.layers[i] is layer i's pair of pools, keys and values, each (num_pages, page_size, n_kv_heads,
    head_dim), flash-attn's paged layout, when it decodes; else (n_kv_heads, num_pages, page_size, head_dim),
    from which SDPA's path gathers a head's pages into contiguous keys, whole pages at a time (`gather`). Row
    r's pages, in order, are table[r, :npages[r]]: token t of the row lives in page table[r, t // page_size] at
    slot t % page_size.
    A row takes pages as it grows (`grow`) and returns them when it is done (`release`); who gets memory
    when the pool runs short is the caller's decision (rollout.Pager picks and preempts rows). Pages are counted by
    reference: the samples of one prompt hold the prompt's full pages together (`share`), and a row only
    ever writes past its length, into pages it holds alone. Zero-filled, so never-written slots are
    finite (masked keys still multiply their values by 0).
    """

    def __init__(self, cfg, num_rows, max_len, device, dtype, page_size, num_pages=None):
        self.flash = use_flash(device, dtype) and paged_flash(str(device), dtype)
        if self.flash and page_size % 256:  # flash_attn_with_kvcache's documented requirement
            raise ValueError(f"flash-attn's paged KV cache needs page_size a multiple of 256, got {page_size}")
        self.num_rows = num_rows
        self.max_len = max_len
        self.page_size = page_size
        width = self.pages(max_len)  # pages of a full row
        self.num_pages = num_rows * width if num_pages is None else num_pages
        if self.num_pages < width:
            raise ValueError(f"a pool of {self.num_pages} pages of {page_size} tokens cannot hold one row of "
                             f"max_len {max_len}")
        L = cfg.num_hidden_layers
        Hkv = cfg.num_key_value_heads
        hd = cfg.head_dim
        # one page more than the rows can hold: a static decode step writes its padding rows' tokens into it
        pages = self.num_pages + 1
        pool = (pages, page_size, Hkv, hd) if self.flash else (Hkv, pages, page_size, hd)
        self.page_dim = 0 if self.flash else 1  # the pages' axis of a pool
        # each pool its own tensor: a compiled decode step (Qwen.static_step) writes its tokens into them in place,
        # where it copied all layers' pools, whole, every step when they were views of one tensor (x27 slower than
        # eager at batch 32 with 304 MiB of KV on the CPU, 2 s a step with 2.4 GiB)
        self.layers = [[torch.zeros(pool, device=device, dtype=dtype) for _ in "kv"]
                       for _ in range(L)]
        # SDPA: each layer's gathered keys and values (`gather`), and what they hold: (pages, a (places, 3)
        # tensor of each place's row, version and tokens), set by model.forward_cached
        self.kept = [None] * L
        self.buffers = [torch.empty(0, device=device, dtype=dtype) for _ in range(L)]
        self.last = None
        # how many times each row was released: its tokens in the kept gather are its own while it keeps its
        # version (a list, bumped a row at a time: marking the row in `last` cost ~70 us a release)
        self.versions = [0] * num_rows
        self.lengths = torch.zeros(num_rows, dtype=torch.long)  # tokens held by each row (CPU)
        # unused entries: page 0, never written
        self.table = torch.zeros((num_rows, width), dtype=torch.long)
        # pages held by each row, a list: read and written a row at a time (~1 us, a tensor's element ~10 us)
        self.npages = [0] * num_rows
        self.refs = [0] * self.num_pages  # rows holding each page
        self.free = list(range(self.num_pages))[::-1]  # pop() hands out the lowest page first

    def pages(self, tokens):
        return -(-tokens // self.page_size)

    def grow(self, row, tokens):
        """give row enough pages for `tokens` tokens; an error when the pool has too few free pages"""
        need = max(0, self.pages(tokens) - self.npages[row])  # the free pages it must take
        if tokens > self.max_len or need > len(self.free):
            raise RuntimeError(f"KV pool: row {row} needs {need} more pages for {tokens} tokens (max_len "
                               f"{self.max_len}), {len(self.free)} of {self.num_pages} are free")
        for _ in range(need):
            page = self.free.pop()
            self.refs[page] = 1
            self.table[row, self.npages[row]] = page
            self.npages[row] += 1

    def share(self, src, dsts):
        """the empty rows dsts start as copies of src's tokens: src's full pages by reference, and each a page of
        its own holding a copy of src's last, partly filled one (copy on write, done at once: its next token
        goes into that page), copied for all of dsts at once: a few kernels a layer, however many samples.
        A dst that holds tokens is refused (a caller's bug: the engine hands over rows it has just claimed)."""
        n = int(self.lengths[src])
        full = n // self.page_size
        # src's full pages, which every dst holds too
        full_pages = self.table[src, :full]
        for dst in dsts:
            if self.npages[dst]:
                raise ValueError(f"share: row {dst} is not empty")
            for page in full_pages.tolist():
                self.refs[page] += 1
            self.table[dst, :full] = full_pages
            self.npages[dst] = full
            # the page of its own, if src has a partly filled one
            self.grow(dst, n)
            self.lengths[dst] = n
        if n % self.page_size and dsts:
            # src's last page, and each dst's own copy of it
            pages = self.table[[src, *dsts], full].to(self.layers[0][0].device)
            for pool in itertools.chain(*self.layers):
                pool.index_copy_(self.page_dim, pages[1:],
                                 pool.index_select(self.page_dim, pages[0].expand(len(dsts))))

    def gather(self, layer, table, stale):
        """SDPA's keys and values of `layer` for the rows whose pages are table (B, P): (Hkv, B, P x page_size,
        head_dim) each, contiguous, in the layer's buffer, kept (`kept`) for the next forward: with as many rows
        and pages, it gathers only its `stale` rows into it (model.forward_cached says which: those not in the
        same place holding the same tokens; None: every row, afresh) and writes the others' new tokens in
        (model.attend). The price: a second copy of the decoding rows' keys and values. (At batch 64 of
        bench.py's model, the gather this replaced, of the pages in flash-attn's layout into a fresh tensor,
        took ~1.7x as long as one gather here, and SDPA on the strided keys it gave ~3x as long as on these.)"""
        (Hkv, _, ps, hd), (B, P) = self.layers[layer][0].shape, table.shape
        if stale is not None:
            for pool, buf in zip(self.layers[layer], self.kept[layer] if len(stale) else ()):
                # (Hkv, stale rows, P, ps, hd)
                buf.view(Hkv, B, P, ps, hd)[:, stale] = pool[:, table[stale]]
            return self.kept[layer]
        size = 2 * Hkv * B * P * ps * hd  # the keys' and the values' elements
        if self.buffers[layer].numel() < size:
            self.buffers[layer] = self.buffers[layer].new_empty(size)
        bufs = self.buffers[layer][:size].view(2, Hkv, B * P, ps, hd)  # keys, values
        for pool, buf in zip(self.layers[layer], bufs):
            torch.index_select(pool, 1, table.flatten(), out=buf)
        self.kept[layer] = [buf.view(Hkv, B, P * ps, hd) for buf in bufs]
        return self.kept[layer]

    def release(self, row):
        """row gives its pages back (those no other row holds become free) and holds no tokens"""
        # the kept gather's copy of the row is stale from now on (model.forward_cached compares versions)
        self.versions[row] += 1
        for page in self.table[row, :self.npages[row]].tolist():
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)
        self.table[row] = 0
        self.npages[row] = 0
        self.lengths[row] = 0

    def holds(self, row):
        """whether row has any tokens in the cache"""
        return bool(self.lengths[row])

    def free_pages(self):
        return len(self.free)


# -----------------------------------------------------------------------------
# checkpoints: HF safetensors directories

def load_model(path, device="cpu", dtype=torch.float32):
    """a Qwen built on the meta device (no init wasted), materialised on `device` and filled from `path`.
    device="meta" returns it unmaterialised (for shard_model + load_weights)."""
    with torch.device("meta"):
        model = Qwen(Config.from_json(path)).to(dtype)
    if torch.device(device).type != "meta":
        load_weights(model, path, device)
    return model


@torch.no_grad()
def load_weights(model, path, device):
    """copy the safetensors in `path` into model's parameters, tensor by tensor in the params' dtype.

    A model still on the meta device is first materialised on `device`. FSDP2-sharded (DTensor)
    params read only this rank's rows (Shard(0)), so no rank ever holds the full model.
    Optimizers must be built after this (materialising replaces the parameter objects).
    """
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    # the weight files: a sharded checkpoint's index names its shards, else one model.safetensors
    index = f"{path}/model.safetensors.index.json"
    files = [f"{path}/model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = [f"{path}/{name}"
                     for name in sorted(set(json.load(f)["weight_map"].values()))]
    elif not os.path.exists(files[0]):
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    params = dict(model.named_parameters())
    loaded = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                # some tied checkpoints store the head anyway; older exports store rope's inv_freq buffer
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings or name.endswith("inv_freq"):
                    continue
                if name not in params:
                    raise KeyError(f"{file}: tensor {name!r} matches no parameter of the model")
                p = params[name]
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != p.shape:
                    raise ValueError(f"{file}: {name} has shape {sl.get_shape()}, the model "
                                     f"expects {tuple(p.shape)}")
                # the rows of the tensor this rank holds, from row `start`: all of them unless sharded
                local = p
                start = 0
                if isinstance(p, DTensor):
                    if p.placements != (Shard(0),):
                        raise ValueError(f"{name}: load_weights reads Shard(0) DTensors only, got "
                                         f"{p.placements}")
                    # FSDP2 shards dim 0 like torch.chunk: rank r owns rows [r*c, r*c + local rows)
                    local = p.to_local()
                    start = p.device_mesh.get_local_rank() * math.ceil(p.shape[0] / p.device_mesh.size())
                if local.shape[0] > 0:
                    local.copy_(sl[start:start + local.shape[0]])
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"{path}: no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def full_value(tensor):
    """A DTensor's whole value (a collective: every rank must call it), or a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def save_model(model, path, max_shard_bytes=5 * 2**30, dtype=None):
    """write config.json + safetensors (sharded with an index above max_shard_bytes) under HF names.

    dtype: save in this dtype (e.g. torch.bfloat16 from fp32 master weights); None keeps each param's.
    Under FSDP every rank must call this: params are gathered one at a time with full_tensor() and
    only rank 0 writes, holding at most one shard in memory.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    params = dict(model.named_parameters())
    dtype = dtype or next(model.parameters()).dtype
    # plan shards from global sizes, so every rank agrees without communication
    shards = [[]]
    size = 0  # bytes in the last shard
    total = 0  # bytes in all of them (the index's total_size)
    for name, p in params.items():
        nbytes = p.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        total += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if rank0:
        os.makedirs(path, exist_ok=True)
        # a stale single file or index would shadow the new weights; the config goes too, and comes
        # back last: a save cut short (a kill, a full disk) leaves no directory that reads as a model
        for old in os.listdir(path):
            weights = old.startswith("model") and old.endswith((".safetensors", ".safetensors.index.json"))
            if weights or old == "config.json":
                os.remove(f"{path}/{old}")
    for names, file in zip(shards, files):
        tensors = {}
        for name in names:
            # a collective: all ranks take part
            t = full_value(params[name].detach())
            if rank0:
                tensors[name] = t.to(device="cpu", dtype=dtype).contiguous()
        if rank0:
            save_file(tensors, f"{path}/{file}", metadata={"format": "pt"})
    if rank0 and len(shards) > 1:
        weight_map = {name: file for names, file in zip(shards, files) for name in names}
        with open(f"{path}/model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if rank0:
        with open(f"{path}/config.json", "w") as f:
            json.dump(model.cfg.to_dict(dtype), f, indent=2)


# -----------------------------------------------------------------------------
# FSDP2

def shard_model(model, mesh=None, param_dtype=torch.bfloat16):
    """fully_shard each decoder layer, then the root (embeddings, final norm, head), in place.

    Params stay fp32 shards (the master copy the optimizer updates); forward/backward all-gather them
    in param_dtype (None = keep fp32, for CPU tests) and reduce-scatter grads in fp32.
    forward_cached is registered too, so a sharded model can also decode.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    register_fsdp_forward_method(model, "forward_cached")

"""
Side-by-side speed benchmarks of our rollout engine (rollout.Engine + model.forward_cached) against
transformers' `generate`, on the same random model in the same process. Benchmarks, not timed tests:
they print tables with both sides and the ratio; nothing asserts a speed.

    python bench.py            # a, l, b, k and c below (~5 minutes on one thread of a 2-core CPU)
    python bench.py a          # or l, b, k, c, u, g, p (u, g and p are not part of the default run)
    python bench.py sandbox    # the tool sandbox pool vs a fresh python3 per call (~3 minutes)
    python bench.py scale      # what crosses ranks after a rollout phase, before / after, at 64-GPU scale
    python bench.py mem        # one 14B rank's training transients (a layer's recompute, the output layer)
    python bench.py eval       # eval.py's engine, reserve 0.5 vs "auto", on the demo's held-out set (~1 minute)
    python bench.py gpu        # the prepared check for a GPU (below); --cpu dry-runs it at toy sizes
    python bench.py trl        # RL steps of train_rl.py vs TRL's GRPOTrainer (trl: its own venv)
    python bench.py --threads=2 --reps=5

The model: a random Qwen3 built with transformers (4 layers, width 256, 8 heads / 4 kv heads of 32,
MLP 768, untied lm_head scaled x8 so greedy argmax is not decided by near-ties), vocabulary = the tiny
tokenizer (data.train_tokenizer on rendered prompts), saved to a temp dir and loaded twice: with
model.load_model (ours) and AutoModelForCausalLM.from_pretrained (transformers). fp32, CPU.

(a) single-turn greedy: B distinct rendered prompts, N new tokens, no EOS stop on either side, so both
    do identical work. transformers: one `generate` call on the left-padded batch. Reports tokens/s,
    the ratio, and the share of the compute bound: FLOPs per token (2 x non-embedding params + 2 x hidden
    x vocab + attention at the mean context) x tokens/s / measured fp32 matmul FLOP/s. The matmul rate
    is measured two ways: "mix" = exactly the matmuls of one decode step at batch B (the 28 projections
    and the lm_head, as F.linear, M = B rows), timed interleaved with the runs so it sees the same load;
    that is the bound a decode step can reach on this CPU. "square" = one 2048^3 matmul, the machine's
    best fp32 rate. The "+prefill" column also counts the prompt tokens' FLOPs as useful work; "steps"
    is the decode steps alone (a run of 1 new token is timed too: it is the prefill). "ours compiled" is
    the same engine with model.decode_mode = "compile" (issue 45: its decode steps at static shapes through
    inductor; its first run, which compiles each shape, is timed apart), its tokens checked against eager's.
(l) single-turn greedy where answers end at long-tailed lengths (lognormal, mean ~64 tokens, at most
    256; the end is forced as an <|im_end|> at each prompt's target length, the model's argmax decides
    the rest): 192 prompts. Ours: Engine.generate with 64 rows, a finished row admitting the next
    prompt at once. transformers: `generate` on batches of 64, each batch decoding until its longest
    answer ends (finished rows keep their seat). Same answers on both sides. This is what continuous
    batching is for; (a) is the same work on both sides by construction.
(b) multi-turn with two tool calls per sample: 3 assistant turns of TURN_LEN tokens with 2 fixed tool
    responses in between. The real model computes every token; only the turn boundaries are forced:
    the last tokens of turns 1-2 are forced to a parseable <tool_call> block + <|im_end|>, the last token
    of turn 3 to <|im_end|>, and before that the turn-ending / tool-call tokens are masked out (argmax
    of the real logits otherwise). Ours runs through Engine.run, the thing we ship: the forcing is a
    thin wrapper around model.forward_cached, the tools a stub whose futures are already done, so the
    engine parses the calls, parks and resumes rows and prefills each tool response into the kept KV.
    transformers: the natural loop, one `generate` per turn on the whole left-padded history
    (re-prefill), with the same forcing as a logits processor. Both must produce identical trajectories.
(k) (l)'s and (b)'s workloads on the paged engine (reserve 0.5 and "auto") against the full-reservation
    engine (reserve 1.0), at several KV memories (paging()).
(c) the scheduler simulator's table (static vs dynamic at 64-engine scale), run as a subprocess with
    --efficiency = the share of the compute bound our engine reached in (a) (see main for why).
(sandbox) the tool pool (sandbox.py, isolation on) vs the released executor's pattern, a fresh python3
    per call with the same rlimits, at concurrency 1, 64 and 1024: trivial and sympy snippets, throughput,
    latency end to end and inside the sandbox, and the speed goals (run alone: `python bench.py sandbox`).
(gpu) one command for a GPU, well under 10 minutes, a table printed and JSON written (--out): a random Qwen3
    of Qwen3-0.6B's shapes made by transformers (no download): (1) our logits against transformers' Qwen3 in fp32
    and bf16 on a padded batch; (2) the engine's greedy tokens against transformers' greedy decoding of each
    prompt alone (fp32 must agree in full; bf16's common prefix is reported); (3) bf16 decode tokens/s at batch
    1, 32 and 64, ours against `generate` on identical work and against the card's HBM roofline (weights + KV
    read once per step); (4) where flash-attn decodes through a page table, the same engine reading its pages
    through SDPA; (3b) the engine's decode steps eager against static-shape steps captured as CUDA graphs
    (GraphedSteps, issue 45), ms per step, the tokens against eager's (rows identical, mean common
    prefix: bf16 rounds differently in a static step); peak GPU memory per section; (5) RL steps of configs/tiny_rl.py in bf16 through train_rl.py
    (needs out/tiny-sft and out/data from `bash run.sh`'s first two stages, or --model_path / --data_path).
(u) the policy update of one tiny RL step, the way train_rl.py did it before issue 32 (pack, the output layer
    at every position) and now (pack_sorted, the output layer only at the loss mask): same loss and grad norm.
(g) grading inline in the engine's on_finish vs grading.Grader off the decode loop (grading_off_the_loop).
(scale) what crosses ranks after a rollout phase, measured on 2 gloo ranks and extrapolated to 64 by the
    measured cost per trajectory times the count, each term printed (never below 0).
(trl) RL steps of train_rl.py (rollout + grade + update) against TRL's GRPOTrainer's on the same
    work: configs/tiny_rl.py's model, prompts (ours' first, checked in its rollout dumps), group,
    budget, temperature, learning rate and loss (no KL, clip-higher, token-mean, std-scaled
    advantages, one optimizer step); one assistant turn without the tool, a reward that varies
    there (TRL_TASK); plain GRPO, then RoC (TRL trains all 2G); then both again with the tool
    (tasks/math.py, multi-turn: TRL's tools= with our sandbox behind it, the same prompt and turn
    tokens). TRL generates with transformers' generate.
    Each side runs --trl_steps steps in a fresh process, one thread, ours then TRL, --reps rounds:
    seconds and generated tokens per step, the ratio per step and per token, and what is not equal.
    TRL runs in its own venv (trl_bench's docstring); without it the section says so and exits 0.
(p) where our engine spends its time: the split of one generate() into prefill / decode / sampling,
    and torch-profiler top ops inside the decode steps.

Every timing is interleaved (ours, transformers, matmul mix, repeat) and repeated at least --reps times,
and more while a median still moves by more than 3%; medians are reported, with the load average
(the machine is shared: other jobs slow both sides alike, the ratios are the numbers to read).
"""
import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import gzip
import io
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
import unittest.mock

import torch
import torch.nn.functional as F
import transformers

import agent
import data
import grading
import model as modeling
import rollout
import sandbox
from common import read_jsonl
from grpo_roc import policy_loss
from model import collate, flash_attn_with_kvcache, load_model, token_logprobs
from rollout import Engine, Request, iter_claim
from sandbox import Result, SandboxPool
from tasks import math as math_task

N_NEW = 128  # (a) new tokens per row
BATCHES = (32, 64)  # (a) batch sizes
MT_BATCH = 32  # (b) samples
TURN_LEN = 32  # (b) tokens per assistant turn, the forced end included
CODE, STDOUT = "print(48213 * 907 - 66)", "43729125\n"  # (b) every tool call and its fixed answer
CALL_TEXT = ('</reason>\n<tool_call>\n{"name": "%s", "arguments": {"code": "%s", "input": ""}}\n</tool_call>'
             % (agent.TOOL_NAME, CODE))
RESULT = types.SimpleNamespace(status="ok", stdout=STDOUT, stderr="", value="", duration=0.0)


def load():
    return os.getloadavg()[0]


def medians(fns, reps, tol=0.03):
    """Time each fn in turn (interleaved, so a change of load hits all alike), at least reps rounds and
    then until no median moves by more than tol (at most 3 x reps rounds). -> (median seconds, rounds)."""
    times, prev = [[] for _ in fns], None
    while True:
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        med = [statistics.median(t) for t in times]
        n = len(times[0])
        settled = prev is not None and all(abs(m - p) <= tol * p for m, p in zip(med, prev))
        if n >= 3 * reps or (n >= reps and settled):
            return med, n
        prev = med


def left_pad(seqs, pad):
    """token-id lists -> ids (B, L) left-padded, attention mask (B, L): generate's natural batch"""
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s)
        mask[i, L - len(s):] = 1
    return ids, mask


def build_models(path, n_prompts):
    """the tokenizer, the random Qwen3 saved to path, loaded by us and by transformers, and prompts"""
    problems = data.make_problems(n_prompts, seed=0)
    texts = [agent.prompt_text(p["question"]) + CALL_TEXT + agent.END + agent.tool_suffix_text([STDOUT.strip()])
             for p in problems[:64]]  # the vocabulary does not depend on how many prompts a run needs
    tok = data.train_tokenizer(texts)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, head_dim=32, intermediate_size=768,
                                   max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # logits std ~2.5: greedy outputs do not flip on rounding differences
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return ours, hf, tok, [data.render_prompt(tok, p["question"]) for p in problems]


def flops_per_token(model, ctx):
    """2 x non-embedding params + 2 x hidden x vocab (lm_head) + attention (q.k and p.v) over ctx keys"""
    c = model.cfg
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    attention = 2 * 2 * c.num_hidden_layers * ctx * c.num_attention_heads * c.head_dim
    return 2 * body + 2 * c.hidden_size * c.vocab_size + attention


def step_matmuls(model, M, repeat=10):
    """(fn, flops): fn runs the matmuls of one decode step at batch M (every nn.Linear as F.linear), repeat times"""
    ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(M, w.shape[1]) for w in ws]

    def fn():
        for _ in range(repeat):
            for x, w in zip(xs, ws):
                F.linear(x, w)
    return fn, repeat * sum(2 * M * w.numel() for w in ws)


def square_rate(n=2048):
    """fp32 FLOP/s of an n x n x n matmul (median of 3)"""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    (t,), _ = medians([lambda: a @ b], 3)
    return 2 * n ** 3 / t


# -----------------------------------------------------------------------------
# (a) single-turn greedy throughput

def single_turn(ours, hf, tok, prompts, B, N, reps):
    P = prompts[:B]
    L = max(map(len, P))
    engine = Engine(ours, tok, kv_capacity=B * (L + N + 1), max_len=L + N + 1)
    engine.stop_ids = set()  # no EOS stop: every row generates exactly N tokens, as transformers below
    ids, mask = left_pad(P, tok.pad_token_id)

    def run_ours(n=N, mode="eager"):
        ours.decode_mode = mode  # issue 45: "compile" = static-shape decode steps through inductor
        try:
            return engine.generate(P, n)  # greedy
        finally:
            ours.decode_mode = "eager"

    @torch.no_grad()
    def run_hf(n=N):
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)
        return out[:, L:].tolist()

    a, b = run_ours(), run_hf()  # warm-up, and the check that both do the same thing
    t0 = time.perf_counter()
    c = run_ours(mode="compile")  # its first run compiles each shape of its steps: timed apart
    compile_s = time.perf_counter() - t0
    assert all(len(x) == N for x in a + b), "a side stopped early"
    same, same_compiled = sum(x == y for x, y in zip(a, b)), sum(x == y for x, y in zip(a, c))
    mm, mm_flops = step_matmuls(ours, B)
    # runs of 1 new token = the prefill alone; (N-token run - 1-token run) / (N - 1) = one decode step (the
    # compiled side's prefill is the eager one: a prompt is not a one-token forward)
    (t_ours, t_hf, t_mm, p_ours, p_hf, t_compiled), n = medians(
        [run_ours, run_hf, mm, lambda: run_ours(1), lambda: run_hf(1), lambda: run_ours(mode="compile")], reps)
    # useful work: B x N generated tokens at the mean context (+ the prompts' prefill for the last column)
    ctx = statistics.mean(map(len, P)) + (N + 1) / 2
    decode = B * N * flops_per_token(ours, ctx)
    head = 2 * ours.cfg.hidden_size * ours.cfg.vocab_size  # the lm_head runs on a prompt's last token only
    prefill = sum(len(p) * (flops_per_token(ours, (len(p) + 1) / 2) - head) + head for p in P)
    return dict(B=B, same=same, rounds=n, t_ours=t_ours, t_hf=t_hf, p_ours=p_ours, p_hf=p_hf, mix=mm_flops / t_mm,
                decode=decode, prefill=prefill, plen=[len(p) for p in P], load=load(), t_compiled=t_compiled,
                p_compiled=p_ours, compile_s=compile_s, same_compiled=same_compiled)


def print_single_turn(res, square):
    print(f"{'batch':>5} {'side':<13} {'s/run':>7} {'tok/s':>6} {'prefill s':>9} {'ms/step':>7} {'% mix':>6} "
          f"{'% square':>8} {'% mix+prefill':>13} {'% mix steps':>11}")
    for r in res:
        for side, t, p in (("ours", r["t_ours"], r["p_ours"]), ("ours compiled", r["t_compiled"], r["p_compiled"]),
                           ("transformers", r["t_hf"], r["p_hf"])):
            step = (t - p) / (N_NEW - 1)
            print(f"{r['B']:>5} {side:<13} {t:>7.3f} {r['B'] * N_NEW / t:>6.0f} {p:>9.3f} {1e3 * step:>7.2f} "
                  f"{100 * r['decode'] / t / r['mix']:>6.1f} {100 * r['decode'] / t / square:>8.1f} "
                  f"{100 * (r['decode'] + r['prefill']) / t / r['mix']:>13.1f} "
                  f"{100 * r['decode'] / N_NEW / step / r['mix']:>11.1f}")
        print(f"{r['B']:>5} {'ours / HF':<13} {'x%.2f' % (r['t_hf'] / r['t_ours']):>7} | same tokens "
              f"{r['same']}/{r['B']} rows | prompts {min(r['plen'])}-{max(r['plen'])} tokens | mix "
              f"{r['mix'] / 1e9:.1f} GFLOP/s | {r['rounds']} rounds | load {r['load']:.2f}")
        step, step_compiled = ((r[t] - r["p_ours"]) / (N_NEW - 1) for t in ("t_ours", "t_compiled"))
        print(f"{r['B']:>5} {'compiled / HF':<13} {'x%.2f' % (r['t_hf'] / r['t_compiled']):>7} | compiled / eager "
              f"x{r['t_ours'] / r['t_compiled']:.2f} per run, x{step / step_compiled:.2f} per decode step | same tokens "
              f"as eager {r['same_compiled']}/{r['B']} rows | compile {r['compile_s']:.1f} s (its first run, apart)")


# -----------------------------------------------------------------------------
# (a') single-turn with long-tailed lengths: what continuous batching buys

class StopAt(torch.nn.Module):
    """Our model with each prompt's answer ending (<|im_end|>) exactly at its target length; before it
    the stop tokens are masked out, the model's argmax decides the rest. To the engine, just a model.
    A row's place is read from its whole context (prompt + answer so far), so a row that the engine
    preempted and prefills again is forced exactly as before."""

    def __init__(self, model, force_, prompts):
        super().__init__()
        self.model, self.cfg, self.force_, self.at = model, model.cfg, force_, {}  # at: row -> [prompt, k]
        self.prompts, self.plens = set(map(tuple, prompts)), sorted({len(p) for p in prompts})

    def forward_cached(self, input_ids, cache, rows, last_only=False, n_new=None):
        slots = list(range(cache.num_rows))[rows] if isinstance(rows, slice) else rows.tolist()
        n = [input_ids.shape[1]] * len(slots) if n_new is None else list(n_new)
        for b, r in enumerate(slots):
            if cache.lengths[r] == 0:  # a prompt, or a preempted row's whole context: find its prompt
                ids = input_ids[b, :n[b]].tolist()
                p = next(tuple(ids[:m]) for m in self.plens if tuple(ids[:m]) in self.prompts)
                self.at[r] = [p, n[b] - len(p)]
            else:
                self.at[r][1] += n[b]
        logits = self.model.forward_cached(input_ids, cache, rows, last_only, n_new)
        self.force_(logits[:, -1], [self.at[r][0] for r in slots], [self.at[r][1] for r in slots])
        return logits


def long_tail(tok, prompts):
    """(l)'s workload: answer lengths (lognormal, mean ~64 tokens, at most 256, seeded) and force_(scores,
    prompts, ks) that ends the answer to each prompt at its length"""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.empty(len(prompts)).log_normal_(3.8, 0.8, generator=g).clamp(4, 256)).long().tolist()
    target = {tuple(p): n for p, n in zip(prompts, lengths)}
    stop = torch.tensor(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))

    def force_(scores, ps, ks):  # token k of the answer to prompt p
        for b, (p, k) in enumerate(zip(ps, ks)):
            scores[b, stop] = float("-inf")
            if k == target[p] - 1:
                scores[b] = float("-inf")
                scores[b, stop[0]] = 0.0
        return scores
    return lengths, force_


def varied_lengths(ours, hf, tok, prompts, B, reps):
    """len(prompts) answers whose lengths are long-tailed (lognormal, mean ~64 tokens, at most 256):
    transformers: `generate` on batches of B prompts, each batch running until its longest answer ends;
    ours: Engine.generate with B rows, a finished row taking the next prompt at once."""
    lengths, force_ = long_tail(tok, prompts)
    stop = torch.tensor(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    L = max(map(len, prompts))
    engine = Engine(StopAt(ours, force_, prompts), tok, kv_capacity=B * (L + 257), max_len=L + 257, max_rows=B)

    def run_ours():
        engine.stats["decode_steps"] = 0
        return engine.generate(prompts, 256)

    @torch.no_grad()
    def run_hf():
        out = []
        for i in range(0, len(prompts), B):
            P = prompts[i:i + B]
            ids, mask = left_pad(P, tok.pad_token_id)
            proc = lambda input_ids, scores, P=P, start=ids.shape[1]: force_(  # noqa: E731
                scores, [tuple(p) for p in P], [input_ids.shape[1] - start] * len(P))
            o = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=256, do_sample=False,
                            eos_token_id=int(stop[0]), pad_token_id=tok.pad_token_id,
                            logits_processor=transformers.LogitsProcessorList([proc]))
            out += [row[:row.index(int(stop[0])) + 1] for row in o[:, ids.shape[1]:].tolist()]
        return out

    a, b = run_ours(), run_hf()
    same = sum(x == y for x, y in zip(a, b))
    assert [len(x) for x in a] == lengths, "an answer did not end at its target length"
    (t_ours, t_hf), n = medians([run_ours, run_hf], reps)
    steps_hf = sum(max(lengths[i:i + B]) for i in range(0, len(prompts), B))
    return dict(B=B, N=len(prompts), same=same, rounds=n, t_ours=t_ours, t_hf=t_hf, tokens=sum(lengths),
                mean=statistics.mean(lengths), max=max(lengths), steps_ours=engine.stats["decode_steps"],
                steps_hf=steps_hf, load=load())


def print_varied_lengths(r):
    for side, t in (("ours", r["t_ours"]), ("transformers", r["t_hf"])):
        print(f"{side:<13} {t:>7.3f} s {r['tokens'] / t:>6.0f} tok/s")
    print(f"{'ours / HF':<13} {'x%.2f' % (r['t_hf'] / r['t_ours']):>7} | same answers {r['same']}/{r['N']} | "
          f"answer lengths mean {r['mean']:.0f}, max {r['max']} | decode steps ours ~{r['steps_ours']} / HF "
          f"{r['steps_hf']} | {r['rounds']} rounds | load {r['load']:.2f}")


# -----------------------------------------------------------------------------
# (b) multi-turn: two tool calls per sample

def forcing(tok, turn_len):
    """force_(scores, turns, ks), in place on scores (n, V) whose row b is at token ks[b] of assistant turn
    turns[b] (0, 1, 2): a turn's last tokens are forced (a tool call + <|im_end|>, or just <|im_end|> in
    the last turn); before them, the tokens that would end the turn or open a call are masked out. The
    model's own argmax decides everything else."""
    end = tok.convert_tokens_to_ids(agent.END)
    call = tok.encode(CALL_TEXT, add_special_tokens=False) + [end]
    tails = [call, call, [end]]
    if len(call) >= turn_len:
        raise ValueError(f"turn_len {turn_len} must exceed the forced tool call ({len(call)} tokens)")
    banned = torch.tensor(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>", "<|im_start|>",
                                                     "<tool_call>", "</tool_call>"]))

    def forced_token(turn, k):  # -1: free
        j = k - (turn_len - len(tails[turn]))
        return tails[turn][j] if j >= 0 else -1

    def force_(scores, turns, ks):
        want = torch.tensor([forced_token(t, k) for t, k in zip(turns, ks)])  # (n,)
        free, forced = (want < 0).nonzero()[:, 0], (want >= 0).nonzero()[:, 0]
        scores[free[:, None], banned] = float("-inf")
        scores[forced] = float("-inf")
        scores[forced, want[forced]] = 0.0
        return scores
    return force_


class Forced(torch.nn.Module):
    """Our model with forced turn boundaries; to the engine it is just a model. Each row's next token is
    token k of assistant turn t, read from the row's context: t counts the <|im_start|> tokens (3 in the
    prompt, 2 more per tool response), k the tokens since the last <|im_start|>assistant\n<reason>. So
    a row the engine preempted and prefills again is forced exactly as before."""

    def __init__(self, model, force_, tok):
        super().__init__()
        self.model, self.cfg, self.force_, self.at = model, model.cfg, force_, {}  # at: row -> [turn, k]
        self.start = tok.convert_tokens_to_ids("<|im_start|>")
        self.gp = len(tok.encode(agent.GENERATION_PROMPT, add_special_tokens=False))

    def forward_cached(self, input_ids, cache, rows, last_only=False, n_new=None):
        slots = list(range(cache.num_rows))[rows] if isinstance(rows, slice) else rows.tolist()
        n = [input_ids.shape[1]] * len(slots) if n_new is None else list(n_new)
        for b, r in enumerate(slots):
            if cache.lengths[r] == 0 or n[b] > 1:  # a prompt, a tool response, or a recomputed context
                ids = input_ids[b, :n[b]].tolist()
                starts = [i for i, t in enumerate(ids) if t == self.start]
                if cache.lengths[r] == 0:
                    self.at[r] = [(len(starts) - 3) // 2, len(ids) - starts[-1] - self.gp]
                else:  # a tool response: the next turn begins after it
                    self.at[r] = [self.at[r][0] + 1, len(ids) - starts[-1] - self.gp]
            else:
                self.at[r][1] += 1
        logits = self.model.forward_cached(input_ids, cache, rows, last_only, n_new)  # (B, T, V)
        self.force_(logits[:, -1], [self.at[r][0] for r in slots], [self.at[r][1] for r in slots])
        return logits


def turns_workload(tok, turn_len):
    """(b)'s workload: the forcing, tools that answer at once (we time the model side), the tool-response
    tokens the engine appends, and the budget of 3 turns with 2 tool responses"""
    suffix = agent.tool_suffix_ids(tok, [agent.tool_response_text(RESULT)])
    done = concurrent.futures.Future()
    done.set_result(RESULT)
    tools = types.SimpleNamespace(submit=lambda code, stdin: done)
    return forcing(tok, turn_len), tools, suffix, 3 * turn_len + 2 * len(suffix) + 1


def multi_turn(ours, hf, tok, prompts, B, turn_len, reps):
    P = prompts[:B]
    force_, tools, suffix, budget = turns_workload(tok, turn_len)
    max_len = max(map(len, P)) + budget + 1
    engine = Engine(Forced(ours, force_, tok), tok, kv_capacity=B * max_len, max_len=max_len, temperature=0.0,
                    sandbox=tools, max_rows=B)

    def run_ours():
        engine.stats["prefill_tokens"] = 0
        trajs = sorted(engine.run(iter_claim([Request(p, key=(0, i, 0)) for i, p in enumerate(P)]), budget),
                       key=lambda t: t.key)
        bad = [t.key for t in trajs if (t.finish, t.turns, len(t.tool_calls)) != ("stop", 3, 2)]
        if bad:
            raise RuntimeError(f"trajectories {bad[:3]} did not run 3 turns with 2 tool calls")
        return [t.prompt_ids + t.response_ids for t in trajs], engine.stats["prefill_tokens"]

    def processor(turn, start):  # token k of one generate call is token k of the turn
        return lambda input_ids, scores: force_(scores, [turn] * len(scores),
                                                [input_ids.shape[1] - start] * len(scores))

    @torch.no_grad()
    def run_hf():
        hist, prefill = [list(p) for p in P], 0
        for turn in range(3):
            ids, mask = left_pad(hist, tok.pad_token_id)
            prefill += int(mask.sum())  # the whole history goes through the model again
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=turn_len, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id,
                              logits_processor=transformers.LogitsProcessorList([processor(turn, ids.shape[1])]))
            hist = [h + o + (suffix if turn < 2 else []) for h, o in zip(hist, out[:, ids.shape[1]:].tolist())]
        return hist, prefill

    (a, pre_ours), (b, pre_hf) = run_ours(), run_hf()  # warm-up and check
    same = sum(x == y for x, y in zip(a, b))
    (t_ours, t_hf), n = medians([run_ours, run_hf], reps)
    return dict(B=B, same=same, rounds=n, t_ours=t_ours, t_hf=t_hf, pre_ours=pre_ours, pre_hf=pre_hf,
                decode=B * 3 * turn_len, R=len(suffix), plen=[len(p) for p in P], load=load())


def print_multi_turn(r):
    decode = r["decode"]
    print(f"{'side':<13} {'s/run':>7} {'tok/s':>7} {'prefill tok':>11} {'recomputed':>10} {'decoded tok':>11}")
    for side, t, pre in (("ours", r["t_ours"], r["pre_ours"]), ("transformers", r["t_hf"], r["pre_hf"])):
        # recomputed: the tokens transformers re-encodes that our engine already held in its KV cache
        rec = pre - r["pre_ours"]
        rec = f"{rec:,} ({100 * rec / pre:.0f}%)"
        print(f"{side:<13} {t:>7.3f} {decode / t:>7.0f} {pre:>11,} {rec:>10} {decode:>11,}")
    bound = (decode + r["pre_hf"]) / (decode + r["pre_ours"])
    print(f"{'ours / HF':<13} {'x%.2f' % (r['t_hf'] / r['t_ours']):>7} | same trajectories {r['same']}/{r['B']} | "
          f"if time were proportional to tokens through the model: x{bound:.2f} | prompts "
          f"{min(r['plen'])}-{max(r['plen'])}, turns {TURN_LEN}, tool responses {r['R']} tokens | "
          f"{r['rounds']} rounds | load {r['load']:.2f}")


# -----------------------------------------------------------------------------
# (k) the paged KV cache: over-commit and preemption against whole-budget reservations

KINDS = (("full", 1.0), ("paged", 0.5), ("auto", "auto"))  # (k): the engines and their reserve


def paging(ours, tok, prompts, B, reps):
    """(l)'s and (b)'s workloads on engines over the same model, timed interleaved: the full-reservation
    engine (reserve=1: every row is promised its whole budget, the admission rule before paging), the
    paged engine with the fixed reserve 0.5 and with reserve="auto" (both at most B rows), each with the
    memory of B whole reservations, of B/2 and (l only, where answers use a quarter of the budget) of
    B/4: the tight case, where only a promise that follows use keeps most rows running. All must give
    the same tokens; every ratio is against the full engine with B rows' memory (the roomy one)."""
    res = []
    lengths, force_l = long_tail(tok, prompts[:3 * B])
    force_b, tools, _, budget_b = turns_workload(tok, TURN_LEN)
    P_l, P_b = prompts[:3 * B], prompts[:MT_BATCH]
    for name, P, budget in (("l", P_l, 256), ("b", P_b, budget_b)):
        rows = B if name == "l" else MT_BATCH
        max_len = max(map(len, P)) + budget + 1
        mems = (rows, rows // 2, rows // 4) if name == "l" else (rows, rows // 2)
        engines = {}
        for mem in mems:
            for kind, reserve in KINDS:
                model = StopAt(ours, force_l, P) if name == "l" else Forced(ours, force_b, tok)
                # full: the engine before paging, mem rows of max_len; paged: up to `rows` rows in that memory
                engines[(mem, kind)] = Engine(model, tok, kv_capacity=mem * max_len, max_len=max_len,
                                              temperature=0.0, sandbox=tools if name == "b" else None,
                                              reserve=reserve, max_rows=mem if kind == "full" else rows)

        def run(engine, P=P, budget=budget):  # engine.stats counts one run
            trajs = engine.run(iter_claim([Request(p, key=(0, i, 0)) for i, p in enumerate(P)]), budget)
            return {t.key: t.response_ids for t in trajs}
        outs = {k: run(e) for k, e in engines.items()}  # warm-up, and the check that all agree
        same = all(o == outs[(rows, "full")] for o in outs.values())
        stats = {k: dict(e.stats) for k, e in engines.items()}
        times, n = medians([lambda e=e: run(e) for e in engines.values()], reps)
        tokens = sum(len(o) for o in outs[(rows, "full")].values())
        res.append(dict(name=name, rows=rows, mems=mems, max_len=max_len, same=same, rounds=n, tokens=tokens,
                        times=dict(zip(engines, times)), stats=stats, load=load()))
    return res


def print_paging(res):
    for r in res:
        roomy = r["times"][(r["rows"], "full")]
        print(f"({r['name']}) {r['tokens']:,} response tokens, max_len {r['max_len']}")
        print(f"{'KV memory':<22} {'engine':<6} {'s/run':>7} {'tok/s':>6} {'decode steps':>12} {'mean batch':>10} "
              f"{'preemptions':>11} {'recomputed':>10} {'/ full':>7} {'/ roomy':>7}")
        for mem in r["mems"]:
            for kind, _ in KINDS:
                t, s = r["times"][(mem, kind)], r["stats"][(mem, kind)]
                print(f"{f'{mem} x max_len tokens':<22} {kind:<6} {t:>7.3f} {r['tokens'] / t:>6.0f} "
                      f"{s['decode_steps']:>12,} {s['decode_tokens'] / max(s['decode_steps'], 1):>10.1f} "
                      f"{s['preemptions']:>11,} {s['recomputed_tokens']:>10,} "
                      f"{'x%.2f' % (r['times'][(mem, 'full')] / t):>7} {'x%.2f' % (roomy / t):>7}")
        t, half = r["times"], r["rows"] // 2
        goals = [f"same rows >= x0.95: paged x{roomy / t[(r['rows'], 'paged')]:.2f}, auto "
                 f"x{roomy / t[(r['rows'], 'auto')]:.2f}",
                 f"half the memory >= x1.30 of full: paged x{t[(half, 'full')] / t[(half, 'paged')]:.2f}, auto "
                 f"x{t[(half, 'full')] / t[(half, 'auto')]:.2f}"]
        if len(r["mems"]) > 2:
            tight = r["mems"][2]
            goals.append(f"tight ({tight} x max_len) >= x0.80 of roomy: paged x{roomy / t[(tight, 'paged')]:.2f}, "
                         f"auto x{roomy / t[(tight, 'auto')]:.2f}")
        print(f"goals: {' | '.join(goals)} | same tokens in all: {r['same']} | {r['rounds']} rounds | "
              f"load {r['load']:.2f}")


# -----------------------------------------------------------------------------
# (p) where our engine spends its time

def profile(ours, tok, prompts, B, N):
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile
    P = prompts[:B]
    L = max(map(len, P))
    engine = Engine(ours, tok, kv_capacity=B * (L + N + 1), max_len=L + N + 1)
    engine.stop_ids = set()
    # label the engine's pieces for the profiler
    for obj, name in ((engine.pager, "admit"), (engine, "decode"), (engine, "sample"), (engine, "step_row")):
        def labelled(*a, _f=getattr(obj, name), _name=name):
            with record_function(f"engine.{_name}"):
                return _f(*a)
        setattr(obj, name, labelled)
    engine.generate(P, N)  # warm-up
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("engine.generate"):
            engine.generate(P, N)
    events = prof.events()
    total = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key.startswith("engine.")}
    whole = total.pop("engine.generate")
    print(f"one generate(), B={B}, {N} new tokens, {whole / 1e3:.0f} ms under the profiler:")
    for k, us in total.items():
        print(f"  {k:<16} {us / 1e3:8.1f} ms {100 * us / whole:5.1f}%")
    rest = whole - sum(total.values())
    print(f"  {'the rest':<16} {rest / 1e3:8.1f} ms {100 * rest / whole:5.1f}%")

    def inside_decode(e):
        while e is not None:
            if e.name == "engine.decode":
                return True
            e = e.cpu_parent
        return False
    own = collections.Counter()
    for e in events:
        if inside_decode(e) and not e.name.startswith("engine."):
            own[e.name] += e.self_cpu_time_total
    steps = sum(1 for e in events if e.name == "engine.decode")
    print(f"top ops inside the {steps} decode steps (the batched model forward; self CPU time per step):")
    for name, us in own.most_common(15):
        print(f"  {name:<52} {us / steps:8.0f} us {100 * us / sum(own.values()):5.1f}%")


# -----------------------------------------------------------------------------
# (sandbox) the tool pool vs the released executor's pattern (a fresh python3 per call, same rlimits)

SANDBOX_CALLS = 1024  # pool calls per cell (at least the concurrency)
SANDBOX_FRESH = {"trivial": 256, "sympy": 32}  # fresh-process calls per cell: they are slow (~3 minutes in all)
SANDBOX_CONCURRENCY = (1, 64, 1024)

SANDBOX_SNIPPETS = {  # {i} makes every call different, so no cache of the warm parent can answer it
    "trivial": "print(sum(range({i} % 100)))",
    "sympy": "import sympy as sp\nx = sp.Symbol('x')\nprint(sp.factor(x**4 - {i}**4))",
}
FRESH_PRELUDE = """import os, resource, signal
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
signal.signal(signal.SIGALRM, lambda *a: os.killpg(0, signal.SIGKILL))
signal.alarm({cpu})
"""


async def fresh_run(code, sem, timeout, memory):
    # code-judge's executor: write the script to a temp dir, start a new python3 in a new session with
    # a prelude that sets the rlimits, wait with a timeout, then kill the process group
    async with sem:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "source.py")
            with open(path, "w") as f:
                f.write(FRESH_PRELUDE.format(cpu=math.ceil(timeout), mem=memory + (128 << 20)) + code)
            p = await asyncio.create_subprocess_exec(sys.executable, path, cwd=d, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, env=sandbox.WORKER_ENV,
                                                     start_new_session=True)
            try:
                out, _ = await asyncio.wait_for(p.communicate(), timeout + 1)
                status = "ok" if p.returncode == 0 else "error"
            except asyncio.TimeoutError:
                out, status = b"", "timeout"
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await p.wait()
        return Result(status, out.decode(), "", "", time.monotonic() - t0)


async def sandbox_cell(run, kind, conc, n):
    """n calls of one kind with at most `conc` in flight: throughput, end-to-end and in-sandbox latency."""
    sem = asyncio.Semaphore(conc)
    lat, run_s = [], []

    async def one(i):
        async with sem:
            t = time.monotonic()
            r = await run(SANDBOX_SNIPPETS[kind].format(i=i + 1))
            lat.append(time.monotonic() - t)
            run_s.append(r.duration)
            if r.status != "ok":
                raise RuntimeError(f"bench call failed: {r}")

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    rate = n / (time.monotonic() - t0)
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1e3  # noqa: E731 (ms)
    return {"rate": rate, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "run50": pct(run_s, 0.5),
            "run99": pct(run_s, 0.99)}


SECCOMP_STATUS = "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"  # 2: a filter is on


def sandbox_bench(isolation, timeout=4.0):
    cores = os.cpu_count()
    print(f"sandbox bench: {cores} pool workers vs {cores} fresh-process executors, {os.cpu_count()} cores\n"
          f"latency = end to end (incl. queueing); run = inside the sandbox (Result.duration); ms\n"
          f"no filter = a second pool, the same but for the syscall filter (built empty), run right after the first")
    rows = {}

    async def main():
        async with contextlib.AsyncExitStack() as pools:
            pool = await pools.enter_async_context(SandboxPool(workers=cores, timeout=timeout, isolation=isolation))
            built = sandbox._seccomp
            sandbox._seccomp = lambda: b""  # bwrap then gets no filter to load
            try:
                unfiltered = await pools.enter_async_context(
                    SandboxPool(workers=cores, timeout=timeout, isolation=isolation))
            finally:
                sandbox._seccomp = built
            seccomp = [(await p.run(SECCOMP_STATUS)).stdout.strip() for p in (pool, unfiltered)]
            print(f"pool isolation: {pool.mode}; Seccomp in a call: {seccomp[0]} (pool), {seccomp[1]} (no filter)")
            fresh_sem = asyncio.Semaphore(cores)  # code-judge runs one process at a time per executor

            async def fresh(code):
                return await fresh_run(code, fresh_sem, timeout, pool.memory)

            for kind in SANDBOX_SNIPPETS:
                for conc in SANDBOX_CONCURRENCY:
                    n_pool = max(SANDBOX_CALLS, conc)
                    n_fresh = min(n_pool, SANDBOX_FRESH[kind])
                    load = os.getloadavg()[0]
                    p = await sandbox_cell(pool.run, kind, conc, n_pool)
                    u = await sandbox_cell(unfiltered.run, kind, conc, n_pool)
                    f = await sandbox_cell(fresh, kind, conc, n_fresh)
                    rows[kind, conc] = p, f, u
                    print(f"{kind:7s} c={conc:<4d} | pool n={n_pool:<4d} {p['rate']:6.1f}/s "
                          f"lat p50 {p['p50']:7.1f} p99 {p['p99']:7.1f} run p50 {p['run50']:5.1f} p99 {p['run99']:5.1f} "
                          f"| no filter {u['rate']:6.1f}/s run p50 {u['run50']:5.1f} p99 {u['run99']:5.1f} "
                          f"| fresh n={n_fresh:<3d} {f['rate']:5.1f}/s lat p50 {f['p50']:7.1f} p99 {f['p99']:7.1f} "
                          f"| x{p['rate'] / f['rate']:4.1f} | load {load:.1f}", flush=True)

    asyncio.run(main())
    print(f"load average after: {os.getloadavg()[0]:.2f} (other jobs on the machine make the numbers noisy)")

    columns = {"pool": 0, "fresh": 1, "no filter": 2}  # of rows' values
    best = {(kind, who): max(v[columns[who]]["rate"] for (k, _), v in rows.items() if k == kind)
            for kind in SANDBOX_SNIPPETS for who in columns}
    print("\nseconds to drain 45,000 calls (best measured throughput, scaled linearly with cores):")
    targets = (2, 16, 64, 256, 1024)
    print(f"{'kind':7s} {'executor':9s} " + " ".join(f"{c:>7d} cores" for c in targets))
    for (kind, who), rate in best.items():
        print(f"{kind:7s} {who:9s} " + " ".join(f"{45000 / (rate / cores * c):11.1f} s" for c in targets))

    ratio = {kind: best[kind, "pool"] / best[kind, "fresh"] for kind in SANDBOX_SNIPPETS}
    print("\ngoals (2 cores, isolation on):")
    print(f"  sympy   >= 30x fresh process : x{ratio['sympy']:.1f}")
    print(f"  trivial >= 4x fresh process  : x{ratio['trivial']:.1f}")
    print(f"  trivial >= 500 calls/s       : {best['trivial', 'pool']:.0f}/s")
    for kind in SANDBOX_SNIPPETS:  # issue 43: the filter costs at most 10% of the throughput
        print(f"  {kind:7s} filter on / off >= 0.9 : {best[kind, 'pool'] / best[kind, 'no filter']:.2f} "
              f"({best[kind, 'pool']:.0f}/s vs {best[kind, 'no filter']:.0f}/s)")
    if ("trivial", 64) in rows:
        p = rows["trivial", 64][0]
        print(f"  trivial p99 < 50 ms at c=64  : in sandbox {p['run99']:.1f} ms, end to end {p['p99']:.1f} ms "
              f"(= queueing: 64 in flight / {p['rate']:.0f} per s)")


# -----------------------------------------------------------------------------
# (mem) the training transients of one 14B rank, measured without a GPU

def mem_bench(tokens=20480):
    """(mem) Qwen3-14B shapes, bf16, one micro-batch of `tokens` tokens: the peak memory of (1) one decoder layer
    recomputed in its backward (activation checkpointing: what a layer's backward holds), (2) the chunked output
    layer's log-probs, forward and backward. Run under FakeTensorMode with torch's MemTracker: every tensor has its
    real shape and dtype and no data, so nothing is computed and the peaks are exact for this code (CPU SDPA's
    memory-efficient causal kernel, linear in the tokens as flash-attn's is)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import checkpoint
    import model as M
    cfg, dt, gib = M.Config(), torch.bfloat16, 2 ** 30
    out = {}
    with FakeTensorMode():
        torch.set_default_dtype(dt)
        layer = M.Block(cfg, 0)
        head = torch.randn(cfg.vocab_size, cfg.hidden_size, requires_grad=True)
        torch.set_default_dtype(torch.float32)
        x = torch.randn(1, tokens, cfg.hidden_size, dtype=dt, requires_grad=True)
        cos, sin = M.rope_cos_sin(torch.arange(tokens)[None], cfg, dt)
        h, tg = x[0].detach().requires_grad_(), torch.randint(0, cfg.vocab_size, (tokens,))
        for name, tracked, run in [
                ("decoder layer, recomputed in its backward", (layer, x), lambda: checkpoint(
                    layer, x, cos, sin, dict(flash=False, mask=None), use_reentrant=False).sum().backward()),
                ("output layer, 1,024-token chunks", (head, h), lambda: torch.cat([checkpoint(
                    M.chunk_logprobs, h[i:i + 1024], tg[i:i + 1024], head, None, use_reentrant=False)
                    for i in range(0, tokens, 1024)]).sum().backward())]:
            mt = MemTracker()
            mt.track_external(*tracked)
            with mt:
                run()
            peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
            kinds = {str(k).split(".")[-1].split(":")[0].lower(): v / gib for k, v in peak.items() if k != "Total"}
            out[name] = kinds
            print(f"(mem) {name}, {tokens} tokens: peak {peak['Total'] / gib:.2f} GiB = " +
                  ", ".join(f"{k} {v:.2f}" for k, v in kinds.items() if v >= 0.01))
    # the rest follows from the shapes: the root's embedding and head, gathered in bf16, get full-size bf16
    # gradients that FSDP casts to fp32 (reduce_dtype) before the reduce-scatter
    root = 2 * cfg.vocab_size * cfg.hidden_size
    print(f"(mem) embedding + output-layer gradients before their reduce-scatter: {root * 2 / gib:.2f} GiB bf16 "
          f"+ {root * 4 / gib:.2f} GiB fp32 = {root * 6 / gib:.2f} GiB")
    return out


# -----------------------------------------------------------------------------
# (scale) what crosses ranks after a stage-1 rollout phase, before and after compact trajectories

PAPER_RANKS, PAPER_TRAJS = 64, 16384  # 512 prompts x 32 rollouts on 64 GPUs


def synthetic_trajectories(rank, n, mean_tokens, seed=0):
    """n stage-1-like rollouts of one rank: a ~300-token prompt, a lognormal response around mean_tokens
    (cut at 8K, like stage 1's budget), ~80% of it sampled, 2-3 tool calls with ~200 chars of code and output."""
    import random
    rng = random.Random(seed * 1000 + rank)
    sigma = 0.6
    mu = math.log(mean_tokens - 300) - sigma ** 2 / 2
    out = []
    for i in range(n):
        p, r = 300, min(8192, max(16, int(rng.lognormvariate(mu, sigma))))
        mask = [int(rng.random() < 0.8) for _ in range(r)]
        calls = [agent.CallRecord(agent.TOOL_NAME, {"code": "x" * 200, "input": ""},
                                  rng.choice(["ok", "ok", "error"]), "y" * 200, 0.01)
                 for _ in range(rng.choice([2, 3]))]
        out.append(rollout.Trajectory(
            key=(0, (rank * n + i) // 32, (rank * n + i) % 32), prompt_ids=[rng.randrange(151936) for _ in range(p)],
            response_ids=[rng.randrange(151936) for _ in range(r)], mask=mask,
            logprobs=[-rng.random() if m else 0.0 for m in mask], tool_calls=calls, turns=len(calls) + 1,
            finish="stop", meta={"answer": "42", "problem": i,
                                 "grade": grading.Grade(float(rng.random() < 0.5), False, 1, "42", "42")}))
    return out


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def scale_worker(rank, world, init, variant, n, mean_tokens, results):
    import gc
    import pickle
    import resource
    import scheduler
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mine = synthetic_trajectories(rank, n, mean_tokens)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in mine)
    gc.collect()
    t_gc0 = time.perf_counter()
    gc.collect()  # a full pass over what the rank holds anyway (its own trajectories)
    t_gc0 = time.perf_counter() - t_gc0
    dist.barrier()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    if variant == "before":  # every rank unpickles every rank's trajectories, Python lists and all
        everything = [None] * world
        dist.all_gather_object(everything, mine)
        secs = time.perf_counter() - t0
        gathers = {"all_gather_object(trajectories)": (sum(len(pickle.dumps(p)) for p in everything), secs)}
    else:  # every rank gets the summaries; the tokens of half the trajectories move, to the rank that trains them
        local = [scheduler.summarize(t, t.meta["grade"]) for t in mine]  # (its own trajectories: scales with them, not with all)
        t_local = time.perf_counter() - t0
        t0 = time.perf_counter()
        summaries = sorted((s for part in scheduler.gather(local) for s in part), key=lambda s: s.key)
        t1 = time.perf_counter()
        kept = summaries[::2]  # RoC keeps G of 2G
        dest = {s.key: j % world for j, s in enumerate(kept)}
        got = scheduler.exchange(mine, dest)
        t2 = time.perf_counter()
        sent = [scheduler.compact(t) for t in mine if t.key in dest]
        gathers = {"gather_summaries": (len(pickle.dumps(summaries)), t1 - t0),
                   "summarise own + exchange tokens": (len(pickle.dumps(got)) + len(pickle.dumps(sent)), t2 - t1 + t_local)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    t_gc = time.perf_counter()
    gc.collect()
    t_gc = time.perf_counter() - t_gc - t_gc0  # what the gathered objects add to a full GC pass
    results[rank, variant] = {"gathers": gathers, "peak_mib": peak, "gc_s": t_gc, "tokens": tokens, "n": n}
    dist.barrier()
    dist.destroy_process_group()


def eval_reserve_bench(model_path, data_path="out/data/heldout.jsonl", rounds=2):
    """eval.py's engine with the fixed reserve 0.5 and with "auto" (what eval.py runs), interleaved on one model,
    the demo's held-out set, 4 samples at T = 1.0, the demo's eval settings (configs/tiny_eval.py), both with
    deterministic=True (what the demo's evals run) and without: seconds per evaluation, avg@4, and whether the
    two reserves gave the same trajectories, token for token."""
    import numpy as np
    import eval as ev
    from common import read_jsonl
    from rollout import Engine, kv_rows
    task = grading.load_task("tasks/math.py")
    problems = read_jsonl(data_path)
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    prompt_ids = [np.asarray(tok.encode(task.prompt(p), add_special_tokens=False), np.int32) for p in problems]
    model = modeling.load_model(model_path)
    max_len = 128 + 192
    rows = kv_rows(model, max_len, 0, limit=len(problems) * 4)
    print(f"eval's engine on {model_path}: {len(problems)} problems x 4 samples, {rows} rows of KV, "
          f"load average {load():.2f}")
    with SandboxPool(workers=2, timeout=4.0) as sandbox:
        for deterministic in (True, False):
            seen = {}
            for _ in range(rounds):
                for reserve in (0.5, "auto"):
                    engine = Engine(model, tok, kv_capacity=rows * max_len, max_len=max_len, temperature=1.0,
                                    sandbox=sandbox, max_turns=4, tools=task.TOOLS, reserve=reserve,
                                    deterministic=deterministic)
                    tokens = []
                    start = time.perf_counter()
                    summary, _ = ev.evaluate(engine, tok, problems, 4, 192, "dynamic", prompt_ids=prompt_ids,
                                             task=task, on_graded=lambda t, s: tokens.append((t.key, t.response_ids)))
                    wall = time.perf_counter() - start
                    seen[reserve] = sorted(tokens)
                    print(f"  deterministic={deterministic} reserve={reserve}: {wall:.1f} s, "
                          f"avg@4 {100 * summary['avg@k']:.2f}%, decode steps {engine.stats['decode_steps']}")
            print(f"  deterministic={deterministic}: the same trajectories with 0.5 and auto: "
                  f"{seen[0.5] == seen['auto']}")


def scale_bench(world=2, per_rank=1024, mean_tokens=4600):
    """(scale) One stage-1 step's post-rollout data movement on `world` gloo ranks, before (all_gather_object of
    every Trajectory, Python lists) and after (scheduler.gather_summaries + scheduler.exchange of compact
    arrays), each in fresh processes; per rank: bytes received, seconds, peak RSS growth, the GC pass after;
    then the same extrapolated to 64 ranks x 16,384 trajectories by the measured cost per byte and per
    trajectory (loopback here: a real network adds its transfer time, the same for both)."""
    import torch.multiprocessing as mp
    print(f"(scale) {world} gloo ranks x {per_rank} synthetic stage-1 trajectories (~{mean_tokens} tokens, lognormal), "
          f"load average {load():.2f}")
    results = mp.Manager().dict()
    for variant in ("after", "before"):
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(scale_worker, args=(world, os.path.join(d, "init"), variant, per_rank, mean_tokens, results),
                     nprocs=world, join=True)
    print(f"{'variant':7s} {'gather':32s} {'rank':>4s} {'MiB in':>9s} {'s':>7s} {'peak RSS +MiB':>14s} {'gc s':>6s}")
    for variant in ("before", "after"):
        for rank in range(world):
            r = results[rank, variant]
            for name, (nbytes, secs) in r["gathers"].items():
                print(f"{variant:7s} {name:32s} {rank:4d} {nbytes / 2**20:9.1f} {secs:7.2f} {r['peak_mib']:14.0f} "
                      f"{r['gc_s']:6.2f}")
    # the extrapolation: measured cost per item (never below 0; a GC pass measured under its baseline, which
    # load can do, counts as 0) times how many items one rank handles at the paper's size
    extra = {}
    for variant in ("before", "after"):
        r = results[0, variant]
        n_all, n_own = world * r["n"], r["n"]
        if variant == "before":  # every rank receives every trajectory
            (nbytes, secs), = r["gathers"].values()
            terms = [("all_gather_object", secs / n_all, nbytes / n_all, PAPER_TRAJS)]
        else:  # the summaries of all; the tokens of its own share (and the summarising of its own trajectories)
            (bs, ss), (bx, sx) = r["gathers"].values()
            terms = [("summaries", ss / n_all, bs / n_all, PAPER_TRAJS),
                     ("own tokens", sx / n_own, bx / n_own, PAPER_TRAJS // PAPER_RANKS)]
        terms.append(("gc", max(0.0, r["gc_s"]) / n_all, 0, PAPER_TRAJS))
        secs = sum(per_item * count for _, per_item, _, count in terms)
        mib = sum(b * count for _, _, b, count in terms) / 2**20
        # peak memory: what it holds of all trajectories (before) or of its own share (after, the tokens)
        share = PAPER_TRAJS / n_all if variant == "before" else PAPER_TRAJS / PAPER_RANKS / n_own
        peak = max(0.0, r["peak_mib"]) * share
        extra[variant] = (mib, secs, peak, terms, r["gc_s"])
    print(f"\nextrapolated to {PAPER_RANKS} ranks x {PAPER_TRAJS} trajectories, per rank per step "
          "(measured per-trajectory cost x trajectories):")
    for variant, (mib, secs, peak, terms, gc_s) in extra.items():
        fit = " + ".join(f"{name} {1e3 * per_item:.3f} ms x {count:,}" for name, per_item, _, count in terms)
        note = f" (gc measured {gc_s:+.2f} s, under its baseline: counted as 0)" if gc_s < 0 else ""
        print(f"  {variant:7s} {mib / 1024:7.2f} GiB received, {secs:6.2f} s = {fit}{note}; "
              f"peak RSS +{peak / 1024:6.2f} GiB")
    b, a = extra["before"], extra["after"]
    faster = f"x{b[1] / a[1]:.0f}" if a[1] > 0 else "n/a (after measured 0 s)"
    less = f"x{b[2] / a[2]:.0f}" if a[2] > 0 else "n/a (after measured +0 MiB)"
    print(f"goal (after): under 1 s and under 1 GiB per rank per step: {a[1]:.2f} s, {a[2] / 1024:.2f} GiB | "
          f"{faster} faster, {less} less memory than before")


# -----------------------------------------------------------------------------

def tiny_rl_batch(n=64, seed=0, vocab=4096, group=8):
    """n kept trajectories shaped like one step of configs/tiny_rl.py (lengths, not content): a 55-90 token
    prompt shared by `group` trajectories (RoC keeps 8 a prompt), a lognormal response of ~76 tokens (at most
    192) of which ~1/3 is sampled and the rest is one tool output in between: ~9.4K tokens, the loss on ~17% of
    them, as the issue-32 profile of the tiny run. Also each trajectory's (prompt, shared count), collate's
    prompts."""
    import random
    rng = random.Random(seed)
    seqs, prompts = [], []
    for k in range(n):
        if k % group == 0:
            prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(55, 90))]
        prompt = len(prompt_ids)
        response = min(192, max(8, int(rng.lognormvariate(math.log(66), 0.55))))
        first = max(1, response // 6)  # a reasoning turn with a tool call ...
        last = max(1, response // 6)  # ... and the answer after the tool output
        ids = prompt_ids + [rng.randrange(vocab) for _ in range(response)]
        seqs.append({"ids": ids[:-1], "tgt": ids[1:], "adv": [rng.gauss(0, 1)] * (len(ids) - 1),
                     "mask": [0] * (prompt - 1) + [1] * first + [0] * (response - first - last) + [1] * last})
        prompts.append((k // group, prompt))
    return seqs, prompts


def update_step(reps, max_tokens=4096, kl_coef=0.05):
    """(u) the policy update of one tiny RL step (tiny_rl_batch, on data.prepare's tiny model shape, random
    weights), the way train_rl.py did it before issue 32 and the way it does it now, interleaved: before,
    micro-batches from common.pack (longest first into the emptiest bin, right-padded rows) and the output
    layer + log-softmax at every position; now, micro-batches from common.pack_sorted (similar lengths
    together) and the output layer only where the loss mask is 1. Same loss, entropy and grad norm.
    Issue 45's arms, on now's micro-batches: "unfused" writes RMSNorm out as model.py did before (six ops and
    their backward where F.rms_norm is one: bitwise the same numbers), "compiled" runs
    each decoder layer through inductor, as the compile_update key does (inductor; its compile is timed apart, before
    the rounds). Issue 42's arm, "now + KL" (kl_coef > 0): a
    frozen reference's no_grad forward per micro-batch, then k3 in the loss; the reference's forward is timed
    on its own inside it. "now @N" and "compiled @N": now's and compiled's update on configs/tiny_rl.py's own
    micro-batches of N tokens (1,024 since issue 45: closer lengths share a micro-batch, less padding).
    "shared @N": now @N with a prompt's tokens run once for its trajectories in a micro-batch (collate's
    prompts, Qwen.forward's shared), what train_rl.py does on SDPA's path since."""
    import copy
    from common import pack, pack_sorted
    from grpo_roc import kl_penalty
    from model import Config, Qwen
    cfg = Config(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen(cfg)
    compiled = copy.deepcopy(model)
    # what load_trainable(compiled=True) does (the compile_update key)
    for layer in compiled.model.layers:
        layer.compile(dynamic=True)
    # the reference: frozen (train_rl.py: load_trainable(..., frozen=True)); the starting weights plus a little
    # noise, so the KL is not 0 as it is at a run's first step
    reference = Qwen(cfg)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param), alpha=0.01)
    seqs, prompts = tiny_rl_batch()
    lengths = [len(x["ids"]) for x in seqs]
    n_tokens = torch.tensor(float(sum(sum(x["mask"]) for x in seqs)))
    # the tiny RL config's own micro-batches (configs/tiny_rl.py: 1,024 tokens since issue 45, 4,096 before)
    tiny = train_rl_config(["configs/tiny_rl.py"])["max_tokens_per_micro"]
    # name: (micro-batches, the output layer at the loss positions only, the model, RMSNorm written out,
    # a prompt run once for its trajectories)
    plans = {"before": (pack(lengths, max_tokens), False, model, False, False),
             "unfused": (pack_sorted(lengths, max_tokens), True, model, True, False),
             "now": (pack_sorted(lengths, max_tokens), True, model, False, False),
             "compiled": (pack_sorted(lengths, max_tokens), True, compiled, False, False),
             "now + KL": (pack_sorted(lengths, max_tokens), True, model, False, False),
             f"now @{tiny}": (pack_sorted(lengths, tiny), True, model, False, False),
             f"compiled @{tiny}": (pack_sorted(lengths, tiny), True, compiled, False, False),
             f"shared @{tiny}": (pack_sorted(lengths, tiny), True, model, False, True)}
    out = {}
    ref_times = []

    def written_out(self, x):  # model.RMSNorm.forward before F.rms_norm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def update(name):
        bins, at_loss, net, unfused, shared = plans[name]
        opt = torch.optim.SGD(net.parameters(), lr=0.0)  # lr 0: the weights stay as they are between rounds
        micros = [collate([seqs[i] for i in idx], "cpu", packed=False,
                          prompts=[prompts[i] for i in idx] if shared else ()) for idx in bins]
        if name == "now + KL":
            # as train_rl.py: the reference's log-probs of every micro-batch first, under no_grad
            t0 = time.perf_counter()
            with torch.no_grad():
                for m in micros:
                    m["ref_logprobs"] = token_logprobs(reference, m["ids"], m["tgt"], m["seg"],
                                                       where=m["mask"].bool(), shared=m.get("shared"))
            ref_times.append(time.perf_counter() - t0)
        loss_sum, entropy, kl = 0.0, 0.0, 0.0
        patch = unittest.mock.patch.object(modeling.RMSNorm, "forward", written_out)
        with patch if unfused else contextlib.nullcontext():
            for m in micros:
                where = m["mask"].bool() if at_loss else None
                lp, ent = token_logprobs(net, m["ids"], m["tgt"], m["seg"], with_entropy=True, where=where,
                                         shared=m.get("shared"))
                loss = policy_loss(lp, lp.detach(), m["adv"], m["mask"], num_tokens=n_tokens)
                if "ref_logprobs" in m:
                    kl_per_token = torch.where(m["mask"].bool(), kl_penalty(lp, m["ref_logprobs"]), 0.0)
                    kl_mean = kl_per_token.sum() / n_tokens
                    loss = loss + kl_coef * kl_mean
                    kl += float(kl_mean.detach())
                loss.backward()
                loss_sum += float(loss.detach())
                entropy += float((ent * m["mask"]).sum() / n_tokens)
        norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0))
        out[name] = (loss_sum, entropy, norm, kl, [p.grad.clone() for p in net.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    update("compiled")  # the compile, timed apart
    compile_s = time.perf_counter() - t0
    times, rounds = medians([functools.partial(update, name) for name in plans], reps)
    print(f"\n(u) the policy update of one tiny RL step: {len(seqs)} trajectories, {sum(lengths):,} tokens, "
          f"the loss on {int(n_tokens):,}; tiny model shape ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, vocab "
          f"{cfg.vocab_size}), {rounds} rounds, load average {load():.2f}")
    print(f"{'':14s} {'micro-batches':>13s} {'padded slots':>12s} {'head positions':>14s} {'s/update':>9s} "
          f"{'loss':>12s} {'entropy':>9s} {'grad norm':>10s} {'loss/kl':>8s} {'max |grad - now|':>16s}")
    for name, t in zip(plans, times):
        bins, at_loss = plans[name][:2]
        slots = sum(len(b) * max(lengths[i] for i in b) for b in bins if b)
        loss, ent, norm, kl, grads = out[name]
        diff = max(float((a - b).abs().max()) for a, b in zip(grads, out["now"][4]))
        print(f"{name:14s} {len(bins):13d} {slots:12,} {int(n_tokens) if at_loss else slots:14,} {t:9.3f} "
              f"{loss:12.8f} {ent:9.5f} {norm:10.6f} {kl:8.1e} {diff:16.2e}")
    speed = dict(zip(plans, times))
    print(f"goal: the update >= x1.4 faster than before: x{speed['before'] / speed['now']:.2f}")
    print(f"issue 45: now / unfused x{speed['unfused'] / speed['now']:.2f}, compiled / unfused "
          f"x{speed['unfused'] / speed['compiled']:.2f}, compiled / now x{speed['now'] / speed['compiled']:.2f} "
          f"(goal >= x1.3 of today's); compile {compile_s:.1f} s (first update, not in the rounds)")
    now = speed["now"]
    print(f"the tiny config's micro-batches ({tiny} tokens; {max_tokens} above): "
          f"now x{now / speed[f'now @{tiny}']:.2f}, compiled x{now / speed[f'compiled @{tiny}']:.2f}, "
          f"shared x{now / speed[f'shared @{tiny}']:.2f} of now at {max_tokens}; a prompt run once for its "
          f"trajectories (shared) x{speed[f'now @{tiny}'] / speed[f'shared @{tiny}']:.2f} of now @{tiny}")
    ref = statistics.median(ref_times)
    with_kl = speed["now + KL"]
    print(f"the KL term (kl_coef {kl_coef}): the update x{with_kl / now:.2f} ({with_kl - now:+.3f} s), of which the "
          f"reference's forward (time/reference) {ref:.3f} s = {ref / now:.0%} of the update without it")


def grading_off_the_loop(tok, reps, prompts=8, samples=16):
    """(g) one tiny RL step's rollouts whose answers need math-verify (fractions), graded inline in the engine's
    on_finish vs by grading.Grader off the decode loop; the end of the timing is every grade in hand."""
    qs = [f"What is {i} / {i + 7}?" for i in range(1, prompts + 1)]
    golds = [f"\\frac{{{i}}}{{{i + 7}}}" for i in range(1, prompts + 1)]
    answers = [tok.encode(f"<reason>r</reason>\n<answer>\\boxed{{\\frac{{{2 * i}}}{{{2 * (i + 7)}}}}}</answer>"
                          "<|im_end|>", add_special_tokens=False) for i in range(1, prompts + 1)]
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, intermediate_size=384,
                                   max_position_embeddings=2048)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
        model = load_model(d, dtype=torch.float32).eval()

    class Forced(Engine):  # every rollout writes its scripted answer (the model's logits are computed anyway)
        def sample(self, rows, *args):
            toks, lps = super().sample(rows, *args)
            for j, r in enumerate(rows):
                a, pos = answers[r.req.key[1]], len(r.traj.response_ids)
                toks[j] = a[pos] if pos < len(a) else toks[j]
            return toks, lps
    engine = Forced(model, tok, kv_capacity=prompts * samples * 600, max_len=600)
    reqs = lambda: [Request(data.render_prompt(tok, q), key=(0, i, s), meta={"answer": golds[i]})  # noqa: E731
                    for i, q in enumerate(qs) for s in range(samples)]
    math_task.reward("1", "\\frac{1}{2}")  # start the math-verify helper before the timing

    def inline():
        grades = []
        engine.run(iter_claim(reqs()), 64, lambda t: grades.append(
            math_task.reward(agent.sampled_turns(tok, t.response_ids, t.mask), golds[t.key[1]])))
        assert grades == [1.0] * len(qs) * samples

    def off_loop():
        grader = grading.Grader(tok)
        engine.run(iter_claim(reqs()), 64, grader)
        assert [r.reward for r in grader.results().values()] == [1.0] * len(qs) * samples
    (a, b), rounds = medians([inline, off_loop], reps)
    print(f"\n(g) {prompts * samples} rollouts whose answers need math-verify, {rounds} rounds: graded inline "
          f"{a:.2f} s, off the decode loop {b:.2f} s: x{a / b:.2f}")


# -----------------------------------------------------------------------------
# (gpu) one prepared command for the first GPU this project is lent

# HBM bandwidth in TB/s by the card's name (the vendors' data sheets), for the decode roofline
# (the longest name the card's contains: "H100" is the SXM card, "NVIDIA H100 80GB HBM3"; the
# PCIe and NVL cards have other HBM)
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H20": 4.0, "A100": 2.0,
            "MI300X": 5.3, "MI325X": 6.0, "MI250": 3.2}


def hbm_of(card):
    """the HBM TB/s of a card by its name (torch.cuda.get_device_name), None if not listed"""
    names = sorted((name for name in HBM_TBPS if name in card), key=len)
    return HBM_TBPS[names[-1]] if names else None


class NoStops:
    """A random model has no stop tokens: the engine reads only their ids from a tokenizer, and -1 is none."""
    def convert_tokens_to_ids(self, token):
        return -1


def random_qwen3(path, dry):
    """A random Qwen3 saved to path (fp32) -> its transformers config. On a GPU Qwen3-0.6B's own shapes
    (28 layers, width 1024, 16/8 heads of 128, MLP 3072, vocabulary 151,936, tied); --cpu: a toy.
    The final norm's weight is scaled x40 so logits are peaked (std ~25 at 0.6B's shapes) and
    greedy argmax is seldom decided by near-ties that rounding could flip; the layers' output
    projections x4, so the residual stream is the layers' and not the token's own embedding: the
    greedy tokens then depend on what attention read, which sections 2 and 3b compare. With the
    (tied) embedding scaled x40 instead, as before, every greedy token was its input token, at
    0.6B's shapes and the toy's alike: those comparisons could not fail."""
    shapes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16) if dry else \
        dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    cfg = transformers.Qwen3Config(**shapes, max_position_embeddings=4096, tie_word_embeddings=True,
                                   rope_theta=1e6, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cpu" if dry else "cuda"):  # 0.6B random weights are made in a second on the card
        hf = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        hf.model.norm.weight.mul_(40.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(4.0)
            layer.mlp.down_proj.weight.mul_(4.0)
    hf.save_pretrained(path)
    return cfg


def gpu_logits(path, dev, lens=(100, 37, 64, 5)):
    """1. our model against transformers' Qwen3 on a right-padded batch, fp32 and bf16: the largest logit
    difference over real tokens, and how many of their argmaxes agree"""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (len(lens), max(lens)), generator=g)  # ids < 512 exist in every vocabulary
    mask = (torch.arange(max(lens)) < torch.tensor(lens)[:, None]).long()
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        ours = load_model(path, dev, dtype).eval()
        with torch.no_grad():
            a = theirs(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.float()[mask.bool().to(dev)]
            b = ours(ids.to(dev), attention_mask=mask.to(dev)).float()[mask.bool().to(dev)]
        res[str(dtype).removeprefix("torch.")] = dict(
            max_abs_diff=(a - b).abs().max().item(), logit_std=a.std().item(),
            argmax_agree=(a.argmax(-1) == b.argmax(-1)).float().mean().item())
        del theirs, ours, a, b
    return res


def common_prefix(mine, theirs):
    """how many tokens two completions share from the start"""
    parted = (i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y)
    return next(parted, min(len(mine), len(theirs)))


def gpu_greedy(path, dev, dry, dtype, n_prompts, new):
    """2. the engine's greedy tokens against transformers' greedy decoding of each prompt alone: prompts
    identical in full, and the mean length of the common prefix (bf16 rounds differently on each side, so
    a late divergence there is rounding, not a bug; fp32 must agree)"""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(4, 24 if dry else 200, (n_prompts,), generator=g)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in lengths]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    ours = load_model(path, dev, dtype).eval()
    max_len = max(map(len, prompts)) + new + 1
    engine = Engine(ours, NoStops(), kv_capacity=len(prompts) * max_len, max_len=max_len, max_rows=len(prompts))
    mine = engine.generate(prompts, new)
    same, prefix = 0, []
    for p, out in zip(prompts, mine):
        with torch.no_grad():
            ref = theirs.generate(input_ids=torch.tensor([p], device=dev), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        same += out == ref
        prefix.append(common_prefix(out, ref))
    del theirs, ours, engine
    return dict(prompts=n_prompts, new_tokens=new, identical=same, mean_common_prefix=statistics.mean(prefix))


def gpu_decode(path, dev, dry, batches, prompt_len, new, hbm, sync):
    """3-4. bf16 decode speed at each batch: ours (Engine.generate) against transformers' generate on the same
    prompts (equal lengths, no padding, no stop: identical work), decode alone (a run of `new` tokens less a run
    of 1, the prefill), against the HBM roofline: a decode step reads every weight once and each row's KV.
    Where flash-attn decodes through a page table, the same engine again with the KV read through SDPA."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    ours = load_model(path, dev, torch.bfloat16).eval()
    c = ours.cfg
    weight_bytes = 2 * sum(p.numel() for p in ours.parameters())
    kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    g = torch.Generator().manual_seed(3)
    rows = []
    for B in batches:
        prompts = [torch.randint(0, 512, (prompt_len,), generator=g).tolist() for _ in range(B)]
        ids = torch.tensor(prompts, device=dev)
        engine = Engine(ours, NoStops(), kv_capacity=B * (prompt_len + new + 1), max_len=prompt_len + new + 1,
                        max_rows=B)

        def timed(fn):
            def run():
                fn()
                sync()
            return run

        @torch.no_grad()
        def run_hf(n):
            theirs.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)

        sides = {"ours": lambda n: engine.generate(prompts, n), "transformers": run_hf}
        if engine.cache.flash:  # the same engine, its pages read through SDPA instead of flash-attn's kernel:
            # built as where the kernel cannot decode through a page table (the SDPA path's pool layout)
            with unittest.mock.patch.object(modeling, "paged_flash", lambda device, dtype: False):
                sdpa_engine = Engine(ours, NoStops(), kv_capacity=B * (prompt_len + new + 1),
                                     max_len=prompt_len + new + 1, max_rows=B)
            assert not sdpa_engine.cache.flash
            sides["ours, SDPA pages"] = lambda n: sdpa_engine.generate(prompts, n)
        for fn in sides.values():
            fn(2)  # warm-up
        fns = [timed(lambda fn=fn, n=n: fn(n)) for fn in sides.values() for n in (new, 1)]
        times, rounds = medians(fns, 1)  # 1 to 3 rounds: a GPU's timings hardly move
        # a decode step reads the weights once and, per row, the KV of its context (mean over the run)
        step_bytes = weight_bytes + B * (prompt_len + new / 2) * kv_bytes_per_token
        roofline = B * hbm * 1e12 / step_bytes if hbm else None
        for i, side in enumerate(sides):
            full, prefill = times[2 * i], times[2 * i + 1]
            decode_s = max(full - prefill, 1e-9)
            tok_s = B * (new - 1) / decode_s
            rows.append(dict(batch=B, side=side, run_s=full, prefill_s=prefill, ms_per_step=1e3 * decode_s / (new - 1),
                             decode_tok_s=tok_s, roofline_tok_s=roofline,
                             roofline_pct=100 * tok_s / roofline if roofline else None, rounds=rounds))
        del engine
    del theirs, ours
    return rows


class GraphedSteps:
    """Issue 45: model.Qwen.static_step's decode steps captured as CUDA graphs, one per shape (bucket of rows and
    pages), captured at a shape's first step and replayed after, the step's inputs copied into the graph's own:
    vLLM's and SGLang's way of launching a step's hundreds of small kernels at once. Set as a model's static_step
    (decode_mode "static") for one KV cache: the graphs write into that cache's pools. It lives here, not in
    model.py, until a GPU run shows its worth (model.py had no room for its ~215 code tokens)."""

    def __init__(self, model):
        self.model = model
        self.graphs = {}  # the inputs' shapes -> (the graph, its own inputs, its output)
        self.pool = None  # the memory pool the graphs share

    def __call__(self, input_ids, pos, att):
        names = [k for k, v in att.items() if torch.is_tensor(v)]
        inputs = [input_ids, pos] + [att[k] for k in names]
        key = tuple(z.shape for z in inputs)
        if key not in self.graphs:
            copies = [z.clone() for z in inputs]
            args = (*copies[:2], {**att, **dict(zip(names, copies[2:]))})
            # the warm-up and the capture on one side stream, as torch's docs prescribe: a lazy
            # initialisation made once a stream (cuBLAS's workspace is one a stream) is then made
            # by the warm-up, not in the capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # after the copies are made
            with torch.cuda.stream(stream):
                # a warm-up run first (lazy initialisations stay out of the graph), as vLLM does;
                # its writes into the pool are the step's own, which the replay repeats
                self.model.run(*args)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.model.run(*args)
            torch.cuda.current_stream().wait_stream(stream)
            self.pool = graph.pool()
            self.graphs[key] = (graph, copies, out)
        graph, copies, out = self.graphs[key]
        for copy, z in zip(copies, inputs):
            copy.copy_(z)
        graph.replay()
        return out  # forward_cached passes it through the head before the next replay overwrites it


# each compiled side adds its shapes' entries to one function's cache (model.Qwen.run): past dynamo's default of
# 8, a step would run eagerly without a word and be timed as compiled; here it may hold more, and past that it fails
@torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True)
def gpu_graphs(path, dev, dry, batches, prompt_len, new, hbm, sync, deadline=math.inf,
               save=lambda rows: None, others=None):
    """3b. issue 45: the engine's decode steps eager (forward_cached) against static-shape steps captured as CUDA
    graphs (GraphedSteps as model.static_step: a graph per bucket of rows and pages, replayed), bf16, ms per
    decode step (a run of `new` tokens less a run of 1) and the share of the HBM roofline; the first run of each
    batch, which captures its graphs, is timed apart; the tokens of both sides compared (rows
    identical, and the mean common prefix: the random model's bf16 tokens part where a static step
    rounds otherwise, and at the first decode token where it reads a wrong input or key). On a GPU also "compile"
    (decode_mode "compile": the same steps through inductor, its first run, which compiles, apart) and
    "reduce-overhead": decode_mode "graphs", the engine's own CUDA graphs (the same steps compiled with
    torch.compile's mode="reduce-overhead", its graph trees, the KV pools marked as static addresses so the graphs
    may write into them in place). Where it matches GraphedSteps, the engine has what GraphedSteps does without
    its ~215 code tokens. --cpu: "static" (the same steps run eagerly: a CPU has no graphs).
    A compiled side ("compile", "reduce-overhead") not begun by deadline (time.perf_counter()) is
    skipped, a row saying so: a compile per shape and batch may take minutes, where a capture by
    hand takes a second, so GraphedSteps is timed at every batch. save(rows) after each batch (the
    JSON report: a kill keeps them). others: the sides besides eager (default: "static" on --cpu,
    the three above on a GPU)."""
    ours = load_model(path, dev, torch.bfloat16).eval()
    c = ours.cfg
    weight_bytes = 2 * sum(p.numel() for p in ours.parameters())
    kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    # the sides besides eager
    others = others or (("static",) if dry else ("graphs", "compile", "reduce-overhead"))
    # inductor leaves a step out of its CUDA graphs without a word (an input it cannot keep in place, a tensor on the
    # CPU, ...; its reason goes to a log that is off): "reduce-overhead" would be timed as graphs while it runs as
    # "compile". Where this torch has the switch, such a step raises, saying why (its side FAILED); either way each
    # side's skipped graphs are counted (cudagraph_skips; inductor's own counter)
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    graphs_or_error = ({"triton.cudagraph_or_error": True}
                       if hasattr(inductor_config.triton, "cudagraph_or_error") else {})
    g = torch.Generator().manual_seed(4)
    rows = []

    def held_mib():
        """the GPU memory the caching allocator holds now, MiB (None on the CPU)"""
        return torch.cuda.memory_reserved() / 2**20 if dev == "cuda" else None
    for B in batches:
        prompts = [torch.randint(0, 512, (prompt_len,), generator=g).tolist() for _ in range(B)]
        engine = Engine(ours, NoStops(), kv_capacity=B * (prompt_len + new + 1), max_len=prompt_len + new + 1,
                        max_rows=B)

        graphed = GraphedSteps(ours)  # this engine's graphs (they write into its cache)
        # the compiled steps of the two compiled sides, made by model.static_step on each one's first run in its
        # decode_mode ("reduce-overhead": "graphs") and kept by the model, one a mode; afresh at each batch
        ours.compiled = {}
        modes = {"eager": "eager", "compile": "compile", "reduce-overhead": "graphs"}

        def run(n, side):
            # graphs (GraphedSteps) as static's steps
            ours.decode_mode = modes.get(side, "static")
            if side == "graphs":
                ours.static_step = graphed
            try:
                with inductor_config.patch(graphs_or_error if side == "reduce-overhead" else {}):
                    out = engine.generate(prompts, n)
                    sync()
                return out
            finally:
                ours.decode_mode = "eager"
                ours.__dict__.pop("static_step", None)  # the method again
        eager_tokens = run(new, "eager")  # warm-up
        # held: the GPU memory the caching allocator holds once a side's first run is done (MiB), so the growth
        # from one side to the next is what that side kept: a CUDA graph keeps its own memory pool, per shape
        first_s, same, prefix, skips = {}, {}, {}, {}
        held = {"eager": held_mib()}
        # the sides that ran: one that fails on this device is reported, and the others still timed
        sides = ["eager"]
        for side in others:
            t0 = time.perf_counter()
            if t0 > deadline and side in ("compile", "reduce-overhead"):
                late = "not begun: past the time budget (--budget_s)"
                rows.append(dict(batch=B, side=side, skipped=late))
                continue
            skipped = counters["inductor"]["cudagraph_skips"]
            try:
                tokens = run(new, side)  # captures (or compiles) each bucket's step
            except Exception as e:  # noqa: BLE001 (one command on a lent GPU: every side that can run, runs)
                traceback.print_exc()
                rows.append(dict(batch=B, side=side, error=f"{type(e).__name__}: {e}"[:2000]))
                continue
            sides.append(side)
            first_s[side] = time.perf_counter() - t0
            same[side] = sum(a == b for a, b in zip(eager_tokens, tokens))
            # bf16 rounds differently in a static step (padded rows, whole pages): a random model's
            # greedy tokens part after a while; a step that reads wrong inputs or keys parts at its
            # first token
            prefix[side] = statistics.mean(map(common_prefix, eager_tokens, tokens))
            skips[side] = counters["inductor"]["cudagraph_skips"] - skipped
            held[side] = held_mib()
        times, rounds = medians([functools.partial(run, n, side) for side in sides for n in (new, 1)], 1)
        step_bytes = weight_bytes + B * (prompt_len + new / 2) * kv_bytes_per_token
        roofline = B * hbm * 1e12 / step_bytes if hbm else None  # tokens/s if each step only read HBM once
        for i, side in enumerate(sides):
            decode_s = max(times[2 * i] - times[2 * i + 1], 1e-9)
            tok_s = B * (new - 1) / decode_s
            rows.append(dict(batch=B, side=side, ms_per_step=1e3 * decode_s / (new - 1), decode_tok_s=tok_s,
                             roofline_pct=100 * tok_s / roofline if roofline else None, rounds=rounds,
                             first_run_s=first_s.get(side), same_tokens=same.get(side, B), rows=B,
                             common_prefix=prefix.get(side, new),
                             cudagraph_skips=skips.get(side, 0), mib_held=held.get(side)))
        # each batch's lines as soon as it is measured: a run stopped by the device's time limit keeps them
        print_gpu_graphs([r for r in rows if r["batch"] == B], title=B == batches[0])
        save(rows)
        del engine
    del ours
    return rows


def print_gpu_graphs(rows, title=True):
    if title:
        print("3b. decode steps, eager vs static shapes (issue 45; CUDA graphs and inductor on a GPU, run eagerly on "
              "--cpu):")
        print(f"   {'batch':>5} {'side':<15} {'ms/step':>8} {'tok/s':>9} {'% roofline':>10} {'first run s':>11} "
              "same tokens  common prefix  graphs skipped  MiB held")
    for r in rows:
        if "error" in r:
            print(f"   {r['batch']:>5} {r['side']:<15} FAILED: {r['error'][:200]}")
            continue
        if "skipped" in r:
            print(f"   {r['batch']:>5} {r['side']:<15} SKIPPED: {r['skipped']}")
            continue
        pct = f"{r['roofline_pct']:.1f}" if r["roofline_pct"] is not None else "?"
        first = f"{r['first_run_s']:.2f}" if r["first_run_s"] is not None else ""
        print(f"   {r['batch']:>5} {r['side']:<15} {r['ms_per_step']:>8.2f} {r['decode_tok_s']:>9,.0f} {pct:>10} "
              f"{first:>11} {str(r['same_tokens']) + '/' + str(r['rows']):<11}  "
              f"{r['common_prefix']:>13.1f}  "
              f"{r.get('cudagraph_skips', 0):>14}  "
              f"{'' if r.get('mib_held') is None else format(r['mib_held'], '8,.0f')}")
    for B in sorted({r["batch"] for r in rows}):
        eager, *others = [r for r in rows if r["batch"] == B and "ms_per_step" in r]
        if others:
            ratios = (f"{r['side']} / eager x{eager['ms_per_step'] / r['ms_per_step']:.2f}"
                      for r in others)
            print(f"   batch {B}: " + ", ".join(ratios) + " per step")


def gpu_rl_steps(model_path, data_path, steps, dry, isolation, decode_mode="eager"):
    """5. a few RL steps of the tiny config through train_rl.py itself (bf16 on the GPU), from its metrics; 5b (part
    rl_graphs, only when asked for) the same with decode_mode "graphs": the engine's CUDA graphs replayed while the
    weights they read change in place after every step, whose sampling-time log-probs must then stay as close to
    the trainer's (mismatch/abs_mean) as in 5's eager steps"""
    if not (os.path.isdir(model_path) and os.path.isfile(data_path)):
        return {"skipped": f"no model at {model_path} or data at {data_path}: make them with `python data.py prepare` "
                           f"and `python train_sft.py configs/tiny_sft.py`, or pass --model_path / --data_path"}
    with tempfile.TemporaryDirectory() as run_dir:
        args = [sys.executable, "train_rl.py", "configs/tiny_rl.py", f"--model_path={model_path}",
                f"--data_path={data_path}", f"--run_dir={run_dir}", f"--steps={steps}", f"--tool_isolation={isolation}",
                "--save_every=1000", "--dump_every=0", "--kv_capacity=65536", f"--decode_mode={decode_mode}",
                f"--dtype={'float32' if dry else 'bfloat16'}"]
        if dry:
            args += ["--prompts_per_step=2", "--samples_per_prompt=4", "--keep_per_prompt=2",
                     "--max_response_tokens=64", "--tool_workers=1"]
        t0 = time.perf_counter()
        # 5 minutes at most: a lent GPU's command has 10, and a hung run must leave section 3b some
        p = subprocess.run(args, cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True,
                           timeout=300)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            return {"failed": f"train_rl.py failed (rc {p.returncode})", "tail": (p.stdout + p.stderr)[-3000:]}
        keys = {"reward": "rollout/reward", "kept": "roc/kept", "grad_norm": "loss/grad_norm", "tool_calls": "tool/calls",
                "response_len": "rollout/response_len", "t_rollout": "time/rollout", "t_train": "time/train",
                "tok_per_s": "rollout/tok_per_s", "mismatch": "mismatch/abs_mean"}  # train_rl.py's metric names
        steps = [{k: m.get(v) for k, v in keys.items()} for m in data.read_metrics(run_dir)]
        report = {"wall_s": wall, "steps": steps, "updated": sum(bool(s["kept"]) for s in steps)}
        # what the section is for: an update on the GPU. A model that earns no reward (every group's rewards
        # equal, as the first GPU run's 1-epoch SFT model) leaves nothing to train, and says so
        if not (dry or report["updated"]):
            report["failed"] = (f"no step updated the weights: {model_path} earned no reward in any group. Carry a "
                                f"trained model (out/tiny-sft and out/data from `bash run.sh`'s first two stages)")
        return report


def gpu_bench(dry, hbm_tbps, model_path, data_path, rl_steps, isolation, out_path, parts,
              budget_s=480):
    """Everything a first GPU should tell us, in one command, well under 10 minutes; --cpu dry-runs
    it. Section 3b begins no compiled side past budget_s seconds from the start (a compile takes
    minutes).
    """
    start = time.perf_counter()
    assert dry or torch.cuda.is_available(), "no GPU visible to torch: run `python bench.py gpu --cpu` for the dry run"
    dev = "cpu" if dry else "cuda"
    sync = (lambda: None) if dry else torch.cuda.synchronize
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    name = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    hbm = hbm_tbps or hbm_of(name)
    report = dict(device=name, torch=torch.__version__, transformers=transformers.__version__, hbm_tbps=hbm,
                  flash_attn=flash_attn_with_kvcache is not None, load=load())
    print(f"(gpu) {name} | torch {torch.__version__} | transformers {transformers.__version__} | HBM "
          f"{hbm or '?'} TB/s | flash-attn {'yes' if report['flash_attn'] else 'not installed: SDPA only'}", flush=True)
    failed = []

    def section(key, fn, show, *args):
        """run one part, print its lines as soon as it ends; a part that raises is reported and the next runs"""
        if parts and key not in parts:
            return
        t0 = time.perf_counter()
        if not dry:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            report[key] = fn(*args)
            show(report[key])
            # a part that ran with a side that failed (section 3b) fails too, its other rows kept
            if isinstance(report[key], list) and any("error" in row for row in report[key]):
                failed.append(key)
        except Exception as e:  # noqa: BLE001 (one command on a lent GPU: every part that can run, runs)
            report[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            failed.append(key)
            print(report[key]["traceback"], flush=True)
        if not dry:
            report.setdefault("peak_gib", {})[key] = torch.cuda.max_memory_allocated() / 2**30
        print(f"   ({key}: {time.perf_counter() - t0:.0f} s"
              + (f", peak GPU memory {report['peak_gib'][key]:.1f} GiB)" if not dry else ")"), flush=True)
        # the report so far, after every part: a run stopped by its time limit leaves what it measured
        write(report)

    def write(so_far):
        with open(out_path + ".part", "w") as f:
            json.dump(so_far, f, indent=1)
        os.replace(out_path + ".part", out_path)

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)

    with tempfile.TemporaryDirectory() as path:
        cfg = random_qwen3(path, dry)
        params = sum(p.numel() for p in load_model(path, "meta").parameters())
        report["model"] = dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                               params=params)
        print(f"random Qwen3 of {params / 1e6:.1f}M params ({cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
              f"vocabulary {cfg.vocab_size})", flush=True)
        section("logits", gpu_logits, print_gpu_logits, path, dev)
        for key, dtype, n in (("greedy_fp32", torch.float32, 8), ("greedy_bf16", torch.bfloat16, 8)):
            section(key, gpu_greedy, functools.partial(print_gpu_greedy, key), path, dev, dry, dtype,
                    4 if dry else n, 8 if dry else 64)
        section("decode", gpu_decode, functools.partial(print_gpu_decode, report["flash_attn"]), path, dev, dry,
                (1, 2, 4) if dry else (1, 32, 64), 16 if dry else 128, 8 if dry else 128, hbm, sync)
        section("rl", gpu_rl_steps, print_gpu_rl, model_path, data_path, 1 if dry else rl_steps, dry, isolation)
        # the static steps last: the longest part (a compile or capture per side, shape and batch), so a run cut
        # short by a device's time limit has all the others
        # its rows written after each batch too
        section("graphs", gpu_graphs, lambda rows: None, path, dev, dry, (1, 2, 4) if dry else (1, 32, 64),
                16 if dry else 128, 8 if dry else 128, hbm, sync, start + budget_s,
                lambda rows: write({**report, "graphs": rows}))
        # 5b. the RL steps with the engine's CUDA graphs: only when asked for by name (its compiles take minutes)
        if "rl_graphs" in parts:
            section("rl_graphs", gpu_rl_steps, functools.partial(print_gpu_rl, label="5b. RL, graphs,"), model_path,
                    data_path, 1 if dry else rl_steps, dry, isolation, "graphs")
    print(f"wrote {out_path}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def print_gpu_logits(res):
    for dtype, r in res.items():
        print(f"1. logits {dtype:<8} vs transformers: max |diff| {r['max_abs_diff']:.2e} (logit std "
              f"{r['logit_std']:.1f}), argmax agrees on {100 * r['argmax_agree']:.1f}% of tokens")


def print_gpu_greedy(key, r):
    print(f"2. {key}: {r['identical']}/{r['prompts']} prompts token-identical to transformers' greedy over "
          f"{r['new_tokens']} tokens (mean common prefix {r['mean_common_prefix']:.1f})")


def print_gpu_decode(flash, rows):
    print("3. bf16 decode steps alone (a run of N new tokens less a run of 1):")
    print(f"   {'batch':>5} {'side':<17} {'ms/step':>8} {'tok/s':>9} {'% roofline':>10} {'prefill s':>9}")
    for r in rows:
        pct = f"{r['roofline_pct']:.1f}" if r["roofline_pct"] is not None else "?"
        print(f"   {r['batch']:>5} {r['side']:<17} {r['ms_per_step']:>8.2f} {r['decode_tok_s']:>9,.0f} {pct:>10} "
              f"{r['prefill_s']:>9.3f}")
    for B in sorted({r["batch"] for r in rows}):
        by = {r["side"]: r for r in rows if r["batch"] == B}
        flash_vs = (f", paged flash-attn / SDPA pages x{by['ours']['decode_tok_s'] / by['ours, SDPA pages']['decode_tok_s']:.2f}"
                    if "ours, SDPA pages" in by else "")
        print(f"   batch {B}: ours / transformers x{by['ours']['decode_tok_s'] / by['transformers']['decode_tok_s']:.2f}"
              f"{flash_vs}")
    if not flash:
        print("4. paged flash-attn vs SDPA: not measured, flash-attn is not installed here")


def print_gpu_rl(rl, label="5. RL"):
    steps = rl.get("steps")
    if steps is None:  # skipped, or train_rl.py failed
        print(f"{label} steps: {rl}")
    else:
        for i, s in enumerate(steps, 1):
            # a step that updated nothing logs no grad norm and no update time
            print(f"{label} step {i}: reward {s['reward']:.3f} | kept {s['kept']} | gnorm {s['grad_norm'] or 0:.2f} | "
                  f"len {s['response_len']:.0f} | rollout {s['t_rollout']:.1f} s ({s['tok_per_s']:,.0f} tok/s) | "
                  f"train {s['t_train'] or 0:.2f} s | engine vs trainer log-probs {s['mismatch'] or 0:.4f}")
        print(f"   train_rl.py wall time {rl['wall_s']:.0f} s (start-up included); {rl['updated']} of "
              f"{len(steps)} step(s) updated the weights")
    if "failed" in rl:
        raise RuntimeError(f"RL steps: {rl['failed']}")


# (trl): an RL step of train_rl.py against TRL's GRPOTrainer on the same work. TRL lives in its own
# venv (--trl_python; the recipe is in trl_bench's docstring) and bench.py runs there too, as the
# TRL side (--trl_worker). The loss settings GRPOConfig can mirror, at the values it mirrors:
TRL_LOSS = {"adv_scale": "std", "loss_norm": "token", "ratio_level": "token", "mini_batches": 1,
            "kl_coef": 0.0, "dual_clip": 0.0, "tis_cap": 0.0, "mismatch_band": 0.0,
            "activation_checkpointing": False, "dtype": "float32"}
# the single-turn task of (trl), written to a temp file for train_rl.py's --task and loaded by the
# TRL side too. The tiny model answers every arithmetic question with a tool call, so one turn
# never holds an answer and the math reward is 0 for every sample: no group would carry a signal
# and ours would skip the update. This reward is the share of the question's expression that the
# turn copies (its longest run of it: 1 when copied whole). A tiny model that miscopies numbers
# earns it in parts, so groups differ on any CPU's model (a reward of exact copies alone was 0 in
# almost every sample of one box's model, and ours then trained nothing), and both sides do the
# whole update.
TRL_TASK = '''"""bench.py trl: math_no_tool's prompt; reward: the share of the question's expression
the turn copies (its longest run of it), 1 when copied whole"""
import difflib

from tasks.math_no_tool import COLUMNS, TOOLS, predict, prompt  # noqa: F401


def grade(row, pred, turns, grader, trajectory):
    expression = row["question"].removeprefix("What is ").removesuffix("?")
    text = "".join(turns)
    run = difflib.SequenceMatcher(None, expression, text, autojunk=False).find_longest_match(
        0, len(expression), 0, len(text))
    return run.size / len(expression), run.size == len(expression)
'''


def train_rl_config(args, path="train_rl.py"):
    """train_rl.py's settings for its command-line args (config files and --key=value): its
    defaults (the module-level assignments above configure(), read from its source), then
    configurator.configure."""
    import ast
    import configurator
    with open(path) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in tree.body:
        # the defaults end at `cfg = configure(globals())`, the first assignment of a call
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            break
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            # a constant expression (256 << 20, 1e-6), evaluated with no names in scope
            expression = compile(ast.Expression(node.value), path, "eval")
            defaults[node.targets[0].id] = eval(expression, {})
    with contextlib.redirect_stdout(io.StringIO()):
        return configurator.configure(defaults, list(args))


def trl_config(cfg, micro_rows):
    """GRPOConfig's keyword arguments for train_rl's settings cfg, and each setting it cannot
    mirror as a line to print. Every sample of a step is trained (plain GRPO; with RoC, TRL has no
    down-sampling: it trains all 2G). micro_rows: TRL's rows per micro-batch (it counts rows, ours
    tokens)."""
    group = cfg["samples_per_prompt"] if cfg["roc"] else cfg["keep_per_prompt"]
    batch = cfg["prompts_per_step"] * group
    if batch % micro_rows:
        raise ValueError(f"--trl_micro_rows={micro_rows} must divide the step's {batch} samples")
    unequal = [f"{key} = {cfg[key]!r} (TRL runs {value!r})"
               for key, value in TRL_LOSS.items() if cfg[key] != value]
    kwargs = dict(
        per_device_train_batch_size=micro_rows,
        gradient_accumulation_steps=batch // micro_rows,
        num_generations=group,
        max_completion_length=cfg["max_response_tokens"],
        temperature=cfg["temperature"],
        top_p=cfg["top_p"],
        top_k=0,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=cfg["warmup_steps"],
        weight_decay=cfg["weight_decay"],
        max_grad_norm=cfg["grad_clip"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        # the loss: no KL term, clip-higher, a token-mean over the step's sampled tokens,
        # std-scaled group advantages, one optimizer step a generation (the old log-probs are the
        # update's own)
        beta=0.0,
        epsilon=cfg["eps_low"],
        epsilon_high=cfg["eps_high"],
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        mask_truncated_completions=False,
        # the tool's turns: ours counts assistant turns, TRL the tool rounds between them
        max_tool_calling_iterations=cfg["max_turns"] - 1,
        # GRPOConfig's defaults that are not ours: activation checkpointing and bf16 on
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        shuffle_dataset=False,
        seed=cfg["seed"],
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    return kwargs, unequal


def trl_missing(trl_python):
    """None where trl_python imports trl, transformers and torch; else why not, in one line."""
    if not os.path.exists(trl_python):
        return f"{trl_python} does not exist"
    probe = subprocess.run([trl_python, "-c", "import torch, transformers, trl"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no error text"])[-1]
        return f"{trl_python} cannot import trl: {last}"
    return None


def trl_worker(spec_path):
    """The TRL side, run by the trl venv's python: GRPOTrainer on the spec's prompts, timed step by
    step. Writes spec_path + ".out.json": per optimizer step its seconds (on_step_begin to
    on_step_end: the generation, the rewards, every micro-batch's forward and backward, the
    optimizer step), its generated tokens, its mean reward and each micro-batch's padded tokens
    (rows x width)."""
    import datasets
    import trl
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    with open(spec_path) as f:
        spec = json.load(f)
    tok = transformers.AutoTokenizer.from_pretrained(spec["model_path"])
    tools = []
    pool = None
    if spec["tool"]:
        # the tool: our sandbox pool, answered in our words (agent.tool_response_text). TRL calls
        # it by its name and reads its schema from the signature and the docstring, built from
        # ours
        settings = spec["tool"]
        pool = SandboxPool(workers=1, timeout=settings["timeout"], memory=settings["memory"],
                           isolation=settings["isolation"]).start()

        def execute_python_code_with_standard_io(code: str, input: str):
            result = pool.submit(code, input or "").result()
            return agent.tool_response_text(result, settings["max_chars"])
        function = agent.TOOL_SCHEMA["function"]
        arguments = function["parameters"]["properties"]
        execute_python_code_with_standard_io.__doc__ = (
            function["description"] + "\n\nArgs:\n"
            + "".join(f"    {name}: {arg['description']}\n" for name, arg in arguments.items()))
        tools.append(execute_python_code_with_standard_io)
        # the parser of Qwen3's <tool_call> JSON blocks: our model's, under the release's template
        from trl.chat_template_utils import qwen3_template
        tok.response_template = qwen3_template
    # the same prompt tokens as our engine's, checked: TRL renders and tokenizes a prompt itself,
    # through the chat template with the tools where it has them
    for row, ids in zip(spec["rows"], spec["prompt_ids"]):
        text = row["prompt"]
        if tools:
            text = tok.apply_chat_template(text, tools=tools, add_generation_prompt=True,
                                           tokenize=False)
        if tok(text)["input_ids"] != ids:
            raise SystemExit(f"TRL's tokens of a prompt differ from ours: {text[-80:]!r}")
    policy = transformers.AutoModelForCausalLM.from_pretrained(spec["model_path"],
                                                               dtype=torch.float32)
    task = grading.load_task(spec["task"])
    grader = grading.Grader(None, helpers=1)
    steps = []
    current = {}

    def reward(completion_ids, completions, question, answer, **_):
        # as ours grades: a rollout cut by the budget scores 0, a finished one the task's grade of
        # its sampled turns (with the tool: the assistant messages TRL parsed)
        rewards = []
        for ids, completion, row_question, row_answer in zip(completion_ids, completions, question,
                                                             answer):
            finished = bool(ids) and ids[-1] == tok.eos_token_id
            if not finished:
                rewards.append(0.0)
                continue
            if tools:
                turns = [message["content"] for message in completion
                         if message["role"] == "assistant"]
            else:
                turns = [tok.decode(ids[:-1])]
            row = {"question": row_question, "answer": row_answer}
            rewards.append(task.grade(row, None, turns, grader, None)[0])
        current["tokens"] += sum(map(len, completion_ids))
        current["rewards"] += rewards
        return rewards

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.update(tokens=0, rewards=[], micro=[], start=time.perf_counter(),
                           cpu=time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"seconds": time.perf_counter() - current.pop("start"),
                          "cpu": time.process_time() - current.pop("cpu"),
                          "tokens": current["tokens"],
                          "trained": len(current["rewards"]),
                          "reward": statistics.mean(current["rewards"]),
                          "micro_tokens": current["micro"]})

    config = trl.GRPOConfig(output_dir=os.path.dirname(spec_path), **spec["trl_config"])
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=config, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(spec["rows"]),
                              callbacks=[Clock()], tools=tools or None)
    if tools:
        # a tool turn follows the model's <|im_end|> at once in the release and in ours
        # (agent.tool_suffix_text); TRL cuts its suffix from the template's rendering, with the
        # "\n" the template writes after <|im_end|>: dropped, so the model sees the tokens it was
        # trained on
        suffix_ids = trainer._get_tool_suffix_ids
        newline = tok.encode("\n", add_special_tokens=False)

        def release_suffix(tool_messages):
            ids = suffix_ids(tool_messages)
            return ids[len(newline):] if ids[:len(newline)] == newline else ids
        trainer._get_tool_suffix_ids = release_suffix
    compute_loss = trainer.compute_loss

    def counted_loss(model, inputs, *args, **kwargs):
        # each micro-batch's padded tokens, as ours counts them against max_tokens_per_micro
        rows, prompt_width = inputs["prompt_ids"].shape
        current["micro"].append(rows * (prompt_width + inputs["completion_ids"].shape[1]))
        return compute_loss(model, inputs, *args, **kwargs)
    trainer.compute_loss = counted_loss
    trainer.train()
    grader.close()
    if pool:
        pool.close()
    with open(spec_path + ".out.json", "w") as f:
        json.dump({"steps": steps,
                   "trl": trl.__version__,
                   "transformers": transformers.__version__,
                   "torch": torch.__version__,
                   "threads": torch.get_num_threads()}, f)
    return 0


# train_rl.py run with a CPU clock per step: the process's CPU seconds (all its threads: the
# engine, the grader's, the update) from the loop's start (the Logger is made right before it) or
# the last step's log or rollout dump, to this step's log. The sandbox's processes are not counted
# (the TRL side's neither). Wall clocks mislead on a shared machine; CPU seconds much less so.
OURS_CLOCK = """
import runpy, sys, time
import common, scheduler
init = common.Logger.__init__
log = common.Logger.log
join_parts = scheduler.join_parts
mark = [0.0]
def timed_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    mark[0] = time.process_time()
def timed_log(self, step, metrics):
    metrics["bench/cpu_s"] = time.process_time() - mark[0]
    log(self, step, metrics)
    mark[0] = time.process_time()
def timed_join(*args):
    join_parts(*args)
    mark[0] = time.process_time()
common.Logger.__init__ = timed_init
common.Logger.log = timed_log
scheduler.join_parts = timed_join
sys.argv = sys.argv[1:]
runpy.run_path("train_rl.py", run_name="__main__")
"""


def ours_steps(args, run_dir):
    """train_rl.py with args in a fresh process, one thread: per step its seconds (rollout +
    grade wait + gather + update, its own clocks), CPU seconds (OURS_CLOCK), generated tokens,
    trajectories trained, mean reward."""
    p = subprocess.run([sys.executable, "-c", OURS_CLOCK, "train_rl.py", *args,
                        f"--run_dir={run_dir}"],
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise RuntimeError(f"train_rl.py failed (rc {p.returncode}):\n{tail}")
    rows = []
    for m in data.read_metrics(run_dir):
        seconds = m["time/rollout"] + m["time/grade_wait"] + m["time/gather"] + m["time/train"]
        rows.append({"seconds": seconds,
                     "cpu": m["bench/cpu_s"],
                     "tokens": round(m["rollout/tok_per_s"] * m["time/rollout"]),
                     "trained": m["roc/kept"],
                     "reward": m["rollout/reward"]})
    return rows


def trl_side(trl_python, spec_path):
    """TRL's steps for the spec, in a fresh process of trl_python, one thread."""
    p = subprocess.run([trl_python, os.path.abspath(__file__), "trl", f"--trl_worker={spec_path}"],
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise RuntimeError(f"the TRL side failed (rc {p.returncode}):\n{tail}")
    with open(spec_path + ".out.json") as f:
        return json.load(f)


def check_prompts(run_dir, steps, per_step, questions):
    """The questions ours trained on, read back from its rollout dumps, are those TRL is given."""
    for step in range(1, steps + 1):
        path = os.path.join(run_dir, "rollouts", f"step_{step:06d}.jsonl.gz")
        with gzip.open(path, "rt") as f:
            seen = {json.loads(line)["question"] for line in f}
        if seen != set(questions[(step - 1) * per_step:step * per_step]):
            raise RuntimeError(f"step {step}: ours trained on other prompts than TRL is given")


def trl_bench(trl_python, rounds, steps, micro_rows, model_path, data_path,
              variants=("grpo", "roc", "tool", "tool_roc")):
    """(trl) RL steps of ours (train_rl.py, one assistant turn, no tool) against TRL's GRPOTrainer
    on the same work; each side a fresh process a round, one thread, interleaved: ours, TRL, ours,
    TRL... variants: "grpo" (plain GRPO, G samples a prompt, all trained) and "roc" (ours: 2G
    sampled, RoC keeps G; TRL, which has no RoC, samples 2G and trains them all).
    TRL's venv (never the project's .venv): a CPU torch, our pinned transformers, the newest trl:
        python3 -m venv /work/trl-venv
        /work/trl-venv/bin/pip install torch==2.13.0 \\
            --index-url https://download.pytorch.org/whl/cpu
        /work/trl-venv/bin/pip install -r requirements.txt trl
    """
    unknown = set(variants) - {"grpo", "roc", "tool", "tool_roc"}
    if unknown:
        raise ValueError(f"unknown --trl_variants {sorted(unknown)}: choose from grpo, roc, tool, "
                         f"tool_roc")
    missing = trl_missing(trl_python)
    if missing:
        print(f"(trl) skipped: trl is not installed for {trl_python} ({missing}). Make its venv "
              f"as bench.trl_bench's docstring says and pass --trl_python=<its python>.")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        copy_task = os.path.join(tmp, "copy_task.py")
        with open(copy_task, "w") as f:
            f.write(TRL_TASK)
        base = ["configs/tiny_rl.py", f"--steps={steps}", f"--model_path={model_path}",
                f"--data_path={data_path}", "--save_every=100000", "--dump_every=1"]
        # without the tool: one assistant turn (max_turns 1 ends the episode at a tool call, as
        # TRL's generation does); with it: tasks/math.py, multi-turn, the tool in our sandbox
        single = [f"--task={copy_task}", "--max_turns=1"]
        runs = {variant: {"args": base + ([] if variant.startswith("tool") else single)
                          + [f"--roc={variant.endswith('roc')}"]} for variant in variants}
        tok = transformers.AutoTokenizer.from_pretrained(model_path)
        problems = read_jsonl(data_path)
        for variant, run in runs.items():
            cfg = run["cfg"] = train_rl_config(run["args"])
            run["trl"], run["unequal"] = trl_config(cfg, micro_rows)
            run["trl"]["max_steps"] = steps
            run["sides"] = {"ours": [], "TRL": []}
            # our data stream's first prompts (train_rl.prompt_at from cursor 0): each row's
            # prompt as the task renders it, those within max_prompt_tokens, in the seed's order
            # of epoch 0
            task = grading.load_task(cfg["task"])
            prompt_ids = [tok.encode(task.prompt(row), add_special_tokens=False)
                          for row in problems]
            fitting = [i for i, ids in enumerate(prompt_ids)
                       if len(ids) <= cfg["max_prompt_tokens"]]
            generator = torch.Generator().manual_seed(cfg["seed"])
            order = torch.randperm(len(fitting), generator=generator).tolist()
            stream = [fitting[i] for i in order[:steps * cfg["prompts_per_step"]]]
            # TRL's prompt: the text itself, or with the tool the user's message, which TRL renders
            # through the chat template (the release's: the same text, checked on its side)
            tool = None
            rows = [dict(problems[i], prompt=task.prompt(problems[i])) for i in stream]
            if variant.startswith("tool"):
                tool = {"timeout": cfg["tool_timeout"], "memory": cfg["tool_memory"],
                        "isolation": cfg["tool_isolation"], "max_chars": cfg["tool_max_chars"]}
                rows = [dict(problems[i],
                             prompt=[{"role": "user", "content": problems[i]["question"]}])
                        for i in stream]
            run["questions"] = [problems[i]["question"] for i in stream]
            run["spec"] = os.path.join(tmp, f"{variant}.json")
            with open(run["spec"], "w") as f:
                json.dump({"model_path": model_path,
                           "task": cfg["task"],
                           "tool": tool,
                           "rows": rows,
                           "prompt_ids": [prompt_ids[i] for i in stream],
                           "trl_config": run["trl"]}, f)
        cfg = runs[variants[0]]["cfg"]
        print(f"(trl) {rounds} round(s) x {steps} RL steps a side and variant, each side a fresh "
              f"process, one thread; {cfg['prompts_per_step']} prompts a step, "
              f"{cfg['max_response_tokens']} new tokens at most, temperature "
              f"{cfg['temperature']}, lr {cfg['lr']}, {model_path}. grpo, roc: one assistant "
              f"turn, no tool, reward: the share of the question's expression the turn copies "
              f"(bench.TRL_TASK); tool, tool_roc: tasks/math.py with the tool (our sandbox on "
              f"both sides), up to {runs[variants[-1]]['cfg']['max_turns']} turns", flush=True)
        for round_index in range(rounds):
            for variant, run in runs.items():
                # ours, then TRL, right after: one round's two sides see the same load
                run_dir = os.path.join(tmp, f"{variant}{round_index}")
                ours = ours_steps(run["args"], run_dir)
                if round_index == 0:
                    check_prompts(run_dir, steps, run["cfg"]["prompts_per_step"], run["questions"])
                out = trl_side(trl_python, run["spec"])
                run["sides"]["ours"] += ours
                run["sides"]["TRL"] += out["steps"]
                run["versions"] = out
                print(f"   round {round_index + 1} {variant}: ours "
                      + ", ".join(f"{s['seconds']:.2f}" for s in ours) + " s | TRL "
                      + ", ".join(f"{s['seconds']:.2f}" for s in out["steps"])
                      + f" s | load average {load():.2f}", flush=True)
    versions = runs[variants[0]]["versions"]
    print(f"   TRL side: trl {versions['trl']}, transformers {versions['transformers']}, torch "
          f"{versions['torch']}, {versions['threads']} thread(s); ours: torch "
          f"{torch.__version__}, OMP_NUM_THREADS=1")
    for variant, run in runs.items():
        print_trl(variant, run, steps)
    print_trl_terms(cfg, runs)
    return 0


def print_trl(variant, run, steps):
    """One variant's table: medians over the steps after each process's first (its first step pays
    one-time costs on both sides; with one step a process, every step counts). s: wall seconds,
    cpu: the process's CPU seconds, ms/token: per generated token."""
    print(f"\n   {variant}: {'side':<5} {'steps':>5} {'s/step':>7} {'cpu s':>6} {'tokens':>6} "
          f"{'ms/token':>8} {'cpu ms/token':>12} {'trained':>7} {'reward':>6}  (medians)")
    med = {}
    for name, rows in run["sides"].items():
        timed = [s for i, s in enumerate(rows) if steps == 1 or i % steps]
        med[name] = {key: statistics.median(s[key] for s in timed)
                     for key in ("seconds", "cpu", "tokens", "trained", "reward")}
        med[name]["per_token"] = statistics.median(s["seconds"] / s["tokens"] for s in timed)
        med[name]["cpu_per_token"] = statistics.median(s["cpu"] / s["tokens"] for s in timed)
        m = med[name]
        print(f"   {'':<{len(variant)}}  {name:<5} {len(timed):>5} {m['seconds']:>7.2f} "
              f"{m['cpu']:>6.2f} {m['tokens']:>6.0f} {1000 * m['per_token']:>8.3f} "
              f"{1000 * m['cpu_per_token']:>12.3f} {m['trained']:>7.0f} {m['reward']:>6.3f}")
    ours = med["ours"]
    trl = med["TRL"]
    line = (f"   {variant}: ours / TRL x{trl['seconds'] / ours['seconds']:.2f} per step "
            f"(CPU x{trl['cpu'] / ours['cpu']:.2f}), x{trl['per_token'] / ours['per_token']:.2f} "
            f"per generated token (CPU x{trl['cpu_per_token'] / ours['cpu_per_token']:.2f})")
    if steps > 1:
        firsts = {name: statistics.median(s["seconds"] for s in rows[::steps])
                  for name, rows in run["sides"].items()}
        line += (f"; first steps apart: ours {firsts['ours']:.2f} s, TRL {firsts['TRL']:.2f} s, "
                 f"x{firsts['TRL'] / firsts['ours']:.2f}")
    print(line)
    # a side that trains nothing skips its update: not the same work (a model that earns no reward)
    for name, m in med.items():
        if m["trained"] == 0:
            print(f"   {variant}: not the same work: {name} trained no trajectory in its median "
                  f"step (every group's rewards equal), so its update did not run")


def print_trl_terms(cfg, runs):
    """What both sides share, and what they do not."""
    micro = [t for run in runs.values() for s in run["sides"]["TRL"] for t in s["micro_tokens"]]
    trl = next(iter(runs.values()))["trl"]
    print(f"   equal: model, prompts and their tokens (checked), {cfg['max_response_tokens']} new "
          f"tokens, temperature {cfg['temperature']}, top-p {cfg['top_p']}, no top-k, lr "
          f"{cfg['lr']}, {cfg['warmup_steps']} warm-up steps, AdamW (weight decay "
          f"{cfg['weight_decay']}), grad clip {cfg['grad_clip']}, no KL, clip "
          f"{cfg['eps_low']}/{cfg['eps_high']}, token-mean loss over the step, std-scaled group "
          f"advantages, one optimizer step, fp32, no activation checkpointing")
    print(f"   not equal: micro-batches: ours token-balanced, at most "
          f"{cfg['max_tokens_per_micro']} tokens padding included; TRL "
          f"{trl['per_device_train_batch_size']} rows each (--trl_micro_rows), padded to the "
          f"longest ({statistics.median(micro):.0f} tokens median, {max(micro)} most)")
    print("   not equal: ours drops groups whose rewards are all equal before the update "
          "(trained); TRL trains them with advantage 0. With RoC ours trains G of 2G, TRL all 2G")
    print(f"   not equal: TRL's warm-up starts at lr 0, ours at lr / {cfg['warmup_steps']}; each "
          f"side samples its own tokens, so tokens a step differ: ms/token divides by its own")
    if any(variant.startswith("tool") for variant in runs):
        # configs/tiny_rl.py awaits its tools (deterministic); --deterministic=false overlaps them
        ours_calls = ("sends the calls to the sandbox pool as turns end and awaits every "
                      "answer before its next forward" if cfg["deterministic"]
                      else "runs calls while other rows decode")
        print("   tool: the same prompt tokens (TRL renders them with the release's chat "
              "template), sandbox, tool answers and turn tokens; not equal: TRL runs the calls "
              "when the whole batch's generate ends, one call at a time, then generates again for "
              f"the rows that called, on their whole history; ours {ours_calls}, and keeps each "
              "row's KV. TRL parses calls with trl's Qwen3 parser, ours "
              "with agent.parse_tool_calls (a malformed call is answered differently)")
    for run in runs.values():
        for line in run["unequal"]:
            print(f"   not mirrored: {line}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="engine vs transformers benchmarks (see the module docstring)")
    ap.add_argument("sections", nargs="*", default=["a", "l", "b", "k", "c"],
                    help="a l b k c p u g (default: a l b k c), or sandbox, trl alone")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 unless the cores are idle)")
    ap.add_argument("--reps", type=int, default=3, help="minimum timed rounds per measurement")
    ap.add_argument("--efficiency", type=float, default=None,
                    help="(c) without (a): the share of the bound to simulate with (default: measure it)")
    ap.add_argument("--isolation", default="auto", help="sandbox (and gpu's RL steps): auto (bubblewrap) or none (trusted code only)")
    ap.add_argument("--per_rank", type=int, default=1024, help="scale: trajectories per rank")
    ap.add_argument("--cpu", action="store_true", help="gpu: dry run on the CPU at toy sizes")
    ap.add_argument("--hbm_tbps", type=float, default=None, help="gpu: HBM TB/s (default: from the card's name)")
    ap.add_argument("--model_path", default="out/tiny-sft", help="gpu: the model of the RL steps")
    ap.add_argument("--data_path", default="out/data/train.jsonl", help="gpu: the prompts of the RL steps")
    ap.add_argument("--rl_steps", type=int, default=5, help="gpu: RL steps of configs/tiny_rl.py")
    ap.add_argument("--out", default="out/bench_gpu.json", help="gpu: where the JSON report goes")
    ap.add_argument("--parts", default="", help="gpu: only these parts, comma-separated (logits, greedy_fp32, "
                    "greedy_bf16, decode, graphs, rl; rl_graphs only when named); default all")
    ap.add_argument("--budget_s", type=float, default=480,
                    help="gpu: seconds from the start past which 3b begins no compiled side")
    ap.add_argument("--trl_python", default="/work/trl-venv/bin/python",
                    help="trl: the python of a venv with trl (bench.trl_bench's docstring)")
    ap.add_argument("--trl_steps", type=int, default=2, help="trl: RL steps per process and side")
    ap.add_argument("--trl_micro_rows", type=int, default=32,
                    help="trl: TRL's rows per micro-batch")
    ap.add_argument("--trl_variants", default="grpo,roc,tool,tool_roc",
                    help="trl: any of grpo, roc, tool, tool_roc (comma-separated)")
    ap.add_argument("--trl_worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sections == ["gpu"]:
        sys.exit(gpu_bench(args.cpu, args.hbm_tbps, args.model_path, args.data_path, args.rl_steps, args.isolation,
                           args.out, set(filter(None, args.parts.split(","))), args.budget_s))
    if args.trl_worker:  # the TRL side of (trl), in TRL's venv
        sys.exit(trl_worker(args.trl_worker))
    if args.sections == ["trl"]:
        sys.exit(trl_bench(args.trl_python, args.reps, args.trl_steps, args.trl_micro_rows,
                           args.model_path, args.data_path, args.trl_variants.split(",")))
    if args.sections == ["sandbox"]:  # no model involved
        sys.exit(sandbox_bench(args.isolation))
    if args.sections == ["mem"]:
        sys.exit(mem_bench() and 0)
    if args.sections == ["scale"]:
        sys.exit(scale_bench(per_rank=args.per_rank))
    if args.sections == ["eval"]:
        torch.set_num_threads(args.threads)
        sys.exit(eval_reserve_bench(args.model_path))
    unknown = set(args.sections) - set("albkcpug")
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}: choose from a l b k c p u g")
    if args.threads < 1 or args.reps < 1:
        ap.error("--threads and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    print(f"{cpu} | {os.cpu_count()} cores | torch {torch.__version__} {torch.get_num_threads()} thread(s) | "
          f"transformers {transformers.__version__} | fp32 | load average {load():.2f}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf, tok, prompts = build_models(tmp, max(3 * BATCHES[-1], MT_BATCH))
        c = ours.cfg
        print(f"model: qwen3 {c.num_hidden_layers} layers, width {c.hidden_size}, {c.num_attention_heads}/"
              f"{c.num_key_value_heads} heads of {c.head_dim}, MLP {c.intermediate_size}, vocab {c.vocab_size}, "
              f"{sum(p.numel() for p in ours.parameters()) / 1e6:.2f}M params")
        efficiency = args.efficiency
        if "a" in args.sections or ("c" in args.sections and efficiency is None):
            print(f"\n(a) single-turn greedy, {N_NEW} new tokens per row, no EOS stop. tok/s: generated tokens per "
                  f"second. prefill s: a run of 1 new token; ms/step: (run - prefill) / {N_NEW - 1}.\n"
                  f"% = FLOPs per generated token x tok/s / matmul FLOP/s, the matmuls of one decode step at batch B "
                  f"(mix) or 2048^3 (square); +prefill: the prompts' FLOPs count too; steps: decode steps alone")
            square = square_rate()
            batches = BATCHES if "a" in args.sections else BATCHES[-1:]
            res = [single_turn(ours, hf, tok, prompts, B, N_NEW, args.reps) for B in batches]
            print_single_turn(res, square)
            print(f"square 2048^3 matmul: {square / 1e9:.1f} GFLOP/s")
            r = res[-1]
            ratios = ", ".join(f"B={x['B']} x{x['t_hf'] / x['t_ours']:.2f} (compiled x{x['t_hf'] / x['t_compiled']:.2f})"
                               for x in res)
            fracs = ", ".join(f"B={x['B']} {100 * x['decode'] / x['t_ours'] / x['mix']:.0f}%" for x in res)
            print(f"goals: ours >= 1.5x transformers: {ratios} | ours >= 40% of the compute bound (mix): {fracs}")
            efficiency = efficiency or r["decode"] / r["t_ours"] / r["mix"]
        if "l" in args.sections:
            B = BATCHES[-1]
            print(f"\n(l) single-turn greedy, {3 * B} prompts whose answers end at long-tailed lengths (forced "
                  f"<|im_end|>); ours: Engine.generate with {B} rows, transformers: generate on batches of {B}")
            r = varied_lengths(ours, hf, tok, prompts[:3 * B], B, args.reps)
            print_varied_lengths(r)
        if "b" in args.sections:
            print(f"\n(b) multi-turn, {MT_BATCH} samples x 3 assistant turns of {TURN_LEN} tokens with 2 tool calls "
                  f"each; ours: Engine.run, transformers: generate per turn on the whole history")
            r = multi_turn(ours, hf, tok, prompts, MT_BATCH, TURN_LEN, args.reps)
            print_multi_turn(r)
            print(f"goal: ours >= 3x transformers: x{r['t_hf'] / r['t_ours']:.2f}")
        if "u" in args.sections:
            update_step(args.reps)
        if "g" in args.sections:
            grading_off_the_loop(tok, args.reps)
        if "k" in args.sections:
            print("\n(k) the paged engine (over-commit + preemption; reserve 0.5 and reserve=auto) vs the "
                  "full-reservation engine (reserve 1.0), on (l)'s and (b)'s workloads, greedy; mean batch: rows per "
                  "decode step; KV memory in whole reservations (max_len tokens); / roomy: against full with the "
                  "most memory")
            print_paging(paging(ours, tok, prompts, BATCHES[-1], args.reps))
        if "p" in args.sections:
            print("\n(p) profile of our engine, (a)'s workload")
            profile(ours, tok, prompts, BATCHES[-1], 32)
    if "c" in args.sections:
        # the simulator's efficiency is the share of the roofline bounds an engine reaches on its GPU. we
        # can only measure our engine here, on a CPU, against this CPU's compute bound (a decode step
        # of a tiny model is compute-bound on a CPU, memory-bound on a GPU): the closest measured number
        # we have, so the table is printed with it; the simulator's own default (0.5) is a guess.
        print(f"\n(c) simulate.py --efficiency={efficiency:.3f}  (= our share of the compute bound "
              f"in (a), B={BATCHES[-1]}; the simulator's default 0.5 is an assumption)", flush=True)
        subprocess.run([sys.executable, "simulate.py", f"--efficiency={efficiency:.3f}"],
                       cwd=os.path.dirname(os.path.abspath(__file__)), check=True)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s | load average now {load():.2f}")

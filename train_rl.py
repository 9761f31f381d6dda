"""
Agentic RL with GRPO-RoC: the rStar2-Agent recipe, one file, read top to bottom.

CPU (tiny model):   python train_rl.py configs/tiny_rl.py
64 GPUs, stage 1:   torchrun --nnodes 8 --nproc_per_node 8 train_rl.py configs/stage1.py
resume a run:       add --resume=true (continues exactly from the latest out/<run>/step_*/)

One step: take B prompts -> 2G multi-turn rollouts each (rollout.py engines, work balanced across
ranks by free KV capacity in scheduler.py, tool calls in the sandbox pool) -> the task's reward
(tasks/math.py by default: 0/1 by math-verify, graded by grading.py) -> GRPO-RoC (grpo_roc.py): drop
groups whose rewards are all equal, Resample-on-Correct 2G -> G, group-normalised advantages -> token-balanced micro-batches -> the "old" log-probs (with one
optimizer step per RL step, the update's own forward, detached) -> clipped token-mean policy loss ->
AdamW -> new weights to the engines. Every step also logs how far the engine's sampling-time log-probs
are from the trainer's (mismatch_*); tis_cap and mismatch_band correct for it (off: not in the paper).

How this deviates from textbook GRPO (all from the paper, §2.2):
- Resample-on-Correct: positives are down-sampled with probability ∝ 1/(p_err + p_format), so the
  update sees the cleanest correct trajectories; negatives are down-sampled uniformly.
- groups whose 2G rewards are all equal carry no signal and are dropped before RoC.
- no KL term and no entropy bonus; clip-higher (ε_low 0.2, ε_high 0.28); tool-response tokens are
  masked out of the loss. The loss is a mean over all sampled tokens of the mini-batch (DAPO's
  token-mean; the released code takes verl's per micro-batch); loss_norm="group" is Eq. 6's
  per-question normalisation.
- truncated trajectories are kept, with reward 0 (paper §4.3.1; score_truncated=true grades them like the
  released code does).

Weights for generation: each rank keeps an unsharded inference copy of the policy (bf16 on GPU) next
to its FSDP2 training shards; after every optimizer step each parameter is gathered with
`full_tensor()` one at a time and copied into it (a 14B model: 29.6 GB bf16 per rank; see README).
"""
import functools
import glob
import gzip
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import agent
import grading
import grpo_roc
from checkpoint import checkpoint_dir, latest_checkpoint, load_trainable, load_trainer_state, save_checkpoint
from common import (Logger, barrier, collate, compute_cleanup, compute_init, pack, pack_sorted, print0, read_jsonl,
                    resolve_model)
from configurator import configure
from model import load_model, token_logprobs, use_flash
from rollout import Engine, Request, kv_rows
from sandbox import SandboxPool
from scheduler import exchange, gather_summaries, generate

# -----------------------------------------------------------------------------
# defaults: the tiny CPU run; configs/stage*.py carry the paper's 14B values
model_path = "out/tiny-sft"  # HF directory to start from (weights + tokenizer)
data_path = "out/data/train.jsonl"  # JSONL with the task's columns (the math task: "question" and "answer")
task = "tasks/math.py"  # the task file: prompt, tools, reward (README "Fork it"); tasks/math_no_tool.py: no tool
run_dir = "out/tiny-rl"
resume = False  # continue from the latest checkpoint in run_dir
data_restart = False  # False: continue the data stream of the checkpoint model_path is (stage 2), same data only
optimizer_from = ""  # checkpoint whose optimizer state to continue (stage 2); "" = fresh (stage 3 resets)
steps = 60
prompts_per_step = 8  # B (paper: 512)
samples_per_prompt = 16  # 2G rollouts per prompt (paper: 32)
keep_per_prompt = 8  # G kept by Resample-on-Correct (paper: 16)
roc = True  # False: plain GRPO, sample keep_per_prompt and use them all
roc_mode = "sample"  # "sample" (paper: p ∝ 1/penalty) or "deterministic" (released code)
score_truncated = False  # True: grade rollouts cut by the budget like finished ones (released code); paper: 0
# rollout
max_response_tokens = 256  # one budget for model + tool tokens (paper: 8K stage 1, 12K stages 2-3)
max_prompt_tokens = 128
max_turns = 10  # paper: 10 (stages 1-2), 15 (stage 3)
temperature = 1.0
top_p = 1.0
kv_capacity = 0  # tokens of KV cache per engine; 0 = kv_fraction of free accelerator memory (CPU: 256 rows)
kv_fraction = 0.5  # the rest stays for training: activations, gathered layers, optimizer state
kv_reserve = 0.5  # share of a rollout's budget promised at admission (1 = full reservation, never preempts)
deterministic = False  # True: runs repeat bit for bit on a busy machine too (static split; tools not overlapped)
rollout_split = "dynamic"  # how ranks share the rollouts: "dynamic" (claim by free KV) or "static" (fixed split)
tool_workers = 0  # sandbox workers per rank; 0 = the node's cores shared by its ranks (LOCAL_WORLD_SIZE)
tool_timeout = 4.0  # seconds per call (rStar's README runs code-judge with MAX_EXECUTION_TIME=4; the paper gives none)
tool_memory = 256 << 20  # bytes of address space per call (code-judge's MAX_MEMORY default)
tool_isolation = "auto"  # "auto" (bubblewrap) or "none": no sandbox at all, for trusted code only
tool_max_chars = 256  # chars per tool response, middle cut (the release: verl's max_tool_response_length)
max_calls_per_turn = 1
# optimisation
lr = 1e-6
warmup_steps = 20  # linear warm-up, then constant
weight_decay = 0.01
grad_clip = 1.0
eps_low = 0.2
eps_high = 0.28
dual_clip = 0.0  # > 1 enables dual-clip for negative advantages (verl default 3.0); 0 = off
mini_batches = 1  # optimizer steps per RL step (paper: 1); 1 also saves the forward for the "old" log-probs
# the loss's three knobs (grpo_roc.py's docstring; configs/dr_grpo.py and configs/gspo.py set them otherwise)
adv_scale = "std"  # the advantage estimator (grpo_roc.ADVANTAGES): "std" (Eq. 7), "none" (Dr. GRPO), "batch"
loss_norm = "token"  # every sampled token of the mini-batch weighs the same; "group" (Eq. 6), "sequence", "constant"
ratio_level = "token"  # the importance ratio per token (PPO), or "sequence" (GSPO)
max_tokens_per_micro = 4096  # tokens per micro-batch and rank, padding included (verl: ppo_max_token_len_per_gpu)
activation_checkpointing = False
# engine vs trainer (none of this is in the paper): the engine's copy may differ from the trainer's weights
rollout_dtype = ""  # the engine's copy: "" = dtype; "bfloat16" on CPU makes the mismatch to correct
tis_cap = 0.0  # > 0 (e.g. 2.0): weight each token's loss by min(exp(trainer - engine log-prob), tis_cap)
mismatch_band = 0.0  # > 0 (e.g. 0.5): drop a trajectory whose mean trainer - engine log-ratio leaves ±band
dtype = "float32"  # compute dtype: "bfloat16" on GPU
# io
save_every = 20
save_hf_every = 0  # HF weights (what eval.py loads) in every N-th save; 0: only the last step's (the rest: shards)
keep_checkpoints = 3  # the newest N checkpoints stay (0: all); those with HF weights are never deleted
dump_every = 10  # every N steps all trajectories of the step go to run_dir/rollouts/ (view.py); 0 = never
dist_timeout_s = 1800  # a collective waiting longer raises (a rank died or hangs); see common.compute_init
seed = 0
wandb_project = ""
cfg = configure(globals())
if deterministic and int(os.environ.get("WORLD_SIZE", 1)) > 1 and rollout_split != "static":
    rollout_split = cfg["rollout_split"] = "static"  # which rank generates a request must not depend on timing
    print0("deterministic=true on several ranks: rollout_split = 'static'")
# -----------------------------------------------------------------------------

try:
    grpo_roc.check_loss_config(adv_scale, loss_norm, ratio_level)
    task_module = grading.load_task(task)
except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"config error: {e}")
if max_prompt_tokens + max_response_tokens > max_tokens_per_micro:  # a whole trajectory in one micro-batch
    raise SystemExit(f"config error: max_prompt_tokens + max_response_tokens = {max_prompt_tokens + max_response_tokens} "
                     f"> max_tokens_per_micro = {max_tokens_per_micro}: raise max_tokens_per_micro or lower the other two")
rank, world, device = compute_init(seed, dist_timeout_s)
model_path = resolve_model(model_path)
ptdtype = getattr(torch, dtype)
packed = use_flash(device, ptdtype)  # packed rows for flash-attn's varlen kernel, padded batches for SDPA
tokenizer = AutoTokenizer.from_pretrained(model_path)
try:
    problems = read_jsonl(data_path, required=task_module.COLUMNS)
except ValueError as e:  # names the file and line
    raise SystemExit(f"data error: {e}")
# each prompt rendered by the task and tokenized once, kept as int32 (a Python list of ints takes ~9x the
# memory: 42K prompts, every rank)
prompt_ids = [np.asarray(tokenizer.encode(task_module.prompt(p), add_special_tokens=False), np.int32) for p in problems]
too_long = sum(len(p) > max_prompt_tokens for p in prompt_ids)
print0(f"{len(problems)} problems from {data_path}; {too_long} longer than {max_prompt_tokens} tokens are skipped")
data = [(i, p) for i, p in enumerate(prompt_ids) if len(p) <= max_prompt_tokens]
if not data:
    raise SystemExit(f"config error: every prompt of {data_path} is longer than max_prompt_tokens = {max_prompt_tokens} "
                     f"(the shortest has {min(map(len, prompt_ids), default=0)} tokens): raise max_prompt_tokens")


@functools.lru_cache(maxsize=2)
def prompt_order(epoch):
    # a fresh permutation every epoch, the same on every rank
    return torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + 1_000_003 * epoch)).tolist()


def prompt_at(c):
    """The c-th prompt of the data stream."""
    return data[prompt_order(c // len(data))[c % len(data)]]

# the policy: FSDP2 training shards (fp32 master weights) + one unsharded inference copy per rank, built
# empty: sync_policy fills it before the first rollout (reading the checkpoint once, not twice)
start = latest_checkpoint(run_dir) if resume else None
init_path = start or model_path
model = load_trainable(init_path, device, ptdtype, activation_checkpointing)
policy = load_model(init_path, device="meta", dtype=getattr(torch, rollout_dtype or dtype)).to_empty(device=device)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
step, cursor = 0, 0
if start:
    state = load_trainer_state(start, model, optimizer)
    step, cursor = state["step"], state["cursor"]
    print0(f"resumed from {start} at step {step}")
    if rank == 0:  # the dumps of the steps after it are about to be made again (metrics.jsonl: see Logger)
        for path in glob.glob(os.path.join(run_dir, "rollouts", "step_*.jsonl.gz")):
            if int(os.path.basename(path)[5:11]) > step:
                os.remove(path)
elif optimizer_from:
    load_trainer_state(optimizer_from, model, optimizer)
    print0(f"optimizer state continued from {optimizer_from}")
if not start and not data_restart and os.path.isfile(os.path.join(model_path, "trainer_state.pt")):
    # a later stage goes on where the previous one stopped instead of replaying its first prompts
    prev = torch.load(os.path.join(model_path, "trainer_state.pt"), weights_only=False)
    if prev.get("data_path") == data_path:
        cursor = prev["cursor"]
        print0(f"data stream continued from {model_path} at prompt {cursor}")


@torch.no_grad()
def sync_policy():
    """Hand the new weights to this rank's engine: gather each shard, one parameter at a time."""
    for (name, p), q in zip(model.named_parameters(), policy.parameters()):
        q.copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)


def plan(kept, part):
    """The token-balanced micro-batches of one mini-batch (kept[i] for i in part), planned on every rank from
    the lengths alone: ([the kept indices of each of this rank's bins], {key: the rank that trains it}).
    A packed row (flash-attn) costs its tokens: pack balances them; right-padded rows (SDPA) cost count x the
    longest: trajectories of similar length share a micro-batch (pack_sorted), so they carry little padding."""
    lengths = [kept[i].n_prompt + kept[i].n_response - 1 for i in part]
    bins = (pack if packed else pack_sorted)(lengths, max_tokens_per_micro, world)
    dest = {kept[part[i]].key: j % world for j, b in enumerate(bins) for i in b}
    return [[part[i] for i in b] for b in bins[rank::world]], dest


def micro_batch(kept, idx, advs, tokens):
    """One packed micro-batch: the kept trajectories idx (their tokens from `exchange`), each token tagged with
    its trajectory's advantage and index (tid)."""
    seqs = []
    for i in idx:
        _, prompt, response, mask, logprobs = tokens[kept[i].key]
        seq, pad = np.concatenate([prompt, response]), np.zeros(len(prompt) - 1)
        seqs.append({"ids": seq[:-1], "tgt": seq[1:], "adv": np.full(len(seq) - 1, advs[i]),
                     "mask": np.concatenate([pad, mask]),  # loss only on sampled tokens
                     "elp": np.concatenate([pad, logprobs]),  # the engine's log-prob of each sampled token
                     "tid": np.full(len(seq) - 1, i)})
    return collate(seqs, device, packed)


def dump_step(step, mine, summaries):
    """Every trajectory of the step as gzip JSONL: what a person reads (view.py) to see what the policy wrote,
    what the tool answered, and what RoC kept. Each rank writes its own trajectories, then rank 0 appends the
    parts to one file (gzip members concatenate), in rank order: readers sort by (group, sample)."""
    path = os.path.join(run_dir, "rollouts", f"step_{step:06d}.jsonl.gz")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    by_key, prompts = {s.key: s for s in summaries}, {}
    with gzip.open(f"{path}.{rank}", "wt", compresslevel=1) as f:  # level 9, the default, is 12x slower for 10% less
        for t in mine:
            b, i, s = t.key[1], t.meta["problem"], by_key[t.key]
            kind = grpo_roc.group_kind([x.meta for x in summaries[b * n_sample:(b + 1) * n_sample]])
            prompts[i] = prompts.get(i) or tokenizer.decode(t.prompt_ids)  # a group's samples share their prompt
            f.write(json.dumps({
                "step": step, "group": b, "sample": t.key[2], "question": problems[i].get("question"),
                "answer": t.meta["answer"], "prompt": prompts[i], "correct": t.meta["correct"],
                "segments": agent.mask_runs(tokenizer, t.response_ids, t.mask),
                "response_ids": t.response_ids, "mask": t.mask, "reward": t.meta["reward"], "finish": t.finish,
                "turns": t.turns, "tool_calls": t.tool_calls, "group_kind": kind, "penalty": s.rl.get("penalty"),
                "kept": "advantage" in s.rl, "advantage": s.rl.get("advantage")}, ensure_ascii=False) + "\n")
    barrier()
    if rank == 0:
        with open(path, "wb") as out:
            for r in range(world):
                with open(f"{path}.{r}", "rb") as part:
                    shutil.copyfileobj(part, out)
                os.remove(f"{path}.{r}")


def n_failed(statuses):
    return sum(s in agent.TOOL_ERRORS for s in statuses)


logger = Logger(run_dir, wandb_project, cfg, rank, resume_step=step if start else None)
tools = SandboxPool(workers=tool_workers or None, timeout=tool_timeout, memory=tool_memory,
                    isolation=tool_isolation).start()
max_len = max_prompt_tokens + max_response_tokens
n_rows = kv_rows(policy, max_len, kv_capacity, kv_fraction, limit=-(-prompts_per_step * samples_per_prompt // world))
# the task's rewards, off the decode loop
grader = grading.Grader(tokenizer, score_truncated, task=task_module, rows=problems, sandbox=tools)
engine = Engine(policy, tokenizer, kv_capacity=n_rows * max_len, max_len=max_len, temperature=temperature, top_p=top_p,
                seed=seed, tools=tools, max_turns=max_turns, max_calls_per_turn=max_calls_per_turn,
                tool_max_chars=tool_max_chars, reserve=kv_reserve, deterministic=deterministic,
                tool_table=task_module.TOOLS)
n_sample = samples_per_prompt if roc else keep_per_prompt
print0(f"rl: {steps} steps × {prompts_per_step} prompts × {n_sample} samples, "
       f"{'RoC ' + roc_mode if roc else 'plain GRPO'}, {world} rank(s), engine rows {engine.num_rows}")

while step < steps:
    t0 = time.perf_counter()
    # 1. rollouts: 2G per prompt, the work shared by all ranks' engines
    sync_policy()
    batch = [prompt_at(cursor + i) for i in range(prompts_per_step)]
    cursor += prompts_per_step
    requests = [Request(p.tolist(), key=(step, b, s), meta={"answer": problems[i].get("answer"), "problem": i})
                for b, (i, p) in enumerate(batch) for s in range(n_sample)]
    mine = generate(engine, requests, max_response_tokens, rollout_split, grader, counter=f"rl/{step}")
    t_rollout = time.perf_counter() - t0
    # the grades of this rank's trajectories, made while the engine went on decoding; then what every rank
    # needs of every trajectory (grades, turns, tool statuses, lengths), while the tokens stay where they are
    grades = grader.results()
    for t in mine:
        t.meta.update(grades[t.key])
    t_grade = time.perf_counter() - t0 - t_rollout
    trajs = gather_summaries(mine)
    t_gather = time.perf_counter() - t0 - t_rollout - t_grade

    # 2. GRPO-RoC: drop uniform groups, resample 2G -> G, advantages over the kept G
    groups = [trajs[g * n_sample:(g + 1) * n_sample] for g in range(prompts_per_step)]
    rewards = torch.tensor([[t.meta["reward"] for t in g] for g in groups])  # (B, 2G)
    keep_groups, n_all_right, n_all_wrong = grpo_roc.filter_groups(rewards)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    kept, kept_rewards, kept_positive = [], [], []
    for g in keep_groups.tolist():
        idx = list(range(n_sample))
        if roc:
            pen = [grpo_roc.penalty(len(t.calls), n_failed(t.calls), t.meta["answers"], t.turns) for t in groups[g]]
            idx = grpo_roc.resample_on_correct(rewards[g], torch.tensor(pen), keep_per_prompt, gen,
                                               mode=roc_mode).tolist()
            for t, p in zip(groups[g], pen):
                t.rl["penalty"] = p
        kept.append([groups[g][i] for i in idx])
        kept_rewards.append(rewards[g, idx])
        kept_positive.append(grpo_roc.positives(rewards[g])[idx])
    t_train, t_exchange = time.perf_counter(), 0.0
    stats = {}
    mism = {k: torch.zeros((), device=device) for k in ("abs", "max", "k3", "out", "n")}
    if kept:
        # one number per kept trajectory; with RoC its sign follows the side RoC kept it on (grpo_roc's docstring)
        advs = grpo_roc.advantages(torch.stack(kept_rewards), adv_scale,
                                   torch.stack(kept_positive) if roc else None).flatten().tolist()
        kept = [t for g in kept for t in g]
        for t, a in zip(kept, advs):
            t.rl["advantage"] = a  # also marks it kept, for the dump
        # 3. policy update: mini-batches of the kept trajectories, token-balanced micro-batches. Every rank
        # plans them all from the lengths; then each trajectory's tokens travel to the one rank that trains it
        lr_now = lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        per_mini = math.ceil(len(kept) / mini_batches)
        parts = [range(s, min(len(kept), s + per_mini)) for s in range(0, len(kept), per_mini)]  # none empty
        plans = [plan(kept, part) for part in parts]
        tokens = exchange(mine, {key: r for _, dest in plans for key, r in dest.items()})
        t_exchange = time.perf_counter() - t_train
        # the "old" policy is this step's weights before any update. With one optimizer step per RL step
        # (the paper) they are the weights of the forward below, so its own log-probs, detached, are the
        # old ones and a second forward would only repeat it; otherwise every mini-batch's come first
        minis = []
        for part, (bins, _) in zip(parts, plans):
            # the loss divisor as one weight per trajectory (token-mean: 1), riding on its advantage
            w = grpo_roc.loss_weights([kept[i].n_sampled for i in part], [kept[i].key[1] for i in part], loss_norm,
                                      max_response_tokens)
            scaled = dict(zip(part, (a * x for a, x in zip((advs[i] for i in part), w))))
            micros = [micro_batch(kept, idx, scaled, tokens) for idx in bins]
            n_tokens = torch.tensor(float(sum(kept[i].n_sampled for i in part)), device=device)
            old = None
            if len(parts) > 1:
                with torch.no_grad():
                    old = [token_logprobs(model, m["ids"], m["tgt"], m["seg"], where=m["mask"].bool()) for m in micros]
            minis.append((micros, old, n_tokens))
        for micros, old, n_tokens in minis:
            for j, m in enumerate(micros):
                # the output layer only where the loss reads: the sampled tokens (log-probs 0 elsewhere)
                lp, ent = token_logprobs(model, m["ids"], m["tgt"], m["seg"], with_entropy=True, where=m["mask"].bool())
                old_lp = lp.detach() if old is None else old[j]
                # the engine sampled these tokens: how far are its log-probs from the trainer's (old) ones?
                mask, elp = m["mask"].bool(), m["elp"].float()
                for k, v in grpo_roc.mismatch(old_lp, elp, mask).items():
                    mism[k] = torch.maximum(mism[k], v) if k == "max" else mism[k] + v
                # corrections for that gap, off by default: truncated importance weights, sequence masking
                weights = grpo_roc.tis_weights(old_lp, elp, tis_cap) if tis_cap else None
                if mismatch_band:
                    mask = grpo_roc.sequence_mask(old_lp, elp, mask, m["tid"], mismatch_band)
                loss, st = grpo_roc.policy_loss(lp, old_lp, m["adv"], mask, eps_low=eps_low, eps_high=eps_high,
                                                dual_clip=dual_clip or None, num_tokens=n_tokens, weights=weights,
                                                seq_ids=m["tid"] if ratio_level == "sequence" else None,
                                                return_stats=True)
                # FSDP averages gradients over ranks; the loss is already normalised by the global count
                (loss * world).backward()
                # token-weighted means over the whole mini-batch (all ranks, summed below)
                share = m["mask"].sum() / n_tokens
                stats["clip_frac"] = stats.get("clip_frac", 0.0) + float(st["clip_frac"] * share) / len(parts)
                stats["entropy"] = stats.get("entropy", 0.0) + float((ent * m["mask"]).sum() / n_tokens) / len(parts)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            stats["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    step += 1
    t_train = time.perf_counter() - t_train

    # 4. metrics: one line and one JSON row per step
    if dist.is_initialized():
        summed = torch.tensor([stats.get(k, 0.0) for k in ("clip_frac", "entropy")], device=device)
        dist.all_reduce(summed)
        stats["clip_frac"], stats["entropy"] = summed.tolist()
        for k in mism:
            dist.all_reduce(mism[k], op=dist.ReduceOp.MAX if k == "max" else dist.ReduceOp.SUM)
    n_loss = max(1.0, float(mism["n"]))
    calls = [c for t in trajs for c in t.calls]
    pos_calls = [c for t in trajs if t.meta["correct"] for c in t.calls]  # the calls of correct trajectories
    err = lambda cs: n_failed(cs) / max(1, len(cs))  # noqa: E731
    metrics = {
        "reward": rewards.mean().item(),
        "kept": len(kept), "reward_kept": sum(t.meta["reward"] for t in kept) / max(1, len(kept)),
        "groups_all_right": n_all_right / prompts_per_step, "groups_all_wrong": n_all_wrong / prompts_per_step,
        "response_len": sum(t.n_response for t in trajs) / len(trajs),
        "truncated_frac": sum(t.finish == "length" for t in trajs) / len(trajs),
        "turns": sum(t.turns for t in trajs) / len(trajs),
        "tool_calls": len(calls) / len(trajs),
        "tool_err": err(calls), "tool_err_pos": err(pos_calls),
        "entropy": stats.get("entropy", 0.0), "clip_frac": stats.get("clip_frac", 0.0),
        "grad_norm": stats.get("grad_norm", 0.0), "lr": optimizer.param_groups[0]["lr"],
        # engine vs trainer log-probs over the loss tokens (see grpo_roc.mismatch)
        "mismatch_abs_mean": float(mism["abs"]) / n_loss, "mismatch_abs_max": float(mism["max"]),
        "mismatch_kl_k3": float(mism["k3"]) / n_loss, "mismatch_ratio_out": float(mism["out"]) / n_loss,
        # seconds: generating; waiting for this rank's last grades; the summaries' gather; the tokens' exchange
        "t_rollout": t_rollout, "t_grade_wait": t_grade, "t_gather": t_gather, "t_exchange": t_exchange,
        "t_tools_wait": engine.stats["tool_wait_s"], "t_train": t_train,
        # this rank's grades that were scored 0 without a verdict: verification too slow (the helper replaced),
        # answers too long or nested too deep to parse, no helper to be had, the task's grade raised (grading.Grader.results)
        "grade_timed_out": grader.stats["timed_out"], "grade_refused": grader.stats["refused"],
        "grade_failed": grader.stats["failed"],
        # this rank's engine: rows it evicted when pages ran out, and the tokens it prefilled again for them
        "preemptions": engine.stats["preemptions"], "recomputed_tokens": engine.stats["recomputed_tokens"],
        "tok_per_s": sum(t.n_response for t in trajs) / t_rollout, "generated_here": len(mine),
    }
    # each tool the task offers: its calls per trajectory and the share of them that failed
    for name in task_module.TOOLS:
        statuses = [c for t in trajs for c, tool in zip(t.calls, t.call_tools) if tool == name]
        metrics[f"tool_calls/{name}"], metrics[f"tool_err/{name}"] = len(statuses) / len(trajs), err(statuses)
    logger.log(step, metrics)
    print0(f"step {step:04d}/{steps} | reward {metrics['reward']:.3f} | kept {len(kept):3d} | "
           f"len {metrics['response_len']:.0f} | trunc {metrics['truncated_frac']:.2f} | calls {metrics['tool_calls']:.2f} | "
           f"tool_err {metrics['tool_err']:.3f} (pos {metrics['tool_err_pos']:.3f}) | "
           f"ent {metrics['entropy']:.3f} | gnorm {metrics['grad_norm']:.2f} | "
           f"dt {t_rollout:.1f}+{t_train:.1f}s")
    if dump_every and (step % dump_every == 0 or step == 1):
        dump_step(step, mine, trajs)
    if step % save_every == 0 or step == steps:
        hf = step == steps or (save_hf_every and step // save_every % save_hf_every == 0)
        save_checkpoint(checkpoint_dir(run_dir, step), model, optimizer, tokenizer,
                        {"step": step, "cursor": cursor, "data_path": data_path},
                        hf_dtype=ptdtype if hf else None, keep=keep_checkpoints)

tools.close()
compute_cleanup()

"""
Agentic RL with GRPO-RoC: the rStar2-Agent recipe, one file, read top to bottom.

CPU (tiny model):   python train_rl.py configs/tiny_rl.py
64 GPUs, stage 1:   torchrun --nnodes 8 --nproc_per_node 8 train_rl.py configs/stage1.py
resume a run:       add --resume=true (continues exactly from the latest out/<run>/step_*/)

One step: take B prompts -> 2G multi-turn rollouts each (rollout.py engines, work balanced across
ranks by free KV capacity in scheduler.py, tool calls in the sandbox pool) -> the task's reward
(tasks/math.py by default: 0/1 by math-verify, graded by grading.py) -> GRPO-RoC (grpo_roc.py): drop
groups whose rewards are all equal, Resample-on-Correct 2G -> G, group-normalised advantages ->
mini-batches of whole groups (mini_batches, 1 by default), each in token-balanced micro-batches -> the
"old" log-probs (with one optimizer step per RL step, the update's own forward, detached) -> clipped
token-mean policy loss -> AdamW -> new weights to the engines. Every step also logs how far the engine's
sampling-time log-probs are from the trainer's (mismatch/*); tis_cap and mismatch_band correct for it
(off: not in the paper).

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
`full_tensor()` one at a time and copied into it (a 14B model: 27.5 GiB bf16 per rank;
docs/scale.md).
"""
import functools
import glob
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import agent
import grading
import grpo_roc
from checkpoint import (checkpoint_dir, load_trainable, load_trainer_state, lock_run, model_dir,
                        resume_point, save_checkpoint)
from common import Logger, barrier, compute_cleanup, compute_init, pack, pack_sorted, print0
from configurator import configure, require
from model import collate, full_value, load_model, token_logprobs, use_flash
from rollout import Engine, Request, kv_rows
from sandbox import SandboxPool
from scheduler import (dump_line, exchange, gather_summaries, generate, join_parts, rollout_metrics,
                       summarize, task_metrics)


# -----------------------------------------------------------------------------
# defaults: the tiny CPU run; configs/stage*.py carry the paper's 14B values
model_path = "out/tiny-sft"  # HF directory to start from (weights + tokenizer)
# JSONL with the task's columns (the math task: "question" and "answer")
data_path = "out/data/train.jsonl"
# the task file: prompt, tools, reward (README "Fork it"); tasks/math_no_tool.py: no tool
task = "tasks/math.py"
#                         (a data row with a "task" column is that task's: one run mixes tasks, metrics per task)
run_dir = "out/tiny-rl"  # checkpoints (step_*/), metrics.jsonl and rollouts/ go here
resume = False  # continue from the latest checkpoint in run_dir
# False: continue the data stream of the checkpoint model_path is (stage 2), where it is the
# same stream (data_path, prompts that fit, seed)
data_restart = False
# checkpoint whose optimizer state to continue (stage 2); "" = fresh (stage 3 resets)
optimizer_from = ""
steps = 60  # RL steps (paper: 300 in stage 1)
prompts_per_step = 8  # B (paper: 512)
samples_per_prompt = 16  # 2G rollouts per prompt (paper: 32)
keep_per_prompt = 8  # G kept by Resample-on-Correct (paper: 16)
roc = True  # False: plain GRPO, sample keep_per_prompt and use them all
roc_mode = "sample"  # "sample" (paper: p ∝ 1/penalty) or "deterministic" (released code)
# True: grade rollouts cut by the budget like finished ones (released code); paper: 0
score_truncated = False
# rollout
max_response_tokens = 256  # one budget for model + tool tokens (paper: 8K stage 1, 12K stages 2-3)
max_prompt_tokens = 128  # longer prompts are skipped (and counted at start)
max_turns = 10  # paper: 10 (stages 1-2), 15 (stage 3)
temperature = 1.0  # sampling temperature of the rollouts, > 0, and of the trainer's log-probs (paper: 1.0)
top_p = 1.0  # nucleus sampling; 1.0 = off
# decode steps: "eager", or at static shapes (model.Qwen.static_step) "static", "compile"
#               (inductor) or "graphs" (inductor's CUDA graphs on a GPU: not yet run on one)
decode_mode = "eager"
# tokens of KV cache per engine; 0 = kv_fraction of free accelerator memory (CPU: 256 rows)
kv_capacity = 0
kv_fraction = 0.5  # the rest stays for training: activations, gathered layers, optimizer state
# KV promised to a rollout at admission: None follows what the step's rollouts used (the engine's
# reserve="auto"); a number is that share of the budget, fixed (1: all of it, never preempts)
kv_reserve = None
# True: runs repeat bit for bit on a busy machine too (static split; tools not overlapped; torch's
# deterministic kernels)
deterministic = False
# how ranks share the rollouts: "dynamic" (claim by free KV) or "static" (fixed split)
rollout_split = "dynamic"
# sandbox workers per rank; 0 = the node's cores shared by its ranks (LOCAL_WORLD_SIZE)
tool_workers = 0
# seconds per call (rStar's README runs code-judge with MAX_EXECUTION_TIME=4; the paper gives none)
tool_timeout = 4.0
tool_memory = 256 << 20  # bytes of address space per call (code-judge's MAX_MEMORY default)
tool_isolation = "auto"  # "auto" (bubblewrap) or "none": no sandbox at all, for trusted code only
# chars per tool response, middle cut (the release: verl's max_tool_response_length)
tool_max_chars = 256
# tool calls run per assistant turn; surplus ones are dropped (the release runs one)
max_calls_per_turn = 1
# seconds a call may take before it is answered "timeout" (and an environment's reply before the episode
# ends); 0: the sandbox's bound + 30 s
tool_call_timeout = 0.0
# optimisation
lr = 1e-6  # AdamW learning rate (paper: 1e-6)
warmup_steps = 20  # linear warm-up, then constant
weight_decay = 0.01  # AdamW weight decay
grad_clip = 1.0  # the gradients' global norm is clipped to this
eps_low = 0.2  # the ratio's lower clip: 1 - eps_low
eps_high = 0.28  # the ratio's upper clip: 1 + eps_high (clip-higher)
dual_clip = 0.0  # > 1 enables dual-clip for negative advantages (verl default 3.0); 0 = off
# optimizer steps per RL step (paper: 1), each on whole groups (grpo_roc.split_mini_batches); 1 also saves the
# forward for the "old" log-probs
mini_batches = 1
# the loss's three knobs (grpo_roc.py's docstring; configs/dr_grpo.py and configs/gspo.py set them otherwise)
adv_scale = "std"  # the advantage estimator (grpo_roc.ADVANTAGES): "std" (Eq. 7), "none" (Dr.
#                   GRPO), "batch", or the user's own "file.py:function" (examples/rloo.py)
# every sampled token of the mini-batch weighs the same; "group" (Eq. 6), "sequence", "constant"
loss_norm = "token"
ratio_level = "token"  # the importance ratio per token (PPO), or "sequence" (GSPO)
# extra loss terms, none in the paper (grpo_roc.py's docstring): + coefficient x a token-mean
loss_terms = []  # [("file.py:function", coefficient), ...]: the user's, logged as loss/<function>
kl_coef = 0.0  # > 0: + kl_coef x KL(policy || frozen reference), logged as loss/kl; 0: no reference
kl_estimator = "k3"  # grpo_roc.kl_penalty: "k3" (verl's low_var_kl), "k1" or "k2"
kl_ref = ""  # the frozen reference: "" = model_path, the run's start (with kl_coef 0: loss/kl only)
# tokens per micro-batch and rank, padding included (verl: ppo_max_token_len_per_gpu)
max_tokens_per_micro = 4096
# recompute each layer's activations in the backward: less memory, more compute
activation_checkpointing = False
# the update's decoder layers through inductor (checkpoint.load_trainable): fused element-wise chains
compile_update = False
# engine vs trainer (none of this is in the paper): the engine's copy may differ from the trainer's weights
rollout_dtype = ""  # the engine's copy: "" = dtype; "bfloat16" on CPU makes the mismatch to correct
# > 0 (e.g. 2.0): weight each token's loss by min(exp(trainer - engine log-prob), tis_cap)
tis_cap = 0.0
# > 0 (e.g. 0.5): drop a trajectory whose mean trainer - engine log-ratio leaves ±band
mismatch_band = 0.0
dtype = "float32"  # compute dtype: "bfloat16" on GPU
# io
save_every = 20  # a checkpoint every N steps, and at the last (0: only at the last)
# HF weights (what eval.py loads) in every N-th save; 0: only the last step's (the rest: shards)
save_hf_every = 0
# the newest N checkpoints stay (0: all); those with HF weights are never deleted
keep_checkpoints = 3
# every N steps all trajectories of the step go to run_dir/rollouts/ (view.py); 0 = never
dump_every = 10
# a collective waiting longer raises (a rank died or hangs); see common.compute_init
dist_timeout_s = 1800
seed = 0  # data order, RoC's sampling and every rollout's generator derive from it
wandb_project = ""  # "" = no wandb (metrics.jsonl is always written)
cfg = configure(globals())
# the ranges of the settings: one outside stops the run here, naming it, not after a step's rollouts
require(globals(),
        # the groups: RoC samples 2G and keeps G; either way the G kept need two for a baseline. The released
        # RoC rule (roc_mode "deterministic") splits every group's 2G into G for even G >= 4 (and G = 5)
        "prompts_per_step >= 1", "keep_per_prompt >= 2",
        "not roc or samples_per_prompt == 2 * keep_per_prompt",
        "not roc or roc_mode == 'sample' or roc_mode == 'deterministic'"
        " and (keep_per_prompt % 2 == 0 and keep_per_prompt >= 4 or keep_per_prompt == 5)",
        # the rollouts; a whole trajectory fits one micro-batch
        "max_response_tokens >= 1", "max_prompt_tokens + max_response_tokens <= max_tokens_per_micro",
        "max_turns >= 1", "max_calls_per_turn >= 1", "tool_max_chars >= 2",
        "temperature > 0", "0 < top_p <= 1",
        # the optimisation and the loss
        "lr >= 0", "warmup_steps >= 0", "grad_clip > 0", "mini_batches >= 1",
        "0 <= eps_low < 1", "eps_high >= 0",
        "dual_clip == 0 or dual_clip > 1", "kl_coef >= 0", "tis_cap == 0 or tis_cap >= 1",
        "mismatch_band >= 0",
        # the checkpoints: a negative count made the rotation's [:-keep] delete the oldest ones, the
        # newest among them
        "keep_checkpoints >= 0")
# -----------------------------------------------------------------------------

try:
    grpo_roc.check_loss_config(adv_scale, loss_norm, ratio_level, kl_estimator)
    task_module = grading.load_task(task)
    # the user's own estimator and loss terms, "file.py:function" (README "Fork it")
    estimator = grpo_roc.ADVANTAGES.get(adv_scale) or grading.load_file(adv_scale)
    # each term as (its metric, loss/<function>; the function; its coefficient)
    terms = [("loss/" + spec.partition(":")[2], grading.load_file(spec), coef)
             for spec, coef in loss_terms]
except (ValueError, FileNotFoundError, ImportError, AttributeError) as e:
    raise SystemExit(f"config error: {e}")
max_len = max_prompt_tokens + max_response_tokens  # the longest trajectory
rank, world, device = compute_init(seed, dist_timeout_s)
# runs that repeat bit for bit take torch's deterministic kernels too: on a CPU with threads the backward of
# model.Qwen.forward's gathers (the shared prompts' keys and values) adds with atomics, in the order the threads
# come. warn_only: where torch has none (cuBLAS without CUBLAS_WORKSPACE_CONFIG=:4096:8) it warns, not stops
torch.use_deterministic_algorithms(deterministic, warn_only=True)
# every check that can refuse the run (config, data, the checkpoint to resume, the sandbox, the engine's settings)
# comes before anything in run_dir changes: a refused resume leaves metrics.jsonl and rollouts/ as they were
# the checkpoint to resume (--resume=true), or None; a new run where an earlier one left checkpoints
# stops here
start = resume_point(run_dir, resume)
# run_dir is this run's alone from here while it lives (its lock, run_dir/lock: nothing else there
# changes before the checks below pass): a second run stops here, before it loads a model for
# minutes (and reads a checkpoint the first one's rotation may delete meanwhile)
if rank == 0:
    lock_run(run_dir)
# what the run starts from (weights, tokenizer, data cursor): the checkpoint it resumes, which
# holds them all (model_path, an earlier stage's checkpoint, may be deleted by then: a resume needs
# it only as the KL's reference), else model_path
init_path = start or model_dir(model_path)
ptdtype = getattr(torch, dtype)
# packed rows for flash-attn's varlen kernel, padded batches for SDPA
packed = use_flash(device, ptdtype)
tokenizer = AutoTokenizer.from_pretrained(init_path)
problems = grading.read_problems(data_path, task_module)
prompt_ids = grading.tokenize_prompts(problems, task_module, tokenizer)
# each problem's task by name (tasks/math.py: "math"), and every tool the tasks offer (the metrics count calls
# per tool)
task_names = [grading.row_task(p, task_module).__name__ for p in problems]
tool_names = list(dict.fromkeys(name for problem in problems
                                for name in grading.row_task(problem, task_module).TOOLS))
# the prompts that fit, with their data row's index: the longer ones are skipped
data = [(i, p) for i, p in enumerate(prompt_ids) if len(p) <= max_prompt_tokens]
print0(f"{len(problems)} problems from {data_path}; "
       f"{len(problems) - len(data)} longer than {max_prompt_tokens} tokens are skipped")
if not data:
    raise SystemExit(f"config error: every prompt of {data_path} is longer than "
                     f"max_prompt_tokens = {max_prompt_tokens} (the shortest has "
                     f"{min(map(len, prompt_ids), default=0)} tokens): raise max_prompt_tokens")


@functools.lru_cache(maxsize=2)
def prompt_order(epoch):
    # a fresh permutation every epoch, the same on every rank
    return torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + 1_000_003 * epoch)).tolist()


def prompt_at(c):
    """The c-th prompt of the data stream."""
    return data[prompt_order(c // len(data))[c % len(data)]]

# the tool's sandbox pool, started (or refused) before the model loads, and asked one call to see it answers
try:
    sandbox = SandboxPool(workers=tool_workers or None, timeout=tool_timeout, memory=tool_memory,
                          isolation=tool_isolation).start()
except (ValueError, RuntimeError) as e:
    raise SystemExit(f"sandbox error: {e}")
probe = sandbox.map(["print(6 * 7)"])[0]
if probe.stdout.strip() != "42":
    sandbox.close()
    raise SystemExit(f"sandbox error: a probe call printed {probe.stdout!r} "
                     f"({probe.status}: {probe.stderr[-300:]})")
# the policy: FSDP2 training shards (fp32 master weights: model) + one unsharded inference copy per rank
# (rollout_model, the engine's), built empty: sync_rollout_model fills it before the first rollout (reading
# the checkpoint once, not twice)
model = load_trainable(init_path, device, ptdtype, activation_checkpointing, compile_update)
rollout_model = load_model(init_path, device="meta",
                           dtype=getattr(torch, rollout_dtype or dtype)).to_empty(device=device)
rollout_model.decode_mode = decode_mode
# AdamW's default betas: (0.9, 0.999)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
# the frozen reference of the KL term: the run's starting model (never a resumed checkpoint, never
# saved), sharded like the policy, in dtype, without gradients or optimizer state; its log-probs
# reach every loss term
reference = None
if kl_coef or kl_ref:
    ref_path = model_dir(kl_ref or model_path, "kl_ref")
    reference = load_trainable(ref_path, device, ptdtype, frozen=True)
    terms.append(("loss/kl", functools.partial(grpo_roc.kl_penalty, kind=kl_estimator), kl_coef))
step, cursor = 0, 0
if start:
    step = load_trainer_state(start, model, optimizer)["step"]
    print0(f"resumed from {start} at step {step}")
elif optimizer_from:
    load_trainer_state(optimizer_from, model, optimizer)
    print0(f"optimizer state continued from {optimizer_from}")
# the data stream a checkpoint's cursor counts prompts of: the prompts of data_path that fit, each
# epoch in the seed's order. A run goes on with the stream of the checkpoint it resumes, or of
# model_path when that is a checkpoint of an earlier stage on the same stream (stage 2: not
# replaying stage 1's first prompts)
stream = (data_path, len(data), seed)
prev_state = f"{init_path}/trainer_state.pt"
if (start or not data_restart) and os.path.isfile(prev_state):
    prev = torch.load(prev_state, weights_only=False)
    if prev.get("stream") == stream:
        cursor = prev["cursor"]
        print0(f"data stream continued from {init_path} at prompt {cursor}")
    elif start:
        # another stream would train some prompts of this epoch twice and skip others: a new
        # seed, or new data, is a new stage (model_path and optimizer_from at the checkpoint)
        raise SystemExit(f"config error: {start} was saved by a run with (data_path, prompts "
                         f"that fit, seed) = {prev.get('stream')}, this has {stream}: "
                         "resume with the run's")


@torch.no_grad()
def sync_rollout_model():
    """Hand the new weights to this rank's engine: gather each shard, one parameter at a time."""
    for param, engine_param in zip(model.parameters(), rollout_model.parameters()):
        engine_param.copy_(full_value(param))


def plan(kept, part):
    """The token-balanced micro-batches of one mini-batch (kept[i] for i in part), planned on every rank from
    the lengths alone: ([the kept indices of each of this rank's bins], {key: the rank that trains it}).
    A packed row (flash-attn) costs its tokens: pack balances them; right-padded rows (SDPA) cost count x the
    longest: trajectories of similar length share a micro-batch (pack_sorted), so they carry little padding."""
    lengths = [kept[i].n_prompt + kept[i].n_response - 1 for i in part]
    bins = (pack if packed else pack_sorted)(lengths, max_tokens_per_micro, world)
    dest = {kept[part[i]].key: j % world for j, b in enumerate(bins) for i in b}
    return [[part[i] for i in b] for b in bins[rank::world]], dest


def micro_batch(kept, indices, advantages, tokens):
    """One micro-batch: the kept trajectories at `indices` (their tokens from `exchange`), each token tagged with
    its trajectory's advantage and index into `kept` (traj_index). Right-padded rows (SDPA): the trajectories of
    a prompt share its tokens (collate's prompts), so the layers run them once for all of them here (in the tiny
    run a prompt is half of a trajectory's tokens)."""
    seqs, prompts = [], []
    for index in indices:
        arrays = tokens[kept[index].key]
        seq = np.concatenate([arrays.prompt_ids, arrays.response_ids])
        pad = np.zeros(len(arrays.prompt_ids) - 1)
        seqs.append({"ids": seq[:-1],
                     "tgt": seq[1:],
                     "adv": np.full(len(seq) - 1, advantages[index]),
                     # the loss reads the sampled tokens only (mask 1), and the engine's log-prob of each
                     "mask": np.concatenate([pad, arrays.mask]),
                     "engine_logprobs": np.concatenate([pad, arrays.logprobs]),
                     "traj_index": np.full(len(seq) - 1, index)})
        prompts.append((kept[index].key[:2], len(arrays.prompt_ids)))  # (step, prompt index)
    return collate(seqs, device, packed, prompts)


def micro_logprobs(net, micro, **kwargs):
    """The log-probs (B, T) of a micro-batch's tokens under net (the policy, the reference), computed where the
    loss reads them only (its mask: the output layer runs there alone), 0 elsewhere; kwargs: token_logprobs'.
    At the rollouts' temperature: the engine sampled from softmax(logits / temperature), and the ratio, the KL to
    the reference and the engine-vs-trainer gap are all of that distribution (verl's actor divides the same way)."""
    return token_logprobs(net, micro["ids"], micro["tgt"], micro["seg"], where=micro["mask"].bool(),
                          shared=micro.get("shared"), temperature=temperature, **kwargs)


def dump_step(step, mine, groups):
    """Every trajectory of the step as gzip JSONL: what a person reads (view.py) to see what the policy wrote,
    what the tool answered, and what RoC kept. Each rank writes its own trajectories, then rank 0 appends the
    parts to one file, in rank order: readers sort by (group, sample). groups: the step's summaries, one list
    per group in sample order (the step loop's)."""
    path = f"{run_dir}/rollouts/step_{step:06d}.jsonl.gz"
    os.makedirs(f"{run_dir}/rollouts", exist_ok=True)
    prompts = {}
    # level 9, the default, is 12x slower for 10% less
    with gzip.open(f"{path}.{rank}", "wt", compresslevel=1) as f:
        for trajectory in mine:
            # the key is (step, group, sample): where its summary sits
            _, group, sample = trajectory.key
            summary = groups[group][sample]
            kind = grpo_roc.group_kind(groups[group])
            if summary.problem not in prompts:  # a group's samples share their prompt: decoded once
                prompts[summary.problem] = tokenizer.decode(trajectory.prompt_ids)
            f.write(dump_line(trajectory, summary, tokenizer, problems[summary.problem],
                              prompts[summary.problem], step=step, group_kind=kind))
    barrier()
    if rank == 0:
        join_parts(path, world)


# the rollouts of a prompt: 2G for RoC to choose G from; plain GRPO samples the G it keeps
n_sample = samples_per_prompt if roc else keep_per_prompt
# this rank's share of a step's rollouts: the most rows its engine holds at once (with reserve="auto" an engine
# holding more would take rollouts from engines that would run them sooner), and the most rows of KV it needs
rollouts_per_rank = -(-prompts_per_step * n_sample // world)
n_rows = kv_rows(rollout_model, max_len, kv_capacity, kv_fraction, limit=rollouts_per_rank)
# the task's rewards, off the decode loop
grader = grading.Grader(tokenizer, score_truncated, task=task_module, rows=problems,
                        sandbox=sandbox)
try:
    engine = Engine(rollout_model, tokenizer, kv_capacity=n_rows * max_len, max_len=max_len,
                    max_rows=rollouts_per_rank,
                    reserve="auto" if kv_reserve is None else kv_reserve,
                    temperature=temperature, top_p=top_p, seed=seed,
                    sandbox=sandbox, max_turns=max_turns, max_calls_per_turn=max_calls_per_turn,
                    tool_max_chars=tool_max_chars, deterministic=deterministic,
                    tools=task_module.TOOLS, call_timeout=tool_call_timeout or None)
except ValueError as e:  # a setting the engine refuses (kv_reserve out of [0, 1], ...)
    raise SystemExit(f"config error: {e}")
# every check passed: now the run directory changes
# a resumed run's steps after its checkpoint are about to be made again: their dumps go, and metrics.jsonl
# keeps the rows up to the checkpoint (see Logger)
if start and rank == 0:
    for path in glob.glob(f"{run_dir}/rollouts/step_*.jsonl.gz"):
        if int(os.path.basename(path)[5:11]) > step:
            os.remove(path)
logger = Logger(run_dir, wandb_project, cfg, rank, resume_step=step if start else None)
print0(f"rl: {steps} steps × {prompts_per_step} prompts × {n_sample} samples, "
       f"{'RoC ' + roc_mode if roc else 'plain GRPO'}, {world} rank(s), "
       f"engine rows {engine.num_rows}")

while step < steps:
    step_start = time.perf_counter()
    # 1. rollouts: 2G per prompt, the work shared by all ranks' engines
    sync_rollout_model()
    batch = [prompt_at(cursor + offset) for offset in range(prompts_per_step)]
    cursor += prompts_per_step
    # each request with its row's tools, and the maker of its own environment when the row's task keeps state
    requests = [Request(prompt.tolist(), key=(step, group_index, sample_index),
                        meta={"problem": problem},
                        **grading.rollout_seam(problems[problem], task_module))
                for group_index, (problem, prompt) in enumerate(batch)
                for sample_index in range(n_sample)]
    mine = generate(engine, requests, max_response_tokens, rollout_split, grader,
                    counter=f"rl/{step}")
    t_rollout = time.perf_counter() - step_start
    # the grades of this rank's trajectories, made while the engine went on decoding; then what every rank
    # needs of every trajectory (grades, turns, tool statuses, lengths), while the tokens stay where they are
    grades = grader.results()
    t_grade = time.perf_counter() - step_start - t_rollout
    summaries = gather_summaries([summarize(trajectory, grades[trajectory.key])
                                  for trajectory in mine])
    t_gather = time.perf_counter() - step_start - t_rollout - t_grade

    # 2. GRPO-RoC: drop uniform groups, resample 2G -> G, advantages over the kept G
    groups = [summaries[group * n_sample:(group + 1) * n_sample]
              for group in range(prompts_per_step)]
    rewards = torch.tensor([[summary.reward for summary in group] for group in groups])  # (B, 2G)
    keep_groups, n_all_right, n_all_wrong = grpo_roc.filter_groups(rewards)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    # the kept samples (keep_per_prompt of each kept group, group after group), and per kept group on which
    # side of RoC each was kept
    kept = []
    kept_positive = []
    for group in keep_groups.tolist():
        # without RoC a group keeps all its samples; with it, RoC picks keep_per_prompt of them by penalty
        chosen = range(n_sample)
        if roc:
            for summary in groups[group]:
                # an "overloaded" call (our sandbox's queue, not the policy) counts in neither side of p_err
                statuses = summary.call_statuses
                summary.penalty = grpo_roc.penalty(len(statuses), agent.n_failed(statuses),
                                                   summary.n_answers, summary.turns,
                                                   num_overloaded=statuses.count("overloaded"))
            penalties = torch.tensor([summary.penalty for summary in groups[group]])
            chosen = grpo_roc.resample_on_correct(rewards[group], penalties, keep_per_prompt,
                                                  generator, mode=roc_mode).tolist()
        kept += [groups[group][index] for index in chosen]
        kept_positive.append(grpo_roc.positives(rewards[group])[chosen])
    # the update's clock (the tokens' exchange is its first part) and its statistics
    t_train = time.perf_counter()
    t_exchange = 0.0
    t_reference = 0.0
    grad_norm = 0.0
    # every summed statistic of the update, per rank: token-weighted clip fraction and entropy, and the
    # engine-vs-trainer gap's sums (grpo_roc.mismatch); all are summed over ranks once, in step 4
    sums = {key: torch.zeros((), device=device) for key in
            ("clip_frac", "entropy", "abs", "k3", "out", "n", *(name for name, *_ in terms))}
    mismatch_max = torch.zeros((), device=device)  # the one statistic reduced by max, not by sum
    if kept:
        # advantages: one number per kept trajectory; with RoC its sign follows the side RoC kept it on
        # (grpo_roc's docstring). The kept rewards first, one row per kept group: (kept groups, G)
        kept_rewards = torch.tensor([summary.reward for summary in kept]).view(-1, keep_per_prompt)
        advantages = grpo_roc.advantages(
            kept_rewards, estimator, torch.stack(kept_positive) if roc else None).flatten().tolist()
        for summary, advantage in zip(kept, advantages):
            summary.advantage = advantage
            summary.kept = True

        # 3. policy update: mini-batches of the kept trajectories, token-balanced micro-batches
        for param_group in optimizer.param_groups:  # linear warm-up, then constant
            param_group["lr"] = lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr
        # plan: every rank splits the kept trajectories into mini-batches and plans all their micro-batches
        # from the lengths alone, so all ranks agree on who trains what
        # mini-batches as ranges of kept indices, each whole groups, none empty
        parts = grpo_roc.split_mini_batches(len(kept), keep_per_prompt, mini_batches)
        plans = [plan(kept, part) for part in parts]
        # exchange: each trajectory's tokens travel to the one rank that trains it
        owners = {key: owner for _bins, dest in plans for key, owner in dest.items()}
        tokens = exchange(mine, owners)
        t_exchange = time.perf_counter() - t_train
        # old log-probs: the "old" policy is this step's weights before any update. With one optimizer step per
        # RL step (the paper) they are the weights of the forward below, so its own log-probs, detached, are
        # the old ones and a second forward would only repeat it; otherwise every mini-batch's come first
        minis = []
        for part, (bins, _dest) in zip(parts, plans):
            # the loss divisor as one weight per trajectory (token-mean: 1), riding on its advantage
            weights = grpo_roc.loss_weights([kept[index].n_sampled for index in part],
                                            [kept[index].key[1] for index in part],
                                            loss_norm, max_response_tokens)
            scaled = {index: advantages[index] * weight for index, weight in zip(part, weights)}
            micros = [micro_batch(kept, indices, scaled, tokens) for indices in bins]
            n_tokens = torch.tensor(float(sum(kept[index].n_sampled for index in part)),
                                    device=device)
            if reference is not None:
                # the reference's log-probs of the sampled tokens, a no_grad forward a micro-batch;
                # then its root's gathered weights are freed (FSDP2 keeps a root's for a backward)
                t_reference -= time.perf_counter()
                with torch.no_grad():
                    for micro in micros:
                        micro["ref_logprobs"] = micro_logprobs(reference, micro)
                if dist.is_initialized():
                    reference.reshard()
                # the clock stops when the GPU is done, not when its work is queued
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t_reference += time.perf_counter()
            old_logprobs = None
            if len(parts) > 1:
                with torch.no_grad():
                    old_logprobs = [micro_logprobs(model, micro) for micro in micros]
            minis.append((micros, old_logprobs, n_tokens))
        # micro-batch loop: forward, loss and backward per micro-batch; gradients add up over the mini-batch
        for micros, old_logprobs, n_tokens in minis:
            for micro_index, micro in enumerate(micros):
                # the tokens the policy sampled: the loss reads these only
                mask = micro["mask"].bool()
                # the output layer only where the loss reads (log-probs 0 elsewhere)
                logprobs, entropy = micro_logprobs(model, micro, with_entropy=True)
                old = logprobs.detach() if old_logprobs is None else old_logprobs[micro_index]
                # the engine sampled these tokens: how far are its log-probs from the trainer's (old) ones?
                engine_logprobs = micro["engine_logprobs"]  # float32, as collate makes every float
                gap = grpo_roc.mismatch(old, engine_logprobs, mask)
                mismatch_max = torch.maximum(mismatch_max, gap.pop("max"))
                for key, value in gap.items():
                    sums[key] += value
                # corrections for that gap, off by default: truncated importance weights, sequence masking
                token_weights = None
                if tis_cap:
                    token_weights = grpo_roc.tis_weights(old, engine_logprobs, tis_cap)
                if mismatch_band:
                    mask = grpo_roc.sequence_mask(old, engine_logprobs, mask, micro["traj_index"],
                                                  mismatch_band)
                loss, loss_stats = grpo_roc.policy_loss(
                    logprobs, old, micro["adv"], mask, eps_low=eps_low, eps_high=eps_high,
                    dual_clip=dual_clip or None, num_tokens=n_tokens, weights=token_weights,
                    seq_ids=micro["traj_index"] if ratio_level == "sequence" else None,
                    return_stats=True)
                # extra loss terms (loss_terms, the KL): per-token values, whose token-mean over the
                # mini-batch times the term's coefficient joins the loss
                for name, term, coef in terms:
                    values = term(logprobs=logprobs, old_logprobs=old, mask=mask,
                                  engine_logprobs=engine_logprobs, advantages=micro["adv"],
                                  ref_logprobs=micro.get("ref_logprobs"),
                                  traj_index=micro["traj_index"])  # (B, T)
                    term_mean = torch.where(mask, values, 0.0).sum() / n_tokens
                    loss = loss + coef * term_mean
                    sums[name] += term_mean.detach() / len(parts)
                # FSDP averages gradients over ranks; the loss is already normalised by the global count
                (loss * world).backward()
                # token-weighted means over the whole mini-batch, averaged over mini-batches (ranks: step 4)
                share = micro["mask"].sum() / n_tokens
                sums["clip_frac"] += loss_stats["clip_frac"] * share / len(parts)
                sums["entropy"] += (entropy * micro["mask"]).sum() / n_tokens / len(parts)
            # optimizer step: one per mini-batch, after clipping the gradients' global norm
            total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            # the norm before clipping, made whole (a collective); Logger.log reads the tensor itself
            grad_norm = full_value(total_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    step += 1
    t_train = time.perf_counter() - t_train

    # 4. metrics: the update's sums over all ranks (one all-reduce), then one line and one JSON row per step
    if dist.is_initialized():
        summed = torch.stack(list(sums.values()))
        dist.all_reduce(summed)
        sums = dict(zip(sums, summed))
        dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX)
    n_loss = max(1.0, float(sums["n"]))
    metrics = {
        "rollout/reward": rewards.mean(),
        # rollout/ lengths, endings, turns and tool/ calls, failures and format health, as eval.py reports them too
        **rollout_metrics(summaries, tool_names),
        # with more than one task in the run: reward, correct share and tool errors per task too (task/<name>/...)
        **(task_metrics(summaries, lambda summary: task_names[summary.problem])
           if len(set(task_names)) > 1 else {}),
        "rollout/tok_per_s": sum(summary.n_response for summary in summaries) / t_rollout,
        "rollout/generated_here": len(mine),
        # this rank's engine: rows it evicted when pages ran out, and the tokens it prefilled again for them
        "rollout/preemptions": engine.stats["preemptions"],
        "rollout/recomputed_tokens": engine.stats["recomputed_tokens"],
        "roc/kept": len(kept),
        "roc/reward_kept": sum(summary.reward for summary in kept) / max(1, len(kept)),
        "roc/groups_all_right": n_all_right / prompts_per_step,
        "roc/groups_all_wrong": n_all_wrong / prompts_per_step,
        "loss/entropy": sums["entropy"],
        "loss/clip_frac": sums["clip_frac"],
        "loss/grad_norm": grad_norm,
        "loss/lr": optimizer.param_groups[0]["lr"],
        # the extra loss terms' token-means (loss/kl, loss/<function>), before their coefficients
        **{name: sums[name] for name, *_ in terms},
        # engine vs trainer log-probs over the loss tokens (see grpo_roc.mismatch)
        "mismatch/abs_mean": sums["abs"] / n_loss,
        "mismatch/abs_max": mismatch_max,
        "mismatch/kl_k3": sums["k3"] / n_loss,
        "mismatch/ratio_out": sums["out"] / n_loss,
        # seconds: generating; waiting for this rank's last grades; the summaries' gather; the tokens' exchange
        "time/rollout": t_rollout,
        "time/grade_wait": t_grade,
        "time/gather": t_gather,
        "time/exchange": t_exchange,
        "time/tools_wait": engine.stats["tool_wait_s"],
        "time/train": t_train,
        # of time/train: the frozen reference's forwards (0 without one)
        "time/reference": t_reference,
        # this rank's grades that were scored 0 without a verdict: verification too slow (the helper replaced),
        # answers too long or nested too deep to parse, no helper to be had, the task's grade raised (grading.Grader.results)
        "grade/timed_out": grader.stats["timed_out"],
        "grade/refused": grader.stats["refused"],
        "grade/failed": grader.stats["failed"],
    }
    logger.log(step, metrics)
    print0(f"step {step:04d}/{steps} | reward {metrics['rollout/reward']:.3f} "
           f"| kept {len(kept):3d} | len {metrics['rollout/response_len']:.0f} "
           f"| trunc {metrics['rollout/truncated_frac']:.2f} | calls {metrics['tool/calls']:.2f} "
           f"| tool_err {metrics['tool/err']:.3f} (pos {metrics['tool/err_pos']:.3f}) "
           f"| ent {metrics['loss/entropy']:.3f} | gnorm {metrics['loss/grad_norm']:.2f} "
           f"| dt {t_rollout:.1f}+{t_train:.1f}s")

    # 5. the rollouts' dump and the checkpoint, every so many steps
    if dump_every and (step % dump_every == 0 or step == 1):
        dump_step(step, mine, groups)
    if save_every and step % save_every == 0 or step == steps:
        # the Hugging Face copy beside the shards: at the last step and every save_hf_every-th save
        with_hf = step == steps or (save_hf_every and step // save_every % save_hf_every == 0)
        save_checkpoint(checkpoint_dir(run_dir, step), model, optimizer, tokenizer,
                        {"step": step, "cursor": cursor, "stream": stream},
                        hf_dtype=ptdtype if with_hf else None, keep=keep_checkpoints)

sandbox.close()
compute_cleanup()

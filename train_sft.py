"""
Non-reasoning SFT: teach a base model the agent protocol before RL (paper §4.1) — instruction
following, the JSON tool-call format, `<reason>`/`<answer>` tags — with no reasoning traces.

CPU (tiny model):  python train_sft.py configs/tiny_sft.py
8+ GPUs:           torchrun --nproc_per_node 8 train_sft.py configs/sft.py

Data: JSONL, one conversation per line: {"messages": [...]} with OpenAI-style messages (system, user,
assistant with optional "tool_calls" [{"type": "function", "function": {"name", "arguments"}}], tool).
Each conversation is rendered by agent.render_conversation exactly as an RL rollout builds its tokens
(prompt, then sampled turns and tool-response suffixes), and the loss is on the assistant's tokens
only — the same mask rule as RL. Sequences are packed into token-budget micro-batches; cosine LR with
4% warm-up; FSDP2 under torchrun; the result is an HF directory that every other script loads.
"""
import json
import math
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import agent
from common import (Logger, compute_cleanup, compute_init, pack, collate, print0)
from configurator import configure
from model import load_model, load_weights, save_model, shard_model, token_logprobs, use_flash

# -----------------------------------------------------------------------------
model_path = "out/tiny-base"  # HF directory of the base model (weights + tokenizer)
data_path = "out/data/sft.jsonl"
out_dir = "out/tiny-sft"  # the SFT model is written here in HF format
epochs = 3  # paper: 3
lr = 5e-6  # paper: 5e-6 (peak; cosine decay to lr_min_ratio · lr)
lr_min_ratio = 0.0
warmup_ratio = 0.04  # paper: 4 %
batch_size = 128  # conversations per optimizer step, all ranks together (paper: 128)
max_tokens_per_micro = 8192  # packed tokens per micro-batch and rank
max_seq_len = 8192  # longer conversations are skipped (and counted)
weight_decay = 0.0
grad_clip = 1.0
activation_checkpointing = False
dtype = "float32"  # compute dtype: "bfloat16" on GPU
log_every = 10
seed = 0
wandb_project = ""
cfg = configure(globals())
# -----------------------------------------------------------------------------

rank, world, device = compute_init(seed)
packed = use_flash(device, getattr(torch, dtype))  # packed rows for flash-attn's varlen kernel, padded batches for SDPA
tokenizer = AutoTokenizer.from_pretrained(model_path)

# data: every line is checked up front, errors name the file and line
examples, skipped = [], 0
with open(data_path) as f:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            ids, mask = agent.render_conversation(tokenizer, messages)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{data_path}:{lineno}: {type(e).__name__}: {e}")
        if len(ids) > max_seq_len:
            skipped += 1
            continue
        examples.append({"ids": ids[:-1], "tgt": ids[1:], "mask": mask[1:]})
print0(f"{len(examples)} conversations from {data_path} ({skipped} longer than {max_seq_len} skipped), "
       f"{sum(len(e['ids']) for e in examples)} tokens, {sum(sum(e['mask']) for e in examples)} trained")

if dist.is_initialized():
    model = load_model(model_path, device="meta")
    shard_model(model, param_dtype=getattr(torch, dtype) if dtype != "float32" else None)
    load_weights(model, model_path, device)
else:
    model = load_model(model_path, device=device, dtype=torch.float32)
model.gradient_checkpointing = activation_checkpointing
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
steps_per_epoch = math.ceil(len(examples) / batch_size)
total = epochs * steps_per_epoch
warmup = max(1, round(warmup_ratio * total))
logger = Logger(out_dir, wandb_project, cfg, rank)
print0(f"sft: {epochs} epochs × {steps_per_epoch} steps of {batch_size} conversations, {world} rank(s)")

step = 0
for epoch in range(epochs):
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    for b in range(steps_per_epoch):
        t0 = time.perf_counter()
        # cosine schedule with linear warm-up
        progress = max(0.0, (step - warmup) / max(1, total - warmup))
        lr_now = lr * min((step + 1) / warmup, lr_min_ratio + (1 - lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        batch = [examples[i] for i in order[b * batch_size:(b + 1) * batch_size]]
        n_tokens = sum(sum(e["mask"]) for e in batch)  # token-mean over the whole batch, all ranks
        bins = pack([len(e["ids"]) for e in batch], max_tokens_per_micro, world)
        loss_sum = torch.zeros((), device=device)
        for bin_ in bins[rank::world]:
            mb = collate([batch[i] for i in bin_], device, packed)
            lp = token_logprobs(model, mb["ids"], mb["tgt"], mb["seg"])  # (1, N)
            loss = -(lp * mb["mask"]).sum() / max(1, n_tokens)
            (loss * world).backward()  # FSDP averages over ranks; we already divided by the global count
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.all_reduce(loss_sum)
        step += 1
        logger.log(step, {"loss": loss_sum.item(), "lr": lr_now, "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)})
        if step % log_every == 0 or step == total:
            print0(f"step {step:04d}/{total} | loss {loss_sum.item():.4f} | lr {lr_now:.2e} | "
                   f"dt {time.perf_counter() - t0:.2f}s")

save_model(model, out_dir)
if rank == 0:
    tokenizer.save_pretrained(out_dir)
print0(f"saved {out_dir}")
compute_cleanup()

"""
Shared plumbing for the entry scripts: torchrun init, printing on rank 0, the step logger, and
checkpoints (HF-format weights + trainer state) that `--resume` finds again.
"""
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist


def compute_init(seed=0):
    """torchrun env vars -> (rank, world, device). gloo on CPU, nccl (RCCL on ROCm) on GPU."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    # same seed on every rank: the model init and data order agree; rollouts get their own generators
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return rank, world, device


def compute_cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


class Logger:
    """One JSON line per step in run_dir/metrics.jsonl, forwarded to wandb only if asked.
    On ranks other than 0 every call is a no-op, so call sites never branch."""

    def __init__(self, run_dir, wandb_project="", config=None, rank=0, resume=False):
        self.active = rank == 0
        self.wandb = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if resume else "w")
        if wandb_project:
            import wandb  # optional: only imported when asked for
            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(run_dir), config=config)

    def log(self, step, metrics):
        if not self.active:
            return
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)


def all_gather_dict(d):
    """Merge a dict from every rank into one, the same on all ranks (single process: d itself)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(d)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, d)
    return {k: v for part in parts for k, v in part.items()}


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# -----------------------------------------------------------------------------
# checkpoints: out/<run>/step_000300/ = HF weights (+ tokenizer) and trainer state

def checkpoint_dir(run_dir, step):
    return os.path.join(run_dir, f"step_{step:06d}")


def latest_checkpoint(run_dir):
    steps = [d for d in os.listdir(run_dir) if d.startswith("step_")] if os.path.isdir(run_dir) else []
    return os.path.join(run_dir, max(steps)) if steps else None


def load_trainable(path, device, dtype, activation_checkpointing=False):
    """The model to train, fp32 master weights: under torchrun FSDP2 shards (dtype = compute dtype), each
    rank reading only its own rows of the checkpoint; else one plain fp32 copy. Build the optimizer after
    this: FSDP replaces the parameters it shards."""
    from model import load_model, load_weights, shard_model
    if dist.is_initialized():
        model = load_model(path, device="meta")
        shard_model(model, param_dtype=dtype if dtype != torch.float32 else None)
        load_weights(model, path, device)
    else:
        model = load_model(path, device=device, dtype=torch.float32)
    model.gradient_checkpointing = activation_checkpointing
    return model.train()


def save_checkpoint(path, model, optimizer, tokenizer, state):
    """HF-format weights via model.save_model, the optimizer with torch.distributed.checkpoint (each
    rank writes only its own shards), and a small state dict (step, data cursor, RNG) from rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from model import save_model
    save_model(model, path)
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=os.path.join(path, "optimizer"))
    if int(os.environ.get("RANK", 0)) == 0:
        tokenizer.save_pretrained(path)
        state = {**state, "rng_python": random.getstate(), "rng_numpy": np.random.get_state(),
                 "rng_torch": torch.get_rng_state()}
        torch.save(state, os.path.join(path, "trainer_state.pt"))
    if dist.is_initialized():
        dist.barrier()


def load_trainer_state(path, model, optimizer):
    """Restore optimizer shards and RNG from a checkpoint written by save_checkpoint; returns the state
    dict (step, cursor, ...). The weights are loaded by the caller (model.load_model / load_weights)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    osd = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(osd, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(model, optimizer, osd["optimizer"])
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    random.setstate(state["rng_python"])
    np.random.set_state(state["rng_numpy"])
    torch.set_rng_state(state["rng_torch"])
    return state


# -----------------------------------------------------------------------------
# token-balanced packing, shared by SFT and RL

def pack(lengths, max_tokens, world=1):
    """Split sequences into world × M bins of at most max_tokens tokens (M the same on every rank, so
    all ranks run the same number of forward/backward passes): longest first into the emptiest bin.
    Every rank computes the same bins from the same lengths; bin j belongs to rank j % world."""
    m = max(1, -(-sum(lengths) // (world * max_tokens)))
    while True:
        bins, load = [[] for _ in range(world * m)], [0] * (world * m)
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            j = min(range(len(bins)), key=load.__getitem__)
            bins[j].append(i)
            load[j] += lengths[i]
        if max(load) <= max_tokens or m >= len(lengths):
            return bins
        m += 1


def collate(seqs, device, packed):
    """Turn sequences (dicts of equal-length per-token lists) into a micro-batch of tensors plus "seg",
    the attention mask. packed=True: one row (1, N), sequences told apart by segment ids 1, 2, ...
    (flash-attn's varlen kernel does no work across them). packed=False: a right-padded (n, Lmax)
    batch with a 0/1 mask — cheaper for SDPA, whose attention over one long packed row would cost
    O(N²). An empty bin becomes a single zero token (it still joins the FSDP collectives)."""
    if not seqs:
        seqs = [{"ids": [0], "tgt": [0], "mask": [0], "adv": [0.0], "elp": [0.0], "tid": [0]}]  # RL's keys
    if packed:
        out = {k: [[x for s in seqs for x in s[k]]] for k in seqs[0]}
        out["seg"] = [[k + 1 for k, s in enumerate(seqs) for _ in s["ids"]]]
    else:
        width = max(len(s["ids"]) for s in seqs)
        out = {k: [s[k] + [0] * (width - len(s[k])) for s in seqs] for k in seqs[0]}
        out["seg"] = [[1] * len(s["ids"]) + [0] * (width - len(s["ids"])) for s in seqs]
    return {k: torch.tensor(v, device=device) for k, v in out.items()}

"""
Checkpoints (HF-format weights + sharded trainer state) that `--resume` finds again: where they live, how
they are written whole or not at all, which ones rotation keeps, and how a run loads them back; and the run
directory's guards, for train_rl.py and train_sft.py alike: its two refusals (resume_point) and its lock
(lock_run). Split from common.py as nanochat keeps its checkpoint_manager.py: common.py stays plumbing that
imports nothing of the project, this file imports the model.
"""
import fcntl
import glob
import json
import os
import random
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from common import barrier, resolve_model
from model import load_model, load_weights, save_model, shard_model
from scheduler import gather

# a single process saves and loads its checkpoints with torch.distributed.checkpoint too: it says so each time
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")

# checkpoints: out/<run>/step_000300/
#   state/                model + optimizer shards, torch.distributed.checkpoint: every rank writes its own part
#   trainer_state.pt      step, data cursor, RNG (rank 0)
#   config.json, tokenizer
#   model*.safetensors    HF weights, only where a person needs them (train_rl: the run's last step and every
#                         save_hf_every-th save): rank 0 alone gathers and writes those, while the others wait
# A checkpoint is written as step_X.tmp/ and renamed when it is complete, so a run killed mid-save, or out of
# disk, leaves no step_X/ behind: --resume takes the newest complete one.

def checkpoint_dir(run_dir, step):
    return f"{run_dir}/step_{step:06d}"


def has_weights(path):
    """The HF weight files path holds (what eval.py and transformers load): none, an empty list."""
    return glob.glob(f"{path}/model*.safetensors")


def checkpoints(run_dir):
    """The complete checkpoints of a run, oldest first: the names that end on the step's digits (not a
    save under way, step_X.tmp, nor a copy a person made beside them, step_X.bak)."""
    return sorted(glob.glob(f"{run_dir}/step_[0-9]*[0-9]"))


def latest_checkpoint(run_dir, weights=False):
    """The newest complete checkpoint of run_dir (weights=True: the newest with HF weights), or None."""
    # the names sort by step: the newest is the greatest
    return max((p for p in checkpoints(run_dir) if has_weights(p) or not weights), default=None)


def model_dir(path, key="model_path"):
    """The model directory a config key names: common.resolve_model's (a directory, or a Hub id),
    holding a model (config.json). Anything else, a run directory among them (eval.py takes its
    newest weights; a run to train from names its checkpoint), exits naming the key."""
    path = resolve_model(path, key)
    if not os.path.isfile(f"{path}/config.json"):
        raise SystemExit(f"config error: {key}={path!r} holds no model (config.json); a run "
                         "directory's are its checkpoints: name one (step_*/)")
    return path


def resume_point(run_dir, resume):
    """The checkpoint a run continues from: run_dir's newest with resume (--resume=true), None
    without. Exits where the two disagree: resume with no checkpoint; or a new run where an earlier
    one left checkpoints, which would mix with it (metrics.jsonl emptied, the rotation deleting the
    new run's checkpoints before the old run's, a later --resume taking the old run's newest)."""
    # rank 0's newest, on every rank: a node whose view of a shared file system lags (NFS keeps a
    # folder's listing up to a minute) read another checkpoint's shards than the rest, unsaid
    start = gather(latest_checkpoint(run_dir))[0]
    if resume and not start:
        raise SystemExit(
            f"config error: --resume=true but {run_dir} holds no complete checkpoint (step_*/): "
            "nothing to resume; drop --resume to start this run from step 0")
    if start and not resume:
        raise SystemExit(
            f"config error: {run_dir} holds the checkpoints of an earlier run (the newest: "
            f"{start}): --resume=true continues it; a new run needs its own directory")
    return start


_run_lock = None  # run_dir/lock, open while this process lives (lock_run)


def lock_run(run_dir):
    """Hold run_dir/lock while this process lives (the kernel lets it go when the process ends,
    killed or not): a second run pointed at run_dir, a job started twice, stops here instead of
    interleaving its metrics rows, dumps and checkpoints with the first's. Rank 0 calls it; the open
    file stays here. On a file system without locks (Lustre mounted without flock) runs are not
    guarded."""
    global _run_lock
    os.makedirs(run_dir, exist_ok=True)
    _run_lock = open(f"{run_dir}/lock", "w")
    try:
        fcntl.flock(_run_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"config error: another run is using {run_dir} (it holds {run_dir}/lock)")
    except OSError:  # no locks here
        pass


def load_trainable(path, device, dtype, activation_checkpointing=False, compiled=False, frozen=False):
    """The model to train, fp32 master weights: under torchrun FSDP2 shards (dtype = compute dtype), each
    rank reading only its own part of the checkpoint; else one plain fp32 copy. A checkpoint's own shards
    (state/) are read when it has them, else its HF weights. Build the optimizer after this: FSDP
    replaces the parameters it shards. frozen=True: a reference model, sharded the same way but its
    weights kept in dtype (bf16: half the memory of fp32 master weights), without gradients.
    compiled=True: each decoder layer through inductor (torch.compile; on a CPU it builds C++ with gcc),
    before fully_shard, as FSDP2 expects, so its element-wise chains (RMSNorm, the q/k norms, RoPE, SwiGLU)
    run forward and backward as a few fused kernels instead of dozens of passes over the activations;
    matmuls and attention stay torch's. Shapes are dynamic (micro-batches differ in rows and length) and the
    layers share one graph, so the first update pays the one compile (tens of seconds on a CPU; more under
    FSDP2). Fusion reorders some sums: gradients equal the eager path's within float tolerance, not bitwise
    (tests/test_model.py). The state dict's names are unchanged."""
    model = load_model(path, device="meta", dtype=dtype if frozen else torch.float32)
    if compiled:
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    if dist.is_initialized():
        shard_model(model, param_dtype=dtype if dtype != torch.float32 else None)
    # a checkpoint of ours (its sharded state), else HF weights
    state = f"{path}/state"
    if os.path.isdir(state):
        model.to_empty(device=device)
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=state)
        set_model_state_dict(model, sd["model"])
    else:
        load_weights(model, path, device)
    model.gradient_checkpointing = activation_checkpointing
    return model.requires_grad_(False) if frozen else model.train()


def save_checkpoint(path, model, optimizer, tokenizer, state, hf_dtype=None, keep=0):
    """Write the checkpoint `path` (layout above), with HF weights in hf_dtype unless it is None; then keep
    the newest `keep` complete checkpoints of its run (0: all), and every one with HF weights."""
    rank0 = os.environ.get("RANK", "0") == "0"
    tmp = f"{path}.tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left behind
        os.makedirs(tmp)
    barrier()
    # an optimizer that has not stepped yet (every group of the steps so far dropped) has no
    # state: torch makes one for the state dict by a step at lr 0, which Adam counts as its
    # first (the next real step's bias correction then moved the weights x0.74 as far). It is
    # saved as made, then dropped, here and on a load
    stepped = bool(optimizer.state)
    dcp.save({"model": get_model_state_dict(model),
              "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=f"{tmp}/state")
    if not stepped:
        optimizer.state.clear()
    # HF weights with their config.json, or the config alone
    if hf_dtype is not None:
        save_model(model, tmp, dtype=hf_dtype)  # every rank takes part in the gathers
    elif rank0:
        with open(f"{tmp}/config.json", "w") as f:
            json.dump(model.cfg.to_dict(next(model.parameters()).dtype), f, indent=2)
    if rank0:
        tokenizer.save_pretrained(tmp)
        state = {**state, "stepped": stepped,
                 "rng_python": random.getstate(), "rng_numpy": np.random.get_state(),
                 "rng_torch": torch.get_rng_state()}
        torch.save(state, f"{tmp}/trainer_state.pt")
    barrier()
    if rank0:
        # on disk before it is named complete, else after a power loss a checkpoint could hold
        # files the page cache never wrote back, empty or short, under a name --resume trusts.
        # Linux's sync returns once every file system's pending writes are on disk, as an fsync of
        # every file and folder would: this save's (rank 0 wrote all but the shards, which torch's
        # writer syncs on each rank) and any other process's on the node, which it waits for too.
        # The tiny model's save with HF weights: 69 ms against 61 ms without (median of 10, ext4);
        # an fsync of each file and folder instead cost more here (138 against 113 ms)
        os.sync()
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)  # now it is complete
        os.sync()  # the rename too
        # all but the newest keep (keep 0: [:-0] is empty, all stay)
        for old in checkpoints(os.path.dirname(path))[:-keep]:
            if not has_weights(old):
                shutil.rmtree(old)
    barrier()


def load_trainer_state(path, model, optimizer):
    """Restore the optimizer shards and RNG of a checkpoint written by save_checkpoint; returns its state
    dict (step, cursor, ...). The weights are load_trainable's. The optimizer's settings
    (weight_decay, betas, ...) stay the ones it was built with, the run's config, not the
    checkpoint's."""
    # torch's load replaces the param_groups with copies of the checkpoint's, settings and all:
    # this run's groups, left as they were, go back in their place (the loaded state is keyed by
    # the same parameters)
    groups = optimizer.param_groups
    osd = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(osd, checkpoint_id=f"{path}/state")
    set_optimizer_state_dict(model, optimizer, osd["optimizer"])
    optimizer.param_groups = groups
    state = torch.load(f"{path}/trainer_state.pt", weights_only=False)
    # saved before the optimizer's first step: its state was torch's placeholder (save_checkpoint)
    if not state.get("stepped", True):
        optimizer.state.clear()
    random.setstate(state["rng_python"])
    np.random.set_state(state["rng_numpy"])
    torch.set_rng_state(state["rng_torch"])
    return state

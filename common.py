"""
Shared plumbing for the entry scripts: torchrun init, printing on rank 0, the step logger, and
checkpoints (HF-format weights + trainer state) that `--resume` finds again.
"""
import datetime
import glob
import heapq
import json
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist


# a single process saves and loads its checkpoints with torch.distributed.checkpoint too: it says so each time
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
_cpu_group = None  # a gloo group next to nccl's: Python objects cross ranks over it (see cpu_group)


def compute_init(seed=0, timeout_s=1800):
    """torchrun env vars -> (rank, world, device). gloo on CPU, nccl (RCCL on ROCm) on GPU.
    timeout_s bounds every collective: a rank that waits longer for the others (one of them crashed, hangs,
    or was stopped) raises instead of waiting forever, and torchrun ends the job. It must cover the longest
    honest wait, the spread between the first and the last rank to finish a rollout phase: `python
    simulate.py` puts it at 48-114 s in training and 206-352 s for AIME eval at 30K tokens; 30 min is 5x that."""
    global _cpu_group
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        if device.type == "cuda":  # pickled objects would otherwise travel through GPU memory
            _cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    # same seed on every rank: the model init and data order agree; rollouts get their own generators
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return rank, world, device


def cpu_group():
    """The process group for Python objects (trajectories, grades, metrics): gloo, so a gather of pickled
    bytes moves through host memory, never through accelerator memory next to the KV cache."""
    return _cpu_group


def compute_cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_model(path, key="model_path"):
    """A local model directory for `path`: the directory itself, or a Hugging Face Hub id (Qwen/Qwen3-14B-Base)
    resolved once to its snapshot in the local cache, downloading it if needed and allowed (HF_HUB_OFFLINE=1:
    the cache only). Under torchrun the first rank of each node fetches while the others wait, then all read the
    cache. Anything else exits with one line naming the key and what was looked for."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download
    try:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            snapshot_download(path)
        barrier()
        return snapshot_download(path, local_files_only=True)
    except Exception as e:
        why = "not a valid Hub id" if type(e).__name__ == "HFValidationError" else (str(e).splitlines() or [""])[0]
        raise SystemExit(f"config error: {key}={path!r} is no directory, nor a Hugging Face Hub model that resolves: {why}")


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


class Logger:
    """One JSON line per step in run_dir/metrics.jsonl, forwarded to wandb only if asked.
    On ranks other than 0 every call is a no-op, so call sites never branch. A run resumed from the
    checkpoint of step `resume_step` keeps the rows up to that step only: the steps after it are about
    to be run again, and each step has one row."""

    def __init__(self, run_dir, wandb_project="", config=None, rank=0, resume_step=None):
        self.active = rank == 0
        self.wandb = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        rows = read_jsonl(path, ()) if resume_step is not None and os.path.exists(path) else []
        self.file = open(path, "w")
        self.file.writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= resume_step)
        if wandb_project:
            import wandb  # optional: only imported when asked for
            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(run_dir), config=config,
                                    resume="allow" if resume_step is not None else None)

    def log(self, step, metrics):
        if not self.active:
            return
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)


def read_jsonl(path, required=("question", "answer")):
    """Rows of a JSONL file (every script's data and metrics). A missing file or a bad line raises
    ValueError 'path:line: what is wrong'; `required` fields must be there, question and answer as strings."""
    rows = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in required:
                if key not in row:
                    raise ValueError(f"{path}:{lineno}: missing field {key!r}")
                # answers are compared as text: a JSON number here is almost always a mistake
                if key in ("question", "answer") and not isinstance(row[key], str):
                    raise ValueError(f"{path}:{lineno}: field {key!r} must be a string, got {type(row[key]).__name__}")
            rows.append(row)
    return rows


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def read_metrics(run_dir):
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"), ())


# -----------------------------------------------------------------------------
# checkpoints: out/<run>/step_000300/
#   state/                model + optimizer shards, torch.distributed.checkpoint: every rank writes its own part
#   trainer_state.pt      step, data cursor, RNG (rank 0)
#   config.json, tokenizer
#   model*.safetensors    HF weights, only where a person needs them (train_rl: the run's last step and every
#                         save_hf_every-th save): rank 0 alone gathers and writes those, while the others wait
# A checkpoint is written as step_X.tmp/ and renamed when it is complete, so a run killed mid-save, or out of
# disk, leaves no step_X/ behind: --resume takes the newest complete one.

def checkpoint_dir(run_dir, step):
    return os.path.join(run_dir, f"step_{step:06d}")


def has_weights(path):
    """Does path hold HF weights (what eval.py and transformers load)?"""
    return bool(glob.glob(os.path.join(path, "model*.safetensors")))


def checkpoints(run_dir):
    """The complete checkpoints of a run, oldest first."""
    return sorted(p for p in glob.glob(os.path.join(run_dir, "step_[0-9]*")) if not p.endswith(".tmp"))


def latest_checkpoint(run_dir, weights=False):
    """The newest complete checkpoint of run_dir (weights=True: the newest with HF weights), or None."""
    found = [p for p in checkpoints(run_dir) if has_weights(p) or not weights]
    return found[-1] if found else None


def load_trainable(path, device, dtype, activation_checkpointing=False):
    """The model to train, fp32 master weights: under torchrun FSDP2 shards (dtype = compute dtype), each
    rank reading only its own part of the checkpoint; else one plain fp32 copy. A checkpoint's own shards
    (state/) are read when it has them, else its HF weights. Build the optimizer after this: FSDP
    replaces the parameters it shards."""
    from model import load_model, load_weights, shard_model
    model = load_model(path, device="meta")
    if dist.is_initialized():
        shard_model(model, param_dtype=dtype if dtype != torch.float32 else None)
    if os.path.isdir(os.path.join(path, "state")):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        model.to_empty(device=device)
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=os.path.join(path, "state"))
        set_model_state_dict(model, sd["model"])
    else:
        load_weights(model, path, device)
    model.gradient_checkpointing = activation_checkpointing
    return model.train()


def save_checkpoint(path, model, optimizer, tokenizer, state, hf_dtype=None, keep=0):
    """Write the checkpoint `path` (layout above), with HF weights in hf_dtype unless it is None; then keep
    the newest `keep` complete checkpoints of its run (0: all), and every one with HF weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from model import save_model
    rank0, tmp = int(os.environ.get("RANK", 0)) == 0, path + ".tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left behind
        os.makedirs(tmp)
    barrier()
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=os.path.join(tmp, "state"))
    if hf_dtype is not None:
        save_model(model, tmp, dtype=hf_dtype)  # every rank takes part in the gathers
    if rank0:
        if hf_dtype is None:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(model.cfg.to_dict(next(model.parameters()).dtype), f, indent=2)
        tokenizer.save_pretrained(tmp)
        state = {**state, "rng_python": random.getstate(), "rng_numpy": np.random.get_state(),
                 "rng_torch": torch.get_rng_state()}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    barrier()
    if rank0:
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)  # now it is complete
        for old in checkpoints(os.path.dirname(path))[:-keep] if keep else []:
            if not has_weights(old):
                shutil.rmtree(old)
    barrier()


def load_trainer_state(path, model, optimizer):
    """Restore the optimizer shards and RNG of a checkpoint written by save_checkpoint; returns its state
    dict (step, cursor, ...). The weights are load_trainable's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    osd = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(osd, checkpoint_id=os.path.join(path, "state"))
    set_optimizer_state_dict(model, optimizer, osd["optimizer"])
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    random.setstate(state["rng_python"])
    np.random.set_state(state["rng_numpy"])
    torch.set_rng_state(state["rng_torch"])
    return state


def barrier():
    if dist.is_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# token-balanced packing, shared by SFT and RL

def pack(lengths, max_tokens, world=1):
    """Split sequences into world × M bins of at most max_tokens tokens (M the same on every rank, so
    all ranks run the same number of forward/backward passes): longest first into the emptiest bin
    (a heap: O(n log n)). Every rank computes the same bins from the same lengths; bin j belongs to rank
    j % world. A sequence longer than max_tokens fits no bin: ValueError."""
    if lengths and max(lengths) > max_tokens:
        i = max(range(len(lengths)), key=lengths.__getitem__)
        raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than max_tokens_per_micro={max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    m = max(1, -(-sum(lengths) // (world * max_tokens)))
    while True:
        bins, heap = [[] for _ in range(world * m)], [(0, j) for j in range(world * m)]
        for i in order:
            load, j = heapq.heappop(heap)  # the emptiest bin, the lowest index among equals
            bins[j].append(i)
            heapq.heappush(heap, (load + lengths[i], j))
        if max(load for load, _ in heap) <= max_tokens:
            return bins
        m += max(1, m // 8)  # more bins per rank; with one sequence per bin everything fits


def pack_sorted(lengths, max_tokens, world=1):
    """Split sequences into world × M bins of similar lengths, for right-padded micro-batches (SDPA), where a
    bin costs count × its longest sequence: longest first, dealt to the ranks in snake order (0, 1, .., w-1,
    w-1, .., 0, 0, 1, ..: each rank gets nearly the same tokens), then each rank's run cut into bins while
    count × longest stays <= max_tokens. Every rank gets M bins (empty ones where it has fewer: they still
    join the FSDP collectives). Bin j belongs to rank j % world, as in pack. Too long a sequence: ValueError."""
    if lengths and max(lengths) > max_tokens:
        i = max(range(len(lengths)), key=lengths.__getitem__)
        raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than max_tokens_per_micro={max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    # deal: in each round of `world` sequences, every other round runs backwards
    runs = [[] for _ in range(world)]
    for k, i in enumerate(order):
        turn = k % world
        runs[turn if (k // world) % 2 == 0 else world - 1 - turn].append(i)
    # cut each rank's run into bins; the run is longest first, so a bin's first sequence is its longest
    per_rank = []
    for run in runs:
        bins = []
        for i in run:
            if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
                bins[-1].append(i)
            else:
                bins.append([i])
        per_rank.append(bins)
    m = max(1, max(map(len, per_rank)))
    return [per_rank[r][j] if j < len(per_rank[r]) else [] for j in range(m) for r in range(world)]


def collate(seqs, device, packed):
    """Turn sequences (dicts of equal-length per-token lists or arrays) into a micro-batch of tensors
    (ints as int64, floats as float32) plus "seg", the attention mask. packed=True: one row (1, N),
    sequences told apart by segment ids 1, 2, ... (flash-attn's varlen kernel does no work across them).
    packed=False: a right-padded (n, Lmax) batch with a 0/1 mask — cheaper for SDPA, whose attention over
    one long packed row would cost O(N²). An empty bin becomes a single zero token (it still joins the
    FSDP collectives)."""
    if not seqs:
        # RL's keys
        seqs = [{"ids": [0], "tgt": [0], "mask": [0], "adv": [0.0], "engine_logprobs": [0.0], "traj_index": [0]}]
    lengths = [len(s["ids"]) for s in seqs]
    cols = {k: [np.asarray(s[k]) for s in seqs] for k in seqs[0]}
    if packed:
        out = {k: np.concatenate(v)[None] for k, v in cols.items()}
        out["seg"] = np.repeat(np.arange(1, len(seqs) + 1), lengths)[None]
    else:
        width = max(lengths)
        out = {k: np.stack([np.pad(x, (0, width - len(x))) for x in v]) for k, v in cols.items()}
        out["seg"] = (np.arange(width)[None] < np.array(lengths)[:, None]).astype(np.int64)
    return {k: torch.from_numpy(v).to(device, torch.float32 if v.dtype.kind == "f" else torch.long)
            for k, v in out.items()}

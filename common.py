"""
Shared plumbing for the entry scripts: torchrun init, printing on rank 0, the step logger, jsonl files and
token-balanced packing. It imports nothing of the project; the checkpoints are checkpoint.py's.
"""
import datetime
import heapq
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist


_cpu_group = None  # a gloo group next to nccl's: Python objects cross ranks over it (see cpu_group)


def compute_init(seed=0, timeout_s=1800):
    """torchrun env vars -> (rank, world, device). gloo on CPU, nccl (RCCL on ROCm) on GPU.
    timeout_s bounds every collective: a rank that waits longer for the others (one of them crashed, hangs,
    or was stopped) raises instead of waiting forever, and torchrun ends the job. It must cover the longest
    honest wait, the spread between the first and the last rank to finish a rollout phase: `python
    simulate.py` puts it at 36-88 s in stage-1 training with claiming (170-179 s with a static split), and
    a review estimated 206-352 s for AIME eval at 30K tokens (not simulated); 30 min is 5x that."""
    global _cpu_group
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                device_id=device if cuda else None)
        if cuda:  # pickled objects would otherwise travel through GPU memory
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
        if os.environ.get("LOCAL_RANK", "0") == "0":
            snapshot_download(path)
        barrier()
        return snapshot_download(path, local_files_only=True)
    except Exception as e:
        why = ("not a valid Hub id" if type(e).__name__ == "HFValidationError"
               else (str(e).splitlines() or [""])[0])
        raise SystemExit(f"config error: {key}={path!r} is no directory, nor a Hugging Face Hub "
                         f"model that resolves: {why}")


def print0(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs, flush=True)


class Logger:
    """One JSON line per step in run_dir/metrics.jsonl, forwarded to wandb only if asked.
    On ranks other than 0 every call is a no-op, so call sites never branch. A run resumed from the
    checkpoint of step `resume_step` keeps the rows up to that step only: the steps after it are about
    to be run again, and each step has one row."""

    def __init__(self, run_dir, wandb_project="", config=None, rank=0, resume_step=None):
        self.active = rank == 0
        self.wandb = None  # wandb: only when a project is named
        if not self.active:
            return
        path = f"{run_dir}/metrics.jsonl"
        resumed = resume_step is not None and os.path.exists(path)
        # (a crash while a row was written, the disk full, leaves it cut short: a step past the checkpoint)
        rows = read_jsonl(path, torn_end=True) if resumed else []
        # the rows kept (write_jsonl makes run_dir), then this run's appended
        write_jsonl(path, [r for r in rows if r["step"] <= resume_step])
        self.file = open(path, "a")
        if wandb_project:
            import wandb  # optional: only imported when asked for
            # wandb continues a run by its id alone: a run keeps its wandb run's id in
            # run_dir/wandb.jsonl (one row, {"id": ...}), and a resume passes it back (a new run:
            # none, wandb makes one; "allow" then starts a new run)
            id_path = f"{run_dir}/wandb.jsonl"
            run_id = read_jsonl(id_path)[0]["id"] if resumed and os.path.exists(id_path) else None
            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(run_dir),
                                    config=config, id=run_id, resume="allow")
            write_jsonl(id_path, [{"id": self.wandb.id}])

    def log(self, step, metrics):
        """metrics: {name: a number, or a tensor of one element (read here, once)}"""
        if not self.active:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)


def read_jsonl(path, required=None, torn_end=False):
    """Rows of a JSONL file (every script's data and metrics). A missing file or a bad line raises
    ValueError 'path:line: what is wrong'. `required`: the columns every row must have and their types, a
    dict (a task's COLUMNS); or a function of the row that gives them (a row that names its task needs that
    task's columns). A text column must not be blank. torn_end=True: a last line cut short (not JSON, no
    newline: its writer was stopped mid-row) ends the rows instead (a run's own metrics.jsonl)."""
    rows = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            # bytes, decoded line by line: a line that is not UTF-8 is named by its line number too
            try:
                row = json.loads(line)
            except ValueError as e:
                if torn_end and not line.endswith(b"\n"):
                    break
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, "
                                 f"got {type(row).__name__}")
            # (a row that names its task: that task file missing, or not a task, is this line's error)
            try:
                columns = required(row) if callable(required) else required or {}
            except (OSError, ValueError, ImportError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            for key, kind in columns.items():
                if key not in row:
                    raise ValueError(f"{path}:{lineno}: missing field {key!r}")
                if not isinstance(row[key], kind):
                    raise ValueError(f"{path}:{lineno}: field {key!r} must be {kind.__name__}, "
                                     f"got {type(row[key]).__name__}")
                # a blank text is no question or label (the math task matched a blank one to \boxed{%})
                if kind is str and not row[key].strip():
                    raise ValueError(f"{path}:{lineno}: field {key!r} is empty")
            rows.append(row)
    return rows


def write_jsonl(path, rows):
    """Write rows to path whole or not at all: into path.tmp, renamed over path once complete, so a run
    killed mid-write (or out of disk) leaves the earlier file as it was (a resume's metrics.jsonl, its
    history)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(f"{path}.tmp", path)


def barrier():
    if dist.is_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# token-balanced packing, shared by SFT and RL

def _longest_first(lengths, max_tokens):
    # the sequences' indices, longest first; one longer than max_tokens fits no bin: ValueError naming it
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if order and lengths[order[0]] > max_tokens:
        raise ValueError(f"sequence {order[0]} has {lengths[order[0]]} tokens, "
                         f"more than max_tokens_per_micro={max_tokens}")
    return order


def pack(lengths, max_tokens, world=1):
    """Split sequences into world × M bins of at most max_tokens tokens (M the same on every rank, so
    all ranks run the same number of forward/backward passes): longest first into the emptiest bin
    (a heap: O(n log n)). Every rank computes the same bins from the same lengths; bin j belongs to rank
    j % world. A sequence longer than max_tokens fits no bin: ValueError."""
    order = _longest_first(lengths, max_tokens)
    m = max(1, -(-sum(lengths) // (world * max_tokens)))
    while True:
        bins = [[] for _ in range(world * m)]
        heap = [(0, j) for j in range(world * m)]  # (tokens in bin j, j)
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
    order = _longest_first(lengths, max_tokens)
    # deal: in each round of `world` sequences, every other round runs backwards
    runs = [[] for _ in range(world)]
    for k, i in enumerate(order):
        turn = k % world
        runs[world - 1 - turn if k // world % 2 else turn].append(i)
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
    m = max(1, *map(len, per_rank))
    return [per_rank[r][j] if j < len(per_rank[r]) else [] for j in range(m) for r in range(world)]


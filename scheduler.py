"""
Load balancing of rollout requests across ranks (the paper's §3.2), and what crosses ranks afterwards.

Give each inference engine only as much work as its free KV cache holds, and hand it more the moment
memory frees. Every rank runs one rollout.Engine; whenever its free pages (less what its running rows
were promised) cover another request, it *claims* the next requests from one shared queue. The queue
is just an atomic counter in torch.distributed's c10d store (`store.add` is atomic), over a request
list every rank builds identically from the data — no extra service to start. A fast rank simply
claims more.

`static` mode is the baseline (verl v0.2): request i goes to rank i % world up front, whatever
happens later.

After generation each rank holds the trajectories it generated, and only those. What every rank needs
of every trajectory (GRPO-RoC works on whole groups; the metrics count everything) is its Summary: the
grade, turns, finish, tool-call statuses and lengths, ~100 bytes, gathered by `gather`. The tokens of a
trajectory go to one rank only, the one that trains it (`exchange`), as compact arrays (13 bytes a
token: int32 ids, uint8 mask, float32 log-probs; the Python lists took ~77). At the paper's scale
(16,384 trajectories of ~4.6K tokens on 64 ranks) a rank then moves ~1.6 MB of summaries and ~15 MB of
tokens a step instead of unpickling 5.4 GiB of every rank's lists (`python bench.py scale` measures
both). Both travel over a gloo group (common.cpu_group), through host memory.

How these policies behave at 64-GPU scale: `python simulate.py`.
"""
import pickle
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from common import cpu_group
from rollout import iter_claim


def make_claim(requests, mode, counter):
    """A claim(n) function for rollout.Engine.run over the global request list (same on every rank; any
    sequence that slices, e.g. a Lazy one). counter names this generation's claim counter in the store:
    every rank passes the same name, and no two generations of one process group share one (f"rl/{step}")."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return iter_claim(requests)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "static":  # (a Lazy view: the requests are still made only when claimed)
        return iter_claim(Lazy(len(range(rank, len(requests), world)), lambda j: requests[rank + j * world]))
    assert mode == "dynamic", f"unknown rollout_split {mode!r} (dynamic | static)"
    store = dist.distributed_c10d._get_default_store()
    counter, exhausted = f"rollout_claim/{counter}", False

    def claim(n):
        nonlocal exhausted
        if exhausted:
            return []
        end = store.add(counter, n)  # atomic: the half-open range [end - n, end) is ours alone
        out = requests[end - n:end]
        exhausted = end >= len(requests)
        return out
    return claim


class Lazy:
    """A sequence of n items made on demand by make(i), e.g. Requests: a rank builds only the requests it
    claims, so memory does not grow with the data file."""

    def __init__(self, n, make):
        self.n, self.make = n, make

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.make(j) for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.make(i % self.n)


def generate(engine, requests, budget, mode="dynamic", on_finish=None, *, counter, keep=True):
    """Generate every request exactly once across all ranks; returns the trajectories this rank generated,
    ordered by request key (keep=False: none, on_finish has seen them). counter: see make_claim."""
    return sorted(engine.run(make_claim(requests, mode, counter), budget, on_finish, keep=keep), key=lambda t: t.key)


@dataclass
class Summary:
    """What every rank needs to know of a trajectory, without its tokens."""
    key: tuple
    meta: dict  # the request's meta and the grade (reward, answers, pred)
    turns: int
    finish: str
    calls: list  # one status per tool call (agent.TOOL_ERRORS are the failures)
    n_prompt: int
    n_response: int  # tokens after the prompt, tool responses included
    n_sampled: int  # tokens the policy sampled (mask 1)
    call_tools: list = field(default_factory=list)  # the tool each call named ("" when it did not parse)
    rl: dict = field(default_factory=dict)  # what GRPO-RoC decided: penalty, advantage (kept)


def summarize(t):
    return Summary(t.key, t.meta, t.turns, t.finish, [c["status"] for c in t.tool_calls], len(t.prompt_ids),
                   len(t.response_ids), sum(t.mask), call_tools=[c.get("tool", "") for c in t.tool_calls])


def gather(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank (one process: [obj])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out


def gather_summaries(trajs):
    """The Summary of every trajectory of every rank, ordered by key, on every rank."""
    return sorted((s for part in gather([summarize(t) for t in trajs]) for s in part), key=lambda s: s.key)


def compact(t):
    """A trajectory's tokens as arrays (13 bytes a token)."""
    return (t.key, np.asarray(t.prompt_ids, np.int32), np.asarray(t.response_ids, np.int32),
            np.asarray(t.mask, np.uint8), np.asarray(t.logprobs, np.float32))


def exchange(trajs, dest):
    """Send each of this rank's trajectories whose key is in dest to rank dest[key], compacted; returns
    {key: (key, prompt_ids, response_ids, mask, logprobs)} of those sent here, from every rank. One
    all-to-all of pickled bytes over the gloo group: each rank sends and receives only its own share."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = [[] for _ in range(world)]
    for t in trajs:
        if t.key in dest:
            out[dest[t.key]].append(compact(t))
    if world == 1:
        return {c[0]: c for c in out[0]}
    send = [np.frombuffer(pickle.dumps(o, protocol=5), np.uint8) for o in out]
    sizes = torch.tensor([len(b) for b in send])
    recv_sizes = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes, sizes, group=cpu_group())
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, torch.from_numpy(np.concatenate(send)), recv_sizes.tolist(), sizes.tolist(),
                           group=cpu_group())
    buf, got, at = recv.numpy(), {}, 0
    for n in recv_sizes.tolist():
        got.update((c[0], c) for c in pickle.loads(buf[at:at + n]))
        at += n
    return got

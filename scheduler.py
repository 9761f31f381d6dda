"""
Load balancing of rollout requests across ranks: the paper's §3.2.

Give each inference engine only as much work as its free KV cache holds, and hand it more the moment
memory frees. Every rank runs one rollout.Engine; whenever its free pages (less what its running rows
were promised) cover another request, it *claims* the next requests from one shared queue. The queue
is just an atomic counter in torch.distributed's c10d store (`store.add` is atomic), over a request
list every rank builds identically from the data — no extra service to start. A fast rank simply
claims more.

`static` mode is the baseline (verl v0.2): request i goes to rank i % world up front, whatever
happens later.

After generation every rank gathers all trajectories (GRPO-RoC needs whole groups).

How these policies behave at 64-GPU scale: `python simulate.py`.
"""
import torch.distributed as dist

from rollout import iter_claim


def make_claim(requests, mode, key):
    """A claim(n) function for rollout.Engine.run over the global request list (same on every rank).
    key names this generation's counter in the store: every rank passes the same key, and no two
    generations of one process group share one (e.g. f"rl/{step}")."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return iter_claim(requests)
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "static":
        return iter_claim(requests[rank::world])
    assert mode == "dynamic", f"unknown scheduler mode {mode!r} (dynamic | static)"
    store = dist.distributed_c10d._get_default_store()
    counter, exhausted = f"rollout_claim/{key}", False

    def claim(n):
        nonlocal exhausted
        if exhausted:
            return []
        end = store.add(counter, n)  # atomic: the half-open range [end - n, end) is ours alone
        out = requests[end - n:end]
        exhausted = end >= len(requests)
        return out
    return claim


def generate_all(engine, requests, budget, mode="dynamic", on_finish=None, *, key):
    """Generate every request exactly once across all ranks; every rank returns all trajectories,
    ordered by request key. Also returns how many this rank generated. key: see make_claim."""
    mine = engine.run(make_claim(requests, mode, key), budget, on_finish)
    everything = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
    trajs = sorted((t for part in everything for t in part), key=lambda t: t.key)
    return trajs, len(mine)

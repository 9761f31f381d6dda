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
(16,384 trajectories of ~4.6K tokens on 64 ranks) a rank then moves ~1.8 MB of summaries and ~15 MB of
tokens a step instead of unpickling 5.4 GiB of every rank's lists (`python bench.py scale` measures
both). Both travel over a gloo group (common.cpu_group), through host memory.

How these policies behave at 64-GPU scale: `python simulate.py`.
"""
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

import agent
from common import cpu_group
from rollout import iter_claim


def make_claim(requests, mode, counter):
    """A claim(n) function for rollout.Engine.run over the global request list (same on every rank; any
    sequence that slices, e.g. a Lazy one). counter names this generation's claim counter in the store:
    every rank passes the same name, and no two generations of one process group share one (f"rl/{step}")."""
    world = world_size()
    if world == 1:
        return iter_claim(requests)
    rank = dist.get_rank()
    if mode == "static":
        # a generator: the requests are still made only when claimed
        return iter_claim(requests[index] for index in range(rank, len(requests), world))
    assert mode == "dynamic", f"unknown rollout_split {mode!r} (dynamic | static)"
    store = dist.distributed_c10d._get_default_store()
    counter = f"rollout_claim/{counter}"

    def claim(n):
        # atomic: the half-open range [end - n, end) is ours alone; past the end of the list it holds nothing,
        # an empty claim, and the engine claims no more
        end = store.add(counter, n)
        return requests[end - n:end]
    return claim


@dataclass
class Lazy:
    """A sequence of n items made on demand by make(i), e.g. Requests: a rank builds only the requests it
    claims, so memory does not grow with the data file."""
    n: int
    make: Callable  # i -> item i

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        # range(n) does the index arithmetic: a slice's items, a negative index, the IndexError past the end
        if isinstance(i, slice):
            return [self.make(j) for j in range(self.n)[i]]
        return self.make(range(self.n)[i])


def generate(engine, requests, budget, mode="dynamic", on_finish=None, *, counter, keep=True):
    """Generate every request exactly once across all ranks; returns the trajectories this rank generated,
    ordered by request key (keep=False: none, on_finish has seen them). counter: see make_claim. A deterministic
    engine always splits statically: which rank generates a request must not depend on timing."""
    claim = make_claim(requests, "static" if engine.deterministic else mode, counter)
    return sorted(engine.run(claim, budget, on_finish, keep=keep), key=lambda t: t.key)


@dataclass
class Summary:
    """One trajectory as every rank knows it, without its tokens (~100 bytes): the request, how it ended, its
    tool calls, its grade and, in training, what GRPO-RoC decided about it. The one record of a trajectory that
    the metrics, RoC and the dumps read."""
    key: tuple  # (step, group, sample)
    problem: int  # the data row it answers
    turns: int
    finish: str
    call_statuses: list  # one status per tool call (agent.TOOL_ERRORS are the failures)
    call_tools: list  # the tool each call named ("" when it did not parse or named no known tool)
    # per call: "unparsed", "unknown_tool", "repeat" (the previous call again), or ""
    call_faults: list
    n_prompt: int
    n_response: int  # tokens after the prompt, tool responses included
    n_sampled: int  # tokens the policy sampled (mask 1)
    # the grade (grading.Grader.grade)
    reward: float
    correct: bool  # the task's verdict, what avg@k and the metrics count
    n_answers: int  # <answer> blocks in what the policy sampled (RoC's p_format)
    pred: object  # the task's prediction; None: no answer
    # what maj@k groups it by (eval.py): its pred, or what its task's vote(row, pred, trajectory) says
    # (grading.Grader.grade); None: no vote
    vote: object
    # what GRPO-RoC decided (train_rl.py): the penalty of every sample of a group it saw; the advantage of the kept
    penalty: float = None
    advantage: float = None
    kept: bool = False


def summarize(trajectory, grade):
    """The Summary of a trajectory, graded `grade` (a grading.Grade)."""
    calls = trajectory.tool_calls
    return Summary(trajectory.key, trajectory.meta["problem"], trajectory.turns, trajectory.finish,
                   [call.status for call in calls],
                   [call.tool for call in calls],
                   agent.call_faults(calls),
                   len(trajectory.prompt_ids), len(trajectory.response_ids), sum(trajectory.mask),
                   # the grade's fields, by name: reward, correct, n_answers, pred, vote
                   **asdict(grade))


def rollout_metrics(summaries, tool_names=()):
    """What train_rl.py logs each step and eval.py reports of the rollouts, one name each: rollout/ (length, how
    they ended, turns) and tool/ (calls per trajectory; the share that failed, in all and in correct trajectories;
    the tool-format health: the share of calls that did not parse, named no tool of the table, or repeated the call
    before; per tool in tool_names, its calls per trajectory and their failed share). Over every summary given
    (in training: all 2G rollouts of the step, before RoC keeps G). The failed shares are
    agent.failed_share's: a call answered "overloaded" (our infrastructure) counts on neither side, as in
    p_err (grpo_roc.penalty)."""
    count = len(summaries)
    calls = [status for summary in summaries for status in summary.call_statuses]
    faults = [fault for summary in summaries for fault in summary.call_faults]
    metrics = {
        "rollout/response_len": sum(summary.n_response for summary in summaries) / count,
        "rollout/truncated_frac": sum(summary.finish == "length" for summary in summaries) / count,
        "rollout/turns": sum(summary.turns for summary in summaries) / count,
        "tool/calls": len(calls) / count,
        "tool/err": agent.failed_share(calls),
        "tool/err_pos": agent.failed_share([status for summary in summaries if summary.correct
                                            for status in summary.call_statuses]),
        **{f"tool/{fault}": faults.count(fault) / max(1, len(faults))
           for fault in ("unparsed", "unknown_tool", "repeat")},
    }
    for name in tool_names:
        statuses = [status for summary in summaries
                    for status, tool in zip(summary.call_statuses, summary.call_tools)
                    if tool == name]
        metrics[f"tool/calls/{name}"] = len(statuses) / count
        metrics[f"tool/err/{name}"] = agent.failed_share(statuses)
    return metrics


def task_metrics(summaries, task_of):
    """The totals' reward, correct share and failed-call share, per task (task_of(summary) names it): task/<name>/."""
    metrics = {}
    for name in sorted({task_of(summary) for summary in summaries}):
        mine = [summary for summary in summaries if task_of(summary) == name]
        metrics[f"task/{name}/reward"] = sum(summary.reward for summary in mine) / len(mine)
        metrics[f"task/{name}/correct"] = sum(summary.correct for summary in mine) / len(mine)
        # the task's own tool/err
        metrics[f"task/{name}/tool_err"] = rollout_metrics(mine)["tool/err"]
    return metrics


def world_size():
    """How many ranks there are (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def gather(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank (one process: [obj])."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out


def gather_summaries(mine):
    """The Summary of every trajectory of every rank, ordered by key, on every rank (mine: this rank's
    summaries, scheduler.summarize's)."""
    return sorted((summary for part in gather(mine) for summary in part),
                  key=lambda summary: summary.key)


class Tokens(NamedTuple):
    """A trajectory's tokens as arrays, what `exchange` moves (13 bytes a token)."""
    key: tuple
    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32: everything after the prompt, tool responses included
    mask: np.ndarray  # uint8: 1 on the tokens the policy sampled (the loss reads these only)
    # float32: the engine's log-prob of each response token (0 where mask is 0)
    logprobs: np.ndarray


def compact(trajectory):
    return Tokens(trajectory.key,
                  np.asarray(trajectory.prompt_ids, np.int32),
                  np.asarray(trajectory.response_ids, np.int32),
                  np.asarray(trajectory.mask, np.uint8),
                  np.asarray(trajectory.logprobs, np.float32))


def exchange(trajectories, dest):
    """Send each of this rank's trajectories whose key is in dest to rank dest[key], compacted; returns
    {key: Tokens} of those sent here, from every rank. One
    all-to-all of pickled bytes over the gloo group: each rank sends and receives only its own share."""
    world = world_size()
    out = [[] for _ in range(world)]
    for trajectory in trajectories:
        if trajectory.key in dest:
            out[dest[trajectory.key]].append(compact(trajectory))
    if world == 1:
        return {tokens.key: tokens for tokens in out[0]}
    send = [np.frombuffer(pickle.dumps(o, protocol=5), np.uint8) for o in out]
    sizes = torch.tensor([len(b) for b in send])
    recv_sizes = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes, sizes, group=cpu_group())
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, torch.from_numpy(np.concatenate(send)),
                           recv_sizes.tolist(), sizes.tolist(),
                           group=cpu_group())
    # the received bytes are every rank's pickled list, one after the other
    parts = np.split(recv.numpy(), np.cumsum(recv_sizes.numpy())[:-1])
    return {tokens.key: tokens for part in parts for tokens in pickle.loads(part)}


# -----------------------------------------------------------------------------
# the dumps: every trajectory written down by the rank that made it, the ranks' parts joined by rank 0

def dump_line(trajectory, summary, tokenizer, row, prompt, **step_keys):
    """One trajectory as one JSON line: the record of train_rl.py's rollouts/step_*.jsonl.gz and of eval.py's
    trajectories.jsonl (view.py reads both). The data row's own columns (the math task's question and answer;
    a key below wins a clash), the response in runs of one mask value, the tool calls, the grade and RoC's
    decisions (None / false in eval); step_keys: training's step and group_kind."""
    return json.dumps({
        **row,
        **step_keys,
        "group": trajectory.key[1],
        "sample": trajectory.key[2],
        "prompt": prompt,
        "segments": agent.mask_runs(tokenizer, trajectory.response_ids, trajectory.mask),
        "response_ids": trajectory.response_ids,
        "mask": trajectory.mask,
        "tool_calls": [asdict(call) for call in trajectory.tool_calls],
        "finish": summary.finish,
        "turns": summary.turns,
        "reward": summary.reward,
        "correct": summary.correct,
        "pred": summary.pred,
        "penalty": summary.penalty,
        "advantage": summary.advantage,
        "kept": summary.kept}, ensure_ascii=False) + "\n"


def join_parts(path, world):
    """Append the ranks' parts (path.0, path.1, ...) to path in rank order, then delete them: rank 0 does it
    once every rank has closed its part. Gzip members concatenate, so gzip parts join the same way."""
    with open(path, "wb") as out:
        for rank in range(world):
            with open(f"{path}.{rank}", "rb") as part:
                shutil.copyfileobj(part, out)
            os.remove(f"{path}.{rank}")

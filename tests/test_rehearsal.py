"""
The stage-1 rehearsal: train_rl.py on 2 gloo ranks with the dynamic scheduler, where a scripted policy
(tests/rehearsal.py) makes every hard case of a 64-GPU stage-1 step happen at least once. Then the
reproducibility gate: the same run on a busy CPU, and a resume from the mid-run checkpoint, must both repeat
a quiet run exactly (trajectories, tool outputs, RoC choices, weights).
"""
import contextlib
import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

import data
import zygote
from sandbox import SandboxPool


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("rehearsal")
    with SandboxPool(workers=1) as pool:
        data.prepare(str(d / "base"), 0, pool.map, data_dir=str(d / "data"), n_train=10, n_heldout=2, n_sft=40,
                     hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return d


def rehearse(d, run_dir, *extra, fault="", check=True):
    # two ranks forked by the zygote (tests/zygote.py), as torchrun would start them
    cmd = ["tests/rehearsal.py", *([f"--fault={fault}"] if fault else []), "configs/tiny_rl.py",
           f"--model_path={d}/base", f"--data_path={d}/data/train.jsonl", f"--run_dir={run_dir}",
           "--prompts_per_step=4", "--samples_per_prompt=4", "--keep_per_prompt=2", "--max_response_tokens=128",
           "--max_turns=2", "--max_calls_per_turn=1", "--tool_timeout=1.0", "--tool_workers=2", "--lr=1e-3",
           "--warmup_steps=1", "--save_every=2", "--dump_every=1", "--rollout_split=dynamic",
           "--deterministic=false", *extra]
    p = zygote.run(cmd, timeout=300, ranks=2)
    assert p.returncode == 0 or not check, p.stdout[-3000:] + p.stderr[-5000:]
    return p


@contextlib.contextmanager
def busy(n):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def records(run_dir, step):
    # each rank writes its own trajectories: the dump is in rank order, (group, sample) order after a sort
    with gzip.open(os.path.join(run_dir, "rollouts", f"step_{step:06d}.jsonl.gz"), "rt") as f:
        return sorted((json.loads(line) for line in f), key=lambda r: (r["group"], r["sample"]))


def without_durations(rows):
    # how long a call ran is the machine's business, not the trajectory's
    return [dict(r, tool_calls=[{k: v for k, v in c.items() if k != "duration"} for c in r["tool_calls"]])
            for r in rows]


def digest(path):
    w = load_file(os.path.join(path, "model.safetensors"))
    return hashlib.sha256(b"".join(w[k].numpy().tobytes() for k in sorted(w))).hexdigest()


def test_stage1_rehearsal_every_hard_case(tiny, tmp_path):
    a = tmp_path / "a"
    rehearse(tiny, a, "--steps=4")
    metrics = [json.loads(line) for line in open(a / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # training ended
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m

    step1 = records(a, 1)
    assert len(step1) == 16
    by = {(r["group"], r["sample"]): r for r in step1}
    # the budget ran out inside the first turn (no turn ever ended) and in a later one
    assert by[1, 0]["finish"] == "length" and by[1, 0]["turns"] == 0
    assert by[2, 2]["finish"] == "length" and by[2, 2]["turns"] == 1
    assert by[1, 3]["finish"] == "max_turns"
    statuses = {c["status"] for r in step1 for c in r["tool_calls"]}
    assert {"ok", "invalid", "error", "timeout"} <= statuses, statuses
    # two calls in one turn with max_calls_per_turn=1: one runs, the other is dropped, as the release does
    assert by[2, 0]["segments"][0][0].count("<tool_call>") == 2 and len(by[2, 0]["tool_calls"]) == 1
    assert by[2, 0]["reward"] == 1.0
    assert [by[g, 0]["group_kind"] for g in range(3)] == ["all_correct", "all_wrong", "mixed"]
    # a truncated rollout scores 0 without being read, and only the mixed groups reach RoC
    assert all(r["reward"] == 0 for r in step1 if r["finish"] == "length")
    assert all((r["penalty"] is None) == (r["group_kind"] != "mixed") for r in step1)
    assert sum(r["kept"] for r in step1) == metrics[0]["roc/kept"] > 0
    # step 3: every group is all correct, so nothing is kept and the weights stay as they are
    assert metrics[2]["roc/kept"] == 0 and metrics[2]["roc/groups_all_right"] == 1.0 and metrics[2]["loss/grad_norm"] == 0.0
    assert metrics[1]["loss/grad_norm"] > 0 and metrics[3]["loss/grad_norm"] > 0

    # the data stream: a permutation per epoch (10 problems, 4 a step), reshuffled for the next epoch
    questions = [r["question"] for step in (1, 2, 3, 4) for r in records(a, step) if r["sample"] == 0]
    every = {json.loads(line)["question"] for line in open(tiny / "data" / "train.jsonl")}
    assert set(questions[:10]) == every and questions[10:16] != questions[:6]
    # a later stage starting from a checkpoint goes on with the stream instead of replaying it
    out = rehearse(tiny, tmp_path / "stage2", "--steps=1", f"--model_path={a}/step_000004")
    assert "data stream continued" in out.stdout
    assert {r["question"] for r in records(tmp_path / "stage2", 1)} == every - set(questions[10:16])



def listing(run_dir):
    return sorted(p for p in os.listdir(run_dir) if p.startswith("step_"))


def test_reproducibility_gate_and_a_killed_save(tiny, tmp_path):
    """deterministic=true: a quiet run, the same run on a busy CPU (tool answers arrive at other moments), and
    one whose rank 0 is killed in the middle of step 3's checkpoint save and then resumed give the same
    trajectories, tool outputs, RoC choices and weights, bit for bit. (Without it the engine overlaps tools
    with decoding, so which rows share a forward depends on timing, and a CPU matmul over a few rows rounds
    differently from one over many.) Checkpoints every step, sharded (HF weights only at the end), the newest
    2 kept; a killed save, or one failing for a full disk, leaves only a .tmp directory, never a checkpoint,
    and the resume takes step 2, with one metrics row per step."""
    args = ("--steps=4", "--deterministic=true", "--save_every=1", "--keep_checkpoints=2")
    runs = {name: tmp_path / name for name in ("quiet", "busy", "killed", "enospc")}
    rehearse(tiny, runs["quiet"], *args)
    assert listing(runs["quiet"]) == ["step_000003", "step_000004"]  # rotation: the newest two
    assert os.path.exists(runs["quiet"] / "step_000004" / "model.safetensors")
    assert not os.path.exists(runs["quiet"] / "step_000003" / "model.safetensors")
    with busy(2):
        rehearse(tiny, runs["busy"], *args)
    for fault in ("killed", "enospc"):
        p = rehearse(tiny, runs[fault], *args, fault={"killed": "kill:3", "enospc": "enospc:3"}[fault], check=False)
        assert p.returncode != 0
        assert listing(runs[fault]) == ["step_000001", "step_000002", "step_000003.tmp"], listing(runs[fault])
    # (resuming the full-disk run would repeat the killed run's resume: the same directory state)
    out = rehearse(tiny, runs["killed"], *args, "--resume=true")
    assert f"resumed from {runs['killed']}/step_000002 at step 2" in out.stdout
    assert listing(runs["killed"]) == ["step_000003", "step_000004"]
    assert [json.loads(line)["step"] for line in open(runs["killed"] / "metrics.jsonl")] == [1, 2, 3, 4]
    for name, steps in (("busy", (1, 2, 3, 4)), ("killed", (3, 4))):
        for step in steps:
            assert without_durations(records(runs[name], step)) == without_durations(records(runs["quiet"], step))
        assert digest(runs[name] / "step_000004") == digest(runs["quiet"] / "step_000004"), name


def test_a_stopped_rank_ends_the_run_within_the_timeout(tiny, tmp_path):
    """Rank 1 stops itself (SIGSTOP) as step 2 begins; rank 0 waits at the post-rollout gather until
    dist_timeout_s, then the run ends (gloo's own default would wait 30 minutes)."""
    t0 = time.monotonic()
    p = rehearse(tiny, tmp_path / "s", "--steps=3", "--dist_timeout_s=20", fault="stop:2", check=False)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 150, time.monotonic() - t0  # start-up, step 1, the 20 s wait, the end
    assert [json.loads(line)["step"] for line in open(tmp_path / "s" / "metrics.jsonl")] == [1]


def test_more_mini_batches_than_kept_trajectories(tiny, tmp_path):
    # step 1 keeps 1-2 groups of 2: five mini-batches leave some empty, which are skipped on every rank
    out = rehearse(tiny, tmp_path / "m", "--steps=1", "--mini_batches=5")
    assert "step 0001/1" in out.stdout

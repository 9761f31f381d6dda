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

import pytest
from safetensors.torch import load_file

import data
from sandbox import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("rehearsal")
    with SandboxPool(workers=1) as pool:
        data.prepare(str(d / "base"), 0, pool.map, data_dir=str(d / "data"), n_train=10, n_heldout=2, n_sft=40,
                     hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return d


def rehearse(d, run_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/rehearsal.py",
           "configs/tiny_rl.py", f"--model_path={d}/base", f"--data_path={d}/data/train.jsonl", f"--run_dir={run_dir}",
           "--prompts_per_step=4", "--samples_per_prompt=4", "--keep_per_prompt=2", "--max_response_tokens=128",
           "--max_turns=2", "--max_calls_per_turn=1", "--tool_timeout=1.0", "--tool_workers=2", "--lr=1e-3",
           "--warmup_steps=1", "--save_every=2", "--dump_every=1", "--scheduler=dynamic", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
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
    with gzip.open(os.path.join(run_dir, "rollouts", f"step_{step:06d}.jsonl.gz"), "rt") as f:
        return [json.loads(line) for line in f]


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
    assert sum(r["kept"] for r in step1) == metrics[0]["kept"] > 0
    # step 3: every group is all correct, so nothing is kept and the weights stay as they are
    assert metrics[2]["kept"] == 0 and metrics[2]["groups_all_right"] == 1.0 and metrics[2]["grad_norm"] == 0.0
    assert metrics[1]["grad_norm"] > 0 and metrics[3]["grad_norm"] > 0

    # the data stream: a permutation per epoch (10 problems, 4 a step), reshuffled for the next epoch
    questions = [r["question"] for step in (1, 2, 3, 4) for r in records(a, step) if r["sample"] == 0]
    every = {json.loads(line)["question"] for line in open(tiny / "data" / "train.jsonl")}
    assert set(questions[:10]) == every and questions[10:16] != questions[:6]
    # a later stage starting from a checkpoint goes on with the stream instead of replaying it
    out = rehearse(tiny, tmp_path / "stage2", "--steps=1", f"--model_path={a}/step_000004")
    assert "data stream continued" in out.stdout
    assert {r["question"] for r in records(tmp_path / "stage2", 1)} == every - set(questions[10:16])



def test_reproducibility_gate(tiny, tmp_path):
    """deterministic=true: a quiet run, the same run on a busy CPU (tool answers arrive at other moments) and
    one stopped after step 2 and resumed give the same trajectories, tool outputs, RoC choices and weights,
    bit for bit. (Without it the engine overlaps tools with decoding, so which rows share a forward depends
    on timing, and a CPU matmul over a few rows rounds differently from one over many.)"""
    runs = {name: tmp_path / name for name in ("quiet", "busy", "resumed")}
    rehearse(tiny, runs["quiet"], "--steps=3", "--deterministic=true")
    with busy(2):
        rehearse(tiny, runs["busy"], "--steps=3", "--deterministic=true")
    rehearse(tiny, runs["resumed"], "--steps=2", "--deterministic=true")
    out = rehearse(tiny, runs["resumed"], "--steps=3", "--deterministic=true", "--resume=true")
    assert "resumed from" in out.stdout
    for name in ("busy", "resumed"):
        for step in (1, 2, 3) if name == "busy" else (3,):
            assert without_durations(records(runs[name], step)) == without_durations(records(runs["quiet"], step))
        assert digest(runs[name] / "step_000003") == digest(runs["quiet"] / "step_000003"), name

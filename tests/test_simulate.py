"""Tests for the rollout-scheduling simulator (`python simulate.py`): the
invariants of both policies at small scale, the closed-form event jumps against a plain step-by-step
loop written here, and the fitted length distribution against numpy samples."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from simulate import SIM_PARAMS, kv_capacity, lognormal_fit, sim_params, sim_workload, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(60)  # a simulator that stops making progress fails fast

SMALL = dict(engines=4, prompts=16, samples=8)  # 512 rollouts, 128 per engine under static
TIGHT = 20000  # KV tokens per engine: two reservations of prompt + 8K budget, far below 128 rollouts' needs


@pytest.mark.parametrize("policy", ["static", "dynamic"])
@pytest.mark.parametrize("sync", [True, False])
def test_every_rollout_completes_once(policy, sync):
    for kv in (TIGHT, 0):  # tight and the default (ample) memory
        r = simulate(policy, {**SMALL, "kv_tokens": kv, "static_sync_tools": sync}, seed=1)
        assert r["completions"].shape == (16 * 8,)
        assert (r["completions"] == 1).all()
        # every planned model token is generated exactly once; evicted rows are recomputed, not regenerated
        assert r["generated_tokens"] == r["planned_tokens"] == sim_workload(sim_params(SMALL), 1)["model"].sum()
        assert r["peak_kv_tokens"] <= r["kv_tokens"]  # static stays inside by evicting
        assert r["makespan_s"] > 0 and 0 <= r["idle_pct"] < 100


def test_dynamic_never_overflows_or_evicts():
    for kv in (TIGHT, 3 * TIGHT, 0):
        r = simulate("dynamic", {**SMALL, "kv_tokens": kv}, seed=2)
        assert r["peak_kv_tokens"] <= r["kv_tokens"]
        assert r["evictions"] == r["evicted_rows"] == r["recomputed_tokens"] == 0


def test_static_with_too_little_kv_evicts_and_recomputes():
    for sync in (True, False):
        r = simulate("static", {**SMALL, "kv_tokens": TIGHT, "static_sync_tools": sync}, seed=3)
        assert r["evictions"] > 0 and r["evicted_rows"] >= r["evictions"]
        assert r["recomputed_tokens"] > 0
        # recomputation is prefill work on top of prompts and tool responses
        assert r["prefill_tokens"] > r["recomputed_tokens"]


def test_ample_kv_zero_latency_same_tokens():
    p = {**SMALL, "tool_latency_mean": 0.0}
    static, dynamic = simulate("static", p, seed=4), simulate("dynamic", p, seed=4)
    assert static["evictions"] == 0
    planned = sim_workload(sim_params(p), 4)["model"].sum()
    assert static["generated_tokens"] == dynamic["generated_tokens"] == planned


def test_deterministic_and_seeded():
    a, b = simulate("dynamic", SMALL, seed=5), simulate("dynamic", SMALL, seed=5)
    assert a["makespan_s"] == b["makespan_s"] and (a["completions"] == b["completions"]).all()
    assert simulate("dynamic", SMALL, seed=6)["makespan_s"] != a["makespan_s"]


def reference_one_engine(p, seed, sync=False):
    """One engine with room for every rollout, advanced one decode step at a time (no closed-form jumps):
    the cost model of simulate()'s docstring written out plainly. sync: tool calls wait for every
    rollout to end its turn, then all resume when the slowest returns (static_sync_tools)."""
    w = sim_workload(p, seed)
    n = len(w["plen"])
    bw, flops = p["efficiency"] * p["hbm_bandwidth"], p["efficiency"] * p["peak_flops"]
    per_token = 2 * p["n_params"] / flops
    ctx = w["plen"].astype(float)
    t = w["plen"][0] * per_token  # one prompt: its samples share one prefill
    turn, left = [0] * n, list(w["model"][:, 0])
    state, back = ["decode"] * n, [0.0] * n
    while any(s != "done" for s in state):
        for i in sorted((i for i in range(n) if state[i] == "tool" and back[i] <= t), key=lambda i: back[i]):
            if turn[i] == w["turns"][i] - 1:
                state[i] = "done"
                continue
            r = w["tool"][i, turn[i]]
            t += r * per_token
            ctx[i] += r
            turn[i] += 1
            left[i], state[i] = w["model"][i, turn[i]], "decode"
        rows = [i for i in range(n) if state[i] == "decode"]
        if not rows:
            waiting = [back[i] for i in range(n) if state[i] == "tool"]
            if waiting:
                t = max(t, min(waiting))
            else:  # everyone is at the barrier
                batch = [i for i in range(n) if state[i] == "barrier"]
                for i in batch:
                    state[i], back[i] = "tool", t + max(w["lat"][j, turn[j]] for j in batch)
            continue
        t += (2 * p["n_params"] + ctx[rows].sum() * p["kv_bytes_per_token"]) / bw + p["step_overhead"]
        for i in rows:
            ctx[i] += 1
            left[i] -= 1
            if left[i] == 0:
                if turn[i] == w["turns"][i] - 1 and not w["last_call"][i]:
                    state[i] = "done"
                elif sync:
                    state[i] = "barrier"
                else:
                    state[i], back[i] = "tool", t + w["lat"][i, turn[i]]
    return t


@pytest.mark.parametrize("seed", range(4))
def test_event_jumps_match_a_step_by_step_loop(seed):
    # short rollouts with several tool calls each, 3 rows batched on one engine
    p = sim_params(dict(engines=1, prompts=1, samples=3, resp_mean=600.0, resp_sigma=0.5, calls_mean=3.0,
                        budget=1024, tool_latency_mean=0.5))
    w = sim_workload(p, seed)
    assert w["turns"].max() >= 2  # the case exercises tool calls
    r = simulate("dynamic", p, seed)
    assert r["makespan_s"] == pytest.approx(reference_one_engine(p, seed), rel=1e-9)
    assert r["decode_steps"] >= w["model"].sum(1).max()  # a batch step serves all rows at once
    # static on one engine with ample KV: the same rows, launched at once; with and without the barrier
    for sync in (False, True):
        r = simulate("static", {**p, "static_sync_tools": sync}, seed)
        assert r["evictions"] == 0
        assert r["makespan_s"] == pytest.approx(reference_one_engine(p, seed, sync), rel=1e-9)


def test_one_rollout_hand_computed():
    # no tools, one rollout: makespan = prefill + sum over steps of the roofline time, in closed form by hand
    p = sim_params(dict(engines=1, prompts=1, samples=1, calls_mean=0.0))
    w = sim_workload(p, 0)
    L, M = int(w["plen"][0]), int(w["model"][0, 0])
    bw = 0.5 * 5.3e12
    steps = sum((2 * 14.8e9 + (L + j) * 163840) / bw + 0.002 for j in range(M))
    expect = L * 2 * 14.8e9 / (0.5 * 1.307e15) + steps
    for policy in ("static", "dynamic"):
        r = simulate(policy, p, 0)
        assert r["makespan_s"] == pytest.approx(expect, rel=1e-9)
        assert r["idle_pct"] == pytest.approx(0, abs=1e-9)


def test_static_sync_tools_waits_for_the_slowest_call():
    # one engine, rows that all call a tool: with the barrier the step can only get slower
    p = dict(engines=1, prompts=1, samples=4, resp_mean=600.0, resp_sigma=0.5, calls_mean=3.0, budget=1024,
             tool_latency_mean=2.0)
    sync = simulate("static", {**p, "static_sync_tools": True}, 0)
    free = simulate("static", {**p, "static_sync_tools": False}, 0)
    assert sync["makespan_s"] > free["makespan_s"]
    assert free["makespan_s"] == pytest.approx(simulate("dynamic", p, 0)["makespan_s"], rel=1e-9)  # ample KV


def test_lognormal_fit_matches_samples():
    mu, sigma = lognormal_fit(4096, 8192, 0.10)
    y = np.random.default_rng(0).lognormal(mu, sigma, 1_000_000)
    # standard errors: clip fraction 3e-4, capped mean ~2.5 tokens; the bounds are > 8 of them
    assert np.mean(y > 8192) == pytest.approx(0.10, abs=3e-3)
    assert np.minimum(y, 8192).mean() == pytest.approx(4096, rel=5e-3)
    mu1, s1 = lognormal_fit(1024, 8192, 0.0, sigma=sigma)  # same shape, smaller scale
    assert s1 == sigma
    assert np.minimum(np.exp(mu1 + s1 * np.random.default_rng(1).standard_normal(1_000_000)), 8192).mean() == \
        pytest.approx(1024, rel=5e-3)


def test_default_workload_matches_the_paper_numbers():
    w = sim_workload(sim_params(dict(prompts=64)), 0)  # 2,048 rollouts
    assert abs(w["resp"].mean() - 4096) < 200  # mean ~4K incl. the cap (paper §4.4)
    assert 0.07 < w["truncated"].mean() < 0.13  # ~10% hit the 8K budget
    assert (w["resp"] <= 8192).all() and (w["turns"] <= 10).all()
    assert 2.3 < (w["turns"] - 1 + w["last_call"]).mean() < 3.0  # ~2.75 calls per rollout


def test_kv_capacity_from_qwen3_14b_on_mi300x():
    p = sim_params()
    assert SIM_PARAMS["kv_bytes_per_token"][0] == 2 * 40 * 8 * 128 * 2
    assert kv_capacity(p) == math.floor((0.88 * 192e9 - 2 * 14.8e9) / 163840)  # 850,585 tokens


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="engins"):
        simulate("dynamic", {"engins": 4})
    with pytest.raises(ValueError, match="policy"):
        simulate("fifo", SMALL)
    with pytest.raises(ValueError, match="cannot hold one rollout"):
        simulate("static", {**SMALL, "kv_tokens": 5000})
    with pytest.raises(ValueError, match="clip_frac"):
        simulate("static", {**SMALL, "resp_mean": 500.0})  # 10% at 8K alone makes the mean > 819
    for key, share in (("reserve", -1.0), ("reserve", 1.5), ("auto_prior", -0.5)):
        with pytest.raises(ValueError, match=f"{key} is a share of the budget in \\[0, 1\\], got {share}"):
            simulate("paged", {**SMALL, key: share})


@pytest.mark.parametrize("args, scenario, why", [
    (["--kv_tokens=12000"], "half the KV memory", "KV capacity 6000 tokens cannot hold one rollout"),
    (["--budget=1024", "--resp_mean=800.0"], "early stage 1: 1K mean", "resp_mean 1024.0 must lie in"),
])
def test_the_command_skips_a_scenario_its_parameters_make_impossible(args, scenario, why):
    # parameters that run (the default scenario prints) but make a derived scenario impossible: that row says
    # so and the rest still run, where a traceback ended the table
    command = [sys.executable, "simulate.py", "--engines=2", "--prompts=8", "--samples=4", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{scenario:<28} skipped: {why}" in done.stdout and done.stdout.count("skipped:") == 1
    assert "static w/o the tool barrier  static" in done.stdout


def test_the_command_refuses_a_negative_seed():
    # numpy refuses it in every scenario: each row read "skipped: expected non-negative integer"
    command = [sys.executable, "simulate.py", "--engines=2", "--prompts=8", "--samples=4", "--seed=-1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == "config error: seed must be >= 0, got -1"


def test_paged_completes_everything_within_the_kv():
    for kv in (TIGHT, 0):
        for reserve in (0.0, 0.5):
            r = simulate("paged", {**SMALL, "kv_tokens": kv, "reserve": reserve}, seed=1)
            assert (r["completions"] == 1).all()
            assert r["generated_tokens"] == r["planned_tokens"]
            assert r["peak_kv_tokens"] <= r["kv_tokens"]
    tight = simulate("paged", {**SMALL, "kv_tokens": TIGHT, "reserve": 0.0}, seed=1)
    assert tight["evictions"] > 0 and tight["recomputed_tokens"] > 0


def test_paged_with_the_whole_budget_reserved_is_dynamic():
    """reserve=1 promises every row prompt + budget: the admission rule of dynamic, and nothing to preempt"""
    for kv in (TIGHT, 3 * TIGHT):
        p = {**SMALL, "kv_tokens": kv, "reserve": 1.0}
        a, b = simulate("paged", p, seed=2), simulate("dynamic", p, seed=2)
        assert a["evictions"] == 0
        for k in ("makespan_s", "generated_tokens", "prefill_tokens", "decode_steps", "peak_kv_tokens"):
            assert a[k] == b[k], k


def test_paged_over_commits_and_uses_more_of_the_kv():
    p = {**SMALL, "kv_tokens": 3 * TIGHT}
    dynamic, paged = simulate("dynamic", p, seed=3), simulate("paged", {**p, "reserve": 0.25}, seed=3)
    assert paged["mean_batch"] > dynamic["mean_batch"]
    assert paged["steady_kv_pct"] > dynamic["steady_kv_pct"]


def test_adaptive_completes_everything_within_the_kv_and_repeats():
    for kv in (TIGHT, 3 * TIGHT, 0):
        r = simulate("adaptive", {**SMALL, "kv_tokens": kv}, seed=1)
        assert (r["completions"] == 1).all() and r["generated_tokens"] == r["planned_tokens"]
        assert r["peak_kv_tokens"] <= r["kv_tokens"]
    a, b = (simulate("adaptive", {**SMALL, "kv_tokens": TIGHT}, seed=4) for _ in range(2))
    assert a["makespan_s"] == b["makespan_s"] and a["evictions"] == b["evictions"]


def test_adaptive_runs_more_rows_when_rollouts_end_early():
    """the promise follows the run's finished rollouts: short ones (1K mean of an 8K budget) let more rows
    share the KV than the fixed reserve does; with most rollouts near the budget the gain shrinks. One
    engine, so its share of the step (max_rows) never binds before the KV does"""
    p = dict(engines=1, prompts=16, samples=8, kv_tokens=3 * TIGHT)
    gain = {}
    for name, over in (("short", dict(resp_mean=1024.0, resp_sigma=0.64)), ("long", dict(resp_mean=7000.0,
                                                                                         clip_frac=0.6))):
        a, b = simulate("adaptive", {**p, **over}, seed=3), simulate("paged", {**p, **over}, seed=3)
        assert a["steady_kv_pct"] > b["steady_kv_pct"] and a["makespan_s"] < b["makespan_s"]
        gain[name] = a["mean_batch"] / b["mean_batch"]
    assert gain["long"] < gain["short"]

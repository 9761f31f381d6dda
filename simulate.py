"""
The rollout scheduler at cluster scale, simulated: `python simulate.py [--key=value ...]`.

scheduler.py (which ranks claim which requests) and rollout.Engine (how one engine admits, decodes,
parks rows on tools, and preempts) run on one RL step of the paper's size — 64 engines x 512
prompts x 32 samples — with a documented cost model (see simulate()), to compare scheduling policies
where we cannot run them: the paper's static baseline, our dynamic claiming with whole-budget
reservations, dynamic claiming over a paged KV cache that over-commits by a fixed reserve and preempts,
and the same with the promise following what finished rollouts used (rollout.Engine(reserve="auto")).
Every parameter is written down next to its source (SIM_PARAMS) and printed with every result;
none is tuned toward a result. Standard library + numpy only; nothing here touches torch.
"""
import heapq
import math
import statistics

import numpy as np

SIM_PARAMS = {  # key: (default, source). printed with every result; never tuned toward a result
    # the step
    "engines": (64, "paper §4.3: 64 MI300X; one engine per GPU (TP 1 assumed: the paper does not say)"),
    "prompts": (512, "paper §4.3: 512 prompts per step"),
    "samples": (32, "paper §4.3: 2G = 32 rollouts per prompt"),
    "budget": (8192, "paper §4.4 stage 1: 8K response budget, model + tool tokens"),
    "max_turns": (10, "paper §4.3: T = 10 in stages 1-2"),
    # the rollouts
    "prompt_min": (200, "assumed: problem text + system prompt with the tool schema"),
    "prompt_max": (400, "assumed (uniform per prompt, shared by its samples)"),
    "resp_mean": (4096.0, "paper §4.4: stage-1 mean response grows ~1K -> ~4K; 4K = late stage 1"),
    "clip_frac": (0.10, "paper §4.4: ~10% of stage-1 rollouts hit the 8K cap"),
    "resp_sigma": (0.0, "lognormal sigma; 0 = solve mu and sigma from resp_mean and clip_frac"),
    "calls_mean": (2.75, "paper §3.1: up to 45K tool calls per step / 16,384 rollouts; Poisson, <= T-1"),
    "min_turn_tokens": (32, "assumed: a model turn holds at least a short <tool_call>"),
    "tool_tokens_min": (100, "assumed: tool response + chat glue, uniform"),
    "tool_tokens_max": (300, "assumed: agent.py truncates tool output to 1024 chars (~300 tokens)"),
    "tool_latency_mean": (0.3, "paper §3.1: mean end-to-end latency 0.3 s per call (lognormal)"),
    "tool_latency_sigma": (1.0, "assumed: the paper gives only the mean. our sandbox prototype "
                                "(p50 16 ms, p99 28 ms) is --tool_latency_mean=0.0165 --tool_latency_sigma=0.24"),
    # the accelerator and the model
    "hbm_bytes": (192e9, "MI300X: 192 GB HBM3"),
    "hbm_bandwidth": (5.3e12, "MI300X: 5.3 TB/s peak"),
    "peak_flops": (1.307e15, "MI300X: 1307 TFLOP/s bf16 dense"),
    "efficiency": (0.5, "share of both roofline bounds reached; a default until bench.py measures our "
                        "engine"),
    "step_overhead": (0.002, "assumed: fixed seconds per decode step (scheduling, sampling, launches)"),
    "n_params": (14.8e9, "Qwen3-14B: 14.8B parameters in bf16, all read once per decode step"),
    "kv_bytes_per_token": (163840, "Qwen3-14B config: 2 (k,v) x 40 layers x 8 kv heads x 128 dims x 2 B"),
    "mem_fraction_static": (0.88, "SGLang's default at TP 1: weights + KV pool share of memory; the rest "
                                  "is activations, graphs, runtime"),
    "kv_tokens": (0, "KV tokens per engine; 0 = (mem_fraction_static * hbm_bytes - weights) / "
                     "kv_bytes_per_token"),
    "reserve": (0.5, "rollout.Engine's default (docs/speed.md: why): paged admits a rollout while the KV not yet "
                     "promised holds prompt + reserve x budget"),
    "auto_prior": (0.5, "rollout.AUTO_PRIOR: adaptive counts a rollout not yet finished at this share of "
                        "the budget"),
    "static_sync_tools": (True, "paper §3.2: the static baseline runs each turn's tool calls as one "
                                "synchronous batch per engine"),
}
DECODE, TOOL, BARRIER, DONE = 0, 1, 2, 3  # phases of a simulated rollout
POLICIES = ("static", "dynamic", "paged", "adaptive")


def sim_params(overrides=None):
    """SIM_PARAMS' defaults with `overrides` applied; an unknown key or an impossible value is an error."""
    p = {k: v for k, (v, _) in SIM_PARAMS.items()}
    for k, v in (overrides or {}).items():
        if k not in p:
            raise ValueError(f"unknown simulation parameter {k!r} (known: {', '.join(p)})")
        p[k] = v
    for k in ("engines", "prompts", "samples", "budget", "max_turns", "prompt_min", "min_turn_tokens",
              "tool_tokens_min"):
        if p[k] < 1:
            raise ValueError(f"simulation parameter {k} must be >= 1, got {p[k]!r}")
    if p["prompt_max"] < p["prompt_min"] or p["tool_tokens_max"] < p["tool_tokens_min"]:
        raise ValueError("prompt_max must be >= prompt_min and tool_tokens_max >= tool_tokens_min")
    if p["tool_latency_mean"] < 0 or p["efficiency"] <= 0:
        raise ValueError("tool_latency_mean must be >= 0 and efficiency > 0")
    # shares of the budget, as rollout.Engine takes them (reserve=-1 promised a negative KV, without a word)
    for k in ("reserve", "auto_prior"):
        if not 0 <= p[k] <= 1:
            raise ValueError(f"simulation parameter {k} is a share of the budget in [0, 1], got {p[k]!r}")
    if kv_capacity(p) < p["prompt_max"] + p["budget"]:
        raise ValueError(f"KV capacity {kv_capacity(p)} tokens cannot hold one rollout (prompt_max + budget "
                         f"= {p['prompt_max'] + p['budget']}); raise kv_tokens or the memory")
    return p


def kv_capacity(p):
    """KV-cache tokens of one engine: SGLang's static pool minus the bf16 weights (or kv_tokens if set)."""
    if p["kv_tokens"]:
        return int(p["kv_tokens"])
    return int((p["mem_fraction_static"] * p["hbm_bytes"] - 2 * p["n_params"]) // p["kv_bytes_per_token"])


def lognormal_fit(mean, cap, clip_frac, sigma=0.0):
    """(mu, sigma) of a lognormal Y with E[min(Y, cap)] = mean and, unless sigma is given, P(Y > cap) =
    clip_frac. The capped mean is monotone in the one unknown, so bisection finds it."""
    nd = statistics.NormalDist()

    def capped_mean(mu, s):  # E[min(Y, cap)] in closed form
        z = (math.log(cap) - mu) / s
        return math.exp(mu + s * s / 2) * nd.cdf(z - s) + cap * (1 - nd.cdf(z))

    def solve(f, lo, hi):  # x in [lo, hi] with f(x) = mean, f monotone
        up = f(hi) > f(lo)
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (f(mid) < mean) == up else (lo, mid)
        return (lo + hi) / 2

    if sigma > 0:  # keep the shape, move the scale: the capped mean rises with mu
        if not 0 < mean < cap:
            raise ValueError(f"resp_mean {mean} must lie in (0, budget {cap})")
        return solve(lambda mu: capped_mean(mu, sigma), math.log(mean) - 10 * sigma - 10, math.log(cap)), sigma
    if not (0 < clip_frac < 1 and cap * clip_frac < mean < cap):
        raise ValueError(f"no lognormal has capped mean {mean} with {clip_frac:.0%} above {cap}: need "
                         f"0 < clip_frac < 1 and budget * clip_frac < resp_mean < budget")
    z = nd.inv_cdf(1 - clip_frac)  # ln(cap) = mu + z * sigma pins the clip fraction
    # as sigma grows the capped mean falls from cap towards cap * clip_frac
    s = solve(lambda s: capped_mean(math.log(cap) - z * s, s), 1e-6, 20.0)
    return math.log(cap) - z * s, s


def sim_workload(p, seed):
    """Every rollout's plan, drawn once from `seed` and shared by both policies (arrays over rollouts
    i = prompt * samples + sample, the order of the request list):
      plen (N,) prompt tokens; model (N, T) model tokens of each turn; tool (N, T) tool-response tokens and
      lat (N, T) seconds of the call that ends turn j; turns (N,) turns made; last_call (N,) True when the
      final turn's call was run but its answer did not fit the budget (rollout.py: finish "length");
      resp (N,) response tokens kept; truncated (N,) finished by the budget."""
    rng = np.random.default_rng(seed)
    n, T, budget, floor = p["prompts"] * p["samples"], p["max_turns"], p["budget"], p["min_turn_tokens"]
    mu, sigma = lognormal_fit(p["resp_mean"], budget, p["clip_frac"], p["resp_sigma"])
    plen = rng.integers(p["prompt_min"], p["prompt_max"] + 1, p["prompts"]).repeat(p["samples"])  # (N,)
    natural = rng.lognormal(mu, sigma, n)  # (N,) response length (model + tool tokens) before the budget cut
    ncalls = np.minimum(rng.poisson(p["calls_mean"], n), T - 1)  # (N,)
    tool = rng.integers(p["tool_tokens_min"], p["tool_tokens_max"] + 1, (n, T))  # (N, T)
    lat = np.zeros((n, T))
    if p["tool_latency_mean"] > 0:  # lognormal with the stated mean
        s = p["tool_latency_sigma"]
        lat = rng.lognormal(math.log(p["tool_latency_mean"]) - s * s / 2, s, (n, T))  # (N, T)
    model = np.zeros((n, T), dtype=np.int64)
    turns = np.zeros(n, dtype=np.int64)
    last_call = np.zeros(n, dtype=bool)
    resp = np.zeros(n, dtype=np.int64)
    for i in range(n):
        k = ncalls[i]
        while k and natural[i] - tool[i, :k].sum() < (k + 1) * floor:  # too short for its calls: fewer calls
            k -= 1
        spare = max(int(natural[i]) - int(tool[i, :k].sum()) - (k + 1) * floor, 0)
        cuts = np.sort(rng.integers(0, spare + 1, k))
        plan = np.diff(np.concatenate(([0], cuts, [spare]))) + floor  # (k+1,) model tokens per turn
        used = 0  # walk turns and calls until the budget runs out, as rollout.Engine does
        for j in range(k + 1):
            model[i, j] = min(plan[j], budget - used)
            used += model[i, j]
            turns[i] = j + 1
            if used >= budget or j == k:
                break
            if used + tool[i, j] >= budget:
                last_call[i] = True
                break
            used += tool[i, j]
        resp[i] = used
    return dict(plen=plen, model=model, tool=tool, lat=lat, turns=turns, last_call=last_call, resp=resp,
                truncated=last_call | (resp >= budget), mu=mu, sigma=sigma)


def simulate(policy, params=None, seed=0):
    """Simulate one RL step's rollouts on `engines` engines. `params`: overrides of SIM_PARAMS. Returns
    a dict of metrics (makespan_s, idle_pct, evictions, recomputed_tokens, ...).

    Cost model of one engine (one GPU, TP 1), with F = efficiency:
      decode step, B rows holding C context tokens:  (2 n_params + C kv_bytes_per_token) / (F hbm_bandwidth)
                                                     + step_overhead          (memory-bound roofline)
      prefill or recompute of n tokens:              n 2 n_params / (F peak_flops)  (compute-bound)
      KV: a row holds prompt + response-so-far tokens, also while it waits on a tool; capacity kv_capacity().
    The engine blocks while it prefills; one decode step gives every decoding row one token.

    Policies (the request list is prompt-major, as train_rl.py builds it):
      dynamic  (scheduler.make_claim "dynamic" + rollout.Engine with reserve=1): one shared queue; an engine
               claims the next request only while its free KV holds that rollout's reservation (prompt +
               budget), so it never overflows; samples of one prompt claimed together share one prefill; a
               finished rollout frees its reservation and the engine claims again at once; a turn's tool
               call runs while the other rows keep decoding.
      paged    (the same with rollout.Engine's paged KV cache, reserve < 1): an engine claims the next
               request while the KV not yet promised to its rows holds prompt + reserve x budget (a row is
               promised that much, or what it holds when more); when a decode step or a tool response does
               not fit, it preempts one row at a time — a row parked on a tool call first, else the most
               recently admitted — until it fits; a preempted row is re-admitted, before any new claim and
               in admission order, once its context + reservation fits again (or nothing else is in the
               KV) and a rollout has finished since the last preemption, by recomputing its whole
               context. (The engine also shares a prompt's pages among its samples; the simulator counts
               each sample's prompt, over-stating KV use by up to a prompt, 200-400 tokens, per rollout.)
      adaptive (paged with rollout.Engine(reserve="auto", max_rows=the rank's share)): the response share
               promised is half the mean response share of the engine's rollouts this step, a finished one
               at what it used and one still running at auto_prior (Pager.share); an engine holds at most
               ceil(rollouts / engines) rollouts at once (max_rows).
      static   (make_claim "static", the paper's verl v0.2 + SGLang baseline): request i goes to engine
               i % engines; all of them are launched at once. When a decode step or a tool response
               does not fit the KV, half of the rows in the KV are evicted and re-queued: rows parked
               between turns first (in SGLang their KV is only prefix cache, dropped before running
               requests), then those with the fewest generated tokens (SGLang's retract order). An
               evicted row recomputes its whole context when readmitted, which waits until a rollout
               finishes or nothing else can decode (else it would be evicted again at once). With
               static_sync_tools the engine runs a turn's tool calls as one batch once every rollout
               has ended the turn, and resumes them all when the slowest call returns.

    How it runs: discrete events. Between events (a turn ends, a tool call returns, the KV fills) an
    engine's batch is fixed and every row's context grows by one token per step, so the time of k steps
    has a closed form (an arithmetic series) and the engine jumps k steps at once. Engines advance in
    order of their clocks through one heap, so claims from the shared queue happen in time order.
    Deterministic for a given seed."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} ({' | '.join(POLICIES)})")
    p = sim_params(params)
    w = sim_workload(p, seed)
    plen, model, tool, lat = w["plen"], w["model"], w["tool"], w["lat"]
    turns, last_call = w["turns"], w["last_call"]
    n, E, cap, budget = len(plen), p["engines"], kv_capacity(p), p["budget"]
    pid = np.arange(n) // p["samples"]  # (N,) prompt of each rollout
    bw, flops = p["efficiency"] * p["hbm_bandwidth"], p["efficiency"] * p["peak_flops"]
    step_fixed = 2 * p["n_params"] / bw + p["step_overhead"]  # seconds per step that do not depend on context
    per_ctx = p["kv_bytes_per_token"] / bw  # seconds per context token read in a step
    per_prefill = 2 * p["n_params"] / flops  # seconds per prefilled token
    static, sync = policy == "static", policy == "static" and p["static_sync_tools"]
    paged, adaptive = policy in ("paged", "adaptive"), policy == "adaptive"
    res = int(math.ceil(p["reserve"] * budget))  # paged: response tokens promised to a row at admission
    max_rows = -(-n // E) if adaptive else n  # rows an engine holds at once

    # per-rollout state
    ctx = np.zeros(n, dtype=np.int64)  # tokens in its context (in the KV when in_kv)
    gen = np.zeros(n, dtype=np.int64)  # model tokens generated so far
    turn = np.zeros(n, dtype=np.int64)
    left = model[:, 0].copy()  # model tokens left in the current turn
    phase = np.full(n, DECODE)
    in_kv = np.zeros(n, dtype=bool)
    t_ret = np.zeros(n)  # when its tool call returns
    completions = np.zeros(n, dtype=np.int64)
    # per-engine state
    clock, busy, done_at = np.zeros(E), np.zeros(E), np.zeros(E)
    used, peak = np.zeros(E, dtype=np.int64), np.zeros(E, dtype=np.int64)
    reserved = np.zeros(E, dtype=np.int64)
    mine = [np.arange(e, n, E) if static else np.zeros(0, dtype=np.int64) for e in range(E)]  # unfinished
    waiting = [list(m) for m in mine]  # static: rollouts not in the KV that can decode, in admission order
    may_admit = [True] * E  # static: False from an eviction until a rollout finishes
    stats = dict(evictions=0, evicted_rows=0, recomputed_tokens=0, prefill_tokens=0, generated_tokens=0,
                 decode_steps=0)
    kv_use = [[] for _ in range(E)]  # per engine: (from, to, mean KV tokens in use) of each interval
    queue_dry = [math.inf]  # when the shared queue ran out (dynamic, paged): the end of the steady phase
    next_req = 0  # dynamic: head of the shared queue
    ended = [[0, 0] for _ in range(E)]  # adaptive, per engine: response tokens of its finished rollouts, count

    def prefill(e, tokens):
        kv_use[e].append((clock[e], clock[e] + tokens * per_prefill, used[e]))
        clock[e] += tokens * per_prefill
        busy[e] += tokens * per_prefill
        stats["prefill_tokens"] += int(tokens)

    def evict(e):  # half the rows in the KV: parked ones first, then the fewest generated tokens
        held = mine[e][in_kv[mine[e]]]
        order = np.lexsort((gen[held], phase[held] == DECODE))
        victims = held[order[:max(1, len(held) // 2)]]
        in_kv[victims] = False
        used[e] -= ctx[victims].sum()
        waiting[e].extend(int(i) for i in victims if phase[i] == DECODE)  # the others re-queue on return
        stats["evictions"] += 1
        stats["evicted_rows"] += len(victims)
        may_admit[e] = False

    def promise(e, rows):  # adaptive: Pager.share x budget, with `rows` the engine's unfinished rollouts
        tokens, count = ended[e]
        mean = (tokens + len(rows) * p["auto_prior"] * budget) / (count + len(rows)) if count + len(rows) else \
            p["auto_prior"] * budget
        return int(math.ceil(mean / 2))

    def promised(rows, res):  # paged: KV promised to the rows in the KV beyond what they hold
        held = rows[in_kv[rows]]
        return int(np.maximum(plen[held] + res - ctx[held], 0).sum())

    def preempt(e, rows):  # paged: one row, parked ones first, then the most recently admitted
        held = rows[in_kv[rows]]
        parked = held[phase[held] != DECODE]
        i = int((parked if len(parked) else held).max())  # request order is admission order
        in_kv[i] = False
        used[e] -= ctx[i]
        if phase[i] == DECODE:  # a parked row re-queues when its answer is back
            waiting[e].append(i)
        stats["evictions"] += 1
        stats["evicted_rows"] += 1
        may_admit[e] = False  # until a rollout finishes: else the row could come back only to be preempted
        return i

    def finish(e, i):
        if in_kv[i]:
            used[e] -= ctx[i]
        in_kv[i], phase[i] = False, DONE
        if policy == "dynamic":
            reserved[e] -= plen[i] + budget
        ended[e][0] += int(ctx[i] - plen[i])
        ended[e][1] += 1
        completions[i] += 1
        may_admit[e] = True

    def advance(e):
        """One event of engine e at clock[e]; returns its next clock, or None once it has no work left."""
        nonlocal next_req
        rows = mine[e]
        # 1. tool answers that have arrived: prefill them into the row, or queue an evicted row for recompute
        back = rows[(phase[rows] == TOOL) & (t_ret[rows] <= clock[e])]
        for i in back[np.argsort(t_ret[back], kind="stable")]:
            if turn[i] == turns[i] - 1:  # the final call's answer does not fit the budget: finish "length"
                finish(e, i)
                continue
            r = tool[i, turn[i]]
            while static and in_kv[i] and used[e] + r > cap:  # the answer does not fit: make room
                evict(e)
            while paged and in_kv[i] and used[e] + r > cap:
                if preempt(e, rows) == i:
                    break
            ctx[i] += r
            turn[i] += 1
            left[i], phase[i] = model[i, turn[i]], DECODE
            if in_kv[i]:
                used[e] += r
                prefill(e, r)
            else:
                waiting[e].append(int(i))
        # 2. admit work
        if paged and (may_admit[e] or not in_kv[rows].any()):
            share = promise(e, rows) if adaptive else res  # response tokens promised to a row
            # preempted rows first, in admission order, then claims; all while the unpromised KV fits
            avail = cap - used[e] - promised(rows, share)
            waiting[e].sort()
            while waiting[e]:
                i = waiting[e][0]
                need = max(ctx[i], plen[i] + share)
                if need > avail and in_kv[rows].any():
                    break
                waiting[e].pop(0)
                in_kv[i] = True
                used[e] += ctx[i]
                avail -= need
                stats["recomputed_tokens"] += int(ctx[i])
                prefill(e, ctx[i])
            first = -1
            while not waiting[e] and next_req < n and len(rows) < max_rows and \
                    (plen[next_req] + share <= avail or not in_kv[rows].any()):
                i, next_req = next_req, next_req + 1
                in_kv[i], ctx[i] = True, plen[i]
                used[e] += plen[i]
                avail -= plen[i] + share
                rows = np.append(rows, i)
                if first < 0 or pid[first] != pid[i]:
                    prefill(e, plen[i])
                    first = i
                if next_req == n:
                    queue_dry[0] = clock[e]
        elif policy == "dynamic":  # claim from the shared queue while the next reservation fits
            first = -1
            while next_req < n and reserved[e] + plen[next_req] + budget <= cap:
                i, next_req = next_req, next_req + 1
                reserved[e] += plen[i] + budget
                if next_req == n:
                    queue_dry[0] = clock[e]
                in_kv[i], ctx[i] = True, plen[i]
                used[e] += plen[i]
                rows = np.append(rows, i)
                if first < 0 or pid[first] != pid[i]:  # one prefill per prompt in the claim; copies are free
                    prefill(e, plen[i])
                    first = i
        elif waiting[e] and (may_admit[e] or not (in_kv[rows] & (phase[rows] == DECODE)).any()):
            first = -1
            while waiting[e] and used[e] + ctx[waiting[e][0]] <= cap:
                i = waiting[e].pop(0)
                fresh = ctx[i] == 0
                if fresh:
                    ctx[i] = plen[i]
                in_kv[i] = True
                used[e] += ctx[i]
                if not fresh:
                    stats["recomputed_tokens"] += int(ctx[i])
                    prefill(e, ctx[i])
                elif first < 0 or pid[first] != pid[i]:
                    prefill(e, ctx[i])
                    first = i
        peak[e] = max(peak[e], used[e])
        # 3. decode until the next event, or wait
        dec = rows[in_kv[rows] & (phase[rows] == DECODE)]
        pending = t_ret[rows[phase[rows] == TOOL]]
        if len(dec):
            B, C0 = len(dec), int(ctx[dec].sum())
            k = int(left[dec].min())  # steps until the first row ends its turn
            if static or paged:
                room = (cap - used[e]) // B
                if room == 0:  # the next step does not fit the KV
                    evict(e) if static else preempt(e, rows)
                    mine[e] = rows
                    return clock[e]
                k = min(k, int(room))
            a, b = step_fixed + per_ctx * C0, per_ctx * B  # step j takes a + b j seconds
            if len(pending):  # stop at the step boundary where the first tool answer is in
                dt = pending.min() - clock[e]
                if dt > 0:
                    h = a - b / 2  # k steps take h k + b k^2 / 2
                    k = min(k, max(1, math.ceil((-h + math.sqrt(h * h + 2 * b * dt)) / b)))
                else:
                    k = 1
            spent = k * a + b * k * (k - 1) / 2
            kv_use[e].append((clock[e], clock[e] + spent, used[e] + B * (k - 1) / 2))
            clock[e] += spent
            busy[e] += spent
            ctx[dec] += k
            gen[dec] += k
            left[dec] -= k
            used[e] += k * B
            peak[e] = max(peak[e], used[e])
            stats["generated_tokens"] += k * B
            stats["decode_steps"] += k
            for i in dec[left[dec] == 0]:  # turns that ended
                if turn[i] == turns[i] - 1 and not last_call[i]:
                    finish(e, i)
                elif sync:
                    phase[i] = BARRIER
                else:
                    phase[i], t_ret[i] = TOOL, clock[e] + lat[i, turn[i]]
        elif len(pending):  # every row in the KV waits on a tool: idle until the first answer
            kv_use[e].append((clock[e], max(clock[e], pending.min()), used[e]))
            clock[e] = max(clock[e], pending.min())
        elif (phase[rows] == BARRIER).any():
            if waiting[e]:  # rollouts still to finish the turn do not fit: make room
                evict(e)
            else:  # everyone ended the turn: run the batch of calls, resume when the slowest returns
                at = rows[phase[rows] == BARRIER]
                phase[at], t_ret[at] = TOOL, clock[e] + lat[at, turn[at]].max()
        elif not waiting[e] and (static or next_req >= n):
            done_at[e] = clock[e]
            mine[e] = rows[phase[rows] != DONE]
            return None
        else:  # a bug, not an input error: fail instead of looping forever
            raise AssertionError(f"simulated engine {e} stalled at {clock[e]:.3f} s")
        mine[e] = rows[phase[rows] != DONE]
        return clock[e]

    heap = [(0.0, e) for e in range(E)]
    while heap:
        _, e = heapq.heappop(heap)
        t = advance(e)
        if t is not None:
            heapq.heappush(heap, (t, e))

    makespan = float(done_at.max())
    # the steady phase: until the shared queue runs dry, or the first engine is done when that is earlier
    # (static; or a queue claimed whole at once); the mean share of the KV in use over it, over engines
    worked = done_at[done_at > 0]  # an engine can end up with no work when others claimed it all at once
    t_end = min(queue_dry[0] or math.inf, float(worked.min()) if len(worked) else 0.0)
    def mean_use(t_end):  # mean share of the KV in use over [0, t_end], over engines
        return float(100 * np.mean([sum(u * (min(b, t_end) - a) for a, b, u in segs if a < t_end) /
                                    (cap * max(t_end, 1e-9)) for segs in kv_use]))
    return dict(policy=policy, makespan_s=makespan, idle_pct=float(100 * np.mean(1 - busy / makespan)),
                steady_kv_pct=mean_use(t_end), steady_s=t_end,
                # how long the first engine to finish waits for the last at the post-rollout gather
                spread_s=makespan - (float(worked.min()) if len(worked) else 0.0),
                first_done_kv_pct=mean_use(float(worked.min()) if len(worked) else 0.0),
                mean_batch=stats["generated_tokens"] / max(stats["decode_steps"], 1),
                kv_tokens=cap, peak_kv_tokens=int(peak.max()), completions=completions,
                planned_tokens=int(model.sum()), resp_mu=w["mu"], resp_sigma=w["sigma"],
                resp_tokens_mean=float(w["resp"].mean()), truncated_frac=float(w["truncated"].mean()),
                calls_mean=float((turns - 1 + last_call).mean()), **stats)


if __name__ == "__main__":
    import sys

    import configurator

    argv = sys.argv[1:]
    # the simulation parameters (+ the seed) become config keys: typed --key=value overrides, echoed
    keys = {k: v for k, (v, _) in SIM_PARAMS.items()}
    keys.update(seed=0, __doc__="python simulate.py: rollout scheduling policies at cluster scale (see "
                                "simulate() in simulate.py for the cost model).")
    cfg = configurator.configure(keys, argv)
    seed = cfg.pop("seed")
    if seed < 0:  # numpy's generator takes no negative seed
        sys.exit(f"config error: seed must be >= 0, got {seed}")
    try:
        p = sim_params(cfg)
        mu, sigma = lognormal_fit(p["resp_mean"], p["budget"], p["clip_frac"], p["resp_sigma"])
    except ValueError as e:
        sys.exit(f"config error: {e}")

    print("parameters (value | source):")
    for k, (_, source) in SIM_PARAMS.items():
        value = f"{p[k]:g}" if isinstance(p[k], float) else repr(p[k])
        print(f"  {k:<20} {value:<10} | {source}")
    cap = kv_capacity(p)
    bw, flops = p["efficiency"] * p["hbm_bandwidth"], p["efficiency"] * p["peak_flops"]
    reservations = cap / ((p["prompt_min"] + p["prompt_max"]) / 2 + p["budget"])
    step_ms = 1e3 * (2 * p["n_params"] / bw + p["step_overhead"])
    print(f"derived: KV {cap:,} tokens per engine = {reservations:.0f} reservations of prompt + budget | "
          f"decode step {step_ms:.1f} ms + {1e6 * 1024 * p['kv_bytes_per_token'] / bw:.1f} us per 1K context "
          f"tokens in the batch | prefill {1e6 * 2 * p['n_params'] / flops:.1f} us per token")

    scenarios = [
        ("default", {}),
        ("half the KV memory", {"kv_tokens": cap // 2}),
        ("2x tool latency", {"tool_latency_mean": 2 * p["tool_latency_mean"]}),
        ("early stage 1: 1K mean", {"resp_mean": 1024.0, "resp_sigma": sigma}),  # same shape, 1/4 the scale
        ("static w/o the tool barrier", {"static_sync_tools": False}),  # what the barrier alone costs
    ]
    print(f"\n{p['engines']} engines x {p['prompts']} prompts x {p['samples']} samples, seed {seed}. idle % = "
          f"share of the makespan an engine has nothing to decode or prefill (its rows all wait on tools, "
          f"or it is done while others work), averaged over engines. steady KV % = mean share of the KV in use "
          f"until the shared queue runs dry (or the first engine is done); KV % to 1st done: the same until the first engine is done; spread s = first-to-last engine finish, the longest wait at the post-rollout gather. paged: reserve {p['reserve']:g}; "
          f"adaptive: reserve=auto (prior {p['auto_prior']:g}), at most {-(-p['prompts'] * p['samples'] // p['engines'])} "
          f"rollouts per engine at once.")
    head = (f"{'scenario':<28} {'policy':<8} {'makespan s':>10} {'speedup':>7} {'idle %':>6} {'evictions':>9} "
            f"{'evicted rows':>12} {'recomputed tok':>14} {'mean batch':>10} {'peak KV %':>9} {'steady KV %':>11} "
            f"{'KV % to 1st done':>16} {'spread s':>8}")
    print(head + "\n" + "-" * len(head))
    for name, over in scenarios:
        # a scenario derived from the given parameters can be impossible where they are not (half a KV that
        # held one rollout, a 1K mean under a 1K budget): said so on its row, and the others still run
        try:
            q = sim_params({**p, **over})
            lognormal_fit(q["resp_mean"], q["budget"], q["clip_frac"], q["resp_sigma"])
        except ValueError as e:
            print(f"{name:<28} skipped: {e}")
            continue
        res = {pol: simulate(pol, q, seed) for pol in POLICIES}
        for pol, r in res.items():
            speedup = res["static"]["makespan_s"] / r["makespan_s"]
            kv_pct = 100 * r["peak_kv_tokens"] / r["kv_tokens"]
            print(f"{name if pol == 'static' else '':<28} {pol:<8} {r['makespan_s']:>10.1f} {speedup:>6.2f}x "
                  f"{r['idle_pct']:>6.1f} {r['evictions']:>9,} {r['evicted_rows']:>12,} "
                  f"{r['recomputed_tokens']:>14,} {r['mean_batch']:>10.1f} {kv_pct:>9.1f} {r['steady_kv_pct']:>11.1f} "
                  f"{r['first_done_kv_pct']:>16.1f} {r['spread_s']:>8.1f}")
        r = res["dynamic"]
        print(f"{'':<28} workload: lognormal mu {r['resp_mu']:.3f} sigma {r['resp_sigma']:.3f}, response mean "
              f"{r['resp_tokens_mean']:.0f} tokens, {r['truncated_frac']:.1%} cut by the budget, "
              f"{r['calls_mean']:.2f} tool calls per rollout")

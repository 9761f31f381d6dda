"""
The rollout engine: one per rank. A batched generator with a KV cache that runs multi-turn,
tool-using trajectories with continuous batching, token-in/token-out.

How one engine works (this is the paper's §3.2 idea in plain torch):
- the KV cache has a fixed number of rows, each `max_len` = prompt + response budget tokens long, so
  a row is exactly the reservation the paper's scheduler makes per rollout (prompt length + response
  budget); capacity in tokens = rows × max_len and is never exceeded.
- requests are claimed only while rows are free; a finished row frees its space at once and the next
  request is prefilled into it while the other rows keep decoding (continuous batching).
- samples of the same prompt share the prefill: it is computed once, then the KV row is copied.
- the prefills of one step (newly admitted prompts, tool responses of resumed rows) run together,
  right-padded, in forwards of up to `prefill_tokens` tokens: each forward reads all weights once,
  so batching prefills matters as much as batching the decode steps.
- a row whose assistant turn ends (`<|im_end|>`) is parsed with agent.py; its tool calls go to the
  sandbox pool (running on a background thread) and the row is *parked* with its KV kept; other rows
  keep decoding. When the answers arrive, the tool-response tokens (+ the next
  `<|im_start|>assistant\\n<reason>`) are prefilled into the row and it resumes.
- one response budget per trajectory counts model and tool tokens together (as the paper); finish
  reasons: `stop` (a turn without tool calls), `length` (budget), `max_turns`.
- every row samples with its own torch.Generator seeded from (seed, step, prompt index, sample
  index), so a rollout does not depend on which other rows share its batch.

A trajectory is one list of token ids built by appending; nothing is ever re-rendered or
re-tokenised. The loss mask is 1 exactly on the tokens the policy sampled.
"""
import asyncio
import concurrent.futures
import hashlib
import threading
import time
from dataclasses import dataclass, field

import torch

import agent
from model import KVCache


@dataclass
class Request:
    prompt_ids: list
    key: tuple = (0, 0, 0)  # (step, prompt index, sample index): seeds the row's generator
    meta: dict = field(default_factory=dict)  # passed through to the trajectory (e.g. the gold answer)


@dataclass
class Trajectory:
    key: tuple
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    mask: list = field(default_factory=list)  # 1 on sampled tokens, 0 on tool responses and glue
    logprobs: list = field(default_factory=list)  # sampling-time log-prob of each token (0 where mask 0)
    tool_calls: list = field(default_factory=list)  # dicts: code, stdin, status, output, duration
    turns: int = 0
    finish: str = ""  # stop | length | max_turns
    meta: dict = field(default_factory=dict)
    text: str = ""  # the decoded response, for the reward


class Row:
    """The per-row state machine of the engine (one cache row)."""

    def __init__(self, req, slot, gen, budget):
        self.req, self.slot, self.gen, self.budget = req, slot, gen, budget
        self.traj = Trajectory(key=req.key, prompt_ids=list(req.prompt_ids), meta=req.meta)
        self.turn_start = 0  # index in response_ids where the current assistant turn began
        self.pending = []  # tokens already in the trajectory but not yet in the KV cache
        self.logits = None  # (V,) logits to sample the next token from
        self.calls = None  # while parked: list of (record, future or None)


def row_generator(seed, key, device):
    """A generator seeded from (seed, step, prompt index, sample index) — never from batch position."""
    digest = hashlib.sha256(repr((seed,) + tuple(key)).encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class ToolRunner:
    """Runs an (unentered) async sandbox pool on a background event loop, so the synchronous decode
    loop can submit tool calls and keep decoding while they run."""

    def __init__(self, pool):
        self.pool, self.loop = pool, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(pool.__aenter__(), self.loop).result()

    def submit(self, code, stdin):
        return asyncio.run_coroutine_threadsafe(self.pool.run(code, stdin), self.loop)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.pool.__aexit__(None, None, None), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Engine:
    def __init__(self, model, tokenizer, kv_capacity=8192, max_len=1024, temperature=1.0, top_p=1.0,
                 seed=0, tools=None, max_turns=10, max_calls_per_turn=1, tool_max_chars=256,
                 prefill_tokens=16384, log_events=False):
        self.model, self.tok, self.tools = model, tokenizer, tools
        self.max_len, self.temperature, self.top_p, self.seed = max_len, temperature, top_p, seed
        self.max_turns, self.max_calls, self.tool_max_chars = max_turns, max_calls_per_turn, tool_max_chars
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (activation memory)
        param = next(model.parameters())
        self.device, self.num_rows = param.device, kv_capacity // max_len
        assert self.num_rows >= 1, f"kv_capacity {kv_capacity} holds no row of max_len {max_len}"
        self.cache = KVCache(model.cfg, self.num_rows, max_len, self.device, param.dtype)
        self.stop_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        self.events = [] if log_events else None
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "tool_wait_s": 0.0}

    def log(self, kind, row, **info):
        if self.events is not None:
            self.events.append((time.perf_counter(), kind, row.req.key, info))

    # ---------------------------------------------------------------------------------------------
    # public api

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=0.0):
        """Plain completions, no tools: list of token-id lists in, list of generated id lists out."""
        reqs = [Request(list(p), key=(0, i, 0)) for i, p in enumerate(prompts)]
        saved = self.temperature, self.tools
        self.temperature, self.tools = temperature, None
        try:
            trajs = self.run(iter_claim(reqs), max_new_tokens)
        finally:
            self.temperature, self.tools = saved
        return [t.response_ids for t in sorted(trajs, key=lambda t: t.key)]

    @torch.no_grad()
    def run(self, claim, budget, on_finish=None):
        """Generate until `claim(n_free)` has no more requests and every row has finished.
        claim(n) returns up to n Requests ([] = no more work). Returns the list of Trajectories."""
        rows, free, done, exhausted = {}, list(range(self.num_rows))[::-1], [], False
        while rows or not exhausted:
            # 1. admit new requests into free rows, one prefill per distinct prompt
            todo = []  # prefills: (row, new token ids, rows that then copy its KV)
            if free and not exhausted:
                reqs = claim(len(free))
                exhausted = not reqs
                todo += self.admit(reqs, free, rows, budget)
            # 2. resume parked rows whose tool answers have all arrived
            for row in [r for r in rows.values() if r.calls is not None]:
                if all(f is None or f.done() for _, f in row.calls):
                    todo += self.resume(row)
            # 3. the prompts and tool responses of this step go through the model together
            if todo:
                self.prefill(todo)
            # 4. sample one token for every row that has logits, then one batched decode step
            ready = [r for r in rows.values() if r.logits is not None]
            waiting = [f for r in rows.values() if r.calls for _, f in r.calls if f is not None]
            if ready:
                for row, tok, lp in zip(ready, *self.sample(ready)):
                    self.step_row(row, tok, lp)
                going = sorted((r for r in ready if r.pending and r.calls is None and not r.traj.finish),
                               key=lambda r: r.slot)
                if going:
                    self.decode(going)
            elif waiting:  # nothing to decode: wait for the first tool answer
                t0 = time.perf_counter()
                concurrent.futures.wait(waiting, timeout=0.05, return_when="FIRST_COMPLETED")
                self.stats["tool_wait_s"] += time.perf_counter() - t0
            # 5. free the rows that finished
            for row in [r for r in rows.values() if r.traj.finish]:
                del rows[row.slot]
                self.cache.reset_row(row.slot)
                free.append(row.slot)
                row.traj.text = self.tok.decode(row.traj.response_ids)
                self.log("finish", row, reason=row.traj.finish)
                done.append(row.traj)
                if on_finish is not None:
                    on_finish(row.traj)
        return done

    # ---------------------------------------------------------------------------------------------
    # the pieces of one engine step

    def admit(self, reqs, free, rows, budget):
        """Claimed requests take free rows. Returns their prefills: one per distinct prompt, whose KV
        the other samples of that prompt then copy (prefix sharing)."""
        todo = []
        for req in reqs:
            n = len(req.prompt_ids)
            if n + 1 > self.max_len:
                raise ValueError(f"prompt of {n} tokens does not fit max_len {self.max_len}")
            row = Row(req, free.pop(), row_generator(self.seed, req.key, self.device),
                      min(budget, self.max_len - n))
            if todo and todo[-1][0].req.prompt_ids == req.prompt_ids:
                todo[-1][2].append(row)
            else:
                todo.append((row, req.prompt_ids, []))
            rows[row.slot] = row
            self.log("admit", row, slot=row.slot)
        return todo

    def prefill(self, todo):
        """The new tokens of several rows (prompts, tool responses) through the model together: shortest
        first, right-padded, in forwards of at most `prefill_tokens` padded tokens (which bounds activation
        memory), each row with room in its cache row for the padded length."""
        group, held = [], 0  # held: the most tokens a row of the group already has in the cache
        for item in sorted(todo, key=lambda it: len(it[1])):
            T, n = len(item[1]), int(self.cache.lengths[item[0].slot])  # T: the group's padded length
            if group and (T * (len(group) + 1) > self.prefill_tokens or max(held, n) + T > self.max_len):
                self.prefill_group(group)
                group, held = [], 0
            group.append(item)
            held = max(held, n)
        self.prefill_group(group)

    def prefill_group(self, group):
        n = [len(ids) for _, ids, _ in group]
        ids = torch.tensor([ids + [0] * (max(n) - len(ids)) for _, ids, _ in group], device=self.device)
        slots = torch.tensor([row.slot for row, _, _ in group])
        logits = self.model.forward_cached(ids, self.cache, slots, last_only=True, n_new=n)[:, -1].float()
        self.stats["prefill_tokens"] += sum(n)
        for (row, _, copies), lg in zip(group, logits):
            row.logits = lg
            for other in copies:
                self.cache.copy_row(row.slot, other.slot)  # shared prefill: the samples copy the prompt's KV
                other.logits = lg.clone()

    def sample(self, rows):
        """Temperature / top-p sampling, one generator per row. Returns tokens and their log-probs
        under the temperature-scaled distribution (what the policy sampled from)."""
        logits = torch.stack([r.logits for r in rows])  # (B, V)
        for r in rows:
            r.logits = None
        if self.temperature == 0:
            tok = logits.argmax(-1)
            return tok.tolist(), torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0].tolist()
        logp = torch.log_softmax(logits / self.temperature, -1)  # (B, V)
        probs = logp.exp()
        if self.top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
            sp, si = probs.sort(-1, descending=True)
            sp[(sp.cumsum(-1) - sp) >= self.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(1, si, sp)
        cdf = probs.cumsum(-1)
        u = torch.cat([torch.rand(1, generator=r.gen, device=self.device) for r in rows])  # (B,)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=probs.shape[-1] - 1)  # (B, 1)
        return tok[:, 0].tolist(), logp.gather(1, tok)[:, 0].tolist()

    def step_row(self, row, tok, lp):
        t = row.traj
        t.response_ids.append(tok)
        t.mask.append(1)
        t.logprobs.append(lp)
        row.pending = [tok]
        if tok in self.stop_ids:  # the assistant turn is over
            t.turns += 1
            self.end_turn(row)
        elif len(t.response_ids) >= row.budget:
            t.finish = "length"

    def end_turn(self, row):
        t = row.traj
        if self.tools is None:
            t.finish = "stop"
            return
        calls = agent.parse_tool_calls(self.tok.decode(t.response_ids[row.turn_start:]), self.max_calls)
        if not calls:
            t.finish = "stop"
        elif t.turns >= self.max_turns:
            t.finish = "max_turns"
        else:  # park the row, dispatch its calls; other rows keep decoding
            row.calls = []
            for c in calls:
                if isinstance(c, str):  # malformed call: answered with the error text, never dropped
                    rec = {"code": "", "stdin": "", "status": "invalid", "output": c, "duration": 0.0}
                    row.calls.append((rec, None))
                else:
                    rec = {"code": c.code, "stdin": c.stdin}
                    row.calls.append((rec, self.tools.submit(c.code, c.stdin)))
            self.log("tool_start", row, n=len(calls))

    def resume(self, row):
        """Append the tool answers; returns the row's prefill (its last sampled token + the answers), or
        nothing when they do not fit its budget."""
        t = row.traj
        for rec, fut in row.calls:
            if fut is not None:
                res = fut.result()
                rec.update(status=res.status, duration=res.duration,
                           output=agent.tool_response_text(res, self.tool_max_chars))
            t.tool_calls.append(rec)
        suffix = agent.tool_suffix_ids(self.tok, [rec["output"] for rec, _ in row.calls])
        row.calls = None
        self.log("tool_done", row)
        if len(t.response_ids) + len(suffix) >= row.budget:
            t.finish = "length"  # stop before appending: a trajectory always ends on a model turn
            return []
        t.response_ids += suffix
        t.mask += [0] * len(suffix)
        t.logprobs += [0.0] * len(suffix)
        row.turn_start = len(t.response_ids)
        ids, row.pending = row.pending + suffix, []
        return [(row, ids, [])]

    def decode(self, rows):
        """One decode step: the pending token of every row goes through the model together."""
        ids = torch.tensor([r.pending for r in rows], device=self.device)  # (B, 1)
        slots = [r.slot for r in rows]
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        index = slice(slots[0], slots[-1] + 1) if contiguous else torch.tensor(slots, device=self.device)
        logits = self.model.forward_cached(ids, self.cache, index)[:, -1].float()  # (B, V)
        for r, lg in zip(rows, logits):
            r.pending, r.logits = [], lg
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        self.log("decode", rows[0], rows=[r.req.key for r in rows])


def kv_rows(model, max_len, kv_capacity=0, fraction=0.9, limit=None):
    """How many rows of max_len tokens an engine's KV cache gets: kv_capacity tokens when given, else
    `fraction` of the accelerator's free memory right now (CPU: 256 rows); never more than `limit`
    (the rows a rank can ever fill: more only waste memory)."""
    p = next(model.parameters())
    if kv_capacity:
        rows = kv_capacity // max_len
    elif p.is_cuda:  # K and V for every layer, in the model's dtype
        c = model.cfg
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * p.element_size()
        rows = int(fraction * torch.cuda.mem_get_info(p.device)[0]) // (per_token * max_len)
    else:
        rows = 256
    return max(1, min(rows, limit) if limit else rows)


def iter_claim(reqs):
    """A claim function over a local list of requests (single process)."""
    reqs = list(reqs)

    def claim(n):
        nonlocal reqs
        out, reqs = reqs[:n], reqs[n:]
        return out
    return claim

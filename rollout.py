"""
The rollout engine: one per rank. A batched generator over a paged KV cache that runs multi-turn,
tool-using trajectories with continuous batching, token-in/token-out.

How one engine works (in plain torch; the paper's §3.2 balances rollouts across engines by free KV, and
this over-commits with preemption as vLLM / SGLang do, which §3.2 sets out to avoid):
- the KV cache is one pool of fixed-size pages (model.KVCache); a row takes pages as it grows and
  gives them back when it finishes. The samples of one prompt hold the prompt's pages once, by
  reference (the prompt is prefilled once; each sample copies only the last, partly filled page).
- admission by expected use: a claimed request enters the KV while the free pages, less what the
  rows already running were promised, cover its prompt + `reserve` x its response budget. reserve=1
  promises every row its whole budget, which is the old full-reservation engine: it never preempts.
  With reserve < 1 the engine over-commits: more rows decode together, on the bet that most stop early.
  reserve="auto" makes the bet from what the run's finished rows used (Pager.share).
- preemption: when rows need pages and none are free, the engine preempts rows — first rows parked on
  a tool call (they are not decoding anyway), then the most recently admitted (so the oldest rows keep
  making progress and every row finishes) — frees their pages, and re-admits them later, before any new
  request, by prefilling prompt + response so far. Token-in/token-out makes this exact, and a row
  keeps its sampling generator, so its continuation is the same as an uninterrupted run's.
- a finished row frees its pages and slot at once and the next request is prefilled into them while
  the other rows keep decoding (continuous batching).
- the prefills of one step (new prompts, tool responses, re-admitted rows) run together, right-padded,
  in forwards of up to `prefill_tokens` tokens: each forward reads all weights once, so batching
  prefills matters as much as batching the decode steps.
- a row whose assistant turn ends (`<|im_end|>`) is parsed with agent.py; its tool calls go to the
  sandbox pool (running on a background thread) and the row is *parked* with its KV kept; other rows
  keep decoding. When the answers arrive, the tool-response tokens (+ the next
  `<|im_start|>assistant\\n<reason>`) are prefilled into the row and it resumes.
- a turn without a tool call ends the row, unless the trajectory's environment has a respond(turn_text)
  method (a referee, a simulated user: tasks/guess.py): its answer is appended as the next user turn (mask
  0) and the row decodes on, parked like a row with tool calls; None from it ends the row. An answer that
  takes time comes as a Future, bounded like a call: one not done by the row's deadline ends the row too.
- one response budget per trajectory counts model and tool tokens (and environment replies) together (the
  released code's rule; the paper does not say); finish
  reasons: `stop` (a turn without tool calls, or the environment's end), `length` (budget), `max_turns`
  (a turn with tool calls, or answered by the environment, at the turn limit: a call-free turn there is `stop`).
- every row samples with its own torch.Generator seeded from (seed, step, prompt index, sample
  index), so a rollout does not depend on which other rows share its batch, or on preemption.

A trajectory is one list of token ids built by appending; nothing is ever re-rendered or
re-tokenised. The loss mask is 1 exactly on the tokens the policy sampled.
"""
import concurrent.futures
import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

import agent
from model import KVCache, use_flash


@dataclass
class Request:
    prompt_ids: list
    key: tuple = (0, 0, 0)  # (step, prompt index, sample index): seeds the row's generator
    # passed through to the trajectory (e.g. the gold answer)
    meta: dict = field(default_factory=dict)
    # the tool table of the row's task (name -> agent.Tool); None: the engine's tools
    tools: dict = None
    # makes the trajectory's environment, called once when the row is claimed (e.g. functools.partial(
    # task.environment, row)); None: the task keeps no state across calls
    environment: object = None


@dataclass
class Trajectory:
    key: tuple
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    mask: list = field(default_factory=list)  # 1 on sampled tokens, 0 on tool responses and glue
    # sampling-time log-prob of each token (0 where mask 0)
    logprobs: list = field(default_factory=list)
    # the agent.CallRecord of each call (agent.start_call): tool, arguments, status, output, duration
    tool_calls: list = field(default_factory=list)
    turns: int = 0
    finish: str = ""  # stop | length | max_turns
    meta: dict = field(default_factory=dict)
    # the trajectory's own environment (Request.environment made it): its stateful tools change it, its respond()
    # (if any) answers turns without a call, the task's grade reads its final state; closed when the trajectory
    # ends (Engine.run)
    environment: object = None


# a row's states (see Row)
WAITING = "waiting"
DECODE = "decode"
PARKED = "parked"


class Row:
    """The per-row state machine of the engine (one slot of the KV cache):
    waiting: not in the KV (claimed, or preempted); `pending` holds its whole context, to prefill
    decode:  in the KV, sampling and decoding
    parked:  on its tool calls (`calls`) or its environment's reply, in the KV unless preempted meanwhile"""

    def __init__(self, req, slot, gen, budget):
        self.req = req
        self.slot = slot
        self.gen = gen
        self.budget = budget
        self.traj = Trajectory(key=req.key, prompt_ids=list(req.prompt_ids), meta=req.meta)
        self.state = WAITING
        self.turn_start = 0  # index in response_ids where the current assistant turn began
        # tokens already in the trajectory but not yet in the KV cache
        self.pending = list(req.prompt_ids)
        self.logits = None  # (V,) logits to sample the next token from
        self.calls = []  # while parked: list of (record, future or None)
        # while parked on no call: the environment's answer to the turn, or its Future (Engine.end_turn)
        self.reply = None
        # while parked: when (time.monotonic) calls still unanswered are answered "timeout"
        self.deadline = 0.0
        self.dropped = 0  # tokens preemption took out of the KV, to be prefilled again

    def waits(self):
        """What a parked row waits on: its calls' Futures (a call answered at once has none), and its
        environment's reply when that is a Future."""
        futures = [future for _, future in self.calls if future is not None]
        return futures + [self.reply] if isinstance(self.reply, concurrent.futures.Future) else futures


@dataclass
class Feed:
    """A work item of a forward: new tokens into one row's KV. A prefill (a prompt, tool responses, a
    re-admitted row's whole context) or a decode step (the one token just sampled); both need pages
    first (Pager.fit). `copies`: the rows that then start as copies of it (samples of one prompt share
    its pages)."""
    row: Row
    ids: list
    copies: list = field(default_factory=list)


# reserve="auto": the response share (of the budget) assumed for a row of the run that has not finished yet
AUTO_PRIOR = 0.5


class Pager:
    """The engine's memory policy over its paged KV cache: page sizing, admission, preemption.

    A row entering the KV is *promised* pages: its prompt + a share of its response budget, or what it
    already holds when that is more. New rows enter while the free pages, less what the rows already in
    the KV were promised and do not hold yet (the headroom), cover their own promise. When the pool
    runs short anyway (the bet on early stops was lost), rows are preempted: they give their pages back
    and wait to be prefilled again. The Engine asks; the Pager decides who holds memory.

    The share is `reserve`, fixed, or with reserve="auto" it follows what the run's rows use: half the
    mean response share of the run's rows, counting a finished row at what it used and a row still
    running at AUTO_PRIOR (see share()). So more rows run when rollouts end early and fewer when they
    run long, with preemption when the bet is lost. It is a function of the run's finishes (their
    lengths, in order) and of how many rows the engine holds, never of a clock, so deterministic=True
    repeats it; it starts afresh with every run() (an RL step), so a resume has nothing to restore."""

    def __init__(self, model, kv_capacity, max_len, reserve, max_rows, page_size, stats, log):
        self.auto = reserve == "auto"
        if not self.auto and not (isinstance(reserve, (int, float)) and 0 <= reserve <= 1):
            raise ValueError("reserve (train_rl's kv_reserve): a share of the budget in [0, 1] "
                             f"or 'auto': {reserve!r}")
        self.reserve = reserve
        self.max_len = max_len
        self.stats = stats
        self.log = log
        param = next(model.parameters())
        # flash-attn's paged kernel needs pages of a multiple of 256 tokens; 16 keeps rounding small elsewhere
        page_size = page_size or (256 if use_flash(param.device, param.dtype) else 16)
        # a whole row rounds up to whole pages: the pool gets that rounding for each of the
        # kv_capacity // max_len rows, so reserve=1 admits exactly as many rows as whole-row slots would
        num_pages = max(kv_capacity // page_size, kv_capacity // max_len * -(-max_len // page_size))
        # slots: as many rows as promises of reserve x max_len fit the pool (a slot costs no KV itself);
        # auto: a row per page, the promise decides (pass max_rows = the rank's share of a step's rollouts)
        least = 1e-6 if self.auto else max(reserve, 1e-6)
        self.num_rows = max_rows or min(num_pages, int(kv_capacity / (least * max_len)))
        assert self.num_rows >= 1, f"kv_capacity {kv_capacity} holds no row of max_len {max_len}"
        self.cache = KVCache(model.cfg, self.num_rows, max_len, param.device, param.dtype,
                             page_size, num_pages)

    def start(self, budget):
        """A run begins: every page free, no hold, and the claim size for this budget."""
        # a run that ended in an exception may have left pages behind
        for slot in range(self.num_rows):
            self.cache.release(slot)
        # hold: True from a preemption until a row finishes: no admissions meanwhile, since a row admitted
        # then could only push out the row just preempted
        self.hold = False
        self.budget = budget
        # auto: the response shares of this run's finished rows, summed, and how many they are
        self.used = 0.0
        self.ended = 0

    def share(self, rows):
        """The share of a row's response budget promised to it, given the run's rows (unfinished)."""
        if not self.auto:
            return self.reserve
        # the run's mean response share so far; with nothing finished yet, the prior. Early finishes are
        # the short rows, so the running ones count at the prior until they end: the mean moves as the
        # run's rows actually end, not with the first few
        counted = self.ended + len(rows)
        mean = (self.used + len(rows) * AUTO_PRIOR) / counted if counted else AUTO_PRIOR
        # a row's KV grows from its prompt to prompt + response: rows of all ages together hold about half
        # of their final responses, so half the mean is promised (rows past it count at what they hold)
        return mean / 2

    def claimable(self, rows, free):
        """How many new requests to claim now: while slots and unpromised pages are free. An empty
        engine always claims one; none while preempted rows wait (they get back in first) or on hold."""
        if self.hold or not free or any(row.state == WAITING for row in rows.values()):
            return 0
        # one claim's worth of pages: a request with the longest prompt (max_len - budget) and its promise
        prompt = max(self.max_len - self.budget, 1)
        per_claim = self.cache.pages(min(prompt + math.ceil(self.share(rows) * self.budget),
                                         self.max_len))
        return min(free, max(self.headroom(rows) // per_claim, 0 if rows else 1))

    def reserved(self, row, share):
        """Pages promised to a row: those of its prompt + `share` of its budget (never more than the budget), or
        of what it holds beyond that."""
        # the response part: the promised share, or the response so far when it is longer. A share is at most 1
        # (reserve is checked to lie in [0, 1], auto's is at most 1/2), so the promise is at most the budget
        promised = math.ceil(share * row.budget)
        response = max(promised, len(row.traj.response_ids))
        return self.cache.pages(len(row.traj.prompt_ids) + response)

    def headroom(self, rows):
        """Free pages not yet promised to the rows (a dict slot -> Row) in the KV."""
        share = self.share(rows)
        # what each row in the KV was promised and does not hold yet
        promised = sum(max(0, self.reserved(row, share) - self.cache.npages[row.slot])
                       for row in rows.values() if self.cache.holds(row.slot))
        return self.cache.free_pages() - promised

    def admit(self, waiting, rows):
        """Waiting rows, in the order given (the engine's: oldest first), enter the KV while the
        headroom covers their promise (or nothing else is in the KV). Returns their prefills: one
        per distinct new prompt, whose pages the other samples of that prompt then share."""
        running = any(self.cache.holds(row.slot) for row in rows.values())
        if not waiting or (self.hold and running):
            return []
        # free pages not yet promised, what each row is promised, the prefills admitted so far
        room = self.headroom(rows)
        share = self.share(rows)
        todo = []
        for row in waiting:
            # another sample of the prompt just admitted (both with no response yet): it shares that prefill and
            # needs only its growth
            twin = (not row.traj.response_ids and todo
                    and not todo[-1].row.traj.response_ids
                    and todo[-1].ids == row.pending)
            need = self.reserved(row, share)
            # first come, first served: a later row never overtakes an earlier one that does not fit
            if need > room and (running or todo):
                break
            room -= need
            if twin:
                todo[-1].copies.append(row)
            else:
                todo.append(Feed(row, row.pending))
        return todo

    def fit(self, todo, rows):
        """Pages for every Feed of a forward; when the pool is short, preempt rows until it is not.
        Returns the items that still go ahead (a preempted row's item drops out)."""
        cache = self.cache
        # each row's tokens, read once as a list (a tensor read per row cost ~2% of a decode step at batch 64);
        # preempting a row changes no other row's, and a preempted row's item drops out
        lengths = cache.lengths.tolist()

        def need(item):
            # new pages: the row's growth + a copy of a partly filled last page per sharing sample
            end = lengths[item.row.slot] + len(item.ids)
            growth = max(0, cache.pages(end) - cache.npages[item.row.slot])
            return growth + len(item.copies) * (end % cache.page_size > 0)
        while sum(need(item) for item in todo) > cache.free_pages():
            victim = self.victim(rows, [item.row for item in todo])
            self.preempt(victim)
            todo = [item for item in todo if item.row is not victim]
        for item in todo:
            cache.grow(item.row.slot, lengths[item.row.slot] + len(item.ids))
        return todo

    def victim(self, rows, work):
        """Who gives up its pages: a row parked on a tool call first (it is not decoding anyway), then the
        most recently admitted (the oldest rows keep going, so every row finishes)."""
        # rows in `work` not yet in the KV can be sent back to wait: that frees nothing but their claim
        held = [row for row in rows.values() if self.cache.holds(row.slot) or row in work]
        # `rows` is in claim order (Engine.run): reversed, the newest come first, and max takes
        # the first of its highest
        return max(reversed(held), key=lambda row: row.state == PARKED)

    def preempt(self, row):
        """Drop a row's KV; it keeps its trajectory and generator, and waits to be prefilled again."""
        cached = int(self.cache.lengths[row.slot])
        if cached:
            self.cache.release(row.slot)
            # token-in/token-out: the whole context so far is what gets prefilled on re-admission
            row.pending = row.traj.prompt_ids + row.traj.response_ids
            row.dropped += cached
            self.hold = True
            self.stats["preemptions"] += 1
            self.log("preempt", row, tokens=cached)
        # a parked row stays parked: it is re-admitted once its answers are in (Engine.resume)
        if row.state == DECODE:
            row.state = WAITING

    def finished(self, row):
        """A row is done: its pages go back, admissions may resume, and (auto) its use is counted."""
        self.hold = False
        self.cache.release(row.slot)
        self.used += len(row.traj.response_ids) / row.budget
        self.ended += 1


# seconds past the sandbox pool's own bound before the engine answers a call "timeout" itself
CALL_MARGIN = 30.0


class Engine:
    def __init__(self, model, tokenizer, kv_capacity=8192, max_len=1024, temperature=1.0, top_p=1.0,
                 seed=0, sandbox=None, max_turns=10, max_calls_per_turn=1, tool_max_chars=256,
                 prefill_tokens=16384, log_events=False, reserve=0.5, max_rows=None, page_size=None,
                 deterministic=False, tools=agent.PYTHON_TOOLS, call_timeout=None):
        """kv_capacity: KV tokens in the pool; max_len: prompt + response tokens of one row; reserve: the
        share of a row's response budget promised to it at admission (1 = the whole budget, no
        over-commit), or "auto": a share that follows what the run's rows use (Pager); max_rows: most
        rows at once (default: as many reservations of reserve x max_len as the pool holds; auto: one
        per page, so pass the rank's share of a step's rollouts: an engine holding more at once takes
        them from engines that would run them sooner); page_size: tokens per page (flash-attn needs a
        multiple of 256; 16 elsewhere). sandbox: the sandbox pool; tools: the task's tool table, name ->
        agent.Tool (a call runs as tools[name].run(arguments, sandbox)); a Request's own table and
        environment replace them for its row. call_timeout: seconds a parked row waits for its calls; one
        still unanswered then is answered "timeout" (a failed call) and never waited on again. None: the
        sandbox pool's own bound (its queue wait + its time limit) + CALL_MARGIN, so a sandbox call is
        always answered by the pool first."""
        self.model = model
        self.tok = tokenizer
        self.sandbox = sandbox
        self.tools = tools
        self.max_len = max_len
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.max_turns = max_turns
        self.max_calls = max_calls_per_turn
        self.tool_max_chars = tool_max_chars
        # padded tokens per prefill forward (activation memory)
        self.prefill_tokens = prefill_tokens
        self.call_timeout = call_timeout or (getattr(sandbox, "queue_timeout", 60.0)
                                             + getattr(sandbox, "timeout", 4.0)
                                             + CALL_MARGIN)
        # wait for every tool answer before the next step (no overlap of tools and decoding), so which rows
        # share a forward never depends on how fast the tools answered: on CPU a matmul over 1-5 rows
        # rounds differently from one over 16+, and a flipped sampled token changes the rest of a rollout
        self.deterministic = deterministic
        self.device = next(model.parameters()).device
        self.stop_ids = {tokenizer.convert_tokens_to_ids(token)
                         for token in ("<|im_end|>", "<|endoftext|>")}
        self.events = [] if log_events else None
        # per run() (reset at its start): forwards, tokens, seconds waited on tools, preemptions
        self.stats = dict.fromkeys(("decode_steps", "decode_tokens", "prefill_tokens", "tool_wait_s",
                                    "preemptions", "recomputed_tokens"), 0)
        self.pager = Pager(model, kv_capacity, max_len, reserve, max_rows, page_size,
                           self.stats, self.log)
        self.cache = self.pager.cache
        self.num_rows = self.pager.num_rows

    def log(self, kind, row, **info):
        if self.events is not None:
            self.events.append((time.perf_counter(), kind, row.req.key, info))

    # ---------------------------------------------------------------------------------------------
    # public api

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens):
        """Plain greedy completions, no tools: list of token-id lists in, list of generated id lists out."""
        reqs = [Request(prompt, key=(0, i, 0)) for i, prompt in enumerate(prompts)]
        trajs = self.run(iter_claim(reqs), max_new_tokens, plain=True)
        return [traj.response_ids for traj in sorted(trajs, key=lambda traj: traj.key)]

    @torch.no_grad()
    def run(self, claim, budget, on_finish=None, plain=False, keep=True):
        """Generate until `claim(n)` has no more requests and every row has finished.
        claim(n) returns up to n Requests ([] = no more work). Returns the list of Trajectories (keep=False:
        an empty list; on_finish sees each one, so memory does not grow with the requests). self.stats counts
        this run only. plain=True: greedy completions without tools (generate)."""
        # plain completions sample greedily, and no sandbox means no turn is parsed for tool calls (end_turn)
        temperature = 0 if plain else self.temperature
        sandbox = None if plain else self.sandbox
        # the rows claimed and not finished, by KV slot, in the order they were claimed (a dict
        # keeps its insertion order): the Pager admits the oldest first, preempts the newest first
        rows = {}
        # the free slots, taken from the end: slot 0 first
        free = list(range(self.num_rows))[::-1]
        # the finished trajectories (keep=True)
        done = []
        # claim() returned no requests: it has no more
        exhausted = False
        self.stats.update(dict.fromkeys(self.stats, 0))
        self.pager.start(budget)
        try:
            while rows or not exhausted:
                # 1. claim new requests while slots and unpromised pages are free; rows that wait to get back
                # into the KV come first (and an empty engine always claims)
                n_claim = 0 if exhausted else self.pager.claimable(rows, len(free))
                if n_claim > 0:
                    requests = claim(n_claim)
                    exhausted = not requests
                    self.claimed(requests, free, rows, budget)
                # 2. parked rows whose tool answers have all arrived, or whose calls ran out of time, get them
                # appended
                todo = []
                # the rows parked on their tool calls (or an environment's reply), and their calls still
                # out (step 7 waits on those too when no row decodes)
                parked = [row for row in rows.values() if row.state == PARKED]
                futures = [future for row in parked for future in row.waits()]
                if self.deterministic:
                    # every answer first (or every deadline passed), so which rows share the next forward does not
                    # depend on timing
                    concurrent.futures.wait(futures, timeout=self.call_timeout)
                now = time.monotonic()
                for row in parked:
                    if now >= row.deadline or all(future.done() for future in row.waits()):
                        todo += self.resume(row)
                # 3. waiting rows enter the KV, oldest claimed first, while their promise fits
                waiting = [row for row in rows.values() if row.state == WAITING]
                todo += self.pager.admit(waiting, rows)
                # 4. the prompts, tool responses and recomputed contexts of this step go through the model
                # together, once they have pages (which may preempt rows)
                todo = self.pager.fit(todo, rows)
                if todo:
                    self.prefill(todo)
                # 5. sample one token for every row that has logits
                ready = [row for row in rows.values() if row.logits is not None]
                if ready:
                    for row, token, logprob in zip(ready, *self.sample(ready, temperature)):
                        self.step_row(row, token, logprob, sandbox)
                # 6. free the rows that finished: their pages and their slot. Before the decode step takes
                # pages, which in a full pool would preempt a live row for pages about to come free
                for row in [row for row in rows.values() if row.traj.finish]:
                    del rows[row.slot]
                    self.pager.finished(row)
                    free.append(row.slot)
                    self.log("finish", row, reason=row.traj.finish)
                    # before on_finish: the grade reads the environment's final state, and nothing changes it now
                    close_environment(row.traj)
                    if keep:
                        done.append(row.traj)
                    if on_finish is not None:
                        on_finish(row.traj)
                # 7. one batched decode step; rows preempted since their last forward sampled too, but decode
                # only after re-admission
                going = [Feed(row, row.pending) for row in ready
                         if row.state == DECODE and not row.traj.finish]
                going = sorted(self.pager.fit(going, rows), key=lambda item: item.row.slot)
                if going:
                    self.decode([item.row for item in going])
                elif not ready and futures:
                    # nothing to decode: wait for the first tool answer
                    wait_start = time.perf_counter()
                    concurrent.futures.wait(futures, timeout=0.05, return_when="FIRST_COMPLETED")
                    self.stats["tool_wait_s"] += time.perf_counter() - wait_start
        finally:
            # the rows still running when the step raised end here too: their environments are closed
            for row in rows.values():
                close_environment(row.traj)
        assert self.cache.free_pages() == self.cache.num_pages, "pages leaked"
        return done

    def claimed(self, requests, free, rows, budget):
        """Claimed requests take free slots as waiting rows (nothing in the KV yet)."""
        for request in requests:
            prompt_len = len(request.prompt_ids)
            if prompt_len + 1 > self.max_len:
                raise ValueError(
                    f"prompt of {prompt_len} tokens does not fit max_len {self.max_len}")
            # the row's sampling generator, seeded from (seed, step, prompt index, sample index), never from
            # its batch position; on the CPU whatever the model runs on: a GPU run draws what a CPU run draws,
            # and a decode step on a GPU launches no kernel per row for its draws (sample)
            digest = hashlib.sha256(repr((self.seed, *request.key)).encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            row = Row(request, free.pop(), generator, min(budget, self.max_len - prompt_len))
            rows[row.slot] = row
            # the trajectory's own environment, made once: preemption and re-admission keep the Row, so this
            # object and no other sees this trajectory's calls
            row.traj.environment = request.environment() if request.environment else None
            self.log("admit", row, slot=row.slot)

    # ---------------------------------------------------------------------------------------------
    # the model: prefill, sample, decode

    def prefill(self, todo):
        """The new tokens of several rows (prompts, tool responses) through the model together: shortest
        first, in forwards of at most `prefill_tokens` tokens right-padded (which bounds activation memory).
        The model's layers run on the real tokens alone, packed (model.forward_cached); attention sees each
        row's own, padded, and padding is never written into the cache, so a row near max_len can share a
        forward with longer ones."""
        # the items of the next forward
        group = []
        for item in sorted(todo, key=lambda item: len(item.ids)):
            # the group goes through the model first if this item (the longest yet) would overflow the forward
            if group and len(item.ids) * (len(group) + 1) > self.prefill_tokens:
                self.prefill_group(group)
                group = []
            group.append(item)
        self.prefill_group(group)

    def prefill_group(self, group):
        new_lens = [len(item.ids) for item in group]
        # right-padded to the longest
        padded_ids = torch.tensor([item.ids + [0] * (max(new_lens) - len(item.ids))
                                   for item in group],
                                  device=self.device)
        slots = torch.tensor([item.row.slot for item in group])
        logits = self.model.forward_cached(padded_ids, self.cache, slots, last_only=True,
                                           n_new=new_lens)[:, -1].float()
        self.stats["prefill_tokens"] += sum(new_lens)
        for item, row_logits in zip(group, logits):
            for row in [item.row] + item.copies:
                # a re-admitted row's dropped tokens are now recomputed; every row of a prefill decodes next
                # (an admitted row was waiting, a resumed one decodes already; a preempted row's Feed dropped out)
                self.stats["recomputed_tokens"] += row.dropped
                row.dropped = 0
                row.pending = []
                row.logits = row_logits
                row.state = DECODE
            # shared prefill: the samples hold the prompt's pages by reference
            self.cache.share(item.row.slot, [row.slot for row in item.copies])

    def sample(self, rows, temperature):
        """Temperature / top-p sampling, one generator per row. Returns tokens and their log-probs
        under the temperature-scaled distribution (what the policy sampled from)."""
        logits = torch.stack([row.logits for row in rows])  # (B, V)
        for row in rows:
            row.logits = None
        # the log-probs of softmax(logits / temperature): at temperature 0 (greedy), of the logits divided by 1
        logprobs = torch.log_softmax(logits / (temperature or 1), -1)  # (B, V)
        # greedy: the most likely token
        if temperature == 0:
            tokens = logits.argmax(-1, keepdim=True)  # (B, 1)
        else:
            probs = logprobs.exp()
            # top-p: keep the smallest set of tokens whose mass reaches top_p
            if self.top_p < 1.0:
                sorted_probs, sorted_ids = probs.sort(-1, descending=True)
                # out: the tokens after those whose mass already reaches top_p; never the most
                # likely one (at top_p = 0 every token was out, and the draw took the
                # vocabulary's last, whatever its probability)
                out = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
                out[:, 0] = False
                sorted_probs[out] = 0
                # back in vocabulary order (sorted_ids is a permutation: every entry is written)
                probs = probs.scatter(1, sorted_ids, sorted_probs)
            # inverse-CDF sampling: one uniform draw per row (B,), from the row's own generator (on the CPU)
            cdf = probs.cumsum(-1)
            uniform = torch.cat([torch.rand(1, generator=row.gen) for row in rows]).to(self.device)
            # a draw of exactly 0 (one in 2^24 of torch.rand's) would find token 0 whatever its probability;
            # above 0 (1e-30 is, in the float32 cdf) it finds the first token that has one. (B, 1)
            tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1]).clamp(min=1e-30)[:, None])
            # a draw past the last cumulative value (rounding) takes the last token
            tokens.clamp_(max=probs.shape[-1] - 1)
        return tokens[:, 0].tolist(), logprobs.gather(1, tokens)[:, 0].tolist()

    def decode(self, rows):
        """One decode step: the pending token of every row goes through the model together."""
        pending_ids = torch.tensor([row.pending for row in rows], device=self.device)  # (B, 1)
        slots = torch.tensor([row.slot for row in rows])
        logits = self.model.forward_cached(pending_ids, self.cache, slots)[:, -1].float()  # (B, V)
        for row, row_logits in zip(rows, logits):
            row.pending = []
            row.logits = row_logits
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        self.log("decode", rows[0], rows=[row.req.key for row in rows])

    # ---------------------------------------------------------------------------------------------
    # the agent loop: a sampled token, the end of a turn, tool calls, parking and resuming

    def step_row(self, row, token, logprob, sandbox):
        """Append one sampled token to the row's trajectory; end its turn on a stop token, or the row
        on its budget."""
        traj = row.traj
        traj.response_ids.append(token)
        traj.mask.append(1)
        traj.logprobs.append(logprob)
        # the token is the next input; after the whole context when the row was preempted since its
        # logits were computed
        row.pending.append(token)
        # the assistant turn is over
        if token in self.stop_ids:
            traj.turns += 1
            self.end_turn(row, sandbox)
        # the response budget is spent
        elif len(traj.response_ids) >= row.budget:
            traj.finish = "length"

    def end_turn(self, row, sandbox):
        """Parse the finished turn: no tool call ends the trajectory (so do the turn limit and a
        budget spent on the turn's last token), unless
        the trajectory's environment answers the turn (respond(text): the next user turn's text, None:
        the end, or a Future of either when it takes time: like a tool's run(), respond() is called on the
        decode loop and must not wait); else the row is parked on its calls, which go to the sandbox pool
        (or on the environment's reply), and the other rows keep decoding."""
        traj = row.traj
        # the row's task's tools
        tools = self.tools if row.req.tools is None else row.req.tools
        # the text of this turn only; calls beyond max_calls_per_turn are dropped, as the release does.
        # Plain completions (generate: run's plain=True) parse nothing: a turn is the whole answer
        text = self.tok.decode(traj.response_ids[row.turn_start:])
        calls = [] if sandbox is None else agent.parse_tool_calls(text, self.max_calls, tools)
        # a turn without a call: the trajectory's environment may answer it (a referee, a simulated
        # user) with the next user turn, or end the episode (None). It sees the turn at the turn limit too
        respond = getattr(traj.environment, "respond", None)
        row.reply = respond(text) if respond and not calls else None
        if not calls and row.reply is None:
            traj.finish = "stop"
        elif traj.turns >= self.max_turns:
            traj.finish = "max_turns"
        # the turn ends on the budget's last token: nothing could follow its calls' answers, and the
        # release stops here, before it parses the turn, so they never start
        elif len(traj.response_ids) >= row.budget:
            traj.finish = "length"
        else:
            # park the row (its KV stays) and dispatch each call to its tool by name; the tools answer on their
            # own threads. A malformed call is answered with the error text, never dropped: no future. Each call
            # starts here, once: a preempted row is re-admitted with its answers, never with its calls again
            row.state = PARKED
            row.calls = [agent.start_call(call, tools, sandbox, traj.environment) for call in calls]
            row.deadline = time.monotonic() + self.call_timeout
            self.log("tool_start", row, n=len(calls))

    def resume(self, row):
        """Append the tool answers (or the environment's reply); returns the row's prefill (its last
        sampled token + the answers) when it is in the KV. Nothing when they do not fit its budget."""
        traj = row.traj
        # every call's record gets its answer: status, duration and the text the model will read; a call still
        # unanswered at the deadline is answered "timeout" (its late answer, if any, is never read)
        late = agent.ToolResult("timeout", "", duration=self.call_timeout)
        for record, future in row.calls:
            if future is not None:
                result = future.result() if future.done() else late
                record.status = result.status
                record.duration = result.duration
                record.output = agent.tool_response_text(result, self.tool_max_chars)
            traj.tool_calls.append(record)
        # the tool turn in the release's format, then `<|im_start|>assistant\n<reason>` for the next turn
        responses = [record.output for record, _ in row.calls]
        if responses:
            suffix = agent.tool_suffix_ids(self.tok, responses)
        else:
            # no call: the environment's reply; one that came as a Future and is not done by the deadline
            # ends the episode, as None does
            reply = row.reply
            if isinstance(reply, concurrent.futures.Future):
                reply = reply.result() if reply.done() else None
            if reply is None:
                traj.finish = "stop"
                return []
            # as a user turn of the chat template (right after the model's <|im_end|>, as the tool turn is)
            suffix = self.tok.encode(agent.user_turn_text(reply), add_special_tokens=False)
        row.calls = []
        self.log("tool_done", row)
        # stop before appending: a trajectory always ends on a model turn
        if len(traj.response_ids) + len(suffix) >= row.budget:
            traj.finish = "length"
            return []
        # the answers and the next turn's opening are context, not samples: mask 0
        traj.response_ids += suffix
        traj.mask += [0] * len(suffix)
        traj.logprobs += [0.0] * len(suffix)
        # the next turn's text, for parse_tool_calls, starts here
        row.turn_start = len(traj.response_ids)
        # the last sampled token (the turn's <|im_end|>) is still pending: it goes in with the answers
        row.pending += suffix
        # preempted while parked: it waits to be re-admitted, answers included
        if not self.cache.holds(row.slot):
            row.state = WAITING
            return []
        row.state = DECODE
        return [Feed(row, row.pending)]


def close_environment(traj):
    """The trajectory is over (an answer, its budget, the turn limit, or an exception in the step): its
    environment's close() frees what it holds. What the grade reads stays readable in the object."""
    if traj.environment is not None:
        traj.environment.close()


def kv_rows(model, max_len, kv_capacity, fraction=0.9, limit=None):
    """How many rows of max_len tokens an engine's KV cache gets: kv_capacity tokens when not 0, else
    `fraction` of the accelerator's free memory right now (CPU: 256 rows); never more than `limit`
    (the rows a rank can ever fill: more only waste memory)."""
    p = next(model.parameters())
    if kv_capacity:
        rows = kv_capacity // max_len
    elif p.is_cuda:  # K and V for every layer, in the model's dtype
        cfg = model.cfg
        per_token = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
                     * p.element_size())
        rows = int(fraction * torch.cuda.mem_get_info(p.device)[0]) // (per_token * max_len)
    else:
        rows = 256
    return max(1, min(rows, limit) if limit else rows)


def iter_claim(reqs):
    """A claim function over a local sequence (or any iterable) of requests, taken in order; a sequence that
    makes its items on demand (scheduler.Lazy), or a generator, makes each only when claimed."""
    # a sequence iterates by index: scheduler.Lazy makes item i when it is reached
    remaining = iter(reqs)
    return lambda n: list(itertools.islice(remaining, n))

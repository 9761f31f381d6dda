"""The rollout engine against transformers' greedy decoding, its tool loop, KV limits and seeding."""
import concurrent.futures
import contextlib
import json
import os
import threading
import types

import pytest
import torch
import transformers

import agent
import data
from model import KVCache, load_model
from rollout import Engine, Request, iter_claim


@contextlib.contextmanager
def watching(model, after):
    """model.forward_cached calls after(ids, cache) once each forward is done (on this instance only)."""
    real = model.forward_cached

    def spy(ids, cache, *args, **kw):
        out = real(ids, cache, *args, **kw)
        after(ids, cache)
        return out
    model.forward_cached = spy
    try:
        yield
    finally:
        del model.forward_cached

QUESTIONS = ["What is 12 + 7?", "What is 123456 * 98 - 5?", "What is 3 - 4 * 5 + 6?", "What is 8 * 8?",
             "What is 99999 - 1?", "What is 5 + 5 + 5 + 5?", "What is 31 * 41?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Qwen3 (untied, lm_head scaled so argmax is not decided by near-ties) + tokenizer."""
    d = tmp_path_factory.mktemp("tiny")
    tok = data.train_tokenizer([agent.prompt_text(q) + "<tool_call>print(1)</tool_call><|im_end|>" for q in QUESTIONS])
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d), tok, hf.eval()


def prompts_of(tok, n):
    # different lengths: cut the rendered prompts at different places
    return [data.render_prompt(tok, QUESTIONS[i % len(QUESTIONS)])[: 20 + 5 * i] for i in range(n)]


def test_greedy_equals_transformers_one_prompt_at_a_time(tiny):
    path, tok, hf = tiny
    model = load_model(path)
    prompts = prompts_of(tok, 7)
    stop = sorted(Engine(model, tok, kv_capacity=160, max_len=160).stop_ids)
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=stop,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    # 3 rows for 7 prompts: rows finish and new prompts are admitted while others are mid-decode, their
    # prompts prefilled together (right-padded); then 7 rows with prefills split into forwards of <= 60 tokens
    for rows, prefill_tokens in ((3, 16384), (7, 60)):
        engine = Engine(model, tok, kv_capacity=rows * 160, max_len=160, prefill_tokens=prefill_tokens)
        forwards = []
        with watching(model, lambda ids, cache: forwards.append(ids.shape)):
            outs = engine.generate(prompts, max_new_tokens=24)
        assert outs == refs
        assert engine.stats["decode_steps"] < sum(len(o) for o in outs)  # rows really were batched
        prefills = [s for s in forwards if s[1] > 1]
        assert max(b for b, _ in prefills) > 1 and max(b * t for b, t in prefills) <= prefill_tokens


class Script(torch.nn.Module):
    """A stand-in policy that 'samples' a fixed token script per prompt (one-hot logits), so the
    engine's tool loop can be tested on real tool calls. Each forward call for a row yields the next
    scripted token; a prefill at length 0 starts the row's script."""

    def __init__(self, scripts, vocab):
        super().__init__()
        self.cfg = types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=1)
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.scripts, self.vocab, self.state = scripts, vocab, {}

    def forward_cached(self, input_ids, cache, rows, last_only=False, n_new=None):
        idx = list(range(cache.num_rows))[rows] if isinstance(rows, slice) else rows.tolist()
        n_new = [input_ids.shape[1]] * len(idx) if n_new is None else list(n_new)
        out = torch.zeros(len(idx), 1, self.vocab)
        for b, r in enumerate(idx):
            if cache.lengths[r] == 0:
                self.state[r] = [self.scripts[tuple(input_ids[b, :n_new[b]].tolist())], 0]
            script, i = self.state[r]
            out[b, 0, script[i]] = 100.0
            self.state[r][1] += 1
            cache.lengths[r] += n_new[b]
        return out


class SlowTools:
    """Answers `print(...)` calls with the printed value after a delay that depends on the code."""

    def __init__(self, delays):
        self.delays, self.calls = delays, []

    def submit(self, code, stdin):
        self.calls.append(code)
        fut = concurrent.futures.Future()
        res = types.SimpleNamespace(status="ok", stdout=code[6:-1] + "\n", stderr="", value="", duration=0.0)
        threading.Timer(self.delays.get(code, 0.0), fut.set_result, [res]).start()
        return fut


def scripted(tok, value, extra_tokens):
    call = '<tool_call>{"name": "%s", "arguments": {"code": "print(%s)", "input": ""}}</tool_call>' % (agent.TOOL_NAME, value)
    turn1 = tok.encode("I compute." + call, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    turn2 = tok.encode(" ok" * extra_tokens + "<answer>\\boxed{%s}</answer>" % value, add_special_tokens=False)
    return turn1 + turn2 + [tok.convert_tokens_to_ids("<|im_end|>")]


def test_other_rows_decode_while_a_row_waits_for_its_tool(tiny):
    _, tok, _ = tiny
    prompts = [data.render_prompt(tok, q) for q in QUESTIONS[:3]]
    scripts = {tuple(p): scripted(tok, v, extra) for p, v, extra in zip(prompts, (11, 22, 33), (0, 30, 30))}
    tools = SlowTools({"print(11)": 0.5})  # row 0's tool is slow, the others answer at once
    engine = Engine(Script(scripts, len(tok)), tok, kv_capacity=3 * 400, max_len=400, temperature=0.0,
                    sandbox=tools, log_events=True)
    trajs = sorted(engine.run(iter_claim([Request(p, key=(0, i, 0)) for i, p in enumerate(prompts)]), 300),
                   key=lambda t: t.key)
    ev = engine.events
    start = next(t for t, kind, key, _ in ev if kind == "tool_start" and key == (0, 0, 0))
    done = next(t for t, kind, key, _ in ev if kind == "tool_done" and key == (0, 0, 0))
    others = [e for e in ev if e[1] == "decode" and start < e[0] < done and (0, 0, 0) not in e[3]["rows"]]
    assert len(others) > 10  # rows 1 and 2 kept decoding while row 0 waited
    assert all((0, 0, 0) not in e[3]["rows"] for e in ev if e[1] == "decode" and start < e[0] < done)
    assert sorted(tools.calls) == ["print(11)", "print(22)", "print(33)"]  # each call dispatched once
    for t, v in zip(trajs, ("11", "22", "33")):
        assert t.finish == "stop" and t.turns == 2 and len(t.tool_calls) == 1
        assert t.tool_calls[0].status == "ok" and t.tool_calls[0].output.startswith(f"Tool call success\nstdout: {v}\n")
        text = tok.decode(t.response_ids)
        assert text.count("<tool_response>") == 1 and f"<tool_response>\n{t.tool_calls[0].output}\n</tool_response>" in text
        assert agent.extract_answer(text) == v
        # the loss mask is 1 exactly on the scripted (sampled) tokens
        assert [i for i, m in zip(t.response_ids, t.mask) if m] == scripts[tuple(t.prompt_ids)]
        assert t.prompt_ids + t.response_ids == data.render_prompt(tok, QUESTIONS[t.key[1]]) + t.response_ids


def test_budget_counts_tool_tokens_and_max_turns(tiny):
    _, tok, _ = tiny
    p = data.render_prompt(tok, QUESTIONS[0])
    script = scripted(tok, 11, 0)
    turn1 = script.index(tok.convert_tokens_to_ids("<|im_end|>")) + 1
    # the last two cases: the tool response does not fit, so the row finishes while being resumed
    # (its call ran, as in the release); the call ends the turn at the budget's last token, so the
    # row ends there (the release stops on a spent budget before it parses the turn: no call runs)
    for budget, max_turns, want in ((len(script) + 80, 10, "stop"), (len(script) - 3, 10, "length"),
                                    (len(script) + 80, 1, "max_turns"), (turn1 + 3, 10, "length"),
                                    (turn1, 10, "length")):
        tools = SlowTools({})
        engine = Engine(Script({tuple(p): script}, len(tok)), tok, kv_capacity=2 * 400, max_len=400,
                        temperature=0.0, sandbox=tools, max_turns=max_turns)
        (t,) = engine.run(iter_claim([Request(p)]), budget)
        assert t.finish == want and len(t.response_ids) <= budget
        assert t.response_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") or want == "length"
        ran = budget > turn1 and max_turns > 1
        assert len(tools.calls) == len(t.tool_calls) == ran, (budget, tools.calls, t.tool_calls)


def test_kv_capacity_never_exceeded_and_seeding_ignores_batch_composition(tiny):
    path, tok, _ = tiny
    model = load_model(path)
    reqs = [Request(prompts_of(tok, 6)[i // 4], key=(3, i // 4, i % 4)) for i in range(24)]
    results = {}
    for rows in (2, 5):
        engine = Engine(model, tok, kv_capacity=rows * 128, max_len=128, temperature=1.0, top_p=0.9, seed=7,
                        reserve=1.0)  # whole-budget reservations: rows x max_len is the pool
        capacity = engine.num_rows * engine.max_len
        seen = []

        def checked(ids, cache):
            assert int(cache.lengths.sum()) <= capacity and int(cache.lengths.max()) <= cache.max_len
            seen.append(int((cache.lengths > 0).sum()))
        with watching(model, checked):
            trajs = engine.run(iter_claim(reqs), 40)
        assert max(seen) == rows and len(trajs) == 24
        results[rows] = {t.key: (t.response_ids, t.logprobs) for t in trajs}
    assert results[2].keys() == results[5].keys()
    for k in results[2]:
        assert results[2][k][0] == results[5][k][0]  # same tokens whatever shared the batch
        assert results[2][k][1] == pytest.approx(results[5][k][1], abs=1e-4)
    # samples of one prompt differ (own generators), and the sampled log-probs are real log-probs
    assert len({tuple(results[2][(3, 0, s)][0]) for s in range(4)}) > 1
    assert all(lp <= 0 for toks, lps in results[2].values() for lp in lps)


def test_prefix_sharing_prefills_a_prompt_once(tiny):
    path, tok, _ = tiny
    engine = Engine(load_model(path), tok, kv_capacity=8 * 128, max_len=128, temperature=1.0)
    p = prompts_of(tok, 1)[0]
    for _ in range(2):  # engine.stats counts one run: run() starts it from zero
        trajs = engine.run(iter_claim([Request(p, key=(0, 0, s)) for s in range(8)]), 10)
        assert engine.stats["prefill_tokens"] == len(p) and len(trajs) == 8


def test_cache_rows_too_long_are_refused(tiny):
    path, tok, _ = tiny
    engine = Engine(load_model(path), tok, kv_capacity=64, max_len=64)
    with pytest.raises(ValueError, match="does not fit"):
        engine.generate([list(range(5, 70))], 4)
    assert isinstance(engine.cache, KVCache)


def test_tokens_as_recorded_before_paging(tiny):
    """the engine as it was before the paged KV cache, recorded on this tiny model at temperature 1
    (tests/fixtures/engine_tokens_before_paging.json): with a pool that never runs out, the same seeds
    give the same tokens"""
    path, tok, _ = tiny
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "engine_tokens_before_paging.json")) as f:
        recorded = json.load(f)
    model = load_model(path)
    for name, top_p, seed in (("t1_top_p_0.9", 0.9, 7), ("t1", 1.0, 11)):
        reqs = [Request(prompts_of(tok, 6)[i // 4], key=(3, i // 4, i % 4)) for i in range(24)]
        engine = Engine(model, tok, kv_capacity=5 * 128, max_len=128, temperature=1.0, top_p=top_p, seed=seed)
        got = {repr(t.key): t.response_ids for t in engine.run(iter_claim(reqs), 40)}
        assert got == recorded[name]


def test_a_row_that_finishes_gives_its_pages_back_before_the_decode_step_takes_pages(tiny):
    # two rows in a pool of 16 pages of 4 tokens: row 0 ends (<|im_end|>) at the very step row 1 needs its 9th
    # page. The decode step's pages came before the finished row's were freed, so a full pool preempted row 1
    # (and prefilled its 32 tokens again) for pages about to come free; now it decodes on, as in a pool twice
    # the size, with the same tokens
    path, tok, _ = tiny
    model = load_model(path)
    end, stops = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    class EndsAt(torch.nn.Module):  # no stop token, but row 0 (its prompt starts with 101) ends at 32 tokens
        def __init__(self):
            super().__init__()
            self.model, self.cfg, self.first = model, model.cfg, {}  # first: each row's first prompt token

        def forward_cached(self, ids, cache, rows, last_only=False, n_new=None):
            rows = torch.as_tensor(rows).tolist()
            for b, r in enumerate(rows):
                if cache.lengths[r] == 0:
                    self.first[r] = int(ids[b, 0])
            out = self.model.forward_cached(ids, cache, rows, last_only, n_new)
            out[:, -1, stops] = float("-inf")
            for b, r in enumerate(rows):
                if self.first[r] == 101 and int(cache.lengths[r]) == 32:
                    out[b, -1, end] = float("inf")
            return out

    prompts = [[101] + list(range(200, 207)), [102] + list(range(300, 307))]  # 2 pages each
    runs = []
    for kv in (64, 128):
        engine = Engine(EndsAt(), tok, kv_capacity=kv, max_len=64, temperature=0.0, page_size=4, reserve=0.0,
                        max_rows=2)
        trajs = engine.run(iter_claim([Request(p, key=(0, i, 0)) for i, p in enumerate(prompts)]), 40)
        runs.append(([t.response_ids for t in sorted(trajs, key=lambda t: t.key)], engine.stats["preemptions"]))
    assert runs[0] == runs[1] and runs[0][1] == 0 and len(runs[0][0][0]) == 25, runs


def test_a_draw_of_zero_never_takes_a_token_of_probability_zero(monkeypatch):
    # torch.rand gives exactly 0.0 about once in 2^24 draws (a few times in an RL run's 10^8-10^9 tokens):
    # inverse-CDF sampling then found token 0, here impossible (logit -inf), or outside top-p's nucleus
    logits = torch.tensor([float("-inf"), 0.0, 1.0, -30.0])
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None: torch.zeros(shape))
    for top_p in (1.0, 0.5):
        engine = types.SimpleNamespace(top_p=top_p, device="cpu")
        rows = [types.SimpleNamespace(logits=logits, gen=None) for _ in range(2)]
        tokens, logprobs = Engine.sample(engine, rows, 1.0)
        assert tokens == [1 if top_p == 1.0 else 2] * 2 and all(lp > -30 for lp in logprobs), (top_p, tokens)


def test_a_top_p_at_most_the_most_likely_tokens_probability_samples_that_token():
    # the nucleus is the smallest set of tokens whose mass reaches top_p: the most likely token
    # alone when top_p is at most its probability (here 0.67). top_p = 0 cut every token, and the
    # draw then took the vocabulary's last token, here impossible (logit -inf, log-prob -inf)
    logits = torch.tensor([0.0, 2.0, 1.0, float("-inf")])
    for top_p in (0.5, 1e-9, 0.0):
        engine = types.SimpleNamespace(top_p=top_p, device="cpu")
        rows = [types.SimpleNamespace(logits=logits, gen=torch.Generator().manual_seed(seed))
                for seed in range(8)]
        tokens, logprobs = Engine.sample(engine, rows, 1.0)
        assert tokens == [1] * 8, (top_p, tokens)
        assert logprobs == pytest.approx([torch.log_softmax(logits, -1)[1].item()] * 8)


class ForcedTurns(torch.nn.Module):
    """The tiny model with forced turn boundaries, decided from each row's whole context, so a row that
    is prefilled again after preemption is forced exactly as before. Turn j (counted by <|im_start|>
    tokens: 3 in the prompt, 2 more per tool response) has 8-31 free tokens (the model's own; stop and
    tool tokens masked), then in turns 0 and 1 a tool call printing a number and <|im_end|>; turn 2
    ends with <|im_end|>. To the engine, just a model."""

    def __init__(self, model, tok):
        super().__init__()
        self.model, self.cfg, self.tok, self.hist = model, model.cfg, tok, {}
        self.start = tok.convert_tokens_to_ids("<|im_start|>")
        self.gp = len(tok.encode(agent.GENERATION_PROMPT, add_special_tokens=False))
        self.banned = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>", "<|im_start|>", "<tool_call>",
                                                 "</tool_call>"])
        self.seen = []  # (used pages, pages the row tables hold) before every forward

    def tail(self, h, turn):
        end = [self.tok.convert_tokens_to_ids("<|im_end|>")]
        if turn >= 2:
            return end
        call = '<tool_call>{"name": "%s", "arguments": {"code": "print(%d)", "input": ""}}</tool_call>' % (
            agent.TOOL_NAME, 10 * turn + len(h) % 7)
        return self.tok.encode(call, add_special_tokens=False) + end

    def forward_cached(self, input_ids, cache, rows, last_only=False, n_new=None):
        idx = list(range(cache.num_rows))[rows] if isinstance(rows, slice) else torch.as_tensor(rows).tolist()
        n = [input_ids.shape[1]] * len(idx) if n_new is None else list(n_new)
        if not hasattr(cache, "spied"):  # a sample that shares a prompt's pages shares its history too
            share, cache.spied = cache.share, True

            def spied_share(src, dsts):
                self.hist.update({dst: list(self.hist[src]) for dst in dsts})
                share(src, dsts)
            cache.share = spied_share
        held = {p for r in range(cache.num_rows) for p in cache.table[r, :cache.npages[r]].tolist()}
        self.seen.append((cache.num_pages - cache.free_pages(), len(held)))
        for b, r in enumerate(idx):
            new = input_ids[b, :n[b]].tolist()
            self.hist[r] = new if cache.lengths[r] == 0 else self.hist[r] + new
        logits = self.model.forward_cached(input_ids, cache, rows, last_only, n_new)
        for b, r in enumerate(idx):
            h = self.hist[r]
            starts = [i for i, t in enumerate(h) if t == self.start]
            turn, begin = (len(starts) - 3) // 2, starts[-1] + self.gp
            k = len(h) - begin  # tokens of this turn so far
            free = 8 + (sum(h[:begin]) + turn) % 24
            lg = logits[b, -1]
            if k < free:
                lg[self.banned] = float("-inf")
            else:
                # the forced tail is fixed by the context at the turn's start
                want = self.tail(h[:begin + free], turn)[k - free]
                lg.fill_(float("-inf"))
                lg[want] = 0.0
        return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_tools", [False, True])
def test_preempted_rows_continue_token_for_token(tiny, temperature, with_tools):
    """a pool so small that rows are preempted again and again gives the same trajectories as a pool
    that holds every row's whole budget; the pool is never exceeded and is empty after the run"""
    path, tok, _ = tiny
    model = load_model(path)
    prompts = [data.render_prompt(tok, q) for q in QUESTIONS[:6]]
    reqs = [Request(prompts[i // 2], key=(1, i // 2, i % 2)) for i in range(12)]
    results = {}
    for name, kv, reserve in (("large", 12 * 320, 1.0), ("small", 320, 0.0)):
        forced = ForcedTurns(model, tok)
        tools = SlowTools({"print(%d)" % v: 0.02 * (v % 3) for v in range(20)}) if with_tools else None
        engine = Engine(forced, tok, kv_capacity=kv, max_len=320, temperature=temperature, seed=5, sandbox=tools,
                        reserve=reserve, max_rows=12, page_size=4)
        trajs = engine.run(iter_claim(reqs), 280)
        results[name] = {t.key: t for t in trajs}
        assert len(trajs) == 12
        # the pool: pages in use are exactly the pages the row tables hold, never more than the pool
        assert all(used == held <= engine.cache.num_pages for used, held in forced.seen)
        assert engine.cache.free_pages() == engine.cache.num_pages and not any(engine.cache.refs)
        results[name + "_stats"] = dict(engine.stats)
    assert results["large_stats"]["preemptions"] == 0
    small = results["small_stats"]
    assert small["preemptions"] >= (15 if with_tools else 5) and small["recomputed_tokens"] > 0
    for key, a in results["large"].items():
        b = results["small"][key]
        assert (a.response_ids, a.mask, a.finish, a.turns) == (b.response_ids, b.mask, b.finish, b.turns)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [c.output for c in a.tool_calls] == [c.output for c in b.tool_calls]
        assert a.turns == (3 if with_tools else 1) and a.finish == "stop"
    if temperature == 1.0:  # the samples of a prompt really were sampled
        assert any(results["large"][(1, p, 0)].response_ids != results["large"][(1, p, 1)].response_ids
                   for p in range(6))


def test_samples_of_a_prompt_hold_its_pages_once(tiny):
    path, tok, _ = tiny
    p = data.render_prompt(tok, QUESTIONS[1])[:-5]  # 2 full pages of 16 and a partial one
    assert len(p) % 16 and len(p) > 32
    engine = Engine(load_model(path), tok, kv_capacity=8 * 128, max_len=128, temperature=1.0)
    seen = []
    real = engine.model.forward_cached

    def spy(ids, cache, rows, last_only=False, n_new=None):
        seen.append((ids.shape[1], cache.num_pages - cache.free_pages()))
        return real(ids, cache, rows, last_only, n_new)
    engine.model.forward_cached = spy
    try:
        trajs = engine.run(iter_claim([Request(p, key=(0, 0, s)) for s in range(8)]), 10)
    finally:
        del engine.model.forward_cached
    assert len(trajs) == 8 and engine.stats["prefill_tokens"] == len(p)
    full = len(p) // 16
    # at the first decode step: the prompt's full pages once, and one partly filled page per sample
    # (8 private copies would hold 8 x 3 pages)
    assert seen[1] == (1, full + 8)
    assert engine.cache.free_pages() == engine.cache.num_pages


def test_whole_budget_reservations_admit_as_many_rows_as_before(tiny):
    """reserve=1 is the engine before paging: kv_capacity // max_len rows decode at once, whatever the
    page size, and nothing is ever preempted"""
    path, tok, _ = tiny
    model = load_model(path)
    for page_size in (16, 7):  # 7 does not divide max_len: whole rows round up to whole pages
        engine = Engine(model, tok, kv_capacity=5 * 100, max_len=100, temperature=1.0, reserve=1.0,
                        page_size=page_size)
        engine.stop_ids = set()
        reqs = [Request(prompts_of(tok, 5)[i % 5], key=(0, i, 0)) for i in range(10)]
        engine.run(iter_claim(reqs), 20)
        assert engine.num_rows == 5 and engine.stats["preemptions"] == 0
        assert engine.stats["decode_steps"] == 2 * 19  # two rounds of 5 rows, each 20 tokens (the first sampled)


def test_auto_reserve_follows_what_the_runs_rows_used(tiny):
    """reserve="auto": when rows end early more of them share the KV than under the fixed reserve, when
    they run to their budget the promise grows past the prior; the trajectories are those of a roomy
    engine, the pool is never exceeded, and a second run repeats the first's batches exactly"""
    path, tok, _ = tiny
    model = load_model(path)
    reqs = [Request(prompts_of(tok, 6)[i % 6], key=(0, i, 0)) for i in range(24)]
    roomy = Engine(model, tok, kv_capacity=24 * 128, max_len=128, temperature=1.0, reserve=1.0)

    def run(engine, stop):
        engine.stop_ids, seen = stop, []
        with watching(model, lambda ids, cache: seen.append(sum(cache.holds(r) for r in range(cache.num_rows)))):
            trajs = engine.run(iter_claim(reqs), 60)
        assert engine.cache.free_pages() == engine.cache.num_pages
        return {t.key: t.response_ids for t in trajs}, max(seen)

    short = set(range(len(tok)))  # every token ends the turn: responses of 1 token
    for stop in (short, set()):
        want, _ = run(roomy, stop)
        fixed = Engine(model, tok, kv_capacity=4 * 128, max_len=128, temperature=1.0, reserve=0.5, max_rows=24)
        auto = Engine(model, tok, kv_capacity=4 * 128, max_len=128, temperature=1.0, reserve="auto", max_rows=24,
                      log_events=True)
        (got_fixed, rows_fixed), (got_auto, rows_auto) = run(fixed, stop), run(auto, stop)
        assert got_fixed == got_auto == want
        if stop:
            # 1-token answers: the promise falls from half the prior towards nothing
            assert rows_auto > rows_fixed and auto.pager.share({}) < 0.05
        else:
            # every row uses its whole budget: half of it is promised once the run has seen that
            assert auto.pager.share({}) == 0.5 and auto.stats["preemptions"] > 0
        first = [e[1:] for e in auto.events]
        run(auto, stop)
        assert [e[1:] for e in auto.events[len(first):]] == first  # same admissions, same batches
    with pytest.raises(ValueError, match="auto"):
        Engine(model, tok, kv_capacity=512, max_len=128, reserve="adaptive")


def test_iter_claim_takes_requests_in_order_and_makes_each_only_when_claimed():
    from scheduler import Lazy
    made = []
    claim = iter_claim(Lazy(5, lambda i: made.append(i) or i))
    assert claim(2) == [0, 1] and made == [0, 1]  # nothing made ahead of its claim
    assert claim(2) == [2, 3] and claim(2) == [4] and claim(2) == [] and made == [0, 1, 2, 3, 4]
    assert iter_claim([7, 8])(0) == []

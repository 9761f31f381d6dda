"""The rollout engine against transformers' greedy decoding, its tool loop, KV limits and seeding."""
import concurrent.futures
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
    return [agent.render_prompt(tok, QUESTIONS[i % len(QUESTIONS)])[: 20 + 5 * i] for i in range(n)]


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
        real = model.forward_cached
        model.forward_cached = lambda ids, *a, **k: forwards.append(ids.shape) or real(ids, *a, **k)
        try:
            outs = engine.generate(prompts, max_new_tokens=24)
        finally:
            del model.forward_cached
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
    prompts = [agent.render_prompt(tok, q) for q in QUESTIONS[:3]]
    scripts = {tuple(p): scripted(tok, v, extra) for p, v, extra in zip(prompts, (11, 22, 33), (0, 30, 30))}
    tools = SlowTools({"print(11)": 0.5})  # row 0's tool is slow, the others answer at once
    engine = Engine(Script(scripts, len(tok)), tok, kv_capacity=3 * 400, max_len=400, temperature=0.0,
                    tools=tools, log_events=True)
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
        assert t.tool_calls[0]["status"] == "ok" and t.tool_calls[0]["output"] == v
        text = tok.decode(t.response_ids)
        assert text.count("<tool_response>") == 1 and f"<tool_response>\n{v}\n</tool_response>" in text
        assert agent.extract_answer(text) == v
        # the loss mask is 1 exactly on the scripted (sampled) tokens
        assert [i for i, m in zip(t.response_ids, t.mask) if m] == scripts[tuple(t.prompt_ids)]
        assert t.prompt_ids + t.response_ids == agent.render_prompt(tok, QUESTIONS[t.key[1]]) + t.response_ids


def test_budget_counts_tool_tokens_and_max_turns(tiny):
    _, tok, _ = tiny
    p = agent.render_prompt(tok, QUESTIONS[0])
    script = scripted(tok, 11, 0)
    turn1 = script.index(tok.convert_tokens_to_ids("<|im_end|>")) + 1
    # the last case: the tool response does not fit, so the row finishes while being resumed
    for budget, max_turns, want in ((len(script) + 40, 10, "stop"), (len(script) - 3, 10, "length"),
                                    (len(script) + 40, 1, "max_turns"), (turn1 + 3, 10, "length")):
        engine = Engine(Script({tuple(p): script}, len(tok)), tok, kv_capacity=2 * 400, max_len=400,
                        temperature=0.0, tools=SlowTools({}), max_turns=max_turns)
        (t,) = engine.run(iter_claim([Request(p)]), budget)
        assert t.finish == want and len(t.response_ids) <= budget
        assert t.response_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") or want == "length"


def test_kv_capacity_never_exceeded_and_seeding_ignores_batch_composition(tiny):
    path, tok, _ = tiny
    model = load_model(path)
    reqs = [Request(prompts_of(tok, 6)[i // 4], key=(3, i // 4, i % 4)) for i in range(24)]
    results = {}
    for rows in (2, 5):
        engine = Engine(model, tok, kv_capacity=rows * 128, max_len=128, temperature=1.0, top_p=0.9, seed=7)
        capacity = engine.num_rows * engine.max_len
        seen = []
        real = model.forward_cached

        def checked(ids, cache, idx, last_only=False, n_new=None):
            out = real(ids, cache, idx, last_only, n_new)
            assert int(cache.lengths.sum()) <= capacity and int(cache.lengths.max()) <= cache.max_len
            seen.append(int((cache.lengths > 0).sum()))
            return out
        model.forward_cached = checked
        try:
            trajs = engine.run(iter_claim(reqs), 40)
        finally:
            del model.forward_cached
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

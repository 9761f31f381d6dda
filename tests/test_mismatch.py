"""The engine's sampling-time log-probs against the trainer's, both in fp32 on CPU: two programs (per-row
KV-cache decoding with batched prefills vs one forward over whole packed or padded trajectories) that must
agree on every sampled token of multi-turn trajectories with tool responses in between."""
import concurrent.futures
import types

import pytest
import torch
import transformers

import agent
import data
from model import collate, load_model, token_logprobs
from rollout import Engine, Request, iter_claim

QUESTIONS = ["What is 12 + 7?", "What is 123 * 98 - 5?", "What is 3 - 4 * 5 + 6?", "What is 8 * 8?"]


class EchoTools:
    """Answers every call at once with what print() would show."""

    def submit(self, code, stdin):
        fut = concurrent.futures.Future()
        fut.set_result(types.SimpleNamespace(status="ok", stdout=code[6:-1] + "\n", stderr="", value="",
                                             duration=0.01))
        return fut


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("mismatch")
    call = '<tool_call>\n{"name": "%s", "arguments": {"code": "print(1)", "input": ""}}\n</tool_call>' % agent.TOOL_NAME
    tok = data.train_tokenizer([agent.prompt_text(q) + call + "<|im_end|>" for q in QUESTIONS], vocab_size=1000)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return load_model(str(d), dtype=torch.float32).eval(), tok


def test_fp32_engine_and_trainer_logprobs_agree(tiny, monkeypatch):
    model, tok = tiny
    # the first two turns of every rollout are forced tool calls (with the model's own log-prob of each
    # forced token, as the engine records it); the rest is sampled until the budget ends it
    turn = tok.encode('<reason>go</reason>\n<tool_call>\n{"name": "%s", "arguments": {"code": "print(%d)", '
                      '"input": ""}}\n</tool_call><|im_end|>' % (agent.TOOL_NAME, 42), add_special_tokens=False)
    sample = Engine.sample

    def forced(self, rows, temperature):
        logits = [r.logits for r in rows]
        toks, lps = sample(self, rows, temperature)
        for i, (r, lg) in enumerate(zip(rows, logits)):
            pos = len(r.traj.response_ids) - r.turn_start
            if r.traj.turns < 2 and pos < len(turn):
                toks[i], lps[i] = turn[pos], torch.log_softmax(lg, -1)[turn[pos]].item()
        return toks, lps
    monkeypatch.setattr(Engine, "sample", forced)
    engine = Engine(model, tok, kv_capacity=8 * 700, max_len=700, temperature=1.0, sandbox=EchoTools(), max_turns=5)
    reqs = [Request(data.render_prompt(tok, q), key=(0, i, s)) for i, q in enumerate(QUESTIONS) for s in range(2)]
    trajs = engine.run(iter_claim(reqs), 200)
    assert all(t.turns >= 2 and len(t.tool_calls) == 2 for t in trajs)
    assert all(0 in t.mask[t.mask.index(1):] for t in trajs)  # tool tokens sit between sampled ones

    seqs = []
    for t in trajs:
        ids = t.prompt_ids + t.response_ids
        pad = [0] * (len(t.prompt_ids) - 1)
        seqs.append({"ids": ids[:-1], "tgt": ids[1:], "mask": pad + t.mask, "engine_logprobs": pad + t.logprobs})
    for packed in (False, True):  # padded rows (SDPA's path) and one packed row (flash-attn's layout)
        m = collate(seqs, "cpu", packed)
        with torch.no_grad():
            lp = token_logprobs(model, m["ids"], m["tgt"], m["seg"])
        mask = m["mask"].bool()
        gap = (lp - m["engine_logprobs"].float())[mask].abs()
        assert mask.sum() > 300 and gap.max() <= 1e-4, (packed, gap.max())

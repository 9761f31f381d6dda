"""agent.py against the reference: the released chat template (rendered by transformers), math-verify,
hand-written expectations for parsing, truncation and answer extraction."""

import json
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import agent
import data
from sandbox import SandboxPool

REF = Path(__file__).resolve().parent / "fixtures"  # copies of the released template and tool schema
TEMPLATE = (REF / "rstar2_chat_template.jinja").read_text()
SCHEMA = json.loads((REF / "rstar2_tool_schema.json").read_text())


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    with SandboxPool(workers=1) as pool:  # real tool outputs, tracebacks included
        convs = [data.sft_conversation(p, rng, pool.map, error_rate=0.5) for p in data.make_problems(200, 0)]
    return data.train_tokenizer(["".join(t for t, _ in agent.conversation_segments(c)) for c in convs])


def reference(tok, messages, gen=True, tokenize=False):
    return tok.apply_chat_template(messages, tools=[SCHEMA], chat_template=TEMPLATE, add_generation_prompt=gen,
                                   tokenize=tokenize, return_dict=False)


def call(code, **extra):
    args = {"code": code, "input": ""} | extra
    return {"type": "function", "function": {"name": agent.TOOL_NAME, "arguments": args}}

# -----------------------------------------------------------------------------
# prompt and tool turns == the reference template


def test_constants_match_reference():
    assert agent.TOOL_SCHEMA == SCHEMA
    assert list(agent.TOOL_SCHEMA["function"]) == list(SCHEMA["function"])  # key order shows in the prompt
    assert agent.SYSTEM_PROMPT in TEMPLATE


@pytest.mark.parametrize("question", ["What is 12 * 34?", "Find $x$ if \\frac{x}{2} = {3}.\nExplain.", "√2 ≈ ?  {}"])
def test_prompt_matches_reference(tok, question):
    messages = [{"role": "user", "content": question}]
    assert agent.prompt_text(question) == reference(tok, messages)
    assert agent.render_prompt(tok, question) == reference(tok, messages, tokenize=True)
    assert agent.prompt_text(question).endswith("<|im_start|>assistant\n<reason>")
    sys_messages = [{"role": "system", "content": "Be brief."}] + messages
    assert agent.prompt_text(question, system="Be brief.") == reference(tok, sys_messages)


def test_tool_suffix_matches_reference(tok):
    q, turn = "What is 2 + 3?", "<reason>use python</reason>"
    calls = [call("print(2 + 3)"), call("x = input()\nprint(x)", input="7")]
    messages = [{"role": "user", "content": q},
                {"role": "assistant", "content": turn, "tool_calls": calls},
                {"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    turn_text = (turn[len("<reason>"):] + '\n<tool_call>\n{"name": "execute_python_code_with_standard_io", "arguments": '
                 '{"code": "print(2 + 3)", "input": ""}}\n</tool_call>\n<tool_call>\n{"name": '
                 '"execute_python_code_with_standard_io", "arguments": {"code": "x = input()\\nprint(x)", "input": "7"}}'
                 '\n</tool_call>')
    want = reference(tok, messages)
    assert agent.prompt_text(q) + turn_text + "<|im_end|>" + agent.tool_suffix_text(["5", "7"]) == want
    suffix = agent.tool_suffix_ids(tok, ["5", "7"])
    assert tok.decode(suffix) == agent.tool_suffix_text(["5", "7"])
    assert suffix[-1] == tok.convert_tokens_to_ids("<reason>")
    # the calls the template rendered parse back to the same code and stdin
    parsed = agent.parse_tool_calls(turn_text, max_calls=2)
    assert parsed == [agent.ToolCall("print(2 + 3)", ""), agent.ToolCall("x = input()\nprint(x)", "7")]
    with pytest.raises(ValueError, match="non-empty"):
        agent.tool_suffix_ids(tok, [])

# -----------------------------------------------------------------------------
# SFT rendering


def test_render_conversation_ids_and_mask(tok):
    final = "<reason>done</reason>\n<answer>\\boxed{5}</answer>"
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "<reason>typo first</reason>", "tool_calls": [call("prnt(2 + 3)")]},
                {"role": "tool", "content": "NameError: name 'prnt' is not defined"},
                {"role": "assistant", "content": "<reason>fixed</reason>",
                 "tool_calls": [{"type": "function", "function": {"name": agent.TOOL_NAME,
                                                                  "arguments": json.dumps({"code": "print(2 + 3)"})}}]},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": final}]
    ids, mask = agent.render_conversation(tok, messages)
    assert len(ids) == len(mask)
    # same text as the reference template up to the final turn (whose rendering there is the quirk)
    # (the template tojson-s a string of arguments a second time, so hand it the parsed object)
    fixed = dict(messages[3], tool_calls=[{"type": "function", "function": {"name": agent.TOOL_NAME, "arguments": {"code": "print(2 + 3)"}}}])
    want = reference(tok, messages[:3] + [fixed, messages[4]]) + final[len("<reason>"):] + "<|im_end|>"
    assert tok.decode(ids) == want
    # the prompt comes first, all mask 0
    prompt = agent.render_prompt(tok, "What is 2 + 3?")
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    # mask 1 exactly on the three assistant turns, each a contiguous run ending in <|im_end|>
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert [tok.decode(r) for r in runs] == [
        "typo first</reason>\n<tool_call>\n" + json.dumps({"name": agent.TOOL_NAME, "arguments": {"code": "prnt(2 + 3)", "input": ""}}) + "\n</tool_call><|im_end|>",
        "fixed</reason>\n<tool_call>\n" + json.dumps({"name": agent.TOOL_NAME, "arguments": {"code": "print(2 + 3)"}}) + "\n</tool_call><|im_end|>",
        "done</reason>\n<answer>\\boxed{5}</answer><|im_end|>"]
    assert mask[-1] == 1 and ids[-1] == tok.eos_token_id
    # the tool outputs and forced prefixes are never trained
    assert all(m == 0 for i, m in zip(ids, mask) if i == tok.convert_tokens_to_ids("<tool_response>"))


@pytest.mark.parametrize("messages, where", [
    ([{"role": "bot", "content": "x"}], "message 0: unknown role"),
    ([{"role": "assistant", "content": "<reason>x"}], "message 0: expected the user"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "no tag"}], "message 1: assistant content must"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "5"}], "message 1: tool message without"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a</reason>"},
      {"role": "tool", "content": "5"}], "message 2: the conversation goes on"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [call("1")]},
      {"role": "tool", "content": "5"}], "message 2: the conversation must end"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [call("1"), call("2")]},
      {"role": "tool", "content": "5"}, {"role": "assistant", "content": "<reason>b"}], "message 2: 1 tool message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [{"type": "function"}]}],
     "message 1: tool call needs"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}], "message 1: unexpected user"),
    ([{"role": "user", "content": 3}], "message 0: user content must be a string"),
    ([{"role": "user", "content": "q"}], "the conversation must end"),
])
def test_render_conversation_errors(tok, messages, where):
    with pytest.raises(ValueError, match=where):
        agent.render_conversation(tok, messages)

# -----------------------------------------------------------------------------
# tool calls and tool responses


def test_parse_tool_calls():
    def block(obj):
        return "<tool_call>\n" + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n</tool_call>"
    ok = {"name": agent.TOOL_NAME, "arguments": {"code": "print(1)", "input": "x"}}
    assert agent.parse_tool_calls("<reason>a</reason>" + block(ok)) == [agent.ToolCall("print(1)", "x")]
    assert agent.parse_tool_calls("no call here") == []
    # input is optional, arguments may arrive as a JSON string
    assert agent.parse_tool_calls(block({"name": agent.TOOL_NAME, "arguments": {"code": "1"}})) == [agent.ToolCall("1", "")]
    assert agent.parse_tool_calls(block({"name": agent.TOOL_NAME, "arguments": json.dumps({"code": "2"})})) == [agent.ToolCall("2", "")]
    errors = {
        "{not json": "Failed to decode tool call",
        json.dumps([1, 2]): '"name" and "arguments"',
        json.dumps({"name": "bash", "arguments": {"code": "ls"}}): "Unknown tool 'bash'",
        json.dumps({"name": agent.TOOL_NAME, "arguments": {"input": ""}}): '"code" as a string (it is missing)',
        json.dumps({"name": agent.TOOL_NAME, "arguments": {"code": 5}}): '"code" as a string',
        json.dumps({"name": agent.TOOL_NAME, "arguments": {"code": "1", "input": 3}}): '"input" must be a string',
        json.dumps({"name": agent.TOOL_NAME, "arguments": "{bad"}): "Failed to decode tool call arguments",
        json.dumps({"name": agent.TOOL_NAME, "arguments": [1]}): "must be a JSON object",
    }
    for text, msg in errors.items():
        (out,) = agent.parse_tool_calls(block(text))
        assert isinstance(out, str) and msg in out, (text, out)
    # every block gets one answer: calls beyond max_calls are answered "skipped", never dropped
    three = block(ok) + "\n" + block("{bad") + block(ok)
    out = agent.parse_tool_calls(three, max_calls=1)
    assert out[0] == agent.ToolCall("print(1)", "x") and all("skipped" in o for o in out[1:]) and len(out) == 3
    out = agent.parse_tool_calls(three, max_calls=2)
    assert out[0] == agent.ToolCall("print(1)", "x") and "Failed to decode" in out[1] and "skipped" in out[2]
    # a call that was never closed is answered as well
    out = agent.parse_tool_calls(block(ok) + '<tool_call>\n{"name": ', max_calls=2)
    assert len(out) == 2 and "not closed" in out[1]
    with pytest.raises(ValueError, match="max_calls"):
        agent.parse_tool_calls("", max_calls=0)


def test_truncate():
    assert agent.truncate("short", 10) == "short"
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    out = agent.truncate(text, 20)
    assert out == text[:10] + "\n...(truncated 80 chars)...\n" + text[-10:]
    assert agent.truncate("abcde", 3) == "a\n...(truncated 2 chars)...\nde"
    with pytest.raises(ValueError, match="max_chars"):
        agent.truncate("abc", 0)


def result(status, stdout="", stderr="", value="", duration=0.1):
    return SimpleNamespace(status=status, stdout=stdout, stderr=stderr, value=value, duration=duration)


def test_tool_response_text():
    assert agent.tool_response_text(result("ok", stdout="42\n")) == "42"
    assert agent.tool_response_text(result("ok", value="(17, 110)")) == "(17, 110)"  # trailing expression
    assert agent.tool_response_text(result("ok", stdout="1\n", value="")) == "1"
    assert agent.tool_response_text(result("ok", value="3", stderr="Warning: x\n")) == "3\nWarning: x"
    assert "print()" in agent.tool_response_text(result("ok"))
    tb = "Traceback (most recent call last):\n  File \"<code>\", line 1\nNameError: name 'prnt' is not defined\n"
    assert agent.tool_response_text(result("error", stdout="partial", stderr=tb)) == "partial\n" + tb.rstrip("\n")
    t = agent.tool_response_text(result("timeout", duration=10.0))
    assert "10.0 s" in t and "Timeout" in t
    assert "memory" in agent.tool_response_text(result("memory"))
    assert "crashed" in agent.tool_response_text(result("crash"))
    assert "Segmentation fault" in agent.tool_response_text(result("crash", stderr="Segmentation fault"))
    assert "overloaded" in agent.tool_response_text(result("overloaded"))
    long = agent.tool_response_text(result("ok", stdout="7" * 5000), max_chars=100)
    assert long == "7" * 50 + "\n...(truncated 4900 chars)...\n" + "7" * 50
    with pytest.raises(ValueError, match="unknown sandbox result status 'weird'"):
        agent.tool_response_text(result("weird"))

# -----------------------------------------------------------------------------
# answers and reward


def test_extract_answer():
    assert agent.extract_answer("<answer>\\boxed{42}</answer>") == "42"
    assert agent.extract_answer("<answer>so \\boxed{\\frac{1}{2}} ok</answer>") == "\\frac{1}{2}"
    assert agent.extract_answer("<answer>\\boxed{1} then \\boxed{2}</answer>") == "2"  # the final boxed
    assert agent.extract_answer("<answer>\\boxed{\\{1, 2\\}}</answer>") == "\\{1, 2\\}"  # escaped braces
    assert agent.extract_answer("<answer>\\boxed{3</answer>") is None  # unbalanced
    assert agent.extract_answer("<answer>42</answer>") is None  # no boxed
    assert agent.extract_answer("\\boxed{42}") is None  # boxed outside <answer> does not count
    assert agent.extract_answer("\\boxed{1} <answer>\\boxed{2}</answer> \\boxed{3}") == "2"
    assert agent.extract_answer("<answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>") == "2"  # last block
    assert agent.count_answers("<answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>") == 2
    assert agent.count_answers("<answer>unclosed") == 0


def test_reward():
    def r(inner, gold):
        return agent.reward(f"<reason>...</reason>\n<answer>{inner}</answer>", gold)
    assert r("\\boxed{110}", "110") == 1.0
    assert r("\\boxed{-0012}", "-12") == 1.0
    assert r("\\boxed{111}", "110") == 0.0
    assert r("\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # math-verify
    assert r("\\boxed{\\frac{1}{2}}", "1/2") == 1.0
    assert r("\\boxed{\\dfrac12}", "\\frac{1}{2}") == 1.0
    assert r("\\boxed{\\frac{1}{3}}", "0.5") == 0.0
    assert r("\\boxed{1,000}", "1000") == 1.0
    assert agent.reward("<reason>the answer is \\boxed{110}</reason>", "110") == 0.0  # missing <answer>
    assert agent.reward("\\boxed{110} <answer>\\boxed{7}</answer>", "110") == 0.0  # boxed outside <answer>
    assert agent.reward("<answer>\\boxed{7}</answer> <answer>\\boxed{110}</answer>", "110") == 1.0  # last counts
    assert agent.reward("<answer>\\boxed{110}</answer> <answer>\\boxed{7}</answer>", "110") == 0.0
    with pytest.raises(ValueError, match="gold answer must be a string"):
        agent.reward("<answer>\\boxed{1}</answer>", 1)


@pytest.mark.timeout(120)  # a hang fails here, not at the suite-wide limit
def test_reward_never_hangs():
    agent.reward("<answer>\\boxed{\\frac{2}{4}}</answer>", "0.5")  # helper started, so timing below is verify only
    for bomb in ["9^{9^{9^{9}}}", "(10^{8})!"]:
        t0 = time.time()
        assert agent.reward(f"<answer>\\boxed{{{bomb}}}</answer>", "1", timeout=1.0) == 0.0
        assert time.time() - t0 < 5.0, bomb
    # the helper was killed and comes back for the next call
    assert agent.reward("<answer>\\boxed{\\frac{1}{2}}</answer>", "0.5") == 1.0


def test_reward_from_threads():
    out = {}

    def work(k, inner, gold):
        out[k] = agent.reward(f"<answer>\\boxed{{{inner}}}</answer>", gold)
    cases = [("\\frac{3}{4}", "0.75", 1.0), ("\\sqrt{4}", "2", 1.0), ("\\frac{1}{5}", "0.25", 0.0), ("12", "12", 1.0)]
    threads = [threading.Thread(target=work, args=(k, a, g)) for k, (a, g, _) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out == {k: want for k, (_, _, want) in enumerate(cases)}

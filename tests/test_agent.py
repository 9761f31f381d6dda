"""agent.py against the reference: the released chat template (rendered by transformers), math-verify,
hand-written expectations for parsing, truncation and answer extraction."""

import dataclasses
import json
import random
import re
import time
from pathlib import Path

import pytest

import agent
import data
import grading
import sandbox
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


@pytest.mark.release
def test_constants_match_reference():
    assert agent.TOOL_SCHEMA == SCHEMA
    assert list(agent.TOOL_SCHEMA["function"]) == list(SCHEMA["function"])  # key order shows in the prompt
    assert agent.SYSTEM_PROMPT in TEMPLATE


@pytest.mark.release
@pytest.mark.parametrize("question", ["What is 12 * 34?", "Find $x$ if \\frac{x}{2} = {3}.\nExplain.", "√2 ≈ ?  {}"])
def test_prompt_matches_reference(tok, question):
    messages = [{"role": "user", "content": question}]
    assert agent.prompt_text(question) == reference(tok, messages)
    assert data.render_prompt(tok, question) == reference(tok, messages, tokenize=True)
    assert agent.prompt_text(question).endswith("<|im_start|>assistant\n<reason>")
    sys_messages = [{"role": "system", "content": "Be brief."}] + messages
    assert agent.prompt_text(question, system="Be brief.") == reference(tok, sys_messages)


def release_tool_turn(tok, texts):
    """The release's tool turn (rstar2_agent_loop.py): the tool messages rendered alone with the template and
    a generation prompt, minus the ids of the rendered empty conversation (its default system turn)."""
    system = tok.apply_chat_template([{}], chat_template=TEMPLATE, add_generation_prompt=False, tokenize=True,
                                     return_dict=False)
    turn = tok.apply_chat_template([{"role": "tool", "content": t} for t in texts], chat_template=TEMPLATE,
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    assert turn[:len(system)] == system
    return turn[len(system):]


@pytest.mark.release
def test_tool_suffix_matches_release(tok):
    for texts in (["5"], ["5", "Tool call success\nstdout: 7\n\nexecution time: 0.01s"]):
        assert agent.tool_suffix_ids(tok, texts) == release_tool_turn(tok, texts)
    # no "\n" after the model's <|im_end|>: the release's token stream differs from the template's
    # rendering of the whole conversation exactly there
    q, turn = "What is 2 + 3?", "<reason>use python</reason>"
    calls = [call("print(2 + 3)"), call("x = input()\nprint(x)", input="7")]
    messages = [{"role": "user", "content": q},
                {"role": "assistant", "content": turn, "tool_calls": calls},
                {"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    turn_text = (turn[len("<reason>"):] + '\n<tool_call>\n{"name": "execute_python_code_with_standard_io", "arguments": '
                 '{"code": "print(2 + 3)", "input": ""}}\n</tool_call>\n<tool_call>\n{"name": '
                 '"execute_python_code_with_standard_io", "arguments": {"code": "x = input()\\nprint(x)", "input": "7"}}'
                 '\n</tool_call>')
    ours = agent.prompt_text(q) + turn_text + "<|im_end|>" + agent.tool_suffix_text(["5", "7"])
    assert ours.replace("<|im_end|><|im_start|>user", "<|im_end|>\n<|im_start|>user") == reference(tok, messages)
    suffix = agent.tool_suffix_ids(tok, ["5", "7"])
    assert tok.decode(suffix) == agent.tool_suffix_text(["5", "7"])
    assert suffix[0] == tok.convert_tokens_to_ids("<|im_start|>") and suffix[-1] == tok.convert_tokens_to_ids("<reason>")
    # the calls the template rendered parse back to the same code and stdin
    parsed = [started(c) for c in agent.parse_tool_calls(turn_text, max_calls=2)]
    assert parsed == [("print(2 + 3)", ""), ("x = input()\nprint(x)", "7")]
    with pytest.raises(ValueError, match="non-empty"):
        agent.tool_suffix_ids(tok, [])

# -----------------------------------------------------------------------------
# SFT rendering


@pytest.mark.release
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
    # ... but for the "\n" the template puts after each <|im_end|> that a tool turn follows (the release has none)
    text = tok.decode(ids)
    assert text.count("<|im_end|><|im_start|>user\n<tool_response>") == 2
    assert text.replace("<|im_end|><|im_start|>user", "<|im_end|>\n<|im_start|>user") == want
    # the prompt comes first, all mask 0
    prompt = data.render_prompt(tok, "What is 2 + 3?")
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
    ([{"role": "assistant", "content": "<reason>x"}], "message 0: assistant message before any user"),
    ([{"role": "system", "content": "s"}, {"role": "system", "content": "s2"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "<reason>x"}], "message 1: expected the user"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "no tag"}], "message 1: assistant content must"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "5"}], "message 1: tool message without"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a</reason>"},
      {"role": "tool", "content": "5"}], "message 2: tool message without"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a</reason>"},
      {"role": "assistant", "content": "<reason>b</reason>"}], "message 2: the conversation goes on"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [call("1")]},
      {"role": "tool", "content": "5"}], "message 2: the conversation must end"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [call("1"), call("2")]},
      {"role": "tool", "content": "5"}, {"role": "assistant", "content": "<reason>b"}], "message 3: assistant message while 1 tool call"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [{"type": "function"}]}],
     "message 1: a tool call needs"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "<reason>a"}],
     "message 1: unexpected user"),
    # a user turn follows only a turn without calls (an environment's reply), never a tool message
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<reason>a", "tool_calls": [call("1")]},
      {"role": "tool", "content": "5"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "<reason>b"}],
     "message 3: unexpected user"),
    ([{"role": "user", "content": 3}], "message 0: user content must be a string"),
    ([{"role": "user", "content": "q"}], "the conversation must end"),
])
def test_render_conversation_errors(tok, messages, where):
    with pytest.raises(ValueError, match=where):
        agent.render_conversation(tok, messages)

# -----------------------------------------------------------------------------
# tool calls and tool responses, as the release parses and answers them


def block(obj):
    return "<tool_call>\n" + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n</tool_call>"


OK_CALL = {"name": agent.TOOL_NAME, "arguments": {"code": "print(1)", "input": "x"}}
RETRIES = "Error when executing tool: run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts."


class Submits:
    """A sandbox pool that only records what it was asked to run: submit(code, stdin) -> (code, stdin)."""
    def submit(self, code, stdin=""):
        return code, stdin


def started(call, tools=agent.PYTHON_TOOLS):
    """One parsed call through agent.start_call: (code, stdin) it ran, or the text it was answered with."""
    rec, run = agent.start_call(call, tools, Submits())
    assert (run is None) == (rec.status == "invalid")
    return rec.output if run is None else run


def answered(text, max_calls=1):
    return [started(c) for c in agent.parse_tool_calls(text, max_calls)]


@pytest.mark.release
def test_parse_tool_calls():
    assert answered("<reason>a</reason>\n" + block(OK_CALL) + "<|im_end|>") == [("print(1)", "x")]
    (call,) = agent.parse_tool_calls(block(OK_CALL))
    assert call == agent.ToolCall(agent.TOOL_NAME, {"code": "print(1)", "input": "x"})
    assert agent.parse_tool_calls("no call here") == []
    # the release runs what it can: missing "code" runs empty code, missing or null "input" is no stdin
    def args(a):
        return block({"name": agent.TOOL_NAME, "arguments": a})
    assert answered(args({"code": "1"})) == [("1", "")]
    assert answered(args({"code": "1", "input": None})) == [("1", "")]
    assert answered(args({"input": "5"})) == [("", "5")]
    # what the release answers instead (tool_parser.py, rstar2_agent_loop.py _call_tool, code_judge_tool.py):
    # the text of the exception its code raises
    answers = {
        block("{not json"): "Failed to decode tool call: Expecting property name enclosed in double quotes: "
                            "line 2 column 2 (char 2)",  # the block is not stripped: line 2
        block(""): "Failed to decode tool call: Expecting value: line 3 column 1 (char 2)",
        block([1, 2]): "Failed to decode tool call: list indices must be integers or slices, not str",
        block({"name": agent.TOOL_NAME}): "Failed to decode tool call: 'arguments'",
        block({"arguments": {"code": "1"}}): "Failed to decode tool call: 'name'",
        block({"name": "bash", "arguments": {"code": "ls"}}): "Error when executing tool: 'bash'",
        block({"name": "python_code_with_standard_io", "arguments": {"code": "1"}}):
            "Error when executing tool: 'python_code_with_standard_io'",
        args(json.dumps({"code": "2", "input": ""})): "Error when executing tool: 'str' object has no attribute 'get'",
        args([1]): "Error when executing tool: 'list' object has no attribute 'get'",
        args({"code": 5}): "Error when executing tool: 'int' object has no attribute 'encode'",
        args({"code": None}): "Error when executing tool: 'NoneType' object has no attribute 'encode'",
        # a lone surrogate (a JSON escape) cannot be encoded: the client raises, nothing runs
        args({"code": "print('\ud800')"}): "Error when executing tool: 'utf-8' codec can't encode character "
                                           "'\\ud800' in position 7: surrogates not allowed",
        args({"code": "1", "input": 3}): RETRIES,  # code-judge refuses the request (422) until the client gives up
    }
    for text, want in answers.items():
        assert answered(text) == [want], text
    (out,) = answered(block({"name": 3, "arguments": {}}))
    assert out.startswith("Failed to decode tool call: ")
    with pytest.raises(ValueError, match="max_calls"):
        agent.parse_tool_calls("", max_calls=0)


@pytest.mark.release
def test_surplus_and_unclosed_calls():
    # only the first max_calls blocks count (verl's max_parallel_calls = 1): the rest get no answer at all
    three = block(OK_CALL) + "\n" + block("{bad") + block(OK_CALL)
    assert answered(three, max_calls=1) == [("print(1)", "x")]
    out = answered(three, max_calls=2)
    assert out[0] == ("print(1)", "x") and out[1].startswith("Failed to decode") and len(out) == 2
    assert len(agent.parse_tool_calls(three, max_calls=5)) == 3
    # an unclosed <tool_call> is not a call: after a closed one it is ignored, alone the turn has no calls
    # (so the trajectory ends there)
    assert answered(block(OK_CALL) + '<tool_call>\n{"name": ', max_calls=2) == [("print(1)", "x")]
    assert agent.parse_tool_calls('<reason>a</reason>\n<tool_call>\n{"name": "x", "arguments": {}}<|im_end|>') == []
    assert agent.parse_tool_calls("</tool_call> then <tool_call>") == []


def test_surplus_calls_get_no_record():
    # the engine with a scripted policy: one turn with 3 calls, max_calls_per_turn=1 -> one call executed,
    # one record, one <tool_response>
    from rollout import Engine, Request, iter_claim
    from test_rollout import Script, SlowTools  # its scripted policy and tools
    tok = data.train_tokenizer([agent.prompt_text("What is 8 * 8?") + block(OK_CALL) + "<|im_end|>"])
    prompt = data.render_prompt(tok, "What is 8 * 8?")
    calls = "".join(block({"name": agent.TOOL_NAME, "arguments": {"code": f"print({v})", "input": ""}}) for v in (64, 65, 66))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    script = (tok.encode("</reason>\n" + calls, add_special_tokens=False) + [end]
              + tok.encode("</reason>\n<answer>\\boxed{64}</answer>", add_special_tokens=False) + [end])
    tools = SlowTools({})
    engine = Engine(Script({tuple(prompt): script}, len(tok)), tok, kv_capacity=400, max_len=400, temperature=0.0,
                    sandbox=tools, max_calls_per_turn=1)
    (t,) = engine.run(iter_claim([Request(prompt, key=(0, 0, 0))]), 300)
    assert tools.calls == ["print(64)"]
    assert [c.arguments["code"] for c in t.tool_calls] == ["print(64)"] and t.tool_calls[0].status == "ok"
    assert t.tool_calls[0].tool == agent.TOOL_NAME
    assert tok.decode(t.response_ids).count("<tool_response>") == 1 and t.finish == "stop"


def test_call_faults_tell_unparsed_unknown_and_repeated_calls():
    # the records start_call makes, one call a turn, in order: the tool-format health train_rl.py logs
    python = {"name": agent.TOOL_NAME, "arguments": {"code": "print(1)"}}
    turns = ['{"name": "x"',  # not JSON
             json.dumps({**python, "name": "python"}),  # a name the table lacks
             json.dumps(python), json.dumps(python),  # a call, then the same call verbatim
             json.dumps({**python, "arguments": {"code": "print(2)"}}),  # the same tool with new code
             '{"name": "x"', '{"name": "x"']  # a failed parse repeated is still a failed parse
    records = [agent.start_call(agent.parse_tool_calls(block(turn))[0], agent.PYTHON_TOOLS, Submits())[0] for turn in turns]
    assert agent.call_faults(records) == ["unparsed", "unknown_tool", "", "repeat", "", "unparsed", "unparsed"]
    assert agent.call_faults([agent.CallRecord("", None, "ok")] * 2) == ["", ""]  # records without a tool: no repeat


def test_truncate():
    assert agent.truncate("short", 10) == "short"
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    assert agent.truncate(text, 20) == text[:10] + "...(truncated)..." + text[-10:]
    assert agent.truncate("abcdefgh", 5) == "ab...(truncated)...gh"  # odd: max_chars // 2 each side
    assert agent.truncate(text, 100) == text
    with pytest.raises(ValueError, match="max_chars"):
        agent.truncate("abc", 1)


def result(status, stdout="", stderr="", value="", duration=0.1):
    return agent.ToolResult(status, stdout, stderr, value, duration)


def test_the_sandbox_result_has_the_tool_results_fields():
    # the Python tool answers with sandbox.Result as it is (sandbox.py imports nothing of ours), so its fields
    # must be a ToolResult's, in the same order; and a ToolResult's defaults are an empty answer of no time
    fields = [(f.name, f.type) for f in dataclasses.fields(agent.ToolResult)]
    assert [(f.name, f.type) for f in dataclasses.fields(sandbox.Result)] == fields
    assert agent.ToolResult("ok", "7\n") == agent.ToolResult("ok", "7\n", "", "", 0.0)


def release_text(run_success, reason, stdout, stderr, cost, max_chars=256):
    # the release's tool response, written from its documented format: code-judge's fields (stdout and
    # stderr cut to 1000 chars by the service) in the client's words, then verl's middle cut at
    # max_tool_response_length characters
    stdout, stderr = (stdout or "")[:1000], (stderr or "")[:1000]
    lines = ["Tool call success"] if run_success else ["Tool call failure", "reason: " + reason]
    lines += ["stdout: " + stdout] * bool(stdout) + ["stderr: " + stderr] * bool(stderr)
    text = "\n".join(lines + ["execution time: %.2fs" % cost])
    if len(text) > max_chars:
        text = text[:max_chars // 2] + "...(truncated)..." + text[len(text) - max_chars // 2:]
    return text


TB = "NameError at line 2: name 'prnt' is not defined\n  prnt(1)\n"  # the harness's words (sandbox_worker.py)
LONG = "".join(f"{i}\n" for i in range(2000))
# a sandbox result of each kind, and the fields code-judge reports for the same run (MAX_EXECUTION_TIME=4):
# (run_success, reason, stdout, stderr, cost). The cost is not measured on our side (see agent's docstring):
# 0.01 s, a timeout its limit
KINDS = {
    "success": (result("ok", stdout="42\n", duration=0.012), (True, "", "42\n", "", 0.01)),
    "stdout and stderr": (result("ok", stdout="1\n", stderr="<string>:2: UserWarning: w\n  warn('w')\n"),
                          (True, "", "1\n", "<string>:2: UserWarning: w\n  warn('w')\n", 0.01)),
    "trailing expression": (result("ok", value="(17, 110)", duration=0.004), (True, "", "(17, 110)\n", "", 0.01)),
    "empty output": (result("ok", duration=0.0), (True, "", "", "", 0.01)),
    # the harness exits with os._exit(1): only what was flushed before the error is shown (the sandbox's
    # stdout holds exactly that)
    "exception": (result("error", stderr=TB, duration=0.05), (False, "", "", TB, 0.01)),
    "flushed, then exception": (result("error", stdout="partial\n", stderr=TB), (False, "", "partial\n", TB, 0.01)),
    "exit status": (result("error", duration=0.05), (False, "", "", "", 0.01)),
    "timeout": (result("timeout", stdout="before\n", stderr="[sandbox] timeout: killed after 4 s", duration=4.003),
                (False, "worker_timeout", "before\nSuicide from timeout.\n", "", 4.0)),
    "memory": (result("memory", stderr="Traceback (most recent call last):\nMemoryError\n"),
               (False, "", "", "Traceback (most recent call last):\nMemoryError\n", 0.01)),
    "crash": (result("crash", stderr="[sandbox] killed by signal SIGSEGV", duration=0.02),
              (False, "", "", "", 0.01)),
    "long output": (result("ok", stdout=LONG, stderr="warn\n[sandbox] stdout truncated: 9 more bytes dropped (cap 9)"),
                    (True, "", LONG, "warn\n", 0.01)),
    "long error": (result("error", stderr="E" * 3000 + "\n"), (False, "", "", "E" * 3000 + "\n", 0.01)),
}


@pytest.fixture(scope="module")
def bpe():
    """A second byte-level BPE, pre-tokenized like Qwen2's (digits one by one, newlines runs kept apart),
    trained on tool turns: a tokenizer whose merges differ from the tiny one's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    qwen2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(qwen2), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    texts = [release_text(*f) for _, f in KINDS.values()] + [TEMPLATE, agent.prompt_text("What is 1 + 1?")] * 3
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=800, special_tokens=special,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.mark.release
@pytest.mark.parametrize("kind", list(KINDS))
def test_tool_turn_token_identical_to_release(tok, bpe, kind):
    res, fields = KINDS[kind]
    want = release_text(*fields)
    assert agent.tool_response_text(res, max_chars=256) == want
    for t in (tok, bpe):
        assert agent.tool_suffix_ids(t, [agent.tool_response_text(res, 256)]) == release_tool_turn(t, [want])
    # and with verl's default of 256 left implicit
    assert agent.tool_response_text(res) == want


@pytest.mark.release
def test_tool_response_text():
    assert agent.tool_response_text(result("ok", stdout="42\n")) == "Tool call success\nstdout: 42\n\nexecution time: 0.01s"
    # the same run gives the same text, however long it took (else no exact resume)
    assert agent.tool_response_text(result("ok", duration=0.003)) == agent.tool_response_text(result("ok", duration=2.7))
    assert agent.tool_response_text(result("timeout", duration=2.004)).endswith("execution time: 2.00s")
    # the harness prints a trailing expression's repr after whatever was printed, without a newline in between
    assert agent.tool_response_text(result("ok", stdout="a", value="3")) == "Tool call success\nstdout: a3\n\nexecution time: 0.01s"
    # only trailing "[sandbox] " lines are ours; a program's own output that looks like one is kept
    assert agent.tool_response_text(result("ok", stderr="[sandbox] x\nmine\n")).count("[sandbox] x") == 1
    assert agent.tool_response_text(result("overloaded", stderr="[sandbox] not started")) == RETRIES
    long = agent.tool_response_text(result("ok", stdout="7" * 5000), max_chars=100)
    assert long == "Tool call success\nstdout: " + "7" * 24 + "...(truncated)..." + "7" * 28 + "\nexecution time: 0.01s"
    with pytest.raises(ValueError, match="unknown sandbox result status 'weird'"):
        agent.tool_response_text(result("weird"))


@pytest.mark.release
def test_tool_response_text_of_real_runs():
    # the sandbox's own results for each kind map as the table above says
    with SandboxPool(workers=1, timeout=1.0) as pool:
        ok, err, slow, empty = pool.map(["print(6 * 7)", "print('partial')\nprnt(1)", "print('before', flush=True)\n"
                                         "import time\ntime.sleep(5)", "x = 1"])
    assert agent.tool_response_text(ok) == "Tool call success\nstdout: 42\n\nexecution time: 0.01s"
    e = agent.tool_response_text(err)
    assert e.startswith("Tool call failure\nreason: \nstderr: ") and "NameError" in e and "partial" not in e
    assert agent.tool_response_text(slow) == (
        "Tool call failure\nreason: worker_timeout\nstdout: before\nSuicide from timeout.\n\nexecution time: 1.00s")
    assert agent.tool_response_text(empty) == "Tool call success\nexecution time: 0.01s"


@pytest.mark.release
def test_tool_response_text_through_the_sandbox_is_the_release_text():
    # end to end: code run in the real sandbox, worded by the formatter, against the release's text for the
    # same code (its harness's stdout/stderr, checked by running it; tests/test_sandbox.py has the cases).
    # Only the execution time is ours by design (0.01 s, a timeout its limit: see agent's docstring).
    with SandboxPool(workers=2, timeout=1.0) as pool:
        err, value, slow = pool.map(["print('lost')\nx = [1, 2]\ny = x[2]\nprint(y)", "print('a')\n6 * 7",
                                     "print('before')\nimport time\ntime.sleep(10)"])
    assert agent.tool_response_text(err) == release_text(
        False, "", "", "IndexError at line 3: list index out of range\n  y = x[2]\n", 0.01)
    assert agent.tool_response_text(value) == release_text(True, "", "a\n42\n", "", 0.01)
    assert agent.tool_response_text(slow) == release_text(
        False, "worker_timeout", "before\nSuicide from timeout.\n", "", 1.0)

# -----------------------------------------------------------------------------
# answers and reward

def boxed(inner):
    return f"<reason>...</reason>\n<answer>\\boxed{{{inner}}}</answer>"


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
    assert agent.extract_answer([]) is None and agent.count_answers([]) == 0


def test_the_answer_is_the_final_turns_outside_tool_calls():
    code = '<tool_call>\n{"name": "x", "arguments": {"code": "# <answer>\\\\boxed{1}</answer>"}}\n</tool_call>'
    # only the final turn answers; p_format's count is over all the turns
    assert agent.extract_answer(["<answer>\\boxed{1}</answer>", "checked, done"]) is None
    assert agent.count_answers(["<answer>\\boxed{1}</answer>", "checked, done"]) == 1
    assert agent.extract_answer(["<answer>\\boxed{1}</answer>", "<answer>\\boxed{2}</answer>"]) == "2"
    # nothing inside a tool call counts, closed or not (an unclosed one runs to the end of the turn)
    for turn in [code, "look " + code[:-12], code + "<answer>\\boxed{2}</answer>"[:0]]:
        assert agent.extract_answer([turn]) is None and agent.count_answers([turn]) == 0
    assert agent.extract_answer([code + "\n<answer>\\boxed{2}</answer>"]) == "2"
    assert agent.extract_answer(["<answer>\\boxed{2}</answer>" + code]) == "2"
    assert agent.count_answers([code + "<answer>\\boxed{2}</answer>", code]) == 1
    # and a block cannot be stitched together around one
    assert agent.extract_answer(["<answer>\\boxed{3}" + code + "</answer>"]) is None


def test_readers_are_linear():
    # the lazy regexes rescanned the rest of the text from every unclosed tag: 97 s for a 120K \boxed{0...0x}
    # in the integer reader, 5 s for a turn of repeated <tool_call> in the call parser. Now each is a
    # few milliseconds at 200K characters (bounds generous: the box is shared)
    n = 20_000
    for f, text in [(agent.parse_tool_calls, "</tool_call>" + "<tool_call>" * n),
                    (agent.parse_tool_calls, "<tool_call>" * n + "</tool_call>"),
                    (agent.count_answers, "</answer>" + "<answer>" * n),
                    (agent.extract_answer, "<answer>" * n + "\\boxed{" * n + "</answer>"),
                    (agent.extract_answer, "<tool_call>" * n + "<answer>\\boxed{1}</answer>"),
                    (grading.plain_int, "0" * 200_000 + "x")]:
        assert len(text) > 100_000
        t0 = time.time()
        f(text)
        assert time.time() - t0 < 1.0, (f.__name__, text[:30])
    # the same blocks as the regex it replaced, on random tag soup
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(["<tool_call>", "</tool_call>", "x", "<"]) for _ in range(rng.randrange(12)))
        blocks = [text[a:b] for a, b in agent._blocks(text, "<tool_call>", "</tool_call>")]
        assert blocks == re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL), text

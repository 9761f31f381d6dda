"""data.py: the tiny task (answers checked with sympy), JSONL I/O errors, SFT traces with real tool output,
the tokenizer (round trip, token budgets), the prepared HF directory loaded back through transformers, and the
benchmark converter on each layout it claims (parquet and JSONL) and on malformed rows."""

import contextlib
import io
import json
import random
import re
import statistics
import traceback
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sympy

import agent
import data
import grading
from common import read_jsonl, write_jsonl as common_write_jsonl
from tasks import math as math_task
import zygote

REF = Path(__file__).resolve().parent / "fixtures"  # copies of the released template and tool schema


def run_inprocess(calls):
    # a minimal stand-in for the sandbox pool: exec with captured stdout, traceback on error
    results = []
    for code, stdin in calls:
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, "<code>", "exec"), {})
            results.append(SimpleNamespace(status="ok", stdout=buf.getvalue(), stderr="", value="", duration=0.01))
        except Exception:
            results.append(SimpleNamespace(status="error", stdout=buf.getvalue(), stderr=traceback.format_exc(), value="", duration=0.01))
    return results


def text_of(messages):
    return "".join(t for t, _ in agent.conversation_segments(messages))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prep")
    tok, model = data.prepare(str(out / "tiny-base"), seed=0, run=run_inprocess, n_train=2000, n_heldout=200, n_sft=400)
    return out, tok, model


def test_make_problems():
    probs = data.make_problems(2000, seed=3)
    assert probs == data.make_problems(2000, seed=3) and probs != data.make_problems(2000, seed=4)
    assert len({p["question"] for p in probs}) == 2000
    ops, digits = set(), set()
    for p in probs:
        expr = p["question"].removeprefix("What is ").removesuffix("?")
        assert p["answer"] == str(sympy.sympify(expr))  # independent evaluation
        toks = expr.split()
        nums, o = toks[::2], toks[1::2]
        assert 1 <= len(o) <= 3 and set(o) <= {"+", "-", "*"}
        ops.add(len(o))
        digits |= {len(n) for n in nums}
    assert ops == {1, 2, 3} and digits == {1, 2, 3, 4, 5, 6}
    exclude = {p["question"] for p in probs}
    assert not exclude & {p["question"] for p in data.make_problems(500, seed=3, exclude=exclude)}
    # one digit, one operator: 10 * 3 * 10 problems exist; asking for more is refused, not drawn forever
    assert len(data.make_problems(300, seed=0, max_digits=1, max_ops=1)) == 300
    with pytest.raises(ValueError, match="301 problems asked, but only 300 exist"):
        data.make_problems(301, seed=0, max_digits=1, max_ops=1)
    small = {p["question"] for p in data.make_problems(200, seed=0, max_digits=1, max_ops=1)}
    with pytest.raises(ValueError, match="200 of them excluded"):
        data.make_problems(101, seed=1, max_digits=1, max_ops=1, exclude=small)


def test_jsonl_roundtrip_and_errors(tmp_path):
    rows = [{"question": "What is 1 + 2?", "answer": "3"}, {"question": "√?", "answer": "-4", "extra": [1]}]
    path = tmp_path / "d.jsonl"
    common_write_jsonl(str(path), rows)
    assert read_jsonl(str(path), math_task.COLUMNS) == rows
    # the math task's columns are text: the type comes from the task, not from the reader
    bad = {
        '{"question": "q", "answer": "1"}\n\n{"question": "q", "answer": 2}\n': ":3: field 'answer' must be str",
        '{"question": "q", "answer": "1"}\n{"question": "q"\n': ":2: not valid JSON",
        '{"answer": "1"}\n': ":1: missing field 'question'",
        '[1, 2]\n': ":1: expected a JSON object",
        # a blank label (the math task's reward matched it to the answer \\boxed{%}: reward 1)
        '{"question": "q", "answer": "1"}\n{"question": "q", "answer": " "}\n': ":2: field 'answer' is empty",
    }
    for text, msg in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + msg):
            read_jsonl(str(path), math_task.COLUMNS)
    path.write_text('{"messages": []}\n')
    assert read_jsonl(str(path), required={"messages": list}) == [{"messages": []}]
    # a line that is not UTF-8 is named by its line too (its position in a read-ahead buffer said nothing)
    path.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + ":2: not valid JSON.*utf-8"):
        read_jsonl(str(path), math_task.COLUMNS)


def test_a_rows_bad_task_is_named_by_its_line(tmp_path):
    # a row's "task" that is no task file: an AttributeError traceback (a number), or "file ... not found"
    # without the data file and line
    path = tmp_path / "mixed.jsonl"
    row = '{"question": "q", "answer": "1"}\n'
    for task, msg in (("5", "No module named '5'"), ('"tasks/nope.py"', "file 'tasks/nope.py' not found"),
                      ('"no_such_module"', "No module named 'no_such_module'"),
                      ('"configurator.py"', "task 'configurator.py' does not define COLUMNS")):
        path.write_text(row + row[:-2] + f', "task": {task}}}\n')
        with pytest.raises(SystemExit, match=re.escape(f"data error: {path}:2: {msg}")):
            grading.read_problems(str(path), math_task)


def test_sft_conversation():
    problem = {"question": "What is 12 * 34 - 5?", "answer": "403"}
    clean = data.sft_conversation(problem, random.Random(0), run_inprocess, error_rate=0.0)
    assert [m["role"] for m in clean] == ["user", "assistant", "tool", "assistant"]
    assert clean[2]["content"] == "Tool call success\nstdout: 403\n\nexecution time: 0.01s"  # the real output of the code
    assert clean[1]["tool_calls"][0]["function"]["arguments"] == {"code": "print(12 * 34 - 5)", "input": ""}
    assert math_task.reward(clean[-1]["content"], "403") == 1.0
    for seed in range(6):
        buggy = data.sft_conversation(problem, random.Random(seed), run_inprocess, error_rate=1.0)
        assert [m["role"] for m in buggy] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert buggy[2]["content"].startswith("Tool call failure\nreason: \nstderr: Traceback") and "Error" in buggy[2]["content"]
        assert buggy[4]["content"] == clean[2]["content"]
        # the bug is a real one: the sandbox runs the first call and it fails
        (first,) = agent.parse_tool_calls(text_of(buggy).split("<|im_start|>assistant")[1])
        assert run_inprocess([(first.arguments["code"], "")])[0].status == "error"
    # the "undefined" kind: the first call names a variable no call defined; the fix is the first to type the expression
    for seed in range(3):
        buggy = data.sft_conversation(problem, random.Random(seed), run_inprocess, error_rate=1.0, bug_kind="undefined")
        first, fix = (m["tool_calls"][0]["function"]["arguments"]["code"] for m in (buggy[1], buggy[3]))
        assert "12 * 34" not in first and "NameError" in buggy[2]["content"] and fix == "print(12 * 34 - 5)"
    # the whole trace is in protocol: parsing the rendered turns gives back the executed code
    ids_text = text_of(clean)
    assert agent.parse_tool_calls(ids_text.split("<|im_start|>assistant")[1]) == [agent.ToolCall(agent.TOOL_NAME, {"code": "print(12 * 34 - 5)", "input": ""})]
    # a sandbox that answers wrongly must not yield a silently wrong trace
    def wrong(calls):
        return [SimpleNamespace(status="ok", stdout="7\n", stderr="", value="", duration=0.0) for _ in calls]
    with pytest.raises(RuntimeError, match="expected '403'"):
        data.sft_conversation(problem, random.Random(0), wrong, error_rate=0.0)


def test_tokenizer(prepared):
    _, tok, _ = prepared
    assert len(tok) <= 4096
    for text in ["What is 123456 * 7?", "print('héllo √ 世界')\n\tx = {1: [2]}", "<reason>a</reason>\n<answer>\\boxed{-5}</answer>",
                 "Traceback (most recent call last):\n  NameError: name 'prnt' is not defined", "   spaces   \n\n"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # numbers are chunks of up to 3 digits from the left, every chunk one token; tags one token each
    # and not special (skip_special_tokens keeps them)
    assert tok.convert_ids_to_tokens(tok.encode("90817", add_special_tokens=False)) == ["908", "17"]
    assert all(len(tok.encode(f"{i:0{n}d}", add_special_tokens=False)) == 1 for n in (1, 2, 3) for i in range(10 ** n))
    for t in data.TAG_TOKENS + data.SPECIAL_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert tok.decode(tok.encode("<|im_start|><answer>1</answer>", add_special_tokens=False), skip_special_tokens=True) == "<answer>1</answer>"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # token budgets on problems the tokenizer never saw (mean over 200)
    probs = data.make_problems(200, seed=99)
    rng = random.Random(0)
    prompt = [len(data.render_prompt(tok, p["question"])) for p in probs]
    traj = [len(agent.render_conversation(tok, data.sft_conversation(p, rng, run_inprocess, error_rate=0.0))[0]) for p in probs]
    assert statistics.mean(prompt) < 60 and statistics.mean(traj) < 120, (statistics.mean(prompt), statistics.mean(traj))


def test_prepared_dir_loads(prepared):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, tok, model = prepared
    base, data_dir = out / "tiny-base", out / "data"
    train = read_jsonl(str(data_dir / "train.jsonl"))
    heldout = read_jsonl(str(data_dir / "heldout.jsonl"))
    sft = read_jsonl(str(data_dir / "sft.jsonl"), required={"question": str, "answer": str, "messages": list})
    assert (len(train), len(heldout), len(sft)) == (2000, 200, 400)
    assert not {p["question"] for p in heldout} & {p["question"] for p in train + sft}
    loaded = AutoTokenizer.from_pretrained(str(base))
    q = heldout[0]["question"]
    assert data.render_prompt(loaded, q) == data.render_prompt(tok, q)
    assert loaded.eos_token_id == tok.eos_token_id and loaded.pad_token_id == tok.pad_token_id
    # the saved chat template renders like the reference (prompt, tool turns) and like our renderer (whole trace)
    ref_template = (REF / "rstar2_chat_template.jinja").read_text()
    schema = json.loads((REF / "rstar2_tool_schema.json").read_text())
    buggy = next(c["messages"] for c in sft if len(c["messages"]) == 6)
    for msgs in ([buggy[0]], buggy[:3], buggy[:5]):
        ours = loaded.apply_chat_template(msgs, tools=[schema], add_generation_prompt=True, tokenize=False)
        assert ours == loaded.apply_chat_template(msgs, tools=[schema], chat_template=ref_template, add_generation_prompt=True, tokenize=False)
    full = loaded.apply_chat_template(buggy, tools=[schema], tokenize=False)
    assert full == text_of(buggy).replace("<|im_end|><|im_start|>user", "<|im_end|>\n<|im_start|>user") + "\n"
    # the model: a random-init tiny Qwen3 with tied embeddings that transformers loads back
    m = AutoModelForCausalLM.from_pretrained(str(base))
    n = sum(p.numel() for p in m.parameters())
    # by hand: per layer q,k,v,o (128x128, 128x64, 128x64, 128x128) + 3 MLP mats (128x384) + norms (2*32 + 2*128)
    layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 384 + 2 * 32 + 2 * 128
    assert m.config.model_type == "qwen3" and n == len(loaded) * 128 + 4 * layer + 128  # tied: one embedding
    assert m.config.vocab_size == len(loaded) and m.config.tie_word_embeddings
    assert (m.config.hidden_size, m.config.num_hidden_layers, m.config.num_key_value_heads, m.config.head_dim) == (128, 4, 2, 32)
    assert m.config.eos_token_id == loaded.eos_token_id
    import torch
    ids = torch.tensor([data.render_prompt(loaded, q)])
    assert torch.equal(m(ids).logits, model(ids).logits)  # the saved weights are the ones made


# ----------------------------------------------------------------------------- the converter

def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def read_out(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_convert_each_layout(tmp_path):
    # HuggingFaceH4/aime_2024 parquet: id, problem, solution, answer, url, year (answers as strings)
    aime24 = tmp_path / "aime24.parquet"
    pq.write_table(pa.table({"id": [60, 61], "problem": ["Find x.", "Find y. "], "solution": ["s", "t"],
                             "answer": ["204", "025"], "url": ["u", "v"], "year": ["2024", "2024"]}), aime24)
    # a parquet with integer answers (other AIME / HMMT dumps)
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"problem_idx": [1], "problem": ["Count z."], "answer": [33]}), ints)
    # opencompass/AIME2025 JSONL: question, answer
    aime25 = tmp_path / "aime2025-I.jsonl"
    write_jsonl(aime25, [{"question": "Q1", "answer": "70"}, "", {"question": "Q2", "answer": "588"}])
    # HuggingFaceH4/MATH-500 JSONL
    math500 = tmp_path / "test.jsonl"
    write_jsonl(math500, [{"problem": "Convert (0,3).", "solution": "...", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                           "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"}])
    # the rStar2-Agent repo's preprocessed parquet: prompt = [user: problem], reward_model.ground_truth
    rstar = tmp_path / "aime24_rstar2.parquet"
    pq.write_table(pa.table({
        "data_source": ["aime24"], "agent_name": ["rstar2_agent"],
        "prompt": [[{"role": "user", "content": "What is 6*7?"}]],
        "reward_model": [{"ground_truth": "42", "style": "rule"}]}), rstar)
    out = tmp_path / "out" / "all.jsonl"
    n = data.convert([str(aime24), str(ints), str(aime25), str(math500), str(rstar)], str(out))
    rows = read_out(out)
    assert n == len(rows) == 7
    assert rows[0] == {"question": "Find x.", "answer": "204", "id": 60}
    assert rows[1] == {"question": "Find y.", "answer": "025", "id": 61}
    assert rows[2] == {"question": "Count z.", "answer": "33", "id": 1}
    assert rows[3:5] == [{"question": "Q1", "answer": "70"}, {"question": "Q2", "answer": "588"}]
    assert rows[5] == {"question": "Convert (0,3).", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                       "id": "test/precalculus/807.json"}
    assert rows[6] == {"question": "What is 6*7?", "answer": "42"}
    # what we write is what the eval script (and train_rl) reads
    assert read_jsonl(str(out)) == rows


def test_convert_reports_bad_rows_with_file_and_row(tmp_path):
    bad_jsonl = tmp_path / "bad.jsonl"
    write_jsonl(bad_jsonl, [{"question": "Q1", "answer": "1"}, "", {"question": "Q3", "solution": "no answer"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: no answer"):
        data.convert([str(bad_jsonl)], str(tmp_path / "o.jsonl"))
    not_json = tmp_path / "broken.jsonl"
    write_jsonl(not_json, [{"question": "Q1", "answer": "1"}, "{oops"])
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        data.convert([str(not_json)], str(tmp_path / "o.jsonl"))
    # a row that is not UTF-8 (a Latin-1 download): named by its row too
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes(b'{"question": "Q1", "answer": "1"}\n{"question": "caf\xe9?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not valid JSON .*utf-8"):
        data.convert([str(not_utf8)], str(tmp_path / "o.jsonl"))
    bad_parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"problem": ["P1", "P2", "P3"], "answer": ["1", None, "3"]}), bad_parquet)
    with pytest.raises(ValueError, match=r"bad\.parquet:2: the answer must be a non-empty string"):
        data.convert([str(bad_parquet)], str(tmp_path / "o.jsonl"))
    cases = [({"text": "Q", "answer": "1"}, "no question"), ({"question": "", "answer": "1"}, "question must be"),
             ({"question": "Q", "answer": 1.5}, "answer must be"), ({"question": "Q", "answer": True}, "answer must be"),
             ({"prompt": 7, "reward_model": {"ground_truth": "1"}}, "a string or a list of chat messages"),
             ({"prompt": [{"role": "system", "content": "Q"}], "reward_model": {"ground_truth": "1"}}, "with a user message"),
             ({"problem": "Q", "solution": "a worked solution, not the answer"}, "no answer"),
             ({"prompt": [{"role": "user", "content": "Q"}], "reward_model": {}}, "no answer")]
    for row, msg in cases:
        with pytest.raises(ValueError, match=msg):
            data.convert_row(row)
    with pytest.raises(ValueError, match=r"\.csv: expected a \.parquet or \.jsonl"):
        data.convert([str(tmp_path / "x.csv")], str(tmp_path / "o.jsonl"))


def test_convert_command_line(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    write_jsonl(a, [{"problem": "P", "answer": 7}])
    pq.write_table(pa.table({"question": ["Q"], "answer": ["x^2"]}), b)
    p = zygote.run(["data.py", "convert", str(a), str(b), str(tmp_path / "o.jsonl")])
    assert p.returncode == 0, p.stderr
    assert "wrote 2 problems" in p.stdout
    assert read_out(tmp_path / "o.jsonl") == [{"question": "P", "answer": "7"}, {"question": "Q", "answer": "x^2"}]


def test_task_data_commands_run(tmp_path):
    # the README's "Fork it" commands for a task file, at toy sizes: the code task's set, then a task's SFT traces
    def command(*args):
        p = zygote.run(["data.py", *args, f"--data_dir={tmp_path}"], timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout
    assert "code_train 3, code_heldout 2" in command("code-set", "--n_train=3", "--n_heldout=2")
    code_rows = read_jsonl(str(tmp_path / "code_train.jsonl"), required={"question": str, "entry": str, "tests": list})
    assert len(code_rows) == 3 and len(read_jsonl(str(tmp_path / "code_heldout.jsonl"), required={"tests": list})) == 2
    common_write_jsonl(str(tmp_path / "train.jsonl"), data.make_problems(5, seed=0, max_digits=3, max_ops=2))
    assert "wrote 3 traces" in command("traces", "--task=tasks/calculator.py", "--n_sft=3")
    traces = read_jsonl(str(tmp_path / "sft_calculator.jsonl"), required={"messages": list, "tools": list})
    assert all(m["content"].startswith("Tool call") for t in traces for m in t["messages"] if m["role"] == "tool")
    # --n_sft=0 traces no row (rows[-0:] once traced them all); a negative count is refused
    assert "wrote 0 traces" in command("traces", "--task=tasks/calculator.py", "--n_sft=0")
    p = zygote.run(["data.py", "traces", "--n_sft=-1", f"--data_dir={tmp_path}"], timeout=300)
    assert p.returncode != 0 and "--n_sft is a number of rows, got -1" in p.stderr
    # the grid task's traces of the math rows (--problems left out): one line naming the row, not a traceback
    p = zygote.run(["data.py", "traces", "--task=tasks/gridworld.py", f"--data_dir={tmp_path}"], timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"traces error: {tmp_path}/train.jsonl:1: missing field 'size'"

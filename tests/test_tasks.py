"""The task and tool seams on their worked examples: tasks/code.py's reward (hidden unit tests in the sandbox, safe
from the solution), tasks/calculator.py's second tool through the engine (records carry its name, its failures
count in p_err), the prompts of several tools / no tool against the released chat template. The few-step RL
runs of both examples are in test_train.py (they need its tiny SFT model)."""
import json
import random
import re
import types
from pathlib import Path

import pytest

import agent
import data
import grading
import grpo_roc
from rollout import Engine, Request, Trajectory, iter_claim
from sandbox import SandboxPool
from test_rollout import Script, SlowTools

CODE = grading.load_task("tasks/code.py")
CALC = grading.load_task("tasks/calculator.py")
MATH = grading.load_task("tasks/math.py")
CHARS = types.SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))  # a tokenizer: one id per character
ROW = {"question": "Write a Python function f(x) that returns x * 3 - 1.", "entry": "f", "answer": "5",
       "tests": [[[2], 5], [[0], -1], [[10], 29], [[-4], -13]]}


def trajectory(text, key=0):
    ids = [ord(c) for c in text]
    return Trajectory(key=key, prompt_ids=[1], response_ids=ids, mask=[1] * len(ids), finish="stop", turns=1,
                      meta={"problem": 0})


def solution(code):
    return f"<reason>write it</reason>\n<answer>```python\n{code}\n```\n\\boxed{{5}}</answer>"


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, timeout=2.0) as p:
        yield p


def grades(task, texts, pool, row=ROW):
    g = grading.Grader(CHARS, task=task, rows=[row], sandbox=pool, timeout=5.0)
    for i, text in enumerate(texts):
        g(trajectory(text, key=i))
    out = g.results()
    g.close()
    return [out[i] for i in range(len(texts))], g.stats


def test_code_reward_runs_the_hidden_tests_and_is_not_the_math_reward(pool):
    right = solution("def f(x):\n    return x * 3 - 1")
    half = solution("def f(x):\n    return x * 3 - 1 if x > 0 else 0")  # passes 2 of 4
    (code_right, code_half), _ = grades(CODE, [right, half], pool)
    program = "def f(x):\n    return x * 3 - 1"
    assert code_right == grading.Grade(1.0, True, 1, program, CODE.vote(ROW, program, None))
    assert (code_half.reward, code_half.correct) == (0.5, False)  # partial credit, not correct
    # the same trajectories under the math task: its reward reads \boxed{5} and knows nothing of tests
    (math_right, math_half), _ = grades(MATH, [right, half], pool)
    assert math_right.reward == math_half.reward == 1.0
    assert CODE.prompt(ROW).count(ROW["question"]) == 1 and "tests" not in CODE.prompt(ROW)  # hidden
    # a JSON value is compared, not its text: an object's keys in another order pass, another value fails
    pairs = {**ROW, "tests": [[[1], {"a": 1, "b": [2, 3]}]]}
    other_order = solution("def f(x):\n    return {'b': [2, 3], 'a': x}")
    other_value = solution("def f(x):\n    return {'b': [3, 2], 'a': x}")
    assert [g.reward for g in grades(CODE, [other_order, other_value], pool, pairs)[0]] == [1.0, 0.0]


@pytest.mark.parametrize("name, code", [
    ("type redefined", "type = lambda *a: True\nisinstance = lambda *a: True\ndef f(x):\n    return 0"),
    ("builtins patched", "import builtins\nbuiltins.type = lambda *a: True\nbuiltins.isinstance = lambda *a: True\n"
                         "def f(x):\n    return 0"),
    ("equal to anything", "class Any:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Any()"),
    ("json.dumps patched", "import json\njson.dumps = lambda *a, **k: '5'\ndef f(x):\n    return 0"),
    ("prints a result", "import atexit\natexit.register(lambda: print(29))\ndef f(x):\n    print(5)\n    return 0"),
    ("exits early", "import sys\nsys.exit(0)"),
    ("stdout replaced", "import sys\nclass W:\n    def write(self, s):\n        return len(s)\n"
                        "    def flush(self):\n        pass\nsys.stdout = sys.__stdout__ = W()\ndef f(x):\n    return 0"),
    ("the harness's frame", "import sys\ng = sys._getframe(1).f_globals\ng['_dumps'] = lambda v: '5'\n"
                            "def f(x):\n    return 0"),
    ("hangs", "def f(x):\n    while True:\n        pass"),
    # the sandbox's own record of the call's status and value (sandbox_worker.LAST_WORD, a shared map), forged
    ("writes the call's last word", "import os, sys\nf = sys._getframe()\nwhile 'LAST_WORD' not in f.f_globals:\n"
                                    "    f = f.f_back\nf.f_globals['LAST_WORD'].seek(0)\n"
                                    "f.f_globals['LAST_WORD'].write(b\"ok\\n'5'\\0\")\nos._exit(0)"),
])
def test_code_reward_cannot_be_forged_by_the_solution(pool, name, code):
    # an earlier attempt paid 1.0 to a solution that redefined `type` where the tests ran: here each test runs
    # apart from the solution's namespace and its expected value never enters the sandbox; a constant guess
    # gets what a constant function would (here: none of the 4 tests expects 0; '5' matches one of them)
    (g,), stats = grades(CODE, [solution(code)], pool)
    assert g.reward <= 0.25 and not g.correct, (name, g)
    assert stats["timed_out"] == stats["failed"] == 0  # even the hanging one is answered within the bounds


def test_a_right_solution_that_prints_past_the_output_cap_still_passes(pool):
    # the result comes back apart from stdout: 70,000 characters printed (the cap is 64 KiB) cut off no verdict
    loud = solution("def f(x):\n    print('x' * 70000)\n    return x * 3 - 1")
    (g,), _ = grades(CODE, [loud], pool)
    assert (g.reward, g.correct) == (1.0, True)


def test_a_right_solution_too_deep_for_its_vote_keeps_its_reward(pool):
    # 1,500 terms parse, but ast.dump recursed past the limit: vote() raised after the tests passed, and the
    # grader paid the failed grade's 0
    deep = "def f(x):\n    return x * 3 - 1" + " + 0" * 1500
    (g,), stats = grades(CODE, [solution(deep)], pool)
    assert (g.reward, g.correct, g.vote) == (1.0, True, " ".join(deep.split())) and stats["failed"] == 0


@pytest.mark.parametrize("change, words", [
    ({"tests": [[2, 5], [0, -1]]}, "test 0 must be [arguments, expected] with the arguments a list"),
    ({"tests": [[[2]]]}, "test 0 must be [arguments, expected]"),
    ({"tests": []}, "it has no tests"),
    ({"entry": "f(x)"}, "entry 'f(x)' is not a function name"),
])
def test_a_code_row_no_solution_could_pass_is_refused(change, words):
    # [2, 5] ran f(*2) and failed every solution without a word; the prompt (made for every row before the
    # first step) refuses the row, naming its question
    with pytest.raises(ValueError, match=re.escape(f"code row {ROW['question']!r}: {words}")):
        CODE.prompt({**ROW, **change})


def test_a_task_grade_that_raises_or_pays_out_of_range_is_bounded():
    bad = types.SimpleNamespace(predict=lambda turns: "x", grade=lambda row, pred, turns, grader, trajectory: (1.5, True))
    raises = types.SimpleNamespace(predict=lambda turns: "x", grade=lambda row, pred, turns, grader, trajectory: 1 / 0)
    for task in (bad, raises):
        g = grading.Grader(CHARS, task=task, rows=[ROW])
        g(trajectory("<answer>x</answer>"))
        assert g.results()[0].reward == 0.0 and g.stats["failed"] == 1
        g.close()

# ----------------------------------------------------------------------------- the second tool


def test_calculator_tool_runs_by_name_in_the_engine_and_counts_in_p_err():
    # a scripted policy: a malformed calculate call, a good one, a Python call, an unknown tool, then the answer
    tok = data.train_tokenizer([CALC.prompt({"question": "What is 6 * 7?"})], vocab_size=600)
    prompt = tok.encode(CALC.prompt({"question": "What is 6 * 7?"}), add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def turn(name, args):
        text = "</reason>\n<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        return tok.encode(text, add_special_tokens=False) + [end]
    script = (turn("calculate", {"expression": "(6 * 7"}) + turn("calculate", {"expression": "6 * 7"})
              + turn(agent.TOOL_NAME, {"code": "print(42)", "input": ""}) + turn("bash", {"cmd": "ls"})
              + turn("calculate", {"expr": "1"})
              + tok.encode("</reason>\n<answer>\\boxed{42}</answer>", add_special_tokens=False) + [end])
    tools = SlowTools({})
    engine = Engine(Script({tuple(prompt): script}, len(tok)), tok, kv_capacity=2000, max_len=2000, temperature=0.0,
                    sandbox=tools, tools=CALC.TOOLS)
    (t,) = engine.run(iter_claim([Request(prompt, key=(0, 0, 0))]), 1500)
    assert [(c.tool, c.status) for c in t.tool_calls] == [
        ("calculate", "error"), ("calculate", "ok"), (agent.TOOL_NAME, "ok"), ("", "invalid"), ("calculate", "invalid")]
    assert t.tool_calls[1].output == "Tool call success\nstdout: 42\n\nexecution time: 0.01s"
    assert t.tool_calls[0].output.startswith("Tool call failure\nreason: \nstderr: SyntaxError")
    assert t.tool_calls[3].output == "Error when executing tool: 'bash'"  # not in the table: the release's text
    assert t.tool_calls[4].output == "Error when executing tool: 'expression'"  # its run() raised KeyError
    assert tools.calls == ["print(42)"]  # only the Python call reached the sandbox
    # p_err counts every tool's failures: 3 of 5 calls failed
    failed = sum(c.status in agent.TOOL_ERRORS for c in t.tool_calls)
    assert grpo_roc.penalty(len(t.tool_calls), failed, 1, t.turns) == pytest.approx(3 / 5)


REF = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.release
def test_tool_blocks_render_as_the_released_template_for_any_table():
    # the released chat template, given 2 tools or none, renders what agent.prompt_text renders from the table
    template = (REF / "rstar2_chat_template.jinja").read_text()
    tok = data.train_tokenizer(["x"], vocab_size=300)
    q = "What is 6 * 7?"
    for tools in (CALC.TOOLS, {}, agent.PYTHON_TOOLS):
        ref = tok.apply_chat_template([{"role": "user", "content": q}], tools=[t.schema for t in tools.values()] or None,
                                      chat_template=template, add_generation_prompt=True, tokenize=False)
        assert agent.prompt_text(q, tools=tools) == ref
    assert grading.load_task("tasks/math_no_tool.py").prompt({"question": q}) == agent.prompt_text(q, tools={})
    assert MATH.prompt({"question": q}) == agent.prompt_text(q)  # the default task: the release's prompt


def test_traces_of_a_task_carry_the_real_tool_answers():
    rows = data.make_problems(8, seed=0, max_digits=3, max_ops=2)
    traces = data.task_traces(CALC, rows, random.Random(1), sandbox=None)  # the calculator needs no sandbox
    for row, trace in zip(rows, traces):
        assert trace["tools"] == [t.schema for t in CALC.TOOLS.values()]
        tool_texts = [m["content"] for m in trace["messages"] if m["role"] == "tool"]
        assert tool_texts[-1] == f"Tool call success\nstdout: {row['answer']}\n\nexecution time: 0.01s"
        assert all(t.startswith("Tool call failure") for t in tool_texts[:-1])
    assert any(len(t["messages"]) == 6 for t in traces)  # some first make a malformed call (a quarter of them)


def test_a_task_file_that_lacks_a_piece_is_named(tmp_path):
    (tmp_path / "half.py").write_text("COLUMNS = {'question': str}\ndef prompt(row):\n    return row['question']\n")
    with pytest.raises(ValueError, match="does not define TOOLS, predict, grade"):
        grading.load_task(str(tmp_path / "half.py"))
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        grading.load_task("tasks/nowhere.py")

# ----------------------------------------------------------------------------- the math task's reward rule


@pytest.fixture(scope="module")
def grader():
    g = grading.Grader(None)  # one math-verify helper for this thread, kept across the tests
    yield g
    g.close()


def boxed(inner):
    return f"<reason>...</reason>\n<answer>\\boxed{{{inner}}}</answer>"


def test_reward(grader):
    def r(inner, gold):
        return MATH.reward(boxed(inner), gold, grader)
    assert r("110", "110") == 1.0
    assert r("-0012", "-12") == 1.0
    assert r("111", "110") == 0.0
    assert r("\\frac{1}{2}", "0.5") == 1.0  # math-verify
    assert r("\\frac{1}{2}", "1/2") == 1.0
    assert r("\\dfrac12", "\\frac{1}{2}") == 1.0
    assert r("\\frac{1}{3}", "0.5") == 0.0
    assert r("1,000", "1000") == 1.0
    # missing <answer>; boxed outside <answer>; the last block counts
    assert MATH.reward("<reason>the answer is \\boxed{110}</reason>", "110", grader) == 0.0
    assert MATH.reward("\\boxed{110} <answer>\\boxed{7}</answer>", "110", grader) == 0.0
    assert MATH.reward("<answer>\\boxed{7}</answer> <answer>\\boxed{110}</answer>", "110", grader) == 1.0
    assert MATH.reward("<answer>\\boxed{110}</answer> <answer>\\boxed{7}</answer>", "110", grader) == 0.0
    with pytest.raises(ValueError, match="gold answer must be a string"):
        MATH.reward("<answer>\\boxed{1}</answer>", 1, grader)
    assert MATH.reward(boxed("\\frac{2}{4}"), "0.5") == 1.0  # without a grader: one of its own
    # grade() is reward() on the row's gold, correct when it is 1
    assert MATH.grade({"answer": "0.5"}, "\\frac{2}{4}", [boxed("\\frac{2}{4}")], grader, None) == (1.0, True)
    assert MATH.grade({"answer": "0.5"}, "3", [boxed("3")], grader, None) == (0.0, False)


# the relation forms math-verify reads one side of: issue 46's sixteen, then what else its parser
# (latex2sympy2_extended's grammar: ASSIGNMENT, EQUAL, APPROX, IN, the limit arrows, TRANSFORM_EXCHANGE,
# \xrightarrow) and its fallback (a relation the parser refuses: the rightmost number is read) accept
ISSUE_46 = ["\\to", "\\Rightarrow", "\\iff", "\\implies", "\\mapsto", "\\rightarrow", "\\Leftrightarrow",
            "\\overset{?}{=}", "\\stackrel{?}{=}", "\\thickapprox", "\\backsim", "\\eqsim", "\\asymp",
            "\\fallingdotseq", "\uff1d"]
GRAMMAR = ["=", "==", ":=", "\\equiv", "\\approx", "~=", "\\in", "\\longrightarrow", "\\Longrightarrow",
           "<->", "<=>", "\\leftrightarrow", "\\xrightarrow{f}", "\\xRightarrow{}"]
GRAMMAR += list("\u2261\u2263\u225f\u224e\u224f\u2250\u2251\u2252\u2253\u2254\u2255\u2256\u2257"
                "\u2248\u224a\u224b\u2243\u2245")  # ≡ ≣ ≟ ≎ ≏ ≐ ≑ ≒ ≓ ≔ ≕ ≖ ≗ and ≈ ≊ ≋ ≃ ≅
FALLBACK = ["\\sim", "\\simeq", "\\cong", "\\doteq", "\\Doteq", "\\propto", "\\coloneqq", "\\Coloneqq",
            "\\eqqcolon", "\\eqcirc", "\\bumpeq", "\\Bumpeq", "\\vdash", "\\ni",
            "\\notin", "\\subset", "\\mid", "\\parallel", "\\perp", "\\prec", "\\succeq", "\\ll",
            "\\nleq", "\\nsim", "\\ncong", "\\therefore", "\\because", "\\Leftarrow", "\\impliedby",
            "\\longmapsto", "\\hookrightarrow", "\\nRightarrow", "\\underset{?}{=}",
            "\\stackrel{\\text{def}}{=}", "->", "=>", "==>", "=:", "::=", "~", "\u2192", "\u21d2", "\u21a6",
            "\u27f9", "\u21d4", "\u223c", "\u221d", "\u2208", "\u2234", "\u22a2", "\u2282", "\uff5e", "\ufe66",
            "\u2a75"]


def test_every_relation_math_verify_reads_one_side_of_is_a_hedge(grader):
    from math_verify import parse, verify  # the reference, here in the test's process
    for relation in ISSUE_46 + GRAMMAR + FALLBACK:
        pair = [f"8 {relation} 7", f"7 {relation} 8"]
        alone = [verify(parse("\\boxed{7}"), parse(f"\\boxed{{{answer}}}")) for answer in pair]
        assert any(alone), relation  # math-verify alone pays one of them: it reads one side
        assert [MATH.reward(boxed(answer), "7", grader) for answer in pair] == [0.0, 0.0], relation
        # a relation between equal numbers is no hedge
        assert MATH.reward(boxed(f"7 {relation} 7"), "7", grader) == 1.0, relation
    # a side with a name in it is an answer, not a number; one that simplifies to a number is a number
    for answer in ["x \\to 7", "x \\mapsto 7", "n \\equiv 7", "x \\sim 7", "x \uff1d 7"]:
        assert MATH.reward(boxed(answer), "7", grader) == 1.0, answer
    for hedge in ["8 = 7 + 0 \\cdot x", "8 = 7 + x - x", "8 \\to 7 + 0 \\cdot y"]:
        assert MATH.reward(boxed(hedge), "7", grader) == 0.0, hedge
    # a relation inside brackets is not one of the answer's: the limit's arrow, the sum's index, an evaluation
    # point, a probability's event (math-verify alone pays each: the answer's own = is the last)
    for answer, gold in [("\\lim_{x \\to 0} \\frac{\\sin x}{x} = 1", "1"), ("\\sum_{k=1}^{7} k = 28", "28"),
                         ("\\lim_{x \\to \\frac{\\pi}{2}} \\sin x = 1", "1"), ("\\lim_{x \\to 2^-} f(x) = 5", "5"),
                         ("\\left. f'(x) \\right|_{x=\\frac{1}{2}} = 3", "3"), ("P(X = 2) = \\frac{1}{4}", "\\frac{1}{4}")]:
        assert MATH.reward(boxed(answer), gold, grader) == 1.0, answer
    # and a hedge beside them is still one
    assert MATH.reward(boxed("P(X = 2) = \\frac{1}{4} = \\frac{1}{3}"), "\\frac{1}{4}", grader) == 0.0
    # the orderings math-verify reads whole are not split: 0 < x < 7 is an interval
    assert MATH.reward(boxed("x \\in [0, 7]"), "[0, 7]", grader) == 1.0


def test_hedges_score_zero(grader):
    # math-verify alone pays 1 for each of these against gold 7: it reads one side of the relation
    for hedge in ["8 = 7", "7 \\approx 8", "x = 8 = 7", "8 \\equiv 7", "8 \\sim 7", "8 := 7", "7 \\approxeq 8"]:
        assert MATH.reward(boxed(hedge), "7", grader) == 0.0, hedge
    # a name on one side is an answer, and equal numbers are no hedge
    for answer in ["x = 7", "m + n = 7", "f(2) = 7", "\\frac{14}{2} = 7", "7 = 7", "x \\approx 7"]:
        assert MATH.reward(boxed(answer), "7", grader) == 1.0, answer
    assert MATH.reward(boxed("\\frac{1}{3} \\approx 0.333333"), "\\frac{1}{3}", grader) == 1.0
    assert MATH.reward(boxed("a = 7, b = 8"), "(7, 8)", grader) == 1.0


def test_a_percent_is_its_number(grader):
    # math-verify pays \boxed{700\%} against both 7 and 700; the rule reads it as 700
    assert MATH.reward(boxed("700\\%"), "700", grader) == 1.0
    assert MATH.reward(boxed("700\\%"), "7", grader) == 0.0
    assert MATH.reward(boxed("700\\%"), "700\\%", grader) == 1.0
    assert MATH.reward(boxed("7"), "700\\%", grader) == 0.0
    assert MATH.reward(boxed("12.5\\%"), "12.5", grader) == 1.0
    assert MATH.reward(boxed("\\frac{1}{2}\\%"), "0.5", grader) == 1.0


def test_spacing_and_separators(grader):
    # math-verify alone refuses all but {,} of these: 1\,000 parses as 1*0
    for answer in ["1\\,000", "1 000", "1\u00a0000", "1\u202f000", "1\u2009000", "1\\;000", "1\\ 000",
                   "1~000", "1{,}000", "1000\u200b", "\u200b1000", " 1000 "]:
        assert MATH.reward(boxed(answer), "1000", grader) == 1.0, ascii(answer)
    assert MATH.reward(boxed("1\\,000\\,000"), "1000000", grader) == 1.0
    assert MATH.reward(boxed("1\\,000.5"), "1000.5", grader) == 1.0
    assert MATH.reward(boxed("\\frac{1}{2}\u200b"), "0.5", grader) == 1.0
    assert MATH.reward(boxed("1000"), "1\\,000", grader) == 1.0  # the gold is normalised too
    assert MATH.reward(boxed("1 00"), "100", grader) == 0.0  # not a group of three: not a separator
    assert MATH.reward(boxed("10 000"), "1000", grader) == 0.0

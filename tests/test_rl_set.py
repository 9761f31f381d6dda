"""`python data.py rl-set` (the paper's RL data recipe, §4.2) on hand-made rows of each public source's layout
(tests/fixtures/rl/): each layout read right, JSONL and parquet; each integer spelling kept or dropped as the
docstring says; exact and whitespace duplicates removed; a problem sharing one 8-gram with a benchmark problem
dropped, one sharing a 7-gram kept; the counts printed; bad rows named by file and row. And the label check's
keep rule (eval.keep_by_correct) on scripted trajectories, next to stage 3's."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import agent
import data
import grading
import eval as ev
from common import read_jsonl
from rollout import Trajectory
from scheduler import summarize
from tasks import math as math_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL = Path(__file__).resolve().parent / "fixtures" / "rl"
SOURCES = ["dapo_math_17k.jsonl", "dapo_math_17k_processed.jsonl", "openmathreasoning.jsonl", "project_euler.jsonl"]
BENCH = ["bench_aime.jsonl", "bench_math500.jsonl"]


def problems_of(name):
    return [(question, answer) for _, question, answer, _ in data.read_problems(str(RL / name))]


# ----------------------------------------------------------------------------- layouts

def test_each_layout_read_right(tmp_path):
    # DAPO-Math-17k, original: the question inside the instruction wrapper, the answer in reward_model
    dapo = problems_of("dapo_math_17k.jsonl")
    assert dapo[0] == ("Let $x$ and $y$ be real numbers with $x + y = 10$ and $xy = 21$. Find $x^2 + y^2$.", "58")
    assert [answer for _, answer in dapo] == ["58", "8", "13"]
    assert not any("Solve the following" in q or "Answer:" in q for q, _ in dapo)
    # DAPO-Math-17k-Processed: prompt a string, with or without the wrapper; the answer is `solution`
    processed = problems_of("dapo_math_17k_processed.jsonl")
    assert processed[0] == dapo[0]
    assert processed[1] == ("How many ordered pairs of positive integers $(a, b)$ satisfy $a^2 + b^2 = 625$?", "4")
    # without reward_model, `solution` is the answer; a problem / solution row (MATH) has no answer
    row = json.loads((RL / "dapo_math_17k_processed.jsonl").read_text().splitlines()[2])
    del row["reward_model"]
    assert data.convert_row(row) == ("What is the remainder when $2^{100}$ is divided by $7$?", "2")
    # OpenMathReasoning: problem + expected_answer, one row per generated solution
    omr = problems_of("openmathreasoning.jsonl")
    assert omr[0] == omr[1] == ("How many integers from $1$ to $10{,}000$ are multiples of $10$?", "1,000")
    assert [answer for _, answer in omr[3:]] == ["\\frac{1}{4}", "\\boxed{12}", "12.5", "-7"]
    # Project Euler dump: problem + numerical_answer (an integer or a string), id kept
    euler = problems_of("project_euler.jsonl")
    assert [answer for _, answer in euler] == ["41584", "0.4167", "12.0"]
    # benchmarks in the converter's layouts
    assert problems_of("bench_math500.jsonl")[1] == ("What is the smallest prime factor of $1001$?", "7")
    # parquet: nested columns come back as in JSONL; only the known columns are read
    rows = [json.loads(line) for line in (RL / "dapo_math_17k.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    assert problems_of_path(tmp_path / "dapo.parquet") == dapo
    omr_rows = [json.loads(line) for line in (RL / "openmathreasoning.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(omr_rows), tmp_path / "omr.parquet")
    read = [row for _, row in data.read_rows(str(tmp_path / "omr.parquet"))]
    assert len(read) == 7 and set(read[0]) == {"problem", "expected_answer"}  # no generated_solution


def problems_of_path(path):
    return [(question, answer) for _, question, answer, _ in data.read_problems(str(path))]


# ----------------------------------------------------------------------------- filters

def test_integer_forms_kept_and_dropped():
    kept = {"42": "42", " 42 ": "42", "-7": "-7", "+7": "7", "0042": "42", "-0": "0", "1,000": "1000",
            "12,345,678": "12345678", "1{,}000": "1000", "1,\\!000": "1000", "$42$": "42", "\\boxed{12}": "12",
            "$\\boxed{-3}$": "-3", "12.0": "12", "7.000": "7", "\\boxed{1,000}": "1000"}
    for label, integer in kept.items():
        assert data.integer_answer(label) == integer, label
    dropped = ["12.5", "0.4167", "1/2", "\\frac{1}{4}", "2^{10}", "10^3", "1,00", "1,0000", "1, 2", "3 and 4",
               "12 cm", "x = 3", "\\sqrt{2}", "1e5", "", "$", "\\boxed{}", "twelve", "42.", ".5", "--7"]
    for label in dropped:
        assert data.integer_answer(label) is None, label


def longest_shared_run(text_a, text_b):
    # an independent count: the longest run of consecutive normalised words the two texts share
    a, b = (re.findall(r"[a-z0-9]+", t.lower()) for t in (text_a, text_b))
    return max((n for n in range(1, len(a) + 1) for i in range(len(a) - n + 1)
                if any(a[i:i + n] == b[j:j + n] for j in range(len(b) - n + 1))), default=0)


def test_one_shared_8gram_is_dropped_a_7gram_kept(tmp_path):
    bench = problems_of("bench_aime.jsonl")[0][0]
    eight = problems_of("dapo_math_17k.jsonl")[1][0]  # "... count of ordered pairs of positive integers (a, b) with ..."
    seven = problems_of("dapo_math_17k_processed.jsonl")[1][0]  # "How many ordered pairs of positive integers (a, b) ..."
    assert longest_shared_run(eight, bench) == 8 and longest_shared_run(seven, bench) == 7
    assert len(data.ngram_hashes(eight) & data.ngram_hashes(bench)) == 1
    assert not data.ngram_hashes(seven) & data.ngram_hashes(bench)
    assert data.ngram_hashes(seven, n=7) & data.ngram_hashes(bench, n=7)
    # through the command's function: only the 8-gram one goes
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in (eight, seven)))
    counts = data.rl_set([str(path)], [str(RL / "bench_aime.jsonl")], str(tmp_path / "out.jsonl"))
    assert counts["shares an 8-gram with a benchmark"] == 1 and counts["kept"] == 1
    assert [row["question"] for row in read_jsonl(str(tmp_path / "out.jsonl"))] == [seven]
    # punctuation, case and LaTeX do not hide an 8-gram
    assert data.ngram_hashes("Of ORDERED pairs, of positive-integers $(a,b)$") == data.ngram_hashes("of ordered pairs of positive integers a b")


def test_all_sources_duplicates_and_counts_printed(tmp_path, capsys):
    out = tmp_path / "rl.jsonl"
    counts = data.rl_set([str(RL / name) for name in SOURCES], [str(RL / name) for name in BENCH], str(out))
    # 16 rows: 3 not integers (1/4, 12.5, 0.4167); the Processed copy of DAPO's first problem (wrapper off: the
    # same text) and OpenMathReasoning's second solution row are exact duplicates; its "first  $n$ odd
    # positive\nintegers" is DAPO's third problem up to whitespace; the 8-gram one goes
    assert counts == {"read": 16, "not an integer answer": 3, "exact duplicate": 2, "duplicate up to whitespace": 1,
                      "shares an 8-gram with a benchmark": 1, "kept": 9}
    rows = read_jsonl(str(out))  # what train_rl.py and eval.py read
    assert [(row["answer"], row["source"]) for row in rows] == [
        ("58", "dapo_math_17k.jsonl"), ("13", "dapo_math_17k.jsonl"),
        ("4", "dapo_math_17k_processed.jsonl"), ("2", "dapo_math_17k_processed.jsonl"),
        ("1000", "openmathreasoning.jsonl"), ("12", "openmathreasoning.jsonl"), ("-7", "openmathreasoning.jsonl"),
        ("41584", "project_euler.jsonl"), ("12", "project_euler.jsonl")]
    assert rows[1]["question"] == "The sum of the first $n$ odd positive integers is $169$. What is $n$?"
    assert [row.get("id") for row in rows[-2:]] == [1, 3] and set(rows[0]) == {"question", "answer", "source"}
    printed = capsys.readouterr().out
    assert "16 candidates from 4 file(s); 4 benchmark problems" in printed
    for line in ["not an integer answer +3", "exact duplicate +2", "duplicate up to whitespace +1",
                 "shares an 8-gram with a benchmark +1", "kept +9", "openmathreasoning.jsonl: 7 read, 3 kept"]:
        assert re.search(line.replace(" +", r"\s+"), printed), line


def test_command_line_and_bad_rows(tmp_path):
    for name in SOURCES + BENCH:
        shutil.copy(RL / name, tmp_path / name)
    run = lambda *args: subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), "rl-set", *args],  # noqa: E731
                                       cwd=tmp_path, capture_output=True, text=True)
    p = run("out/rl.jsonl", "--from", *SOURCES, "--decontaminate", *BENCH)
    assert p.returncode == 0, p.stderr
    assert re.search(r"kept\s+9\s+-> out/rl.jsonl", p.stdout) and len(read_jsonl(str(tmp_path / "out/rl.jsonl"))) == 9
    # a bad row stops the build with one line naming the file and the row
    (tmp_path / "bad.jsonl").write_text('{"problem": "P", "expected_answer": "1"}\n\n{"problem": "Q", "solution": "s"}\n')
    p = run("o.jsonl", "--from", "bad.jsonl", "--decontaminate", *BENCH)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("rl-set error: bad.jsonl:3: no answer")
    assert not (tmp_path / "o.jsonl").exists()  # no half-written output
    assert not (tmp_path / "o.jsonl.part").exists()  # nor the part it was written to
    (tmp_path / "bench_bad.jsonl").write_text('{"problem": "P", "answer": "1"}\n{"problem": 7, "answer": "1"}\n')
    p = run("o.jsonl", "--from", *SOURCES, "--decontaminate", "bench_bad.jsonl")
    assert p.returncode == 1 and "rl-set error: bench_bad.jsonl:2: the question must be a non-empty string" in p.stderr
    (tmp_path / "broken.jsonl").write_text('{"problem": "P", "answer": "1"}\n{oops\n')
    p = run("o.jsonl", "--from", "broken.jsonl", "--decontaminate", *BENCH)
    assert p.returncode == 1 and "rl-set error: broken.jsonl:2: not valid JSON" in p.stderr
    p = run(SOURCES[0], "--from", *SOURCES, "--decontaminate", *BENCH)
    assert p.returncode == 1 and "the output is also an input" in p.stderr
    assert (tmp_path / SOURCES[0]).read_text() == (RL / SOURCES[0]).read_text()
    p = run("o.jsonl", "--from", *SOURCES)
    assert p.returncode == 2 and "--decontaminate" in p.stderr  # decontamination is not optional
    pq.write_table(pa.table({"text": ["P"], "label": ["1"]}), tmp_path / "other.parquet")
    p = run("o.jsonl", "--from", "other.parquet", "--decontaminate", *BENCH)
    assert p.returncode == 1 and "other.parquet: none of the columns" in p.stderr and "'text', 'label'" in p.stderr


def test_synthetic_set_at_one_percent_counts_as_planted(tmp_path):
    # tests/rl_set_scale.py's data (docs/data.md's time and memory) at 1%: every filter's count is what was
    # planted: labels in each spelling, copies, 8- and 7-word runs of benchmark problems
    import rl_set_scale
    sources, benchmarks, planted = rl_set_scale.make(str(tmp_path), scale=0.01)
    assert planted["shares an 8-gram with a benchmark"] > 0 and planted["duplicate up to whitespace"] > 0
    assert data.rl_set(sources, benchmarks, str(tmp_path / "rl.jsonl")) == planted


# ----------------------------------------------------------------------------- the label check's keep rule

def graded(problem, sample, gold, answer):
    text = "<reason>r</reason>" + ("" if answer is None else f"<answer>\\boxed{{{answer}}}</answer>")
    t = Trajectory(key=(0, problem, sample), prompt_ids=[1], response_ids=[5] * 4, mask=[1] * 4, tool_calls=[],
                   turns=1, finish="stop", meta={"answer": gold, "problem": problem})
    reward = math_task.reward(text, gold)
    pred = agent.extract_answer(text)
    grade = grading.Grade(reward, reward == 1.0, int(answer is not None), pred, pred)
    return summarize(t, grade)


def test_keep_rule_label_check_and_stage3_on_scripted_samples():
    # 5 problems x 4 samples with 0, 1, 2, 3, 4 right answers (a wrong one, or no answer at all)
    problems = [{"question": f"Q{i}", "answer": str(10 + i), "source": "s"} for i in range(5)]
    groups = [[graded(i, j, p["answer"], p["answer"] if j < i else (None if j % 2 else "0")) for j in range(4)]
              for i, p in enumerate(problems)]
    _, per_problem = ev.metrics(groups)
    assert [p["correct"] for p in per_problem] == [0, 1, 2, 3, 4]
    # the label check: at least N of k right; N = 2 as the paper's "at least twice"
    assert ev.keep_by_correct(problems, per_problem, 2, 4) == problems[2:]
    assert ev.keep_by_correct(problems, per_problem, 1, 4) == problems[1:]
    assert ev.keep_by_correct(problems, per_problem, 4, 4) == problems[4:]
    # stage 3: pass rate < 1
    assert ev.keep_by_correct(problems, per_problem, 0, 3) == problems[:4]

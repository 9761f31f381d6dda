"""Tests for eval.py: pass@k against a brute-force count over all k-subsets, maj@k ties, every metric on
hand-made trajectories with hand-computed values, and the script end to end on a tiny random model (twice:
same numbers; two ranks: the same numbers again)."""

import itertools
import json
import math
import shutil

import pytest

import agent
import eval as ev
import grading
from rollout import Trajectory
from scheduler import summarize
from tasks import math as math_task
import zygote


# ----------------------------------------------------------------------------- pass@k and maj@k

def test_pass_at_k_matches_brute_force_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert ev.pass_at_k(16, 4, 1) == pytest.approx(4 / 16)  # pass@1 is the plain accuracy
    assert ev.pass_at_k(16, 1, 16) == 1.0 and ev.pass_at_k(16, 0, 16) == 0.0


def test_pass_at_k_bad_input():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            ev.pass_at_k(n, c, k)


def test_majority_vote_ties_normalisation_and_none():
    assert ev.majority_vote(["7", "5", "5"]) == 1
    # 5 and 7 tie with two votes each: the answer sampled first among the tied wins (sample 0)
    assert ev.majority_vote(["5", None, "7", "7", " 5"]) == 0
    assert ev.majority_vote([None, "7", "5", "5", "7"]) == 1
    # None answers do not vote, even when they are the majority
    assert ev.majority_vote([None, None, None, "3"]) == 3
    assert ev.majority_vote([None, None]) is None and ev.majority_vote([]) is None
    # whitespace and integer spelling do not split the vote; other spellings do (a plain string vote)
    assert ev.majority_vote(["1/2", "0042", "4 2", "+42", "1/2"]) == 1
    assert ev.majority_vote(["0.5", "1/2", "\\frac{1}{2}", "1 / 2"]) == 1
    assert ev.normalize_answer(" -007 ") == "-7" and ev.normalize_answer("-0") == "0"
    assert ev.normalize_answer("x + 1") == "x+1" and ev.normalize_answer("+") == "+"


def test_the_code_task_votes_on_the_program_not_its_text():
    # one program written with other names, spacing, comments and a docstring: one vote; another program: its own
    code = grading.load_task("tasks/code.py")
    row = {"entry": "f"}
    same = ["def f(x):\n    y = x * 3\n    return y - 1",
            'def f(n):\n    """Triple, less one."""\n    # scale\n    tripled = n*3\n    return tripled-1\n']
    other = ["def f(x):\n    return 3 * x - 1", "def g(x):\n    y = x * 3\n    return y - 1"]
    keys = [code.vote(row, pred, None) for pred in same + other]
    assert keys[0] == keys[1] and len(set(keys)) == 3 and keys[3] != keys[0]  # g is not the entry point f
    assert code.vote(row, None, None) is None and code.vote(row, "def f(:\n  pass", None) == "def f(: pass"
    # maj@k on those keys: the two spellings outvote the one sample that is a program of its own
    assert ev.majority_vote([keys[2], keys[0], keys[1]]) == 1
    assert ev.majority_vote([None, (), "", "7"]) == 3  # empty keys do not vote


def test_evaluate_groups_maj_at_k_by_the_tasks_vote(monkeypatch):
    # a task with vote(): eval calls it with the row, the pred and the trajectory on the rank that made it, and
    # maj@k groups by it, not by the pred's text; the per-problem answer shown is the winner's pred
    import types
    preds = ["two", "one", "uno"]  # samples 1 and 2 say the same in other words; sample 0 is right

    def fake_generate(engine, requests, budget, mode, on_finish, counter, keep):
        for j in range(len(requests)):  # one sampled token each: its sample index (the tokenizer reads preds)
            on_finish(Trajectory(key=requests[j].key, prompt_ids=[1], response_ids=[requests[j].key[2]], mask=[1],
                                 finish="stop", turns=1, meta=requests[j].meta))
    seen = []

    def vote(row, pred, trajectory):
        seen.append((row["question"], pred, trajectory.key))
        return {"one": 1, "uno": 1, "two": 2}[pred]
    task = types.SimpleNamespace(
        __name__="numbers", COLUMNS={"question": str}, TOOLS={}, prompt=lambda row: row["question"], vote=vote,
        predict=lambda turns: turns[0], grade=lambda row, pred, turns, grader, trajectory: (pred == "two", pred == "two"))
    monkeypatch.setattr(ev, "generate", fake_generate)
    tok = types.SimpleNamespace(decode=lambda ids: preds[ids[0]])
    summary, per = ev.evaluate(types.SimpleNamespace(sandbox=None), tok, [{"question": "q"}], 3, 10, prompt_ids=[[1]],
                               task=task)
    assert sorted(seen, key=lambda call: call[2]) == [("q", preds[s], (0, 0, s)) for s in range(3)]
    # the task's vote: 1 (samples 1 and 2), wrong; a vote on the text would be a three-way tie won by sample 0
    assert summary["maj@k"] == 0.0 and summary["avg@k"] == pytest.approx(1 / 3) and per[0]["maj_answer"] == "one"
    assert ev.majority_vote(preds) == 0


def test_a_sample_cut_by_the_budget_does_not_vote(monkeypatch):
    # sample 0 wrote the right answer and rambled on until the budget cut it: it scores 0, so its answer
    # must not win maj@k for the samples that answered the same and were graded right
    import types
    texts = ["<reason>r</reason><answer>\\boxed{5}</answer> and so on",
             "<reason>r</reason><answer>\\boxed{5}</answer>", "<reason>r</reason><answer>\\boxed{5}</answer>",
             "<reason>r</reason><answer>\\boxed{7}</answer>"]

    def fake_generate(engine, requests, budget, mode, on_finish, counter, keep):
        for j in range(len(requests)):
            sample = requests[j].key[2]
            on_finish(Trajectory(key=requests[j].key, prompt_ids=[1], response_ids=[sample], mask=[1],
                                 finish="length" if sample == 0 else "stop", turns=1, meta=requests[j].meta))
    monkeypatch.setattr(ev, "generate", fake_generate)
    tok = types.SimpleNamespace(decode=lambda ids: texts[ids[0]])
    row = {"question": "q", "answer": "5"}
    summary, per = ev.evaluate(types.SimpleNamespace(sandbox=None), tok, [row], 4, 10, prompt_ids=[[1]],
                               task=math_task)
    assert summary["avg@k"] == 0.5 and per[0]["preds"] == ["5", "5", "5", "7"]
    assert summary["maj@k"] == 1.0 and per[0]["maj_answer"] == "5"
    # graded anyway (score_truncated, the released code's rule): it is right and votes
    summary, _ = ev.evaluate(types.SimpleNamespace(sandbox=None), tok, [row], 4, 10, prompt_ids=[[1]],
                             task=math_task, score_truncated=True)
    assert summary["avg@k"] == 0.75 and summary["maj@k"] == 1.0


def test_a_lost_and_a_repeated_sample_do_not_move_samples_between_problems(monkeypatch):
    # two problems (the same row twice: duplicates in the data are two problems), 2 samples
    # each; the engine finishes problem 0's sample 0 twice and never problem 1's sample 1. The
    # summaries were cut into groups of k by position: problem 0's sample 1 was counted as
    # problem 1's, and the numbers came out without a word
    import types

    def fake_generate(engine, requests, budget, mode, on_finish, counter, keep):
        for j in [0, 0, 1, 2]:
            on_finish(Trajectory(key=requests[j].key, prompt_ids=[1], response_ids=[1], mask=[1],
                                 finish="stop", turns=1, meta=requests[j].meta))
    monkeypatch.setattr(ev, "generate", fake_generate)
    tok = types.SimpleNamespace(decode=lambda ids: "<answer>\\boxed{5}</answer>")
    row = {"question": "q", "answer": "5"}
    with pytest.raises(ValueError, match=r"got \[3, 1\]"):
        ev.evaluate(types.SimpleNamespace(sandbox=None), tok, [row, row], 2, 10,
                    prompt_ids=[[1], [1]], task=math_task)


def test_a_grade_given_up_on_scores_0_even_if_it_ends_just_after(monkeypatch):
    # results() gives up on a grade past its bound and scores it 0 (counted timed_out); the grade
    # ending between that and let_go() once took its late 1 instead: the numbers hung on a race
    import concurrent.futures
    import threading
    import types
    started, release = threading.Event(), threading.Event()

    def slow_grade(row, pred, turns, grader, trajectory):
        started.set()
        release.wait()
        return 1.0, True
    task = types.SimpleNamespace(__name__="slow", COLUMNS={"question": str}, TOOLS={},
                                 prompt=lambda row: row["question"], predict=lambda turns: "x",
                                 grade=slow_grade)

    def fake_generate(engine, requests, budget, mode, on_finish, counter, keep):
        on_finish(Trajectory(key=requests[0].key, prompt_ids=[1], response_ids=[1], mask=[1],
                             finish="stop", turns=1, meta=requests[0].meta))
    real_results = grading.Grader.results

    def results_past_the_bound(self):
        # the grade is running, and past its bound: results() gives up on it; then it ends
        started.wait()
        self.deadline = dict.fromkeys(self.deadline, 0.0)
        running = list(self.pending.values())
        out = real_results(self)
        release.set()
        concurrent.futures.wait(running)
        return out
    monkeypatch.setattr(ev, "generate", fake_generate)
    monkeypatch.setattr(grading.Grader, "results", results_past_the_bound)
    tok = types.SimpleNamespace(decode=lambda ids: "x")
    summary, per = ev.evaluate(types.SimpleNamespace(sandbox=None), tok, [{"question": "q"}], 1,
                               10, prompt_ids=[[1]], task=task)
    assert summary["avg@k"] == 0.0 and per[0]["correct"] == 0
    # and the summary counts it: a grade scored 0 without a verdict was in no output of eval.py
    assert summary["grade/timed_out"] == 1 and summary["grade/failed"] == 0


# ----------------------------------------------------------------------------- metrics on crafted trajectories

def traj(problem, sample, gold, answer, length, model_tokens, statuses=(), turns=1, finish="stop"):
    text = "<reason>r</reason>" + ("" if answer is None else f"<answer>\\boxed{{{answer}}}</answer>")
    t = Trajectory(key=(0, problem, sample), prompt_ids=[1, 2], response_ids=[5] * length,
                   mask=[1] * model_tokens + [0] * (length - model_tokens), tool_calls=[agent.CallRecord("", None, s) for s in statuses],
                   turns=turns, finish=finish, meta={"answer": gold, "problem": problem})
    reward = math_task.reward(text, gold)
    pred = agent.extract_answer(text)
    grade = grading.Grade(reward, reward == 1.0, int(answer is not None), pred, pred)
    return summarize(t, grade)  # what eval keeps of a trajectory


def test_metrics_hand_computed():
    groups = [
        # gold 42: right, wrong, no answer, right -> 2/4; vote 42 (2 votes) -> right
        [traj(0, 0, "42", "42", 10, 6, ["ok", "error"], 2), traj(0, 1, "42", "41", 20, 20),
         traj(0, 2, "42", None, 30, 10, ["timeout", "invalid", "ok"], 4, "length"), traj(0, 3, "42", " 042", 40, 40)],
        # gold 8: 1/4; vote 7 -> wrong
        [traj(1, 0, "8", "7", 5, 5), traj(1, 1, "8", "7", 5, 5, ["ok"], 2), traj(1, 2, "8", "8", 5, 5),
         traj(1, 3, "8", "9", 5, 5, ["memory", "crash"], 3, "max_turns")],
        # gold 3: 2/4; 3 and 4 tie, 3 was sampled first -> right
        [traj(2, 0, "3", "3", 100, 50), traj(2, 1, "3", "4", 100, 50), traj(2, 2, "3", "4", 100, 50, ["overloaded"], 2),
         traj(2, 3, "3", "3", 100, 50, [], 1, "length")],
    ]
    assert [t.reward for t in groups[0]] == [1.0, 0.0, 0.0, 1.0]
    s, per = ev.metrics(groups)
    assert s["problems"] == 3 and s["samples"] == 4
    accs = [0.5, 0.25, 0.5]
    assert s["avg@k"] == pytest.approx(1.25 / 3)
    mean = sum(accs) / 3
    assert s["avg@k_se"] == pytest.approx(math.sqrt(sum((a - mean) ** 2 for a in accs) / 2) / math.sqrt(3))
    # pass@2 by hand: c=2 of 4 -> 1 - C(2,2)/C(4,2) = 5/6; c=1 -> 1 - C(3,2)/C(4,2) = 1/2
    assert s["pass@1"] == pytest.approx(s["avg@k"])
    assert s["pass@2"] == pytest.approx((5 / 6 + 1 / 2 + 5 / 6) / 3)
    assert s["pass@4"] == s["pass@k"] == 1.0
    assert set(k for k in s if k.startswith("pass@")) == {"pass@1", "pass@2", "pass@4", "pass@k"}
    assert s["maj@k"] == pytest.approx(2 / 3)
    assert s["reward"] == pytest.approx(5 / 12)  # the mean reward beside avg@k (math-verify's, whatever the finish)
    assert [p["maj_answer"] for p in per] == ["42", "7", "3"] and [p["maj_correct"] for p in per] == [1.0, 0.0, 1.0]
    lengths = [10, 20, 30, 40] + [5] * 4 + [100] * 4
    model = [6, 20, 10, 40] + [5] * 4 + [50] * 4
    assert s["rollout/response_len"] == pytest.approx(sum(lengths) / 12) and s["rollout/response_len_median"] == 25
    assert s["rollout/sampled_len"] == pytest.approx(sum(model) / 12) and s["rollout/sampled_len_median"] == 15
    assert s["rollout/turns"] == pytest.approx((2 + 1 + 4 + 1 + 1 + 2 + 1 + 3 + 1 + 1 + 2 + 1) / 12)
    assert s["tool/calls"] == pytest.approx(9 / 12)
    # errors: error, timeout, invalid, memory, crash = 5 of the 8 calls that count (ok is not an error;
    # overloaded, our infrastructure's, counts on neither side)
    assert s["tool/err"] == pytest.approx(5 / 8)
    # the one "invalid" record has no tool and no answer text: a call that did not parse
    assert s["tool/unparsed"] == pytest.approx(1 / 9) and s["tool/unknown_tool"] == s["tool/repeat"] == 0.0
    assert s["rollout/truncated_frac"] == pytest.approx(2 / 12) and s["rollout/max_turns_frac"] == pytest.approx(1 / 12)
    assert s["rollout/no_answer_frac"] == pytest.approx(1 / 12)
    assert [p["correct"] for p in per] == [2, 1, 2] and [p["tool_errors"] for p in per] == [3, 2, 0]
    assert per[0]["preds"] == ["42", "41", None, "042"] and per[0]["response_len"] == 25
    assert per[0]["truncated"] == 1 and per[2]["tool_calls"] == 1


def test_metrics_majority_counts_first_sample_reward_and_no_answers():
    # no sample answers: maj wrong, no_answer 1; one sample only: se 0
    s, per = ev.metrics([[traj(0, 0, "5", None, 3, 3), traj(0, 1, "5", None, 3, 3)]])
    assert s["maj@k"] == 0.0 and per[0]["maj_answer"] is None and s["rollout/no_answer_frac"] == 1.0
    assert s["avg@k_se"] == 0.0 and s["tool/err"] == 0.0
    with pytest.raises(ValueError, match="same non-zero number of samples"):
        ev.metrics([[traj(0, 0, "5", "5", 3, 3)], []])


# ----------------------------------------------------------------------------- the script on a tiny model

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Qwen3 + tokenizer and its held-out problems, made by data.py's own functions."""
    import data
    from sandbox import SandboxPool
    d = tmp_path_factory.mktemp("tiny")
    with SandboxPool(workers=1) as pool:
        data.prepare(str(d / "base"), 0, pool.map, data_dir=str(d / "data"), n_train=8, n_heldout=3, n_sft=8)
    return d


def run_eval(tiny, out_dir, *extra, ranks=1):
    # one process: a child of the zygote (tests/zygote.py); more: under the real torchrun
    cmd = ["eval.py", "configs/tiny_eval.py", f"--model_path={tiny / 'base'}",
           f"--data_path={tiny / 'data' / 'heldout.jsonl'}", f"--out_dir={out_dir}", "--samples=2",
           "--max_response_tokens=48", "--tool_workers=1", *extra]
    p = zygote.run(cmd, timeout=300, ranks=ranks, torchrun=ranks > 1)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def read_out(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def outputs(out_dir):
    """summary.json without what differs between runs on purpose, and the trajectory dump."""
    with open(out_dir / "summary.json") as f:
        summary = json.load(f)
    summary.pop("wall_s"), summary.pop("peak_rss_mib")
    for key in ("out_dir", "keep_unsolved", "keep_solved", "keep_min_correct", "decode_mode"):
        summary["config"].pop(key)
    return summary, outputs_dump(out_dir)


def outputs_dump(out_dir):
    # the ranks write their trajectories as they finish: in (group, sample) order, read after a sort
    return sorted(read_out(out_dir / "trajectories.jsonl"),
                  key=lambda t: (t["group"], t["sample"]))


@pytest.fixture(scope="module")
def first_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_a")
    p = run_eval(tiny, out, f"--keep_unsolved={out / 'hard.jsonl'}", f"--keep_solved={out / 'labelled.jsonl'}",
                 "--keep_min_correct=1")
    return out, p.stdout


def test_script_runs_and_writes_outputs(tiny, first_run):
    out, stdout = first_run
    assert "| avg@2 |" in stdout
    s, trajs = outputs(out)
    assert s["problems"] == 3 and s["samples"] == 2 and s["temperature"] == 1.0
    assert s["config"]["max_response_tokens"] == 48 and s["config"]["max_turns"] == 4
    assert [(t["group"], t["sample"]) for t in trajs] == [(i, j) for i in range(3) for j in range(2)]
    for t in trajs:
        assert 1 <= len(t["response_ids"]) <= 48 and len(t["mask"]) == len(t["response_ids"])
        assert t["finish"] in ("stop", "length", "max_turns") and t["reward"] in (0.0, 1.0)
        assert "".join(text for text, _ in t["segments"]) and t["segments"][0][1] == 1
    # the summary agrees with the dump it came from
    assert s["avg@k"] == pytest.approx(sum(t["reward"] for t in trajs) / 6)
    assert s["rollout/response_len"] == pytest.approx(sum(len(t["response_ids"]) for t in trajs) / 6)
    assert s["rollout/truncated_frac"] == pytest.approx(sum(t["finish"] == "length" for t in trajs) / 6)
    per = read_out(out / "per_problem.jsonl")
    assert [p["index"] for p in per] == [0, 1, 2]
    assert [p["correct"] for p in per] == [sum(t["reward"] for t in trajs if t["group"] == i) for i in range(3)]
    md = open(out / "summary.md").read()
    assert "| avg@2 |" in md and "| maj@2 |" in md and md.count("/2 |") == 3
    heldout = read_out(tiny / "data" / "heldout.jsonl")
    assert read_out(out / "hard.jsonl") == [heldout[p["index"]] for p in per if p["correct"] < 2]
    assert read_out(out / "labelled.jsonl") == [heldout[p["index"]] for p in per if p["correct"] >= 1]
    assert "(pass rate < 1)" in stdout and "(>= 1 of 2 right)" in stdout
    # the evaluation's own peak RSS (VmHWM, reset once the model is loaded): a real process's tens of MiB at least
    assert 32 < json.load(open(out / "summary.json"))["peak_rss_mib"] < 4096


def test_script_same_numbers_with_same_seed(tiny, first_run, tmp_path):
    run_eval(tiny, tmp_path / "b")
    assert outputs(tmp_path / "b") == outputs(first_run[0])
    # a different seed samples different trajectories (a random 1M-param model: identical text is
    # practically impossible over 6 trajectories of up to 48 tokens)
    run_eval(tiny, tmp_path / "c", "--seed=1")
    assert outputs(tmp_path / "c")[1] != outputs(first_run[0])[1]
    # the decode_mode key reaches the model: its static-shape steps give the eager tokens (tests/test_decode.py)
    run_eval(tiny, tmp_path / "s", "--decode_mode=static")
    assert outputs(tmp_path / "s") == outputs(first_run[0])
    with pytest.raises(AssertionError, match="decode_mode 'cudagraphs': eager, static, compile or graphs"):
        run_eval(tiny, tmp_path / "g", "--decode_mode=cudagraphs")


def test_script_under_torchrun_matches_one_process(tiny, first_run, tmp_path):
    # two ranks share the problems through the scheduler; every trajectory has its own generator,
    # so the results do not depend on which rank made it
    p = run_eval(tiny, tmp_path / "d", ranks=2)
    assert "2 rank(s)" in p.stdout
    assert outputs(tmp_path / "d") == outputs(first_run[0])


# eval.py run as a script that is stopped (Ctrl-C) as it writes per_problem.jsonl
STOPPED_EVAL = '''import runpy, sys
import common


def stopped(path, rows):
    raise KeyboardInterrupt


common.write_jsonl = stopped
sys.argv[0] = "eval.py"
runpy.run_path("eval.py", run_name="__main__")
'''


def test_a_run_stopped_while_it_writes_leaves_no_summary_of_two_runs(tiny, first_run, tmp_path):
    # out_dir holds an earlier run's outputs (2 samples a problem); a run of 1 sample a problem is
    # stopped as it writes its own: it once left its summary.json and summary.md beside the earlier
    # run's per_problem.jsonl (and demo.py takes summary.json for a finished eval)
    out = tmp_path / "out"
    shutil.copytree(first_run[0], out)
    script = tmp_path / "stopped_eval.py"
    script.write_text(STOPPED_EVAL)
    p = zygote.run([str(script), "configs/tiny_eval.py", f"--model_path={tiny / 'base'}",
                    f"--data_path={tiny / 'data' / 'heldout.jsonl'}", "--samples=1",
                    "--max_response_tokens=48", "--tool_workers=1", f"--out_dir={out}"])
    assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr
    # no summary is left: the stopped run's are written last, and the earlier run's went first
    assert not (out / "summary.json").exists() and not (out / "summary.md").exists()
    # the files left are whole: the earlier run's rows, the stopped run's dump (renamed once
    # joined)
    assert [row["samples"] for row in read_out(out / "per_problem.jsonl")] == [2, 2, 2]
    assert [(t["group"], t["sample"]) for t in outputs_dump(out)] == [(0, 0), (1, 0), (2, 0)]
    assert sorted(path.name for path in out.iterdir() if "trajectories" in path.name) == [
        "trajectories.jsonl"]


# eval.py run as a script, each rank's engine counting the trajectories it generates into
# count.<rank>
COUNTING_EVAL = '''import os, runpy, sys
import rollout

run = rollout.Engine.run
made = []


def counting(self, claim, budget, on_finish=None, **kwargs):
    def finished(trajectory):
        made.append(trajectory.key)
        on_finish(trajectory)
    return run(self, claim, budget, finished, **kwargs)


rollout.Engine.run = counting
sys.argv[0] = "eval.py"
runpy.run_path("eval.py", run_name="__main__")
with open(os.path.join(sys.argv[-1].partition("=")[2], "count." + os.environ["RANK"]), "w") as f:
    f.write(str(len(made)))
'''


def test_script_under_torchrun_shares_the_rollouts_across_ranks(tiny, tmp_path):
    # 3 problems x 8 samples on 2 ranks, 12 each. Long responses next to short prompts: a rank's
    # KV (12 rows of prompt + budget) holds the promise (prompt + a quarter of the budget,
    # reserve "auto") of all 24 rollouts, and the first rank to claim took every one of them,
    # leaving the other idle, until each engine held at most its rank's share at once
    # (train_rl.py's max_rows)
    script = tmp_path / "counting_eval.py"
    script.write_text(COUNTING_EVAL)
    out = tmp_path / "e"
    # an earlier run's dump in out_dir: a run without one removes it (it would read as this run's)
    out.mkdir()
    (out / "trajectories.jsonl").write_text("{}\n")
    p = zygote.run([str(script), "configs/tiny_eval.py", f"--model_path={tiny / 'base'}",
                    f"--data_path={tiny / 'data' / 'heldout.jsonl'}", "--samples=8",
                    "--max_response_tokens=384", "--tool_workers=1", "--save_trajectories=false",
                    f"--out_dir={out}"], timeout=300, ranks=2)
    assert p.returncode == 0, p.stdout + p.stderr
    made = [int((out / f"count.{rank}").read_text()) for rank in range(2)]
    assert sum(made) == 24 and min(made) > 0, made
    assert not (out / "trajectories.jsonl").exists()


# a user's script that imports evaluate() and calls it twice under torchrun (two checkpoints,
# two sets)
EVALUATE_TWICE = '''import json, sys
import eval as ev
import grading
from common import compute_init, read_jsonl
from model import load_model
from rollout import Engine
from transformers import AutoTokenizer

model_path, data_path, out = sys.argv[1:]
rank, world, device = compute_init()
task = grading.load_task("tasks/math.py")
problems = read_jsonl(data_path)
tokenizer = AutoTokenizer.from_pretrained(model_path)
prompt_ids = grading.tokenize_prompts(problems, task, tokenizer)
engine = Engine(load_model(model_path), tokenizer, kv_capacity=8 * 128, max_len=128,
                temperature=1.0, max_turns=1, tools={})
summaries = [ev.evaluate(engine, tokenizer, problems, 2, 16, prompt_ids=prompt_ids, task=task)[0]
             for _ in range(2)]
if rank == 0:
    json.dump(summaries, open(out, "w"))
'''


def test_evaluate_twice_under_torchrun(tiny, tmp_path):
    # each call claims from a shared counter of its own: the second once found the first's used up,
    # generated nothing, and raised ("need the same non-zero number of samples")
    script = tmp_path / "evaluate_twice.py"
    script.write_text(EVALUATE_TWICE)
    out = tmp_path / "summaries.json"
    data_path = tiny / "data" / "heldout.jsonl"
    p = zygote.run([str(script), str(tiny / "base"), str(data_path), str(out)],
                   timeout=300, ranks=2)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = json.loads(out.read_text())
    assert first["problems"] == 3 and first == second


def test_script_bad_input_is_named(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"question": "What is 1 + 1?", "answer": 2}])
    p = zygote.run(["eval.py", "configs/tiny_eval.py", f"--model_path={tiny / 'base'}", f"--data_path={bad}"])
    assert p.returncode != 0 and "bad.jsonl:1: field 'answer' must be str" in p.stderr
    p = zygote.run(["eval.py", "configs/tiny_eval.py", f"--model_path={tiny / 'base'}",
                    f"--data_path={tiny / 'data' / 'heldout.jsonl'}", "--max_prompt_tokens=8"])
    assert p.returncode != 0 and "longer than max_prompt_tokens=8" in p.stderr


def test_memory_grows_at_most_1_5_kb_a_sample(tiny):
    """1,024 problems × 8 samples of 8 tokens, 128 rows at a time, evaluated in this process: from the 2,048th
    graded trajectory to the last, RSS grows by at most 1.5 KB a sample (each sample's Summary, which is
    kept: ~0.6 KB). With the grader keeping every grade's future until its results(), as it once did: 2.6 KB
    (3.4 KB over 2,048 problems). The RSS is read as each trajectory is graded, past the run's first ~2,000,
    where the allocator and the threads settle (~100 MiB, by a different amount each run: a peak's comparison
    of two runs of different sizes measured that, and failed the CI at 2.5 KB a sample with nothing kept)."""
    import data
    import torch
    from transformers import AutoTokenizer
    from model import load_model
    from rollout import Engine
    from sandbox import SandboxPool
    problems = data.make_problems(1024, seed=1024)
    tok = AutoTokenizer.from_pretrained(tiny / "base")
    prompt_ids = grading.tokenize_prompts(problems, math_task, tok)
    model = load_model(str(tiny / "base"), device="cpu", dtype=torch.float32)
    rss_kib = []

    def on_graded(trajectory, summary):
        with open("/proc/self/status") as f:
            rss_kib.append(next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")))

    with SandboxPool(workers=1) as pool:
        engine = Engine(model, tok, kv_capacity=128 * (64 + 8), max_len=64 + 8, sandbox=pool, reserve="auto")
        ev.evaluate(engine, tok, problems, 8, 8, prompt_ids=prompt_ids, task=math_task, on_graded=on_graded)
    assert len(rss_kib) == 1024 * 8
    measured = rss_kib[2048:]
    per_sample = (measured[-1] - measured[0]) * 1024 / (len(measured) - 1)
    assert per_sample <= 1536, (per_sample, rss_kib[::1024])


def test_prompts_tokenized_in_batches_as_one_at_a_time(tiny):
    """grading.tokenize_prompts encodes 1,024 prompts a call: 1,030 problems (a second, partial batch) give the
    ids, order and int32 arrays that encoding each prompt alone gives."""
    import data
    from transformers import AutoTokenizer
    problems = data.make_problems(1030, seed=7)
    tok = AutoTokenizer.from_pretrained(tiny / "base")
    batched = grading.tokenize_prompts(problems, math_task, tok)
    assert len(batched) == len(problems)
    for problem, ids in zip(problems, batched):
        alone = tok.encode(math_task.prompt(problem), add_special_tokens=False)
        assert ids.dtype == "int32" and ids.tolist() == alone

"""grading.Grader, the engine's on_finish: the answer comes from the final sampled turn, outside its tool calls;
truncated rollouts score 0 (the paper) unless score_truncated (the released code); grading never holds up the
decode loop, and every grade has a bound whatever its helper does (not started, stopped, killed, slow), with
what passed a bound counted in grader.stats. The grades here are the math task's (tasks/math.py: its rule's
own tests are in test_tasks.py)."""
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

import agent
import data
import grading
from rollout import Trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = grading.load_task("tasks/math.py")
HALF = "<answer>\\boxed{\\frac{1}{2}}</answer>"  # needs math-verify against the gold 0.5
BOMB = "<answer>\\boxed{9^{9^{9^{9}}}}</answer>"  # math-verify never finishes it


@pytest.fixture(scope="module")
def tok():
    texts = ["<|im_start|>assistant\n<reason>compute</reason>\n<answer>\\boxed{7}</answer><|im_end|>\n"
             "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"] * 20
    return data.train_tokenizer(texts, vocab_size=400)


def trajectory(tok, pieces, finish="stop", gold="7", key=(0, 0, 0)):
    ids, mask = [], []
    for text, m in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + piece, mask + [m] * len(piece)
    return Trajectory(key=key, prompt_ids=[1], response_ids=ids, mask=mask, finish=finish, turns=2,
                      meta={"answer": gold})


def grade(tok, traj, **kw):
    g = grading.Grader(tok, **kw)
    g(traj)
    try:
        return g.results()[traj.key]
    finally:
        g.close()


def helper_pids(parent):
    """The live helpers whose parent process is `parent`, found in /proc."""
    pids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f, open(f"/proc/{d}/stat") as s:
                cmd, ppid = f.read(), int(s.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"--helper" in cmd and ppid == parent:
            pids.append(int(d))
    return pids


def alive(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--helper" in f.read()  # a zombie's cmdline is empty
    except OSError:
        return False


RESPONSE = "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"


def call(code):
    return '\n<tool_call>\n{"name": "' + agent.TOOL_NAME + '", "arguments": {"code": "' + code + '", "input": ""}}\n</tool_call>'


def test_tool_output_cannot_supply_the_answer(tok):
    printed = "<|im_end|>\n<|im_start|>user\n<tool_response>\n<answer>\\boxed{7}</answer>\n</tool_response>" \
              "<|im_end|>\n<|im_start|>assistant\n<reason>"
    t = trajectory(tok, [("compute</reason>", 1), (printed, 0), ("so it is done</reason><|im_end|>", 1)])
    assert MATH.reward(tok.decode(t.response_ids), "7") == 1.0  # the whole decoded text would pay out
    assert grade(tok, t) == grading.Grade(0.0, False, 0, None, None)
    # an answer block cannot be stitched together across a tool response either
    t = trajectory(tok, [("<answer>\\boxed{7}", 1), (printed.replace("<answer>\\boxed{7}", ""), 0), ("</reason>", 1)])
    assert grade(tok, t).n_answers == 0
    t = trajectory(tok, [("compute</reason>", 1), (printed, 0), ("<answer>\\boxed{7}</answer><|im_end|>", 1)])
    assert grade(tok, t) == grading.Grade(1.0, True, 1, "7", "7")


def test_the_answer_is_the_final_turns_outside_its_tool_calls(tok):
    # answered in a turn before a tool call, nothing in the final turn: not an answer (p_format still counts it)
    early = trajectory(tok, [("so <answer>\\boxed{7}</answer>, let me check" + call("print(7)") + "<|im_end|>", 1),
                             (RESPONSE, 0), ("checked</reason><|im_end|>", 1)])
    assert grade(tok, early) == grading.Grade(0.0, False, 1, None, None)
    # inside the code of the final turn's tool call (a comment), closed (cut by max_turns) or not
    for text in [call("# <answer>\\\\boxed{7}</answer>") + "<|im_end|>", call("print(1)  # <answer>\\\\boxed{7}</answer>")[:-12]]:
        for finish in ("max_turns", "stop"):
            assert grade(tok, trajectory(tok, [(text, 1)], finish=finish)) == grading.Grade(0.0, False, 0, None, None)
    # the final turn's own answer, beside a call and after a turn that answered otherwise
    late = trajectory(tok, [("<answer>\\boxed{8}</answer>" + call("print(7)") + "<|im_end|>", 1), (RESPONSE, 0),
                            ("7 it is</reason>" + call("print(7)") + "\n<answer>\\boxed{7}</answer><|im_end|>", 1)],
                      finish="max_turns")
    assert grade(tok, late) == grading.Grade(1.0, True, 2, "7", "7")


def test_truncated_rollouts_score_zero_unless_asked(tok):
    t = trajectory(tok, [("done</reason>\n<answer>\\boxed{7}</answer> and more", 1)], finish="length")
    assert grade(tok, t).reward == 0.0
    assert grade(tok, t, score_truncated=True).reward == 1.0
    t.finish = "max_turns"  # not cut by the budget: graded
    assert grade(tok, t).reward == 1.0


def test_grading_does_not_block_the_caller(tok, monkeypatch):
    release = threading.Event()

    def slow_grade(row, pred, turns, grader, trajectory):
        release.wait(30)
        return 1.0, True
    g = grading.Grader(tok, task=types.SimpleNamespace(predict=MATH.predict, grade=slow_grade))
    ts = [trajectory(tok, [("<answer>\\boxed{7}</answer>", 1)], key=(0, 0, i)) for i in range(3)]
    for t in ts:
        g(t)  # returns while the grade is still being computed
    assert not release.is_set()
    time.sleep(0.3)
    release.set()
    assert [r.reward for r in g.results().values()] == [1.0, 1.0, 1.0]
    assert g.stats["wait_s"] > 0 and g.stats["timed_out"] == 0  # the wait is measured
    g.close()


@pytest.mark.timeout(60)
def test_a_hung_grade_is_bounded(tok, monkeypatch):
    # a grade that never returns (injected) scores 0 after its bound (2 x timeout); the next grade, queued
    # behind it on the only thread, is made by the thread that replaces it
    release, real = threading.Event(), agent.extract_answer

    def hang(text):
        if "hang" in str(text):
            release.wait(60)
        return real(text)
    monkeypatch.setattr(agent, "extract_answer", hang)
    g = grading.Grader(tok, timeout=1.0, helpers=1)
    hung = trajectory(tok, [("hang <answer>\\boxed{7}</answer>", 1)], key=(0, 0, 0))
    ok = trajectory(tok, [("<answer>\\boxed{7}</answer>", 1)], key=(0, 0, 1))
    g(hung)
    g(ok)
    t0 = time.time()
    res = g.results()
    waited = time.time() - t0
    release.set()
    assert res == {hung.key: grading.Grade(0.0, False, 0, None, None), ok.key: grading.Grade(1.0, True, 1, "7", "7")}
    assert waited < 15, waited  # ~2 s here; before: until the hang ended (60 s)
    assert g.stats["timed_out"] == 1 and g.stats["wait_s"] >= 1.5
    g.close()


@pytest.mark.timeout(60)
def test_a_helper_that_never_starts_fails_fast(tok, monkeypatch):
    # the helper's process starts but never says "ready": the first grade waits start_timeout once, the
    # queued ones score 0 at once (not one start_timeout each), all counted; after the pause it starts again
    real = subprocess.Popen
    monkeypatch.setattr(grading.subprocess, "Popen",
                        lambda cmd, **kw: real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
    g = grading.Grader(tok, start_timeout=1.0, helpers=1)
    ts = [trajectory(tok, [(HALF, 1)], gold="0.5", key=(0, 0, i)) for i in range(5)]
    for t in ts:
        g(t)
    t0 = time.time()
    res = g.results()
    assert time.time() - t0 < 4.0  # before: 120 s, then it raised
    assert [r.reward for r in res.values()] == [0.0] * 5
    assert (g.stats["helper_starts"], g.stats["helper_start_failures"], g.stats["failed"]) == (1, 1, 5)
    assert helper_pids(os.getpid()) == []  # the one that hung was killed
    monkeypatch.setattr(grading.subprocess, "Popen", real)
    # the pause is over; the real helper imports sympy, which takes more than 1 s on a loaded 2-core box
    g.down_until, g.start_timeout = 0.0, 60.0
    g(ts[0])
    assert g.results()[ts[0].key].reward == 1.0 and g.stats["helper_starts"] == 1
    g.close()


@pytest.mark.timeout(120)
def test_a_stopped_helper_cannot_block_the_writer(monkeypatch):
    # a 200 KB request to a helper that is stopped (SIGSTOP) fills the pipe: the write gives up at timeout
    monkeypatch.setattr(grading, "MAX_ANSWER_CHARS", 10 ** 6)  # let it reach the pipe
    g = grading.Grader(None, timeout=1.0)
    assert MATH.reward(HALF, "0.5", g) == 1.0  # this thread's helper is up
    (pid,) = [p.pid for p in g.procs.values()]
    os.kill(pid, signal.SIGSTOP)
    big = "<answer>\\boxed{" + "+".join(["1"] * 100_000) + "}</answer>"
    t0 = time.time()
    assert MATH.reward(big, "0.5", g) == 0.0
    assert time.time() - t0 < 10  # before: blocked in write() for as long as the helper stayed stopped
    assert not alive(pid)  # killed and replaced
    assert MATH.reward(HALF, "0.5", g) == 1.0
    g.results()
    assert (g.stats["timed_out"], g.stats["helper_starts"]) == (1, 2)
    g.close()


@pytest.mark.timeout(120)
def test_the_helper_dies_with_a_killed_trainer():
    # a "trainer" grades on the Grader's thread, its helper busy with a bomb; SIGKILL the trainer: the helper
    # must be gone within a few seconds (before: it went on computing, reparented to init)
    script = f"""
import sys, time, types
sys.path.insert(0, {ROOT!r})
import grading
tok = types.SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)))
def traj(text, gold, key):
    ids = [ord(c) for c in text]
    return types.SimpleNamespace(key=key, response_ids=ids, mask=[1] * len(ids), finish="stop", meta={{"answer": gold}})
g = grading.Grader(tok, timeout=600, helpers=1)
g(traj({HALF!r}, "0.5", 0))
assert g.results()[0].reward == 1.0
g(traj({BOMB!r}, "1", 1))
time.sleep(1)
print("busy", flush=True)
time.sleep(600)
"""
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline() == "busy\n"
        (pid,) = helper_pids(trainer.pid)
    finally:
        trainer.kill()
        trainer.wait()
    end = time.time() + 5
    while alive(pid) and time.time() < end:
        time.sleep(0.1)
    assert not alive(pid)


@pytest.mark.timeout(120)
def test_grades_run_on_several_helpers(tok):
    # two slow grades at once on a Grader of two: two helpers alive together, each grade bounded by timeout
    before = set(helper_pids(os.getpid()))
    g = grading.Grader(tok, timeout=3.0, helpers=2)
    for i in range(2):
        g(trajectory(tok, [(BOMB, 1)], gold="1", key=(0, 0, i)))
    most, end = 0, time.time() + 60
    while most < 2 and time.time() < end:
        most = max(most, len(set(helper_pids(os.getpid())) - before))
        time.sleep(0.05)
    res = g.results()
    assert most == 2  # before: one helper, one grade at a time
    assert [r.reward for r in res.values()] == [0.0, 0.0]
    assert (g.stats["timed_out"], g.stats["helper_starts"]) == (2, 2)
    g.close()
    assert set(helper_pids(os.getpid())) - before == set()  # close() kills them


def boxed(inner):
    return f"<reason>...</reason>\n<answer>\\boxed{{{inner}}}</answer>"


def test_answers_beyond_the_limits_are_refused():
    # each of these cost the full timeout (5 s) in math-verify: now 0 before parsing, counted
    g = grading.Grader(None)
    for bomb in ["(" * 3000 + "1" + ")" * 3000, "\\left(" * 1000 + "1" + "\\right)" * 1000, "1" * 50_000,
                 "0" * 120_000 + "x", "{" * 11 + "1" + "}" * 11]:
        t0 = time.time()
        assert MATH.reward(boxed(bomb), "\\frac{1}{2}", g) == 0.0
        assert time.time() - t0 < 1.0, bomb[:20]
    # even the right one: too long to be an answer
    assert MATH.reward(boxed("1" * 50_000), "1" * 50_000, g) == 0.0
    assert not g.refuses("(" * grading.MAX_DEPTH + "1" + ")" * grading.MAX_DEPTH)
    assert not g.refuses("1" * grading.MAX_ANSWER_CHARS)
    g.results()
    assert g.stats["refused"] == 6 and g.stats["timed_out"] == 0 and g.stats["helper_starts"] == 0
    g.close()


def test_plain_int_is_the_one_integer_normaliser():
    # the math rule's integer shortcut and eval's maj@k vote both use it
    assert grading.plain_int(" -0012 ") == "-12"
    assert grading.plain_int("+0") == "0"
    assert grading.plain_int("-0") == "0"
    assert grading.plain_int("007") == "7"
    for text in ["+", "", "1.0", "x+1", "1 2", "\u0663", "\u00b2", "--1"]:  # not plain ASCII integers
        assert grading.plain_int(text) is None, ascii(text)


@pytest.mark.timeout(120)  # a hang fails here, not at the suite-wide limit
def test_reward_never_hangs():
    g = grading.Grader(None, timeout=1.0)
    MATH.reward(boxed("\\frac{2}{4}"), "0.5", g)  # helper started, so timing below is verify only
    for bomb in ["9^{9^{9^{9}}}", "(10^{8})!"]:
        t0 = time.time()
        assert MATH.reward(boxed(bomb), "1", g) == 0.0
        assert time.time() - t0 < 5.0, bomb
    # the helper was killed and comes back for the next call
    assert MATH.reward(boxed("\\frac{1}{2}"), "0.5", g) == 1.0
    g.results()
    assert (g.stats["timed_out"], g.stats["helper_starts"]) == (2, 3)
    g.close()


def test_run_in_helper_answers_none_for_what_raises():
    # a function that raises in the helper answers None (the helper lives on); what it returns comes back
    g = grading.Grader(None)
    assert g.run_in_helper(MATH.verify, "7", "\\frac{14}{2}") is True
    assert g.run_in_helper(MATH.verify, "7", None) is None  # None + "}" raises there
    assert g.run_in_helper(MATH.verify, "0.5", "\\frac{1}{2}") is True
    g.results()
    assert g.stats["helper_starts"] == 1 and g.stats["timed_out"] == 0
    g.close()


def test_reward_from_threads():
    grader = grading.Grader(None)
    out = {}

    def work(k, inner, gold):
        # each thread gets its own helper
        out[k] = MATH.reward(f"<answer>\\boxed{{{inner}}}</answer>", gold, grader)
    cases = [("\\frac{3}{4}", "0.75", 1.0), ("\\sqrt{4}", "2", 1.0), ("\\frac{1}{5}", "0.25", 0.0),
             ("12", "12", 1.0)]
    threads = [threading.Thread(target=work, args=(k, a, g)) for k, (a, g, _) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out == {k: want for k, (_, _, want) in enumerate(cases)}
    grader.close()

"""
Grading: the bounded service every task's reward runs on, and the math-verify rule of the rStar2 task.

A Grader is the engine's on_finish callback. It grades each finished trajectory on a pool of background
threads, so the decode loop never waits for a reward (the paper's §3.1 verifies asynchronously too), with the
task's own functions (tasks/math.py is the default; a task is one file, see the README's "Fork it"):

    pred = task.answer(turns)                                        # what maj@k votes on (None: no answer)
    reward, correct = task.grade(row, pred, turns, grader, trajectory)   # reward in [0, 1]; correct for metrics

`turns` are the texts the policy sampled (agent.sampled_turns: never a tool's output), `row` the whole data
row (every JSONL column; a row with a "task" column is graded by that task file: one run mixes tasks),
`trajectory` the rollout.Trajectory: its tool_calls (each call's tool, arguments, status and output) and its
environment (the task's environment(row) object in its final state, closed; None without one).
A task's grade may run code: `grader.sandbox` is the sandbox pool (a Future's
result, waited on from the grading thread), and `grader.reward(turns, gold)` is the math rule below on the
thread's math-verify helper. Whatever grade() does (slow, hangs, raises, runs code) it runs under the same
bounds and counters: a grade still running 2 * timeout seconds after it began is scored 0 (timed_out), one
that raises or returns a reward outside [0, 1] is scored 0 (failed); see Grader.results().

Nothing here knows the protocol's text beyond agent.py's answer reading; nothing here imports a model.
"""
import concurrent.futures
import functools
import itertools
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from agent import count_answers, extract_answer, sampled_turns

# -----------------------------------------------------------------------------
# the math-verify rule (the rStar2 task's reward): answers normalised, then compared

MAX_ANSWER_CHARS = 1000  # a longer answer is refused unread (0): math-verify's time grows with it
MAX_DEPTH = 10  # so is one nested deeper in ( [ { (\left( included): math-verify's parser is exponential in it
_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
# a thousands separator: a space of any kind, \, \; \: "\ " ~ or {,} between a digit and a group of three
_SEPARATOR_RE = re.compile(r"(?<=\d)(?:\s|\\[,;: ]|~|\{,\})(?=\d{3}(?!\d))")
# the relations that say "equals": an answer whose sides hold two different values is a hedge
_RELATION_RE = re.compile(r":=|\\coloneqq|=|\\(?:approxeq|approx|equiv|simeq|sim|cong|doteq)(?![A-Za-z])|[≈≡≃≅]")
_ZERO = {"reward": 0.0, "correct": False, "n_answers": 0, "pred": None}  # a grade that could not be made


def _normalise(s):
    # zero-width characters out, thousands separators out, the percent sign out, any space -> one " "
    s = _SEPARATOR_RE.sub("", s.translate(_ZERO_WIDTH))
    return " ".join(re.sub(r"\\text\{\\%\}|\\?%", "", s).split())


def _plain_int(s):
    # '-0012' -> '-12', '+0' -> '0'; None if s is not a plain integer (linear: "0*(\d+)" would backtrack)
    m = re.fullmatch(r"([+-]?)(\d+)", s.strip())
    if m is None:
        return None
    digits = m.group(2).lstrip("0") or "0"
    return ("-" if m.group(1) == "-" and digits != "0" else "") + digits


def _too_big(s):
    # longer than MAX_ANSWER_CHARS, or nested deeper than MAX_DEPTH at some point (the running bracket depth)
    depths = itertools.accumulate((c in "([{") - (c in ")]}") for c in s)
    return len(s) > MAX_ANSWER_CHARS or max(depths, default=0) > MAX_DEPTH


def _talk(proc, data, timeout):
    # send data to a helper and read its one-line answer, all within timeout seconds and never blocking past
    # it (writes are non-blocking: a stopped helper leaves the pipe full); None if it is late or gone
    from sandbox import read_line, write_all  # here, not above: the helper itself (this file) never imports it
    deadline = time.monotonic() + timeout
    try:
        write_all(proc.stdin.fileno(), data, deadline)
        return read_line(proc.stdout.fileno(), bytearray(), deadline)
    except OSError:  # a full pipe past the deadline (TimeoutError), or a broken one: it died
        return None


def _verify(gold, answer):
    # in the helper: math-verify's verdict, then the hedge check: the sides of the answer's relations that
    # are numbers (sympy's is_number: not x, m + n or f(2)) must all be equal
    from math_verify import parse, verify
    box = lambda s: parse("\\boxed{" + s + "}", parsing_timeout=None)  # noqa: E731
    g, p = box(gold), box(answer)
    if not (g and p and verify(g, p, timeout_seconds=None)):
        return False
    numbers = [q for q in map(box, _RELATION_RE.split(answer)) if q and getattr(q[0], "is_number", False)]
    return all(verify(numbers[0], q, timeout_seconds=None) for q in numbers[1:])


def _serve_verifier(parent):
    # the helper (this file run with --verify-server <pid>): one JSON [gold, answer] per line in, "1" or "0"
    # per line out. It dies with the thread that started it, even a SIGKILLed one (the kernel's
    # PR_SET_PDEATHSIG: no thread of ours needs to be scheduled, and C-level sympy work holds the GIL)
    if sys.platform == "linux":
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the prctl
        return
    import math_verify  # noqa: F401  (the slow import, before "ready")
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: we know
    out, sys.stdout = sys.stdout, sys.stderr  # nothing but answers goes down the pipe
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            ok = _verify(*json.loads(line))
        except Exception:
            ok = False
        out.write("1\n" if ok else "0\n")
        out.flush()


def reward(response_text, gold, timeout=5.0):
    """
    1.0 if the final answer of response_text (a text, or a list of sampled turns) equals gold, else 0.0.
    The rule, in order:
    1. the answer is the content of the last \\boxed{} inside the last <answer>...</answer> block of the
       final assistant turn, outside its tool-call blocks (extract_answer); none -> 0;
    2. answer and gold are normalised: zero-width characters dropped, thousands separators between a
       digit and a group of three dropped (1\\,000, 1 000, 1~000, 1{,}000, a no-break or thin space:
       1000), the percent sign dropped (700\\% reads 700: it equals the golds 700 and 700\\%, not 7),
       runs of spaces of any kind made one " " and the ends stripped;
    3. an answer over MAX_ANSWER_CHARS characters or nested deeper than MAX_DEPTH is refused: 0;
    4. the same text, or the same plain integer (-0012 = -12), is 1 without math-verify;
    5. otherwise math-verify (gold and answer each wrapped in \\boxed{}) decides, except that an answer
       relating two different numbers is a hedge and gets 0: the sides of its =, :=, \\approx, \\equiv,
       \\sim, ... that are numbers must all be equal (per math-verify). 8 = 7 and 7 \\approx 8 are 0 for
       gold 7 (math-verify alone says 1: it reads one side of each); x = 7, m + n = 7, f(2) = 7 and
       \\frac{14}{2} = 7 are 1 (a side with a name in it is not a number); \\frac{1}{3} \\approx 0.333 is 0
       for gold 1/3 (math-verify does not take 0.333 for 1/3 either, 0.333333 it does). math-verify reads
       the right side of =, so 7 = x is 0 for gold 7.
    Verification that takes longer than timeout seconds is 0. One call starts its own math-verify helper
    (a few seconds) when step 5 is reached: to grade many, use a Grader's reward().
    """
    g = Grader(None, timeout=timeout, helpers=1)
    try:
        return g.reward(response_text, gold)
    finally:
        g.close()


class Grader:
    """
    The engine's on_finish callback: grades each finished trajectory on a pool of background threads, so
    the decode loop never waits for math-verify (the paper's §3.1 verifies asynchronously too). The answer
    is read from the sampled turns only (reward() has the rule). A trajectory cut by the response budget
    gets reward 0 without being read (paper §4.3.1: truncated rollouts are kept with a negative outcome, a
    signal against rambling) unless score_truncated, the released code's rule (it grades the text whatever
    the finish).

    Each grading thread owns one math-verify helper process (this file run with --verify-server), started
    the first time it needs one: math-verify's own timeouts use signal.alarm, which fails off the main
    thread and cannot interrupt long C-level sympy/bigint work, so the helper runs without them and is
    killed when it overruns. helpers=None sizes the pool from the cores: cpus // LOCAL_WORLD_SIZE, 1 to 4
    (a helper is ~60 MB: 8 ranks of 4 are ~2 GB a node; integer answers never start one). A thread that
    calls reward() itself gets its own helper too, which dies when that thread ends.
    Every grade is bounded, whatever the helper does: verification gets timeout seconds (a late, stopped or
    dead helper is killed and replaced, the grade is 0); a helper gets start_timeout seconds to start, and
    after a failed start no helper starts for 5 * start_timeout (grades that need one are 0 at once);
    results() gives up on a grade still running 2 * timeout seconds after it began (plus start_timeout
    while it starts a helper), scores it 0 and replaces its thread and helper. The helpers die with the
    process (or with close()).
    """

    def __init__(self, tokenizer, score_truncated=False, timeout=5.0, helpers=None, start_timeout=60.0, task=None,
                 rows=None, sandbox=None):
        self.tok, self.score_truncated = tokenizer, score_truncated
        # the task's answer() and grade(); the rows its grade reads (request meta "problem" indexes them; without
        # rows the request's meta is the row); the sandbox pool a grade that runs code uses
        self.task = task or load_task("tasks/math.py")
        self.rows, self.sandbox = rows, sandbox
        self.timeout, self.start_timeout = timeout, start_timeout
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.size = helpers or max(1, min(4, (os.cpu_count() or 1) // local))
        self.jobs, self.threads, self.pending = queue.SimpleQueue(), [], {}
        self.procs, self.deadline = {}, {}  # thread id -> its helper / when its grade is late
        self.down_until = 0.0  # no helper starts before this: the last start failed
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(("timed_out", "refused", "failed", "helper_starts", "helper_start_failures"), 0)
        self.stats = {}

    def __call__(self, traj):
        # everything, decoding included, on the grading threads: the engine only hands the trajectory over
        while len(self.threads) < self.size:
            self._add_thread()
        fut = self.pending[traj.key] = concurrent.futures.Future()
        row = traj.meta if self.rows is None else self.rows[traj.meta["problem"]]
        self.jobs.put((fut, (traj, row)))
        return fut  # its grade: eval.py lets the trajectory go once it is done

    def _add_thread(self):
        t = threading.Thread(target=self._work, name="grader", daemon=True)
        t.start()
        self.threads.append(t)

    def _work(self):
        me = threading.get_ident()
        while (job := self.jobs.get()) is not None:
            fut, args = job
            self.deadline[me] = time.monotonic() + 2 * self.timeout
            fut.thread = me  # results() reads its deadline
            try:
                out = self.grade(*args)
            except Exception:
                self._count("failed")
                out = dict(_ZERO)
            fut.set_result(out)

    def _count(self, key):
        with self.lock:
            self.counts[key] += 1

    def grade(self, traj, row):
        """One trajectory's grade, in the calling thread: {reward, correct, n_answers, pred}, by the row's task.
        Read from the sampled turns only; a trajectory cut by the budget gets reward 0, not correct, without
        grade()."""
        task = row_task(row, self.task)
        turns = sampled_turns(self.tok, traj.response_ids, traj.mask)
        pred = task.answer(turns)
        reward, correct = 0.0, False
        if traj.finish != "length" or self.score_truncated:
            reward, correct = task.grade(row, pred, turns, self, traj)
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"a task's reward must lie in [0, 1], got {reward!r}")
        return {"reward": float(reward), "correct": bool(correct), "n_answers": count_answers(turns), "pred": pred}

    def reward(self, response_text, gold):
        """reward()'s rule, in the calling thread, with that thread's helper; stats count what it met."""
        if not isinstance(gold, str):
            raise ValueError(f"gold answer must be a string, got {type(gold).__name__}: {gold!r}")
        answer = extract_answer(response_text)
        if not answer:  # None or empty
            return 0.0
        answer, gold = _normalise(answer), _normalise(gold)
        if _too_big(answer):
            self._count("refused")
            return 0.0
        if answer == gold:
            return 1.0
        a, g = _plain_int(answer), _plain_int(gold)
        if a is not None and g is not None:  # integer vs integer needs no sympy
            return float(a == g)
        proc = self._helper()
        if proc is None:
            self._count("failed")
            return 0.0
        line = _talk(proc, (json.dumps([gold, answer]) + "\n").encode(), self.timeout)
        if line not in (b"1", b"0"):  # late, stopped or dead: replace it
            self._count("timed_out")
            self._stop(threading.get_ident())
        return float(line == b"1")

    def _helper(self):
        # the calling thread's helper, started if need be; None if it cannot be had
        me = threading.get_ident()
        proc = self.procs.get(me)
        if proc is not None and proc.poll() is None:
            return proc
        self._stop(me)
        if time.monotonic() < self.down_until:  # a start failed lately: fail fast
            return None
        self.deadline[me] = time.monotonic() + self.start_timeout + 2 * self.timeout
        self._count("helper_starts")
        # started from this thread: its own session (a Ctrl-C reaches only the caller), dies with it
        proc = self.procs[me] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--verify-server", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        os.set_blocking(proc.stdin.fileno(), False)
        if _talk(proc, b"", self.start_timeout) == b"ready":  # the sympy import happens here
            return proc
        self._count("helper_start_failures")
        self._stop(me)
        self.down_until = time.monotonic() + 5 * self.start_timeout
        print(f"grader: the math-verify helper did not start within {self.start_timeout:.0f} s (is math-verify "
              f"installed?); answers that need it score 0 for {5 * self.start_timeout:.0f} s", file=sys.stderr)
        return None

    def _stop(self, ident):
        proc = self.procs.pop(ident, None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def results(self):
        """
        Waits for the grades of the trajectories handed over since the last call, each within its bound
        (the class docstring): {key: {"reward", "correct", "n_answers", "pred"}}. Then self.stats holds what happened
        since the last call:
            wait_s                 seconds this call waited (grading that the rollout did not hide)
            timed_out              grades scored 0 because verification passed timeout (the helper was
                                   killed and replaced) or the grade passed its bound here (its thread
                                   and helper replaced)
            refused                answers scored 0 unread: longer than MAX_ANSWER_CHARS or nested
                                   deeper than MAX_DEPTH
            failed                 grades scored 0 because no helper could be had (a failed start, or
                                   the pause after one) or grading raised
            helper_starts          helper processes started (the first ones of the run included)
            helper_start_failures  starts that did not say "ready" within start_timeout
        """
        t0, out = time.monotonic(), {}
        for key, fut in self.pending.items():
            while not fut.done():
                ident = getattr(fut, "thread", None)
                if ident is not None and time.monotonic() > self.deadline[ident]:  # stuck: give up on it
                    self._count("timed_out")
                    self._stop(ident)
                    self._add_thread()
                    break
                concurrent.futures.wait([fut], timeout=0.1)
            out[key] = fut.result() if fut.done() else dict(_ZERO)
        self.pending = {}
        with self.lock:
            self.stats = {**self.counts, "wait_s": time.monotonic() - t0}
            self.counts = dict.fromkeys(self.counts, 0)
        return out

    def close(self):
        """Stops the grading threads and kills the helpers (a process that just exits needs no close)."""
        for _ in self.threads:
            self.jobs.put(None)
        for ident in list(self.procs):
            self._stop(ident)


@functools.lru_cache(maxsize=None)
def load_task(name):
    """A task: a Python file ("tasks/math.py", relative to the checkout when not found from here) or an
    importable module name ("tasks.math"). See tasks/math.py for what a task defines."""
    import importlib.util
    if name.endswith(".py"):
        path = name if os.path.isfile(name) else os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"task file {name!r} not found")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        task = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(task)
    else:
        task = importlib.import_module(name)
    missing = [key for key in ("COLUMNS", "TOOLS", "prompt", "answer", "grade") if not hasattr(task, key)]
    if missing:
        raise ValueError(f"task {name!r} does not define {', '.join(missing)} (tasks/math.py shows what a task defines)")
    return task


def row_task(row, default):
    """The task a data row names in its "task" column (a task file, loaded once), else `default`: one run or eval
    mixes tasks, each row prompted, offered tools and graded by its own."""
    return load_task(row["task"]) if "task" in row else default


def rollout_seam(row, default):
    """What a row's task gives each of its rollouts (rollout.Request's tools and environment): its tool table, and
    when the task keeps state (an environment(row)), the maker of a new one per trajectory."""
    task = row_task(row, default)
    make = getattr(task, "environment", None)
    return {"tools": task.TOOLS, "environment": make and functools.partial(make, row)}


if __name__ == "__main__" and sys.argv[1:2] == ["--verify-server"]:
    _serve_verifier(int(sys.argv[2]))

"""
Grading: the bounded service every task's reward runs on, and the helpers any task's grade may use. The rules
live in the task files (tasks/math.py: the rStar2 task's math-verify rule).

A Grader is the engine's on_finish callback. It grades each finished trajectory on a pool of background
threads, so the decode loop never waits for a reward (the paper's §3.1 verifies asynchronously too), with the
task's own functions (tasks/math.py is the default; a task is one file, see the README's "Fork it"):

    pred = task.predict(turns)                                       # the prediction (None: no answer)
    reward, correct = task.grade(row, pred, turns, grader, trajectory)   # reward in [0, 1]; correct for metrics
    vote = task.vote(row, pred, trajectory)     # if the task has vote(): what maj@k groups by (else the pred)

`turns` are the texts the policy sampled (agent.sampled_turns: never a tool's output), `row` the whole data
row (every JSONL column; a row with a "task" column is graded by that task file: one run mixes tasks),
`trajectory` the rollout.Trajectory: its tool_calls (each call's tool, arguments, status and output) and its
environment (the task's environment(row) object in its final state, closed; None without one). What a grade
may use of the grader:
    grader.run_in_helper(function, *args)   function(*args) in the thread's helper process (sympy, slow or
                                            unbounded work: math-verify), killed when it passes the timeout
    grader.refuses(text)                    the size bound: text too big to hand to a parser (counted)
    grader.sandbox                          the sandbox pool, for a grade that runs code (a Future's result,
                                            waited on from the grading thread)
and plain_int() below. Whatever grade() does (slow, hangs, raises, runs code) it runs under the same bounds
and counters: a grade still running 2 * timeout seconds after it began is scored 0 (timed_out), one that
raises or returns a reward outside [0, 1] is scored 0 (failed); see Grader.results().

Nothing here knows the protocol's text beyond agent.py's answer reading; nothing here imports a model.
"""
import concurrent.futures
import functools
import importlib.util
import itertools
import json
import logging
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from agent import count_answers, sampled_turns

# -----------------------------------------------------------------------------
# what a grade is

@dataclass
class Grade:
    """One trajectory's grade (Grader.grade), what scheduler.Summary keeps of it. The defaults are the
    grade of a trajectory that could not be graded (late, failed): 0, not correct, no answer."""
    reward: float = 0.0  # in [0, 1]: what training uses
    correct: bool = False  # the task's verdict: what avg@k, pass@k, maj@k and the metrics count
    n_answers: int = 0  # <answer> blocks in the sampled turns (RoC's p_format)
    pred: object = None  # the task's prediction (task.predict); None: no answer
    vote: object = None  # what maj@k groups the sample by: the pred, or the task's vote()


# -----------------------------------------------------------------------------
# the bounds and helpers any task may use

# a longer answer is refused unread (0): math-verify's time grows with it
MAX_ANSWER_CHARS = 1000
# so is one nested deeper in ( [ { (\left( included): math-verify's parser is exponential in it
MAX_DEPTH = 10


def plain_int(text):
    """'-0012' -> '-12', '+0' -> '0'; None if text (its ends stripped) is not a plain integer: an optional
    sign and ASCII digits. Linear in the text ("0*(\\d+)" would backtrack)."""
    match = re.fullmatch(r"([+-]?)([0-9]+)", text.strip())
    if match is None:
        return None
    digits = match[2].lstrip("0") or "0"
    negative = match[1] == "-" and digits != "0"
    return "-" + digits if negative else digits


def _talk(proc, data, timeout):
    # send data to a helper and read its one-line answer, all within timeout seconds and never blocking past
    # it (writes are non-blocking: a stopped helper leaves the pipe full); None if it is late or gone
    # imported here, not above: the helper itself (this file) never imports sandbox
    from sandbox import read_line, write_all
    deadline = time.monotonic() + timeout
    try:
        write_all(proc.stdin.fileno(), data, deadline)
        return read_line(proc.stdout.fileno(), bytearray(), deadline)
    except OSError:  # a full pipe past the deadline (TimeoutError), or a broken one: it died
        return None


def _serve_helper(parent):
    # the helper (this file run with --helper <pid>): one JSON [file, function name, args] per line in, the
    # JSON of that file's function(*args) per line out (null if it raised). It dies with the thread that
    # started it, even a SIGKILLed one (the kernel's PR_SET_PDEATHSIG: no thread of ours needs to be
    # scheduled, and C-level sympy work holds the GIL)
    if sys.platform == "linux":
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the prctl
        return
    import math_verify  # noqa: F401  (the slow import the math tasks' checks need, before "ready")
    # math-verify's "timeout is disabled" warnings: we know
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers goes down the pipe
    out.write("ready\n")
    out.flush()
    load = functools.cache(_load_file)  # file -> its module, loaded by its first call
    for line in sys.stdin:
        try:
            path, name, args = json.loads(line)
            reply = json.dumps(getattr(load(path), name)(*args))
        except Exception:
            reply = "null"
        out.write(reply + "\n")
        out.flush()


class Grader:
    """
    The engine's on_finish callback: grades each finished trajectory on a pool of background threads, so
    the decode loop never waits for math-verify (the paper's §3.1 verifies asynchronously too). The answer
    is read from the sampled turns only (the task has the rule). A trajectory cut by the response budget
    gets reward 0 without being read (paper §4.3.1: truncated rollouts are kept with a negative outcome, a
    signal against rambling) unless score_truncated, the released code's rule (it grades the text whatever
    the finish).

    Each grading thread owns one helper process (this file run with --helper: math-verify imported, the
    task's functions run there by run_in_helper), started the first time it needs one: math-verify's own
    timeouts use signal.alarm, which fails off the main thread and cannot interrupt long C-level
    sympy/bigint work, so the helper runs without them and is killed when it overruns. helpers=None sizes
    the pool from the cores: cpus // LOCAL_WORLD_SIZE, 1 to 4 (a helper is ~60 MB: 8 ranks of 4 are ~2 GB a
    node; integer answers never start one). A thread that calls run_in_helper() itself gets its own helper
    too, which dies when that thread ends.
    Every grade is bounded, whatever the helper does: verification gets timeout seconds (a late, stopped or
    dead helper is killed and replaced, the grade is 0); a helper gets start_timeout seconds to start, and
    after a failed start no helper starts for 5 * start_timeout (grades that need one are 0 at once);
    results() gives up on a grade still running 2 * timeout seconds after it began (plus start_timeout
    while it starts a helper), scores it 0 and replaces its thread and helper. The helpers die with the
    process (or with close()).
    """

    def __init__(self, tokenizer, score_truncated=False, timeout=5.0, helpers=None,
                 start_timeout=60.0, task=None, rows=None, sandbox=None):
        self.tok = tokenizer
        self.score_truncated = score_truncated
        # the task's predict() and grade(); the rows its grade reads (request meta "problem" indexes them;
        # without rows the request's meta is the row); the sandbox pool a grade that runs code uses
        self.task = task or load_task("tasks/math.py")
        self.rows = rows
        self.sandbox = sandbox
        self.timeout = timeout
        self.start_timeout = start_timeout
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.size = helpers or max(1, min(4, (os.cpu_count() or 1) // local))
        self.jobs = queue.SimpleQueue()
        self.threads = []
        self.pending = {}
        self.procs = {}  # thread id -> its helper
        self.deadline = {}  # thread id -> when its grade is late
        self.down_until = 0.0  # no helper starts before this: the last start failed
        self.lock = threading.Lock()
        counters = ("timed_out", "refused", "failed", "helper_starts", "helper_start_failures")
        self.counts = dict.fromkeys(counters, 0)
        self.stats = {}

    def __call__(self, trajectory):
        # everything, decoding included, on the grading threads: the engine only hands the trajectory over
        while len(self.threads) < self.size:
            self._add_thread()
        fut = self.pending[trajectory.key] = concurrent.futures.Future()
        row = trajectory.meta if self.rows is None else self.rows[trajectory.meta["problem"]]
        self.jobs.put((fut, (trajectory, row)))
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
                out = Grade()
            fut.set_result(out)

    def _count(self, key):
        with self.lock:
            self.counts[key] += 1

    def grade(self, trajectory, row):
        """One trajectory's Grade, in the calling thread, by the row's task. Read from the sampled turns
        only; a trajectory cut by the budget gets reward 0, not correct, without grade(), and no vote. Its
        vote is what maj@k groups it by: the pred, unless the task has vote(row, pred, trajectory)
        (tasks/code.py: the program, not its text)."""
        task = row_task(row, self.task)
        turns = sampled_turns(self.tok, trajectory.response_ids, trajectory.mask)
        pred = task.predict(turns)
        reward = 0.0
        correct = False
        # a trajectory cut by the budget is not graded, and its answer does not vote in maj@k either
        key = None
        if trajectory.finish != "length" or self.score_truncated:
            reward, correct = task.grade(row, pred, turns, self, trajectory)
            vote = getattr(task, "vote", None)
            key = vote(row, pred, trajectory) if vote else pred
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"a task's reward must lie in [0, 1], got {reward!r}")
        return Grade(float(reward), bool(correct), count_answers(turns), pred, key)

    def refuses(self, text):
        """True, counted as refused, when text is too big to hand to a parser: longer than MAX_ANSWER_CHARS
        or nested deeper than MAX_DEPTH (math-verify's time grows with both)."""
        # the running bracket depth
        depths = itertools.accumulate((char in "([{") - (char in ")]}") for char in text)
        if len(text) > MAX_ANSWER_CHARS or max(depths, default=0) > MAX_DEPTH:
            self._count("refused")
            return True
        return False

    def run_in_helper(self, function, *args):
        """
        function(*args) in the calling thread's helper process, within timeout seconds: what it returned.
        function is a module-level function of a file (the helper loads that file on its first call); its
        arguments and result are JSON. None when it raised, when it passed the timeout (the helper is killed
        and replaced: timed_out) or when no helper could be had (failed).
        """
        proc = self._helper()
        if not proc:
            self._count("failed")
            return None
        request = [os.path.abspath(function.__code__.co_filename), function.__name__, args]
        line = _talk(proc, (json.dumps(request) + "\n").encode(), self.timeout)
        if line is None:  # late, stopped or dead: replace it
            self._count("timed_out")
            self._stop(threading.get_ident())
            return None
        return json.loads(line)

    def _helper(self):
        # the calling thread's helper, started if need be; None if it cannot be had
        me = threading.get_ident()
        proc = self.procs.get(me)
        if proc and proc.poll() is None:
            return proc
        self._stop(me)
        if time.monotonic() < self.down_until:  # a start failed lately: fail fast
            return None
        self.deadline[me] = time.monotonic() + self.start_timeout + 2 * self.timeout
        self._count("helper_starts")
        # started from this thread: its own session (a Ctrl-C reaches only the caller), dies with it
        proc = self.procs[me] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--helper", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        os.set_blocking(proc.stdin.fileno(), False)
        if _talk(proc, b"", self.start_timeout) == b"ready":  # the sympy import happens here
            return proc
        self._count("helper_start_failures")
        self._stop(me)
        self.down_until = time.monotonic() + 5 * self.start_timeout
        print(f"grader: the math-verify helper did not start within {self.start_timeout:.0f} s "
              f"(is math-verify installed?); answers that need it score 0 for "
              f"{5 * self.start_timeout:.0f} s", file=sys.stderr)
        return None

    def _stop(self, ident):
        proc = self.procs.pop(ident, None)
        if proc:
            proc.kill()
            proc.wait()

    def results(self):
        """
        Waits for the grades of the trajectories handed over since the last call, each within its bound
        (the class docstring): {key: Grade}. Then self.stats holds what happened since the last call:
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
        t0 = time.monotonic()
        out = {}
        for key, fut in self.pending.items():
            while not fut.done():
                ident = getattr(fut, "thread", None)
                # stuck past its deadline: give up on it
                if ident is not None and time.monotonic() > self.deadline[ident]:
                    self._count("timed_out")
                    self._stop(ident)
                    self._add_thread()
                    break
                concurrent.futures.wait([fut], timeout=0.1)
            out[key] = fut.result() if fut.done() else Grade()
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


def load_file(name):
    """A Python file ("tasks/math.py", relative to the checkout when not found from here) or an
    importable module name ("tasks.math"); "file.py:function" is that function of it (a user's
    advantage estimator or loss term in train_rl.py). The one loader of the user's own code."""
    name, _, attribute = name.partition(":")
    if name.endswith(".py"):
        here = os.path.dirname(os.path.abspath(__file__))
        path = name if os.path.isfile(name) else f"{here}/{name}"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"file {name!r} not found")
        module = _load_file(path)
    else:
        module = importlib.import_module(name)
    # a missing function: the AttributeError names it
    return getattr(module, attribute) if attribute else module


@functools.cache
def load_task(name):
    """A task (loaded once per process): a file or module as load_file reads it. See tasks/math.py for what a task defines."""
    task = load_file(name)
    pieces = ("COLUMNS", "TOOLS", "prompt", "predict", "grade")
    missing = [key for key in pieces if not hasattr(task, key)]
    if missing:
        raise ValueError(f"task {name!r} does not define {', '.join(missing)} "
                         "(tasks/math.py shows what a task defines)")
    return task


def _load_file(path):
    # a Python file as a module named after it (tasks/math.py: "math", kept out of sys.modules)
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row_task(row, default):
    """The task a data row names in its "task" column (a task file, loaded once), else `default`: one run or
    eval mixes tasks, each row prompted, offered tools and graded by its own."""
    # (a "task" of another type is read as text: the error then names it, as a module not found)
    return load_task(str(row["task"])) if "task" in row else default


def rollout_seam(row, default):
    """What a row's task gives each of its rollouts (rollout.Request's tools and environment): its tool table,
    and when the task keeps state (an environment(row)), the maker of a new one per trajectory."""
    task = row_task(row, default)
    make = getattr(task, "environment", None)
    return {"tools": task.TOOLS, "environment": make and functools.partial(make, row)}


def read_problems(path, task):
    """A data file's problems, each with the columns of its task (the one a row names, else `task`); a missing
    file, a bad line or a task file a row names that is not there ends the run with an error naming it."""
    from common import read_jsonl  # here, not at the top: the math-verify helper runs this file without torch
    try:
        return read_jsonl(path, required=lambda row: row_task(row, task).COLUMNS)
    except ValueError as e:
        raise SystemExit(f"data error: {e}")


def tokenize_prompts(problems, task, tokenizer):
    """Each problem's prompt, rendered by its task and tokenized once, kept as int32 (a Python list of ints takes
    ~9x the memory: 42K prompts, on every rank). 1,024 prompts rendered and tokenized at a time: a fast tokenizer
    encodes a batch on all cores, and only one batch's texts and lists of ints are held at once (the tiny run's 20K
    prompts: 5.9-7.0 s where one at a time took 10.0-11.6 s, the same ids, on 2 cores at load ~1)."""
    import numpy
    per_call = 1024  # prompts a tokenizer call
    prompt_ids = []
    for start in range(0, len(problems), per_call):
        texts = [row_task(row, task).prompt(row) for row in problems[start:start + per_call]]
        prompt_ids += [numpy.asarray(ids, numpy.int32)
                       for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return prompt_ids


if __name__ == "__main__" and sys.argv[1:2] == ["--helper"]:
    _serve_helper(int(sys.argv[2]))

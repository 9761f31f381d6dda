"""Scripts run as `python script.py args` would run them, without paying the imports each time.

A script of this project costs ~4 s of CPU before it does anything on a 2-core box: torch,
transformers, torch.distributed.checkpoint. The suite runs ~80 of them. A zygote imports all of
that once, then forks a child per command: its own process (and process group), argv, cwd, stdout
and stderr, the script run as __main__, and the exit Python makes (a traceback or SystemExit's
message printed, threads joined, atexit handlers run, streams flushed), so the test sees what a
fresh process gives.

What a child cannot have that a fresh process has: environment variables that a module reads when
it is imported (HF_HUB_OFFLINE, HF_HUB_CACHE, OMP_NUM_THREADS, ...). A command with its own
environment therefore runs as a real process (`run`'s env); the others go to one zygote per test
process (`run`, started on first use). tests/test_readme_commands.py runs the README's commands
through its own, in a scratch checkout.

A command on several ranks (`run`'s ranks) is forked once per rank, each child given what torchrun
gives a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which the
project reads only once a script runs; as under torchrun, the ranks share stdout and stderr, and
the first rank to fail ends the others (SIGKILL, to their whole process groups) and gives the
command its exit code. That saves a 2-rank run ~10 s of CPU (torchrun's own imports and each
rank's). `run(..., torchrun=True)` runs the real launcher instead, which a few tests do so that the
real thing stays tested.

    python tests/zygote.py     # the zygote itself: jobs on stdin, one JSON line each
"""
import atexit
import contextlib
import importlib
import json
import os
import random
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the scripts import: imported once by the zygote, before it forks a child per command
PRELOAD = ["numpy", "torch", "torch.distributed.checkpoint", "transformers", "pyarrow.parquet",
           "agent", "checkpoint", "common", "configurator", "data", "grading", "grpo_roc", "model",
           "rollout", "sandbox", "scheduler"]
# the environment the zygotes start with: this process's as it was imported (at collection), before any test
# changed it (a zygote keeps its environment for every command it runs)
ENVIRON = dict(os.environ)


def serve():
    """The zygote: import PRELOAD, then for each job on stdin ({"argv", "cwd", "out", "err", "timeout",
    "ranks"}) fork a child per rank that runs the script as `python argv...` would (under torchrun with
    ranks > 1), and answer {"rc"} on stdout."""
    sys.path[0] = ROOT  # where `python script.py` finds the flat modules: the script's real folder
    for module in PRELOAD:
        importlib.import_module(module)
    for line in sys.stdin:
        job = json.loads(line)
        deadline = time.time() + job["timeout"]
        ranks = job["ranks"]
        # the ranks append to the job's files, which start empty
        for path in {job["out"], job["err"]}:
            open(path, "w").close()
        sys.stdout.flush()
        port = free_port() if ranks > 1 else None
        running = []
        for rank in range(ranks):
            pid = os.fork()
            if pid == 0:
                if ranks > 1:
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                      LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port))
                run_script(job)
            running.append(pid)
        # wait for every rank; at the deadline, or when a rank fails, kill the process groups of those still
        # running (with the sandbox and grader processes they started)
        rc = 0
        while running:
            for pid in list(running):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    running.remove(pid)
                    rc = rc or os.waitstatus_to_exitcode(status)
            if running and (rc or time.time() > deadline):
                for pid in running:
                    # (a rank that has just ended may have left its group empty)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                for pid in running:
                    status = os.waitpid(pid, 0)[1]
                    rc = rc or os.waitstatus_to_exitcode(status)
                running = []
            time.sleep(0.02)
        print(json.dumps({"rc": rc}), flush=True)


def free_port():
    """A port for rank 0's rendezvous, free now and below the kernel's ephemeral range (32768-60999 unless set
    otherwise), which the ports of the connections and listeners made meanwhile (gloo's, the other pytest
    worker's) come from: none of them can take it in the seconds before rank 0 binds it."""
    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:  # in use
                continue


def run_script(job):
    """In the forked child: its own process group, stdout and stderr appended to the job's files (one file
    when they are the same path), stdin empty, the script as __main__, then the exit Python makes but for the
    teardown of the modules: freeing what the zygote imported would copy its pages, ~1 s a command.
    Never returns."""
    os.setsid()
    os.chdir(job["cwd"])
    out = os.open(job["out"], os.O_WRONLY | os.O_APPEND)
    err = out if job["err"] == job["out"] else os.open(job["err"], os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout.reconfigure(line_buffering=True)  # a killed child's log keeps what it printed
    sys.argv = job["argv"]
    code = 0
    try:
        runpy.run_path(job["argv"][0], run_name="__main__")
    except SystemExit as e:
        # sys.exit("a message"): the message printed, exit code 1, as Python does
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    # Python's own exit: the threading module's exit hooks (they tell an executor's idle workers to stop; joined
    # without them, the workers of a ThreadPoolExecutor, e.g. torch.compile's, waited forever), every thread that
    # is not a daemon joined, then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Zygote:
    """A zygote process; run(argv) runs one script and returns its subprocess.CompletedProcess."""

    def __init__(self, cwd=ROOT, env=None):
        self.cwd = cwd
        self.logs = tempfile.mkdtemp(prefix="zygote-")
        self.count = 0
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=cwd,
                                        env=dict(ENVIRON, OMP_NUM_THREADS="1", **(env or {})),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, argv, timeout=600, log=None, ranks=1):
        """argv as after `python`, on `ranks` processes; log: a file that gets stdout and stderr together
        (in the order they were written) and stays, else each goes to a file of its own that is read and
        removed."""
        self.count += 1
        out = log or os.path.join(self.logs, f"{self.count}.out")
        err = log or os.path.join(self.logs, f"{self.count}.err")
        job = {"argv": list(argv), "cwd": self.cwd, "out": out, "err": err, "timeout": timeout,
               "ranks": ranks}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the zygote died (exit {self.process.wait()})"
        texts = []
        for path in (out, err):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        if not log:
            os.remove(out)
            os.remove(err)
        return subprocess.CompletedProcess(argv, json.loads(answer)["rc"], *texts)

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)
        shutil.rmtree(self.logs, ignore_errors=True)


_shared = []


def run(argv, env=None, timeout=600, ranks=1, torchrun=False):
    """`python argv...` in the repository, on `ranks` processes: children of this test process's zygote; real
    processes when env (variables added to this one's; OMP_NUM_THREADS 1 unless env sets it) is given
    or torchrun=True (under the real torchrun on ranks > 1). Returns a subprocess.CompletedProcess."""
    if env is not None or torchrun:
        if ranks > 1:
            argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *argv]
        return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)
    if not _shared:
        _shared.append(Zygote())
        atexit.register(_shared[0].close)
    return _shared[0].run(argv, timeout=timeout, ranks=ranks)


if __name__ == "__main__":
    serve()

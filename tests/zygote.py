"""Scripts run as `python script.py args` would run them, without paying the imports each time.

A script of this project costs ~4 s of CPU before it does anything on a 2-core box: torch, transformers,
torch.distributed.checkpoint. The suite runs ~80 of them. A zygote imports all of that once, then forks a
child per command: its own process (and process group), argv, cwd, stdout and stderr, the script run as
__main__, and the exit Python makes (a traceback or SystemExit's message printed, threads joined, atexit
handlers run, streams flushed), so the test sees what a fresh process gives.

What a child cannot have that a fresh process has: environment variables that a module reads when it is
imported (HF_HUB_OFFLINE, HF_HUB_CACHE, OMP_NUM_THREADS, ...). A command with its own environment therefore
runs as a real process (`run`'s env), as do torchrun's (`run`'s ranks); the others go to one zygote per test
process (`run`, started on first use). tests/test_readme_commands.py runs the README's commands through its own, in a scratch checkout.

    python tests/zygote.py     # the zygote itself: jobs on stdin, one JSON line each
"""
import atexit
import importlib
import json
import os
import runpy
import shutil
import signal
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
    """The zygote: import PRELOAD, then for each job on stdin ({"argv", "cwd", "out", "err", "timeout"})
    fork a child that runs the script as `python argv...` would, and answer {"rc"} on stdout."""
    sys.path[0] = ROOT  # where `python script.py` finds the flat modules: the script's real folder
    for module in PRELOAD:
        importlib.import_module(module)
    for line in sys.stdin:
        job = json.loads(line)
        deadline = time.time() + job["timeout"]
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run_script(job)
        # wait for the child; at the deadline kill its process group (with the sandbox and grader
        # processes it started)
        done, status = os.waitpid(pid, os.WNOHANG)
        while not done and time.time() < deadline:
            time.sleep(0.02)
            done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.killpg(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def run_script(job):
    """In the forked child: its own process group, stdout and stderr to the job's files (one file when
    they are the same path), stdin empty, the script as __main__, then the exit Python makes but for the
    teardown of the modules: freeing what the zygote imported would copy its pages, ~1 s a command.
    Never returns."""
    os.setsid()
    os.chdir(job["cwd"])
    out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = out if job["err"] == job["out"] else \
        os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
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
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
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

    def run(self, argv, timeout=600, log=None):
        """argv as after `python`; log: a file that gets stdout and stderr together (in the order they were
        written) and stays, else each goes to a file of its own that is read and removed."""
        self.count += 1
        out = log or os.path.join(self.logs, f"{self.count}.out")
        err = log or os.path.join(self.logs, f"{self.count}.err")
        job = {"argv": list(argv), "cwd": self.cwd, "out": out, "err": err, "timeout": timeout}
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


def run(argv, env=None, timeout=600, ranks=1):
    """`python argv...` in the repository: a child of this test process's zygote; a real process when env
    (variables added to this one's) is given, or under torchrun on `ranks` > 1 processes. Returns a
    subprocess.CompletedProcess."""
    if ranks > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *argv]
    if env is not None or ranks > 1:
        return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), timeout=timeout)
    if not _shared:
        _shared.append(Zygote())
        atexit.register(_shared[0].close)
    return _shared[0].run(argv, timeout=timeout)


if __name__ == "__main__":
    serve()

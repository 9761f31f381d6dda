"""
Tests for sandbox.py and sandbox_worker.py: hostile code (each test one property, followed by an honest
call that must still work, and a check that no process or file was left behind), what a call can see
(secrets planted in the checkout, the run's data directory, $HOME and the host's /tmp), supervision
(dead, wedged and overloaded workers), the async front from a background thread, the synchronous
submit(), isolation "none", and a 3,000-call soak (tests/test_sandbox_fresh.py: every call starts from
nothing, as root and as a normal user).
"""

import asyncio
import collections
import concurrent.futures
import errno
import inspect
import os
import platform
import random
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import sandbox
import sandbox_worker
from sandbox import Result, SandboxPool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "sk-test-0123456789abcdef"
ROOT = os.geteuid() == 0


def descendants():
    """Live (non-zombie) processes below this test process: bwrap, workers and anything they started."""
    kids = collections.defaultdict(list)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            kids[int(ppid)].append(int(pid))
    out, todo = set(), [os.getpid()]
    while todo:
        for c in kids[todo.pop()]:
            out.add(c)
            todo.append(c)
    return out


def worker_pids():
    """The worker interpreters (not bwrap, not a call's child): python --worker whose parent is not one."""
    def is_worker(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            return b"sandbox_worker.py" in cmd and os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
        except OSError:
            return False

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    return {p for p in descendants() if is_worker(p) and not is_worker(parent(p))}


def host_call_dirs():
    return {n for n in os.listdir("/tmp") if n.startswith("call-")}


@pytest.fixture(scope="module")
def pool():
    os.environ["SANDBOX_TEST_SECRET"] = SECRET  # set in the parent before the workers start
    tmp_before, procs_before = host_call_dirs(), descendants()  # e.g. agent.py's verifier from other tests
    with SandboxPool(workers=2, timeout=1.5, memory=256 << 20) as p:
        yield p
    os.environ.pop("SANDBOX_TEST_SECRET")
    assert worker_pids() == set() and descendants() <= procs_before, "close() left processes behind"
    # nothing new on the host's /tmp (other runs on this machine may come and go there: not ==)
    assert not host_call_dirs() - tmp_before, "close() left temp dirs behind"


def check_host_and_pool(pool, before):
    """The pool still answers honestly, with the same workers, and nothing was left on the host."""
    r = pool.map([("a, b = map(int, input().split())\nprint(a * b)", "6 7\n")])[0]
    assert (r.status, r.stdout, r.stderr) == ("ok", "42\n", ""), r
    assert descendants() == before, "a call left processes behind or a worker was replaced"
    assert not os.path.exists(os.path.join(REPO, "pwned.txt")) and not os.path.exists("/pwned.txt")


HOSTILE = [  # (name, code, stdin, status, text expected in stdout or stderr)
    ("busy_loop", "while True: pass", "", "timeout", "timeout"),
    ("sleep", "import time\ntime.sleep(10**6)", "", "timeout", "timeout"),
    ("alloc_50GiB", "x = bytearray(50 * 2**30)", "", "memory", "MemoryError"),
    ("numpy_50GiB", "import numpy as np\nx = np.ones(50 * 2**30 // 8)", "", "memory", "MemoryError"),
    ("alloc_gradually", "xs = []\nwhile True:\n    xs.append(bytearray(10**7))", "", "memory", "MemoryError"),
    ("fork_bomb_300", "import os, time\nfor i in range(300):\n    if os.fork() == 0:\n        time.sleep(100)\n"
     "        os._exit(0)\nprint('all forked')", "", "error", "Resource temporarily unavailable"),
    # read-only where the view binds it; "Permission denied" when the checkout is under /tmp, where the call sees
    # an empty directory of its private /tmp in its place (test_hostile then checks the host has no such file)
    ("write_repo", f"open({os.path.join(REPO, 'pwned.txt')!r}, 'w').write('x')", "", "error", "Error at line 1: [Errno"),
    ("write_root", "open('/pwned.txt', 'w').write('x')", "", "error", "Read-only file system"),
    ("print_100MB", "print('x' * 10**8)", "", "ok", "stdout truncated"),
    ("stdin_past_end", "print(input())\nprint(input())", "only one line\n", "error", "EOFError"),
    ("sys_exit_3", "import sys\nsys.exit(3)", "", "error", ""),
    ("sys_exit_0", "import sys\nprint('bye')\nsys.exit(0)", "", "ok", "bye"),
    ("os_exit_0", "import os\nos._exit(0)", "", "ok", ""),
    ("os_exit_3", "import os\nos._exit(3)", "", "error", ""),
    ("deep_recursion", "def f(n):\n    return f(n + 1)\nf(0)", "", "error", "RecursionError"),
    ("ctypes_segfault", "import ctypes\nctypes.string_at(0)", "", "crash", "SIGSEGV"),
    ("self_kill", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "", "crash", "SIGKILL"),
    ("thread_left_running", "import threading, time\nthreading.Thread(target=time.sleep, args=(100,)).start()\n"
     "print('main done')", "", "ok", "main done"),
    ("child_ignores_sigterm", "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import os, signal, "
     "time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)'])\nprint('spawned')",
     "", "ok", "spawned"),
    ("big_file", "with open('big', 'wb') as f:\n    for i in range(1024):\n        f.write(b'x' * 2**20)", "",
     "error", "OSError"),  # RLIMIT_FSIZE (or the sized /tmp): 256 MiB here
    # python3's KeyboardInterrupt and its traceback, as for a Ctrl-C (it was a crash: SIGINT had no
    # handler)
    ("self_sigint", "import os, signal\nos.kill(os.getpid(), signal.SIGINT)", "", "error",
     "KeyboardInterrupt"),
    # the call's last word (sandbox_worker.LAST_WORD) filled whole, no end: its value is cut at the cap all the same
    ("last_word_flooded", "import os, sys\nf = sys._getframe()\nwhile 'LAST_WORD' not in f.f_globals:\n"
     "    f = f.f_back\nw = f.f_globals['LAST_WORD']\nw.seek(0)\nw.write(b'ok\\n' + b'x' * (len(w) - 3))\n"
     "os._exit(0)", "", "ok", ""),
]


@pytest.mark.parametrize("name,code,stdin,status,text", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile(pool, name, code, stdin, status, text):
    before = descendants()
    t = time.monotonic()
    r = pool.map([(code, stdin)])[0]
    assert r.status == status, r
    assert text in r.stdout + r.stderr, r
    if status == "timeout":  # the wall deadline, not the CPU limit or the watchdog
        assert 1.4 < r.duration < 3.0 and time.monotonic() - t < 1.5 + sandbox.GRACE, r
    if name == "print_100MB":
        assert len(r.stdout.encode()) <= pool.output_cap and r.stdout.startswith("xxxx")
    assert len(r.value) <= pool.output_cap, len(r.value)
    if name in ("thread_left_running", "child_ignores_sigterm"):  # answered at once, then cleaned up
        assert r.duration < 1.0, r
    if name == "write_repo":
        assert not os.path.exists(os.path.join(REPO, "pwned.txt"))
    check_host_and_pool(pool, before)


def test_call_cannot_swap_its_dir_for_a_symlink(pool):
    # the call's dir is its own tmpfs, mounted on a read-only /tmp: it can be neither moved nor replaced by a
    # link, and the next call gets a fresh, empty one
    before = descendants()
    r = pool.map(["import os\nd = os.getcwd()\nos.chdir('/')\nos.rename(d, d + '-moved')\n"
                  "os.symlink('/etc', d)\nprint('swapped')"])[0]
    assert r.status == "error" and ("Read-only" in r.stderr or "busy" in r.stderr), r
    check_host_and_pool(pool, before)


def test_kill_parent(pool):
    # as root the worker is another uid (EPERM); as a user it is the namespace's init, which ignores
    # signals from inside; without a namespace it dies and is replaced: any of these is fine, but the
    # pool must keep answering with no process left behind
    r = pool.map(["import os\nos.kill(os.getppid(), 9)"])[0]
    assert r.status in ("error", "ok", "crash"), r
    if r.status != "crash":
        check_host_and_pool(pool, descendants())
    assert pool.map(["print(1)"])[0].stdout == "1\n"
    assert len(worker_pids()) == 2 * pool.workers


def test_network_is_unreachable(pool):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    before = descendants()
    r = pool.map([f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"])[0]
    assert r.status == "error" and "connected" not in r.stdout, r
    assert ("refused" in r.stderr or "unreachable" in r.stderr), r
    with pytest.raises(socket.timeout):
        srv.accept()  # nothing reached the test's port
    srv.close()
    check_host_and_pool(pool, before)


def test_parent_secrets_do_not_reach_the_code(pool):
    assert os.environ["SANDBOX_TEST_SECRET"] == SECRET
    code = ("import os\nprint(sorted(os.environ))\nfor p in ('/proc/1/environ', f'/proc/{os.getppid()}/environ'):\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print(e)")
    r = pool.map([code])[0]
    assert r.status == "ok", r
    assert SECRET not in r.stdout + r.stderr and "SANDBOX_TEST_SECRET" not in r.stdout, r


def test_code_has_no_privileges(pool):
    r = pool.map(["print(open('/proc/self/status').read())"])[0]
    status = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status
    assert status["NoNewPrivs"].strip() == "1"
    if ROOT:
        assert all(int(u) != 0 for u in status["Uid"].split()), status["Uid"]


def test_results_values_and_imports(pool):
    rs = pool.map([
        "1 + 1",                                             # trailing expression -> value
        "print('hi')\n1 + 1",                                # printed too: shown after it
        "x = 3",                                             # no trailing expression
        "None",                                              # None shows nothing, like IPython
        "import sympy as sp\nx = sp.Symbol('x')\nsp.factor(x**2 - 1)",
        "import numpy as np\nnp.arange(4).sum()",
        "import wave, colorsys\ncolorsys.rgb_to_hsv(1.0, 0.0, 0.0)",  # not preloaded: read from disk as the call uid
        ("import sys\nprint(sys.stdin.read()[::-1])", "abc"),
        ("print(open('/dev/stdin').read())", "via /dev"),          # a link into the call's own /proc
        "import os, tempfile\nprint(os.getcwd() == tempfile.gettempdir() and os.listdir('.') == [])",
        "def f(:\n  pass",
        "print('é' * 3)",
        "import sys\nprint('numpy' in sys.modules)",              # standard library only: the lean worker
        "import sys, mpmath\nprint('numpy' in sys.modules)",      # a third-party import: the rich one
        "m = __import__('sys')\nprint('numpy' in m.modules)",     # a computed import: the rich one too
        ("import os\nprint(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'])", ""),
    ])
    assert [(r.status, r.stdout, r.value) for r in rs] == [
        ("ok", "", "2"), ("ok", "hi\n", "2"), ("ok", "", ""), ("ok", "", ""), ("ok", "", "(x - 1)*(x + 1)"),
        ("ok", "", "np.int64(6)"), ("ok", "", "(0.0, 1.0, 1.0)"), ("ok", "cba\n", ""), ("ok", "via /dev\n", ""), ("ok", "True\n", ""),
        ("error", "", ""), ("ok", "ééé\n", ""), ("ok", "False\n", ""), ("ok", "True\n", ""), ("ok", "True\n", ""),
        ("ok", " ".join([rs[9].stdout and rs[-1].stdout.split()[0]] * 3) + "\n", "")]
    # a syntax error in the release harness's words: the line, never the sandbox's own frames
    assert rs[10].stderr == "SyntaxError at line 1: invalid syntax (<unknown>, line 1)\n  def f(:\n", rs[10]
    assert all(isinstance(r, Result) and r.status in sandbox.STATUSES and r.duration > 0 for r in rs)


# ------------------------------------------------------------------------------------------------
# what a call prints is what the release's code harness prints for the same code (rStar's
# rstar2_agent/tools/code_judge_utils.py wrapping the code, run by code-judge's python executor as a
# fresh `python3 source.py`). Each expected text below is what that harness printed for the code, run
# as code-judge runs it with this interpreter (checked by hand against their code, not kept here).
# stdout is the call's stdout, then its trailing value's repr and "\n" (the tool response adds them so);
# for a timeout the harness adds "Suicide from timeout.\n", which the tool response adds as well.

HARNESS = [  # (name, code, stdin, status, stdout the harness gives, stderr the harness gives)
    # 1. an exception: "ErrType at line N: msg\n  <line N>", N from the innermost frame; stdout that
    # print() left in its buffer is lost (the harness ends with os._exit(1)), what was flushed stays
    ("body", "print('a')\nx = 1\ny = x / 0\nprint(y)", "", "error", "",
     "ZeroDivisionError at line 3: division by zero\n  y = x / 0\n"),
    ("syntax", "x = 3\nif x > 2\n    print(x)", "", "error", "",
     "SyntaxError at line 2: expected ':' (<unknown>, line 2)\n  if x > 2\n"),
    ("nested", "def f(n):\n    return [1, 2][n]\n\ny = f(5)", "", "error", "",
     "IndexError at line 2: list index out of range\n      return [1, 2][n]\n"),
    ("nested_in_last_expression", "def f(n):\n    return [1, 2][n]\n\nf(5)", "", "error", "",
     "IndexError: list index out of range\n"),  # its line is counted past the expression's own lines
    ("in_trailing_print", "n = int(input())\nprint(n // 0)", "12\n", "error", "",
     "ZeroDivisionError: integer division or modulo by zero\n"),
    ("own_lineno", "import json\nx = 1\nd = json.loads('{')\nprint(d)", "", "error", "",  # JSON's line 1
     "JSONDecodeError at line 1: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
     "\n  import json\n"),
    ("compile_time_syntax", "x = 1\nreturn x", "", "error", "",
     "SyntaxError at line 2: 'return' outside function (<string>, line 2)\n  return x\n"),
    ("flushed_stays", "print('kept', flush=True)\nraise ValueError('bad')", "", "error", "kept\n",
     "ValueError at line 2: bad\n  raise ValueError('bad')\n"),
    ("last_expression_runs_twice", "print('once', flush=True) or 1 / 0", "", "error", "once\nonce\n",
     "ZeroDivisionError at line 1: division by zero\n  print('once', flush=True) or 1 / 0\n"),
    # 2. the code is "<string>", with no source for warnings to quote
    ("string_filename", "import warnings\nwarnings.warn('careful')\nprint(__file__)", "", "ok", "<string>\n",
     "<string>:2: UserWarning: careful\n"),
    # 3. a trailing expression's repr comes after all other output; one sharing its line is not one
    ("value_after_output", "print('two', end='')\n6 * 7", "", "ok", "two42\n", ""),
    ("value_after_lines", "print('a')\n1 + 1\nprint('b')\n[1] * 3", "", "ok", "a\nb\n[1, 1, 1]\n", ""),
    ("same_line", "x = 5; x", "", "ok", "", ""),
    # 4. a timeout keeps what was printed (a partial line too); stderr is line-buffered: its partial line
    # is lost
    ("timeout_keeps_stdout", "print('before')\nimport time\ntime.sleep(10)", "", "timeout", "before\n", ""),
    ("timeout_partial_lines", "import sys, time\nprint('a', end='')\nsys.stderr.write('line\\n')\n"
     "sys.stderr.write('partial')\ntime.sleep(10)", "", "timeout", "a", "line\n"),
    # 5. SystemExit is not caught by the harness: python3 exits as usual, stdout flushed
    ("sys_exit", "import sys\nprint('out')\nsys.exit(2)", "", "error", "out\n", ""),
    ("sys_exit_message", "import sys\nsys.exit('no luck')", "", "error", "", "no luck\n"),
    # 6. the code may set up stdout anew, as on python3's pipes: what it printed comes out at exit,
    # through the stdout it left in sys first (here, before: an "Illegal seek" and lost output, the
    # call's wrappers made on the worker's /dev/null and the one flushed at exit the call's own)
    ("stdout_reconfigured", "import sys\nsys.stdout.reconfigure(encoding='utf-8')\nprint('é')",
     "", "ok", "é\n", ""),
    ("stdout_rewrapped", "import io, sys\n"
     "sys.stdout = io.TextIOWrapper(sys.stdout.buffer, encoding='utf-8')\nprint('hello')",
     "", "ok", "hello\n", ""),
    ("stdout_set_aside", "import sys\nprint('a')\nsys.stdout = open(1, 'w', closefd=False)\n"
     "print('b')", "", "ok", "b\na\n", ""),
    # 7. a fresh python3 has no fd past its stdio (the sandbox's last word went through fd 3:
    # closing it was answered ok, with the sandbox's own traceback in stderr)
    ("no_fd_3", "import os\nos.close(3)\nprint('unreached')", "", "error", "",
     "OSError at line 2: [Errno 9] Bad file descriptor\n  os.close(3)\n"),
]


@pytest.mark.parametrize("name,code,stdin,status,stdout,stderr", HARNESS, ids=[h[0] for h in HARNESS])
def test_output_is_the_release_harness_output(pool, name, code, stdin, status, stdout, stderr):
    r = pool.map([(code, stdin)])[0]
    notes = "\n".join(f"[sandbox] {n}" for n in ["timeout: killed after 1.5 s"] * (status == "timeout"))
    printed = r.stdout + (r.value + "\n" if r.value else "")
    assert (r.status, printed, r.stderr) == (status, stdout, stderr + notes), r
    assert status != "timeout" or 1.4 < r.duration < 3.0, r  # the deadline still holds


# ------------------------------------------------------------------------------------------------
# what a call can see: only the view (sandbox_worker.view), in every isolation mode

PLANTED = "planted-" + "9f3c1e7a5b" * 2  # the text of every planted secret: it must never come back


@pytest.fixture
def planted(tmp_path):
    """Secret files where a run keeps what a call must not read: the run's data directory (out/data in
    the checkout, like the RL answer key), the checkout itself, $HOME, and the host's /tmp."""
    tag = f"sandbox-secret-{os.getpid()}"
    paths = [os.path.join(REPO, "out", "data", tag + ".jsonl"), os.path.join(REPO, tag),
             os.path.join(os.path.expanduser("~"), "." + tag), str(tmp_path / "out" / "data" / "train.jsonl")]
    made = [d for d in (os.path.join(REPO, "out"), os.path.join(REPO, "out", "data")) if not os.path.isdir(d)]
    for p in paths:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(f'{{"question": "1 + 1", "answer": "{PLANTED}"}}\n')
    yield paths
    for p in paths:
        os.unlink(p)
    for d in reversed(made):
        os.rmdir(d)


PROBE = """
import os
leaks = []
def tries(what, f, *args):
    try:
        out = f(*args)
    except OSError:
        return
    leaks.append(f"{what} {args[0]}: {str(out)[:80]}")
for p in PATHS:
    for q in (p, "/proc/1/root" + p, "/proc/self/root" + p, "/proc/self/cwd/../../.." + p):
        tries("open", lambda q: open(q).read(), q)
        tries("stat", os.stat, q)
        try:
            names = os.listdir(os.path.dirname(q))
        except OSError:
            names = []
        if os.path.basename(q) in names:
            leaks.append(f"listed {q}")
    link = f"link-{len(leaks)}-{abs(hash(p))}"
    os.symlink(p, link)
    tries("open via a symlink", lambda q: open(q).read(), link)
names = {os.path.basename(p) for p in PATHS}
todo = [d.path for d in os.scandir("/") if d.is_dir(follow_symlinks=False) and d.name != "proc"]
walked = 0
while todo:
    try:
        entries = list(os.scandir(todo.pop()))
    except OSError:
        continue
    for e in entries:
        walked += 1
        if e.name in names:
            leaks.append(f"walked to {e.path}")
        if e.is_dir(follow_symlinks=False):
            todo.append(e.path)
print(sorted(os.listdir("/")))
print(walked > 1000, leaks)
"""


def expected_root(view):
    return sorted({op[-1].split("/")[1] for op in view} | {"proc", "tmp"})


def check_sees_only_the_view(pool, planted):
    r = pool.map([f"PATHS = {planted!r}\n" + PROBE], timeout=30)[0]
    assert r.status == "ok", r
    assert PLANTED not in r.stdout + r.stderr, r
    listing, verdict = r.stdout.splitlines()
    assert verdict == "True []", r.stdout  # walked the whole tree, found and opened nothing
    assert eval(listing) == expected_root(sandbox_worker.view()), listing
    # and the view itself holds nothing of the host beyond the interpreter's own paths: system
    # directories, the interpreter's prefix and venv, and the checkout's top (for sandbox_worker.py alone)
    tops = {"usr", "lib", "lib64", "bin", "etc", "dev", "proc", "tmp"}
    tops |= {os.path.realpath(p).split("/")[1] for p in (sys.prefix, sys.base_prefix, REPO)}
    assert set(eval(listing)) <= tops, listing
    inside_repo = [op for op in sandbox_worker.view() if op[-1].startswith(os.path.realpath(REPO) + "/")]
    assert [op[-1] for op in inside_repo if not op[-1].startswith(os.path.realpath(sys.prefix))] == \
        [os.path.join(os.path.realpath(REPO), "sandbox_worker.py")]


def test_call_sees_only_the_view(pool, planted):
    before = descendants()
    for p in planted:  # the planted files are there for the host to read
        assert PLANTED in open(p).read()
    check_sees_only_the_view(pool, planted)
    check_host_and_pool(pool, before)


def test_scientific_stack_computes(pool):
    code = ("import numpy as np, scipy, scipy.optimize, scipy.integrate, scipy.special, sympy as sp, mpmath, sys\n"
            "mpmath.mp.dps = 30\n"
            "print(round(scipy.optimize.brentq(lambda x: x**3 - 2, 0, 2), 9), round(scipy.integrate.quad(np.sin, 0, "
            "np.pi)[0], 9), scipy.special.comb(10, 3, exact=True), int(np.linalg.det(np.array([[2, 1], [1, 3]])).round()),"
            " sp.factor(sp.Symbol('x')**2 - 4), mpmath.sqrt(2))")
    r = pool.map([code, "import sys\nprint('scipy' in sys.modules)", "import sys, mpmath\nprint('scipy' in sys.modules)"],
                 timeout=30)
    assert [x.status for x in r] == ["ok"] * 3, r
    assert r[0].stdout.split() == [str(round(2 ** (1 / 3), 9)), "2.0", "120", "5", "(x", "-", "2)*(x", "+", "2)",
                                   "1.41421356237309504880168872421"], r[0]
    # the standard library alone runs in the lean worker; a third-party import in the rich one, where
    # scipy's top level is preloaded
    assert (r[1].stdout, r[2].stdout) == ("False\n", "True\n"), r


def test_view_refuses_what_it_cannot_find(monkeypatch):
    with pytest.raises(RuntimeError, match="refusing to start.*no-such-dist-b6f1"):
        sandbox_worker.view(("numpy", "no-such-dist-b6f1"))
    procs = descendants()
    monkeypatch.setattr(sandbox_worker, "RICH_DISTS", ("sympy", "no-such-dist-b6f1"))
    with pytest.raises(RuntimeError, match="refusing to start.*the no-such-dist-b6f1 package"):
        SandboxPool(workers=1).start()
    monkeypatch.setattr(sandbox_worker, "DEVICES", ("/dev/null", "/dev/no-such-device-b6f1"))
    sandbox_worker.view.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="refusing to start.*/dev/no-such-device-b6f1"):
            sandbox_worker.view()
    finally:
        sandbox_worker.view.cache_clear()
    assert descendants() == procs


def test_refuses_when_the_view_breaks_an_import(monkeypatch):
    # a view without numpy's bundled libraries: the rich worker cannot import numpy, and the pool says so
    procs, real = descendants(), sandbox_worker.view()
    monkeypatch.setattr(sandbox_worker, "view", lambda dists: tuple(op for op in real if "numpy.libs" not in op[-1]))
    with pytest.raises(RuntimeError, match=r"failed to start.*cannot import numpy in the sandbox.*libscipy_openblas"):
        SandboxPool(workers=1, isolation="bwrap").start()
    assert descendants() == procs


def test_view_binds_each_name_from_the_file_it_names():
    # a library the loader reaches through links (/lib -> usr/lib, libz.so.1 -> libz.so.1.2.13) is bound from
    # its real file under the name ldd printed: no link is re-created inside
    ops = sandbox_worker.view()
    binds = {op[2]: op[1] for op in ops if op[0] == "bind"}
    assert binds and all(real == os.path.realpath(name) for name, real in binds.items())
    ldd = subprocess.run(["ldd", os.path.realpath(sys.executable)], capture_output=True, text=True).stdout
    libc = next(line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines() if "libc.so" in line)
    assert libc in binds, (libc, sorted(binds))
    assert {op[0] for op in ops} <= {"bind", "dev", "symlink", "mask"}
    assert sorted(op[2] for op in ops if op[0] == "symlink") == sorted(sandbox_worker.DEV_LINKS)


def test_pool_starts_from_a_checkout_under_tmp(tmp_path):
    # CI and users may clone under /tmp, which is where the call's private /tmp goes: the directories
    # around the bound files are fresh ones there, and the pool must still start and stay read-only
    root = tmp_path / "checkout"
    root.mkdir()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("sandbox.py", "sandbox_worker.py"):
        (root / name).write_text(open(os.path.join(here, name)).read())
    code = ("from sandbox import SandboxPool\n"
            "with SandboxPool(workers=1) as p:\n"
            "    print(p.map([('print(6 * 7)', '')])[0].stdout, end='')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "42", out.stderr[-2000:]


def test_worker_killed_mid_call_is_replaced(pool):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=pool.map(["import time\ntime.sleep(1.2)"])[0]))
    t.start()
    time.sleep(0.6)
    busy = [p for p in worker_pids() if children(p)]  # the worker whose call is running
    assert len(busy) == 1
    os.kill(busy[0], 9)
    t.join()
    assert out["r"].status == "crash" and out["r"].duration < pool.timeout, out["r"]
    assert pool.map(["print(2)"] * 4)[0].stdout == "2\n"
    assert eventually(lambda: len(worker_pids()) == 2 * pool.workers) and busy[0] not in worker_pids()


def test_wedged_worker_is_replaced(pool):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=pool.map(["import time\ntime.sleep(1.0)"])[0]))
    t.start()
    time.sleep(0.5)
    busy = [p for p in worker_pids() if children(p)]
    os.kill(busy[0], 19)  # SIGSTOP: alive but never answers
    t.join()
    assert out["r"].status == "crash" and pool.timeout < out["r"].duration < pool.timeout + sandbox.GRACE + 1
    assert pool.map(["print(3)"])[0].stdout == "3\n"
    assert eventually(lambda: len(worker_pids()) == 2 * pool.workers) and busy[0] not in worker_pids()


def eventually(cond, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def test_async_front_from_a_background_thread_and_overloaded():
    # the rollout engine enters the pool in an event loop that runs in a background thread
    before = descendants()

    async def main():
        async with SandboxPool(workers=1, timeout=3, queue_timeout=0.3) as pool:
            slow = asyncio.ensure_future(pool.run("import time\ntime.sleep(1.0)\nprint('slow')"))
            await asyncio.sleep(0.05)  # let the task submit its call first
            fast = await pool.run("print('never runs')")  # queued behind `slow` for longer than 0.3 s
            slow = await slow
            honest = await asyncio.gather(*(pool.run(f"print({i} ** 2)") for i in range(3)))
            in_thread = await asyncio.to_thread(pool.map, ["import time\ntime.sleep(1.0)", "print(1)"])
            return slow, fast, honest, in_thread

    out = {}
    t = threading.Thread(target=lambda: out.update(r=asyncio.run(main())))
    t.start()
    t.join(120)
    slow, fast, honest, in_thread = out["r"]
    assert (slow.status, slow.stdout) == ("ok", "slow\n")
    # answered when the worker would have taken it (after `slow`), not by a timer at 0.3 s
    assert fast.status == "overloaded" and 0.9 < fast.duration < 2.5 and "queue_timeout" in fast.stderr, fast
    assert [r.stdout for r in honest] == ["0\n", "1\n", "4\n"]
    assert [r.status for r in in_thread] == ["ok", "overloaded"]
    assert descendants() <= before  # nothing of this pool is left (another test's process may end meanwhile)


def test_submit_without_an_event_loop():
    # the rollout engine's API: submit() from plain threads returns concurrent futures at once; a call that
    # waited past queue_timeout is answered `overloaded` when a worker takes it, and never runs
    before = descendants()
    pool = SandboxPool(workers=1, timeout=3, queue_timeout=0.3).start()
    try:
        slow = pool.submit("import time\ntime.sleep(1.0)\nprint('slow')", "")
        time.sleep(0.05)
        fast, skipped = pool.submit("print('never runs')", ""), pool.submit("print('cancelled')", "")
        assert isinstance(fast, concurrent.futures.Future) and skipped.cancel()
        t = time.monotonic()
        r = fast.result(timeout=5)
        assert r.status == "overloaded" and time.monotonic() - t < 2.5 and "queue_timeout" in r.stderr, r
        assert (slow.result().status, slow.result().stdout) == ("ok", "slow\n")
        futs = [pool.submit(f"print(int(input()) ** 2)", f"{i}\n") for i in range(4)]
        assert [f.result().stdout for f in futs] == ["0\n", "1\n", "4\n", "9\n"]
    finally:
        pool.close()
    assert descendants() == before
    with pytest.raises(RuntimeError, match="not running"):
        pool.submit("print(1)", "")


def test_isolation_none_still_limits_and_cleans_up():
    procs = descendants()
    pool = SandboxPool(workers=1, timeout=1.0, isolation="none").start()
    try:
        rs = pool.map(["print(sum(range(10)))", "import time\ntime.sleep(100)", "x = bytearray(50 * 2**30)",
                       "import os\nos.fork() or os.execvp('sleep', ['sleep', '100'])"])
        assert [r.status for r in rs] == ["ok", "timeout", "memory", "ok"], rs
        assert len(descendants() - procs) == 2  # lean + rich worker: the call's process group was killed
        # each worker's own dir is on the host's /tmp, empty between calls
        own = {os.path.dirname(r.stdout.strip()) for r in pool.map(["import os\nprint(os.getcwd())",
                                                                     "import os, numpy\nprint(os.getcwd())"])}
        assert len(own) == 2 and all(os.path.isdir(d) and os.listdir(d) == [] for d in own), own
        # close() answers what is still queued: one call runs, the ones behind it are told the pool shut down
        out = {}
        t = threading.Thread(target=lambda: out.update(r=pool.map(["import time\ntime.sleep(0.8)"] + ["print(1)"] * 3)))
        t.start()
        time.sleep(0.3)
    finally:
        pool.close()
    t.join()
    assert [r.status for r in out["r"]] == ["ok", "crash", "crash", "crash"], out["r"]
    assert "shut down" in out["r"][1].stderr
    assert descendants() == procs and not any(os.path.exists(d) for d in own)
    with pytest.raises(RuntimeError, match="not running"):
        pool.map(["print(1)"])


def test_refuses_to_start_without_isolation(monkeypatch):
    procs = descendants()
    monkeypatch.setattr(sandbox, "_wrapper", lambda mode, view: [f"/nonexistent/{mode}"])
    with pytest.raises(RuntimeError, match=r"refusing to start: bubblewrap is missing \(apt-get install.*isolation='none'"):
        SandboxPool(workers=1).start()
    # a wrapper that silently isolates nothing is caught by the worker's own checks
    monkeypatch.setattr(sandbox, "_wrapper", lambda mode, view: [])
    with pytest.raises(RuntimeError, match="not isolated.*root holds more than the view.*pid namespace.*writable"):
        SandboxPool(workers=1, isolation="bwrap").start()
    assert descendants() == procs


def run_filter(bpf, arch, nr, args=(0,) * 6):
    """What a classic-BPF seccomp program returns for one syscall (struct seccomp_data: nr, arch, instruction
    pointer, args): an interpreter of the instructions libseccomp emits, to check its output against DENIED."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args)
    program = [struct.unpack("=HBBI", bpf[i:i + 8]) for i in range(0, len(bpf), 8)]
    acc, pc = 0, 0
    while True:
        code, jump_true, jump_false, k = program[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += k
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP | JEQ, JGT, JGE, JSET, with K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jump_true if taken else jump_false
        else:
            raise AssertionError(f"an instruction this interpreter does not know: {code:#x}")


def test_syscall_filter_denies_what_the_docstring_says():
    """The BPF program libseccomp built, run here on each syscall: DENIED, unshare and clone with CLONE_NEWUSER fail with EPERM,
    clone3 with ENOSYS (glibc then uses clone), other syscalls and a plain clone (threads, fork) pass, and another
    ABI (i386, x32 numbers) kills the process. With the kernel's own answers in tests/test_sandbox_fresh.py."""
    import pyseccomp as seccomp
    bpf, arch = sandbox._seccomp(), seccomp.system_arch()
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    promised = ("add_key keyctl request_key io_uring_setup io_uring_enter io_uring_register userfaultfd bpf "
                "perf_event_open kexec_load kexec_file_load ptrace process_vm_readv process_vm_writev").split()
    numbers = {name: seccomp.resolve_syscall(arch, name)
               for name in [*sandbox.DENIED, "read", "clone", "clone3", "unshare"]}
    assert set(promised) <= set(sandbox.DENIED)
    for name in sandbox.DENIED:
        if numbers[name] >= 0:  # (a name this architecture lacks, e.g. iopl on aarch64, resolves below 0)
            assert run_filter(bpf, arch, numbers[name]) == eperm, name
    assert run_filter(bpf, arch, numbers["read"]) == allow
    thread = 0x3D0F00  # CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | ... (pthread_create's)
    assert run_filter(bpf, arch, numbers["clone"], (thread, 0, 0, 0, 0, 0)) == allow
    assert run_filter(bpf, arch, numbers["clone"], (0x10000000 | 17, 0, 0, 0, 0, 0)) == eperm  # CLONE_NEWUSER
    assert run_filter(bpf, arch, numbers["clone3"]) == enosys
    assert run_filter(bpf, arch, numbers["unshare"], (0x10000000 | 0x08000000, 0, 0, 0, 0, 0)) == eperm
    assert run_filter(bpf, arch, numbers["unshare"], (0x08000000, 0, 0, 0, 0, 0)) == allow  # the worker's NEWIPC
    assert run_filter(bpf, 0x40000003, 20) == kill  # AUDIT_ARCH_I386, getpid
    if platform.machine() == "x86_64":
        assert run_filter(bpf, arch, 0x40000000 | 39) == kill  # an x32 number on x86_64's own arch


def test_says_once_when_no_cgroup_caps_the_calls(monkeypatch, capfd):
    """Where no cgroup can be had (here: each refused as a normal user's mkdir is), the pool says so once at start,
    naming why, and its calls still run (capped per process)."""
    def refuse(root, own, name, memory, made):
        raise PermissionError(errno.EACCES, "Permission denied", f"{root}/memory/{name}")
    monkeypatch.setattr(sandbox, "_new_cgroup", refuse)
    with SandboxPool(workers=2) as pool:
        assert pool.map(["print(1)"])[0].stdout == "1\n"
    said = capfd.readouterr().err
    assert said.count("sandbox: no cgroup for the calls (PermissionError: [Errno 13] Permission denied: "
                      "'/sys/fs/cgroup/memory/nano-rstar2-sandbox-") == 1, said


def test_bad_arguments():
    for kwargs, name in [({"isolation": "docker"}, "isolation"), ({"workers": 0}, "workers"),
                         ({"timeout": 0}, "timeout"), ({"memory": 1024}, "memory"), ({"output_cap": 0}, "output_cap"),
                         # (the pool's waits on a worker overflowed poll(): a call never answered)
                         ({"timeout": float("inf")}, "timeout"),
                         ({"queue_timeout": -1}, "queue_timeout")]:
        with pytest.raises(ValueError, match=name):
            SandboxPool(**kwargs)
    with pytest.raises(RuntimeError, match="not running"):
        SandboxPool().map(["print(1)"])


def test_bad_call_arguments(pool):
    with pytest.raises(TypeError, match="code must be str"):
        pool.map([(b"print(1)", "")])
    with pytest.raises(TypeError, match="stdin must be str"):
        pool.map([("print(1)", None)])
    # a timeout past the pool's waits (poll() takes at most ~24 days) is refused: its slot's thread
    # died of an OverflowError, and the call was never answered
    with pytest.raises(ValueError, match="timeout"):
        pool.submit("print(1)", timeout=1e9)
    assert pool.map(["print(1)"] * 4)[-1].stdout == "1\n"


def test_code_too_deep_for_the_parser_is_answered(pool):
    # the pool parses code that imports to pick its worker: code too deep for the parser (a sum of
    # 10,000 terms; 100,000 nested minus signs) is the call's error, answered as one, never an
    # exception of submit()
    long_sum = "import math\nprint(" + "+".join(["1"] * 10_000) + ")"
    nested_minus = "import math\nprint(" + "-" * 100_000 + "1)"
    results = pool.map([long_sum, nested_minus])
    # (the parser's MemoryError reaches the top level: `memory`, by the status rules)
    assert [r.status for r in results] == ["error", "memory"], results
    assert "RecursionError" in results[0].stderr and "MemoryError" in results[1].stderr, results


# ------------------------------------------------------------------------------------------------
# soak: 3,000 calls at concurrency 256, 90% honest with known outputs, 10% hostile


def factorize(n):
    out, d = {}, 2
    while d * d <= n:
        while n % d == 0:
            out[d] = out.get(d, 0) + 1
            n //= d
        d += 1
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def honest_case(rng):
    """(code, stdin, stdout, value) with the answer computed here, outside the sandbox."""
    a, b, n, m = rng.randint(1, 10**4), rng.randint(1, 10**6), rng.randint(2, 10**5), rng.randint(2, 10**4)
    return rng.choice([
        (f"print({a} * {b} + {n})", "", f"{a * b + n}\n", ""),
        (f"s = 0\nfor i in range({m}):\n    s += i * i\nprint(s)", "", f"{sum(i * i for i in range(m))}\n", ""),
        (f"import sympy as sp\nprint(sorted(sp.factorint({a * n}).items()))", "",
         f"{sorted(factorize(a * n).items())}\n", ""),
        (f"import numpy as np\nprint(int(np.arange({n}, dtype=np.int64).sum()))", "", f"{n * (n - 1) // 2}\n", ""),
        ("a, b = map(int, input().split())\nprint(a - b)", f"{a} {b}\n", f"{a - b}\n", ""),
        (f"{a} ** 3", "", "", f"{a ** 3}"),
    ])


SOAK_HOSTILE = [  # (code, status); the slow ones get a 0.1 s timeout
    ("while True: pass", "timeout"), ("import time\ntime.sleep(100)", "timeout"),
    ("x = bytearray(50 * 2**30)", "memory"), ("import ctypes\nctypes.string_at(0)", "crash"),
    ("import sys\nsys.exit(3)", "error"), ("raise ValueError('no')", "error"), ("input()", "error"),
    ("import os\nfor i in range(100):\n    if os.fork() == 0:\n        import time\n        time.sleep(100)", "error"),
    ("open('/pwned.txt', 'w')", "error"), ("print('y' * 10**7)", "ok"),
]


@pytest.mark.slow
def test_soak_3k_calls():
    rng = random.Random(0)
    cases = []  # (code, stdin, status, stdout or None, value or None, timeout)
    for i in range(3_000):
        if i % 10 == 9:
            code, status = rng.choice(SOAK_HOSTILE)
            cases.append((code, "", status, None, None, 0.1 if status == "timeout" else None))
        else:
            code, stdin, stdout, value = honest_case(rng)
            cases.append((code, stdin, "ok", stdout, value, None))
    before = descendants()

    async def main():
        async with SandboxPool(workers=2, timeout=5.0, queue_timeout=300) as pool:
            sem = asyncio.Semaphore(256)

            async def one(code, stdin, timeout):
                async with sem:
                    return await pool.run(code, stdin, timeout=timeout)
            results = await asyncio.gather(*(one(c[0], c[1], c[5]) for c in cases))
            listing = await asyncio.gather(*(pool.run("import os\nprint(os.listdir('/tmp'))") for _ in range(8)))
            return results, listing, descendants() - before

    t = time.monotonic()
    results, listing, procs = asyncio.run(main())
    assert len(results) == len(cases)  # every call answered exactly once (gather: one result per call)
    bad = [(c, r) for c, r in zip(cases, results)
           if r.status != c[2] or (c[3] is not None and (r.stdout, r.value) != (c[3], c[4]))]
    assert not bad, f"{len(bad)} wrong answers, e.g. {bad[:3]}"
    assert len(procs) == 2 * 2 * 2  # 2 slots x (lean, rich) x (bwrap, worker): nothing else alive
    # only its own dir (plus the top of a venv or checkout under /tmp, whose needed pieces are bound)
    bound = {op[-1].split("/")[2] for op in sandbox_worker.view() if op[-1].startswith("/tmp/")}
    assert all(r.status == "ok" and len(set(eval(r.stdout)) - bound) == 1 for r in listing), listing
    assert descendants() == before
    print(f"soak: 3,000 calls in {time.monotonic() - t:.1f} s")


# the default memory limit against code-judge's (MAX_MEMORY 256 MB, not overridden by rStar, + 128 MB for a fresh
# python3): allocations that fail there fail here, allocations that succeed there succeed here
CALIBRATED = [
    ("x = list(range(10**7))", "memory"),           # ~400 MB of ints and pointers
    ("x = [0] * 75_000_000", "memory"),             # 600 MB of pointers
    ("import numpy as np\nx = np.ones(50_000_000)", "memory"),  # 400 MB
    ("x = [0] * 10**7\nprint(len(x))", "ok"),       # 80 MB
    ("x = list(range(10**6))\nprint(len(x))", "ok"),
    ("import numpy as np\nx = np.ones(10**7)\nprint(x.sum())", "ok"),  # 80 MB
    ("x = bytearray(200 * 10**6)\nprint(len(x))", "ok"),
]


def test_default_memory_limit_follows_the_release(pool):
    assert inspect.signature(SandboxPool).parameters["memory"].default == pool.memory == 256 << 20
    results = pool.map([(code, "") for code, _ in CALIBRATED], timeout=4.0)
    assert [r.status for r in results] == [status for _, status in CALIBRATED], results


IPC_MAKE = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "print(libc.shmget(0x5EED, 64 << 20, 0o1666) >= 0, libc.msgget(0x5EED, 0o1666) >= 0, "
            "libc.semget(0x5EED, 1, 0o1666) >= 0)")
IPC_FIND = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "print(libc.shmget(0x5EED, 0, 0), libc.msgget(0x5EED, 0), libc.semget(0x5EED, 0, 0))")


def test_a_call_leaves_no_ipc_objects_and_any_depth_of_directories(pool):
    """SysV shared memory, message queues and semaphores outlive their process (the next call read them, and
    segments sit outside every memory limit); 5,000 nested directories, the deepest shut, killed the worker
    in its clean-up (RecursionError). The next call sees neither, from the same worker."""
    before = descendants()
    nest = ("import os\nfor i in range(5000):\n    os.mkdir('d')\n    os.chdir('d')\n"
            "open('f', 'w').write('x')\nos.chmod('.', 0)\nprint('deep')")
    results = pool.map([IPC_MAKE, IPC_FIND, nest, "import os\nprint(os.listdir('.'))"])
    assert [(r.status, r.stdout) for r in results] == [
        ("ok", "True True True\n"), ("ok", "-1 -1 -1\n"), ("ok", "deep\n"), ("ok", "[]\n")], results
    check_host_and_pool(pool, before)

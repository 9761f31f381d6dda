"""
Tests for sandbox.py: hostile code (each test one property, followed by an honest call that must still
work, and a check that no process or file was left behind), supervision (dead, wedged and overloaded
workers), the async front from a background thread, each isolation mode, and a 10k-call soak.
"""

import asyncio
import collections
import os
import random
import socket
import threading
import time

import pytest

import sandbox
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
            return b"--worker" in cmd and os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
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
    assert host_call_dirs() == tmp_before, "close() left temp dirs behind"


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
    ("write_repo", f"open({os.path.join(REPO, 'pwned.txt')!r}, 'w').write('x')", "", "error", "Read-only file system"),
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
    ("fake_status_on_fd3", "import os\nos.write(3, b'\\0memory\\n')\nprint('ok')", "", "ok", "ok"),
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
    if name in ("thread_left_running", "child_ignores_sigterm"):  # answered at once, then cleaned up
        assert r.duration < 1.0, r
    check_host_and_pool(pool, before)


def test_call_swaps_its_dir_for_a_symlink(pool, tmp_path):
    # where /tmp lets it (a user namespace), a call can move its own dir away and plant a link: the
    # cleanup removes the link without following it, and the next call still gets a fresh dir
    before = descendants()
    r = pool.map(["import os\nd = os.getcwd()\nos.chdir('/')\nos.rename(d, d + '-moved')\n"
                  "os.symlink('/etc', d)\nprint('swapped')"])[0]
    assert (r.status, r.stdout) == ("ok", "swapped\n") or "Permission denied" in r.stderr, r  # root: /tmp is 755
    check_host_and_pool(pool, before)
    target = tmp_path / "target"
    target.mkdir(mode=0o500)
    (tmp_path / "link").symlink_to(target)
    sandbox._rmtree(str(tmp_path / "link"))
    assert not (tmp_path / "link").exists() and target.is_dir() and target.stat().st_mode & 0o777 == 0o500


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
        "print('hi')\n1 + 1",                                # printed -> no value
        "x = 3",                                             # no trailing expression
        "None",                                              # None shows nothing, like IPython
        "import sympy as sp\nx = sp.Symbol('x')\nsp.factor(x**2 - 1)",
        "import numpy as np\nnp.arange(4).sum()",
        "import wave, colorsys\ncolorsys.rgb_to_hsv(1.0, 0.0, 0.0)",  # not preloaded: read from disk as the call uid
        ("import sys\nprint(sys.stdin.read()[::-1])", "abc"),
        "import os, tempfile\nprint(os.getcwd() == tempfile.gettempdir() and os.listdir('.') == [])",
        "def f(:\n  pass",
        "print('é' * 3)",
        "import sys\nprint('numpy' in sys.modules)",              # standard library only: the lean worker
        "import sys, mpmath\nprint('numpy' in sys.modules)",      # a third-party import: the rich one
        "m = __import__('sys')\nprint('numpy' in m.modules)",     # a computed import: the rich one too
        ("import os\nprint(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'])", ""),
    ])
    assert [(r.status, r.stdout, r.value) for r in rs] == [
        ("ok", "", "2"), ("ok", "hi\n", ""), ("ok", "", ""), ("ok", "", ""), ("ok", "", "(x - 1)*(x + 1)"),
        ("ok", "", "np.int64(6)"), ("ok", "", "(0.0, 1.0, 1.0)"), ("ok", "cba\n", ""), ("ok", "True\n", ""),
        ("error", "", ""), ("ok", "ééé\n", ""), ("ok", "False\n", ""), ("ok", "True\n", ""), ("ok", "True\n", ""),
        ("ok", " ".join([rs[8].stdout and rs[-1].stdout.split()[0]] * 3) + "\n", "")]
    # a syntax error shows only the user's code, never the sandbox's own frames
    assert rs[9].stderr.startswith('  File "<code>", line 1') and rs[9].stderr.endswith("SyntaxError: invalid syntax\n")
    assert "sandbox" not in rs[9].stderr and "Traceback" not in rs[9].stderr
    assert all(isinstance(r, Result) and r.status in sandbox.STATUSES and r.duration > 0 for r in rs)


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
    assert fast.status == "overloaded" and 0.25 < fast.duration < 0.9 and "queue_timeout" in fast.stderr, fast
    assert [r.stdout for r in honest] == ["0\n", "1\n", "4\n"]
    assert [r.status for r in in_thread] == ["ok", "overloaded"]
    assert descendants() == before


def test_unshare_fallback():
    before, procs = host_call_dirs(), descendants()
    with SandboxPool(workers=1, timeout=1.0, isolation="unshare") as pool:
        assert pool.mode == "unshare"
        rs = pool.map(["import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
                       "open('/pwned.txt', 'w')", "import os\nprint(os.getpid(), os.getuid() != 0)",
                       "import wave\nprint('ok')", "while True: pass",
                       "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(100)"])
        assert [r.status for r in rs] == ["error", "error", "ok", "ok", "timeout", "ok"], rs
        assert "unreachable" in rs[0].stderr and "Read-only" in rs[1].stderr
        assert rs[2].stdout.split()[1] == "True" if ROOT else True
        assert len(descendants() - procs) == 4  # unshare + worker, lean and rich: the setsid child is gone
    assert descendants() == procs and host_call_dirs() == before


def test_isolation_none_still_limits_and_cleans_up():
    before, procs = host_call_dirs(), descendants()
    pool = SandboxPool(workers=1, timeout=1.0, isolation="none").start()
    try:
        rs = pool.map(["print(sum(range(10)))", "import time\ntime.sleep(100)", "x = bytearray(50 * 2**30)",
                       "import os\nos.fork() or os.execvp('sleep', ['sleep', '100'])"])
        assert [r.status for r in rs] == ["ok", "timeout", "memory", "ok"], rs
        assert len(descendants() - procs) == 2  # lean + rich worker: the call's process group was killed
        left = host_call_dirs() - before  # each worker's own dir on the host's /tmp, empty between calls
        assert len(left) == 2 and not any(os.listdir(os.path.join("/tmp", d)) for d in left)
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
    assert descendants() == procs and host_call_dirs() == before
    with pytest.raises(RuntimeError, match="not running"):
        pool.map(["print(1)"])


def test_refuses_to_start_without_isolation(monkeypatch):
    procs = descendants()
    monkeypatch.setattr(sandbox, "_wrapper", lambda mode, root, memory: [f"/nonexistent/{mode}"])
    with pytest.raises(RuntimeError, match=r"refusing to start.*bwrap.*unshare.*isolation='none'"):
        SandboxPool(workers=1).start()
    # a wrapper that silently isolates nothing is caught by the worker's own checks
    monkeypatch.setattr(sandbox, "_wrapper", lambda mode, root, memory: [])
    with pytest.raises(RuntimeError, match="not isolated.*pid namespace.*writable"):
        SandboxPool(workers=1, isolation="bwrap").start()
    assert descendants() == procs


def test_bad_arguments():
    for kwargs, name in [({"isolation": "docker"}, "isolation"), ({"workers": 0}, "workers"),
                         ({"timeout": 0}, "timeout"), ({"memory": 1024}, "memory"), ({"output_cap": 0}, "output_cap"),
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


# ------------------------------------------------------------------------------------------------
# soak: 10,000 calls at concurrency 256, 90% honest with known outputs, 10% hostile


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
def test_soak_10k_calls():
    rng = random.Random(0)
    cases = []  # (code, stdin, status, stdout or None, value or None, timeout)
    for i in range(10_000):
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
    assert len(procs) == 2 * 2 * 2  # 2 slots x (lean, rich) x (bwrap or unshare, worker): nothing else alive
    # only its own dir (plus a checkout or venv under /tmp, bound back read-only)
    bound = {p.split("/")[2] for p in sandbox._under_tmp()}
    assert all(r.status == "ok" and len(set(eval(r.stdout)) - bound) == 1 for r in listing), listing
    assert descendants() == before
    print(f"soak: 10,000 calls in {time.monotonic() - t:.1f} s")

"""
sandbox.py: an isolated, high-throughput pool that runs untrusted Python snippets (the agent's tool).

rStar2-Agent's code service answers up to 45K tool calls per RL step at ~0.3 s mean latency; its
released executor (code-judge) starts a fresh `python3` per call and isolates nothing by default.
Here a few warm worker interpreters fork a short-lived child per call, so imports are paid once per
worker instead of once per call, and every worker lives inside its own namespace sandbox. A fork
costs in proportion to the parent's resident memory, so each slot keeps two workers: a lean one (the
math stdlib, ~9 MB) for code that imports only the standard library, and a rich one with numpy
and sympy imported and warmed (~57 MB) for the rest. Trivial calls then cost ~2.5 ms instead of ~6.

    with SandboxPool(workers=2, timeout=4.0) as pool:                   # scripts and tests
        results = pool.map([("print(int(input()) * 2)", "21\\n"), "1 + 1"])
    async with SandboxPool() as pool:                                   # the rollout engine
        r = await pool.run("import sympy as sp\\nsp.factor(sp.Symbol('x')**2 - 1)", stdin="")
        r.status, r.stdout, r.stderr, r.value, r.duration    # 'ok', '', '', '(x - 1)*(x + 1)', 0.004

    python sandbox.py --bench       # throughput/latency vs a fresh python3 per call (~3 minutes)

Layout (one box per worker, two workers per slot; a worker is `python -I sandbox.py --worker`):

    trainer process                          bwrap --unshare-* --ro-bind / / --tmpfs /tmp (or unshare)
      run() / map() ─► FIFO queue            ┌────────────────────────────────────────────────────┐
      one thread per slot ─── JSON line ──► │ worker = pid 1 of the namespace, lean or rich warm │
        watchdog: timeout + 2 s   ◄───────── │  per call: fork ─► child: setsid, rlimits, uid     │
                                             │  65534-i, cwd /tmp/call-*/cwd, exec(code)          │
                                             │  wall deadline, then SIGKILL to every other pid    │
                                             └────────────────────────────────────────────────────┘

How a status is decided (first rule that matches):
    overloaded  the call was not started within `queue_timeout` seconds (it never ran)
    crash       the worker died or stopped answering (timeout + 2 s), or the pool shut down first
    timeout     the wall-clock deadline passed (CPU limits miss `sleep`), or the CPU rlimit killed it
    crash       killed by any other signal (segfault, abort, a self-kill)
    memory      a MemoryError reached the top level (the address-space limit was hit)
    error       an exception reached the top level (traceback in stderr) or a non-zero exit status
    ok          anything else, including sys.exit(0) and os._exit(0)
Knobs (keyword arguments; the training configs set them):
    workers        slots, each running one call at a time in its lean or rich worker (default: CPU cores)
    timeout        wall-clock seconds per call (default 4, as the paper's service); run() can override it
    memory         bytes of address space a call process may add on top of the warm interpreter
                   (~20 / ~175 MiB lean / rich), also the largest file it may write and each worker's /tmp size (default 1 GiB)
    output_cap     bytes kept of stdout and of stderr each (default 64 KiB)
    queue_timeout  seconds a call may wait for a free worker before it is answered `overloaded` (default 60)
    isolation      "auto" (bwrap, else unshare, else refuse to start), "bwrap", "unshare", or "none" (opt-out)
run() may be awaited from any event loop in any thread (the rollout engine uses a background thread);
map() blocks, so call it outside a running loop or from asyncio.to_thread.

`value` is the repr of a trailing expression (like IPython's Out[]) when nothing was printed, else "".
`duration` is the seconds the call ran in its worker (for overloaded: the seconds it waited).
stdout and stderr are cut at `output_cap` bytes each; a line in stderr says how much was dropped.

What it protects against (each one is a test in tests/test_sandbox.py):
  - hangs and busy loops (wall deadline kills the whole process group and namespace), fork bombs
    (RLIMIT_NPROC, counted per slot uid), memory blow-ups (RLIMIT_AS), huge files and outputs
    (RLIMIT_FSIZE, a sized /tmp, output caps), crashes and self-kills of the worker (it is replaced
    and the call answered `crash`), stray threads and processes after the code returns (killed),
    processes that ignore SIGTERM or leave the process group (SIGKILL to the whole pid namespace);
  - writes to the host (read-only view of /), network access (empty network namespace: no
    interfaces but loopback, which is not the host's), secrets in the trainer's environment (workers
    get a fresh minimal environment), signals to or ptrace of the trainer (other pid namespace);
  - privilege: as root, code runs as a non-root uid (65534 - slot index) with no capabilities and
    no_new_privs; as a normal user, with that user's uid in a user namespace.
What it does not protect against:
  - kernel exploits: there is no seccomp filter, so the whole syscall surface is reachable;
  - reading the host: everything the uid may read on the host is readable (read-only is not hidden);
  - a strict memory cap per call: RLIMIT_AS is per process, so a call may use up to
    (processes allowed) x `memory`; a cgroup per slot would be the fix;
  - CPU fairness: a call can use its whole time budget on one core, and can starve other workers'
    calls on an oversubscribed machine;
  - with isolation="none" (the explicit opt-out): none of the namespace protections above apply, and
    a process that leaves its process group (setsid) can outlive the call; as root, the call's uid
    may also be unable to import modules the worker did not preload (e.g. a Python under /root).
Needs Linux >= 5.3 (pidfd); the unshare fallback needs Linux >= 5.12 (mount_setattr).
"""

import ast
import ctypes
import gc
import json
import linecache
import math
import os
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import types

NPROC = 64         # processes + threads one call may have (per uid, so per slot when we run as root)
NOFILE = 256       # open files per call process

# ------------------------------------------------------------------------------------------------
# the worker: runs inside the sandbox, one call at a time, forking a locked-down child per call

# what every worker imports before it forks its first call; the rich one adds RICH (the module
# docstring says why there are two)
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq",
           "bisect", "random", "statistics", "re", "string", "json")
RICH = ("numpy", "sympy")
MOUNT_SETATTR = 442  # syscall number, the same on x86_64 and aarch64


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _worker_main(cfg):
    # the pool speaks JSON lines over our stdin/stdout; move them aside so nothing else writes there
    req = os.fdopen(os.dup(0), "rb")
    rep = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    sys.dont_write_bytecode = True
    sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]  # not the repo
    libc = _libc()
    try:
        if cfg["mode"] == "unshare":  # bwrap does this for us; with unshare we are root of a mount ns
            _mount_like_bwrap(libc, cfg)
        problems = _isolation_problems(cfg["mode"])
        if problems:
            raise RuntimeError(f"{cfg['mode']} sandbox is not isolated: " + "; ".join(problems))
        _prepare_calls(cfg, libc)
        _warm(cfg["rich"])
        if cfg["mode"] != "none":  # the call's uid must be able to import what the worker did not preload
            canary = _call("import os, sys\nfor p in sys.path:\n    p.endswith('.zip') or os.listdir(p)", "", 30,
                           cfg, _vmsize(), libc)
            if canary["status"] != "ok":
                raise RuntimeError(f"code running as uid {cfg['uid']} cannot read the Python installation: "
                                   + (canary["stderr"].strip().splitlines() or [canary["status"]])[-1])
    except Exception as e:
        rep.write((json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        rep.flush()
        os._exit(1)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: code running as our uid cannot ptrace us
    vm = _vmsize()
    rep.write((json.dumps({"ready": True, "pid": os.getpid()}) + "\n").encode())
    rep.flush()
    os.dup2(null, 2)
    for line in req:  # the pool closing our stdin ends the loop (and, as pid 1, the namespace)
        r = json.loads(line)
        out = _call(r["code"], r["stdin"], r["timeout"], cfg, vm, libc)
        rep.write((json.dumps(out) + "\n").encode())
        rep.flush()
    _rmtree(os.path.dirname(cfg["tmp"]))  # with isolation="none" it is on the host's /tmp


def _prepare_calls(cfg, libc):
    """What every call's child would otherwise set up itself: done once here, inherited by each fork
    (each step a child skips is pages it does not copy-on-write)."""
    # the call's directory: one path per worker, made and removed per call, inside a fresh directory
    # (a name no one can guess) that only we may change: as root, a call cannot move its own away
    base = tempfile.mkdtemp(prefix="call-")
    os.chmod(base, 0o711)
    cfg["tmp"] = os.path.join(base, "cwd")
    os.environ.update(HOME=cfg["tmp"], TMPDIR=cfg["tmp"])
    tempfile.tempdir = cfg["tmp"]
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (inherited): setuid binaries give no privileges back
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big file gets EFBIG (an error), not a kill
    # the call's stdio: its child puts its pipes on fds 0-2 under these (still empty) wrappers
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.argv = ["<code>"]


def _vmsize():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmSize")).split()[1]) * 1024


def _mount_like_bwrap(libc, cfg):
    """For the unshare fallback: make the host read-only, mount a private /tmp, and (as root) swap
    ancestors that hide Python from the call uid for a tmpfs with Python's directories bound back."""
    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src.encode(), dst.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {src} on {dst} failed")

    def read_only(path):  # mount_setattr(path, AT_RECURSIVE, MOUNT_ATTR_RDONLY)
        attr = struct.pack("QQQQ", 1, 0, 0, 0)
        if libc.syscall(ctypes.c_long(MOUNT_SETATTR), ctypes.c_int(-100), path.encode(), ctypes.c_uint(0x8000),
                        attr, ctypes.c_size_t(len(attr))) != 0:
            raise OSError(ctypes.get_errno(), f"mount_setattr({path}, read-only) failed (needs Linux >= 5.12)")

    MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE, MS_REC = 2, 4, 4096, 8192, 16384
    os.umask(0o022)  # directories made below stay traversable for the call uid
    read_only("/")
    keep = [(p, os.open(p, os.O_PATH)) for p in _under_tmp()]  # still reachable once /tmp is covered
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(cfg['memory'], 64 << 20)},mode=1777")
    for p, fd in keep:
        os.makedirs(p, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        os.close(fd)
        read_only(p)
    for above, paths in cfg["hidden"].items():
        stages = []
        for p in paths:  # park a bind of each path in /tmp, cover the ancestor, move the binds back
            stages.append(tempfile.mkdtemp(dir="/tmp") if os.path.isdir(p) else tempfile.mkstemp(dir="/tmp")[1])
            mount(p, stages[-1], None, MS_BIND | MS_REC)
        mount("tmpfs", above, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
        for p, stage in zip(paths, stages):
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.makedirs(p, exist_ok=True) if os.path.isdir(stage) else open(p, "a").close()
            mount(stage, p, None, MS_MOVE)
            os.rmdir(stage) if os.path.isdir(stage) else os.unlink(stage)
        read_only(above)


def _isolation_problems(mode):
    if mode == "none":
        return []
    problems = []
    if os.getpid() != 1:
        problems.append("the worker is not the init of its own pid namespace")
    here = os.path.dirname(os.path.abspath(__file__))
    if os.access("/", os.W_OK) or os.access(here, os.W_OK):
        problems.append("the host filesystem is writable")
    with open("/proc/net/dev") as f:
        ifaces = {line.split(":")[0].strip() for line in f.readlines()[2:]} - {"lo"}
    if ifaces:
        problems.append(f"network interfaces are visible: {sorted(ifaces)}")
    if not os.access("/tmp", os.W_OK):
        problems.append("/tmp is not writable")
    return problems


def _warm(rich):
    import importlib
    for name in PRELOAD + (RICH if rich else ()):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if "sympy" in sys.modules:  # run the common paths once so lazy imports and caches fill here, not per call
        import sympy as sp
        x = sp.Symbol("x")
        sp.factor(x**4 - 1), sp.expand((x + 1)**5), sp.solve(x**2 - 2, x), sp.simplify(sp.sin(x)**2 + sp.cos(x)**2)
        sp.integrate(x * sp.exp(x), x), sp.diff(sp.sin(x) * x, x), sp.limit(sp.sin(x) / x, x, 0)
        sp.series(sp.exp(x), x, 0, 4), sp.Matrix([[1, 2], [3, 4]]).det(), sp.nsimplify(0.5), sp.N(sp.pi, 30)
        sp.isprime(97), sp.factorint(360), sp.Rational(1, 3) + sp.Rational(1, 6), sp.latex(sp.sqrt(8) / x)
        sp.sympify("x**2 + 2*x + 1"), sp.Poly(x**3 - 1, x).all_coeffs(), sp.binomial(10, 3), sp.summation(x, (x, 1, 10))
    if "numpy" in sys.modules:
        import numpy as np
        np.linalg.solve(np.eye(3), np.ones(3)), np.arange(10).sum(), np.sqrt(np.array([4.0]))
    gc.collect()
    gc.freeze()  # keep the collector from touching (and so copying) the parent's pages in every child
    # back the warm heap with huge pages where the kernel can (MADV_COLLAPSE, Linux >= 6.1; elsewhere a
    # no-op): fork then copies one page-table entry per 2 MiB instead of 512, and fork is most of a call
    # (trivial calls took ~40% less time on a 2-core VM)
    libc, huge = _libc(), 2 << 20
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if fields[1].startswith("rw") and (len(fields) < 6 or fields[5] == "[heap]"):  # anonymous
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                lo, hi = -(-lo // huge) * huge, hi // huge * huge
                if hi > lo:
                    libc.madvise(lo, hi - lo, 25)  # MADV_COLLAPSE


def _call(code, stdin, timeout, cfg, vm, libc):
    """Run one call in a forked child; return the Result fields as a dict."""
    cap, uid, pid1, tmp = cfg["output_cap"], cfg["uid"], os.getpid() == 1, cfg["tmp"]
    try:
        os.mkdir(tmp, 0o700)
    except FileExistsError:  # the last call (as our own uid) put something in its place
        _rmtree(tmp)
        os.mkdir(tmp, 0o700)
    if uid is not None:
        os.chown(tmp, uid, uid)
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, stdin.encode(errors="replace"))  # memfd writes are complete
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ctl_r, ctl_w = os.pipe()
    sys.stdout.flush(), sys.stderr.flush()  # the child inherits these wrappers: nothing of ours in them
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(code, tmp, timeout, cfg, vm, libc, (stdin_fd, out_w, err_w, ctl_w))  # never returns
    for fd in (stdin_fd, out_w, err_w, ctl_w):
        os.close(fd)
    # 1) collect output until the child exits or the deadline passes
    bufs = {out_r: bytearray(), err_r: bytearray(), ctl_r: bytearray()}
    dropped = {out_r: 0, err_r: 0, ctl_r: 0}
    pidfd = os.pidfd_open(pid)
    live = set(bufs)
    poller = select.poll()
    for fd in (*bufs, pidfd):
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)

    def pump(fd, reads=1):  # read what is there, keep up to the cap, count the rest
        for _ in range(reads):
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                if fd in live:
                    poller.unregister(fd)
                    live.remove(fd)
                return
            keep = max(0, cap + 4096 * (fd == ctl_r) - len(bufs[fd]))
            bufs[fd] += chunk[:keep]
            dropped[fd] += len(chunk) - len(chunk[:keep])

    timed_out, exited = False, False
    while not exited:
        left = t0 + timeout - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == pidfd:
                exited = True
            elif fd in bufs:
                pump(fd)
    # 2) kill what is left of the call: its process group, and as pid 1 every other process we see
    for fd in live.copy():  # what the child wrote before it exited is still in the pipes
        pump(fd, reads=64)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, wstatus, usage = os.wait4(pid, 0)
    duration = time.monotonic() - t0
    if pid1:
        try:
            os.kill(-1, signal.SIGKILL)  # from a namespace's init this reaches only that namespace
        except ProcessLookupError:  # nothing else was alive
            pass
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
    for fd in bufs:
        if fd in live:
            pump(fd, reads=64)
        os.close(fd)
    os.close(pidfd)
    try:
        os.rmdir(tmp)  # usually the code wrote nothing
    except OSError:
        _rmtree(tmp)
    # 3) decide the status (the rules are in the module docstring)
    # the child's last word: NUL, status, newline, value (repr escapes NUL; the code may write to fd 3 too)
    ctl_status, has_value, value = bufs[ctl_r].decode(errors="replace").rpartition("\0")[2].partition("\n")
    note = ""
    if timed_out:
        status, note = "timeout", f"[sandbox] timeout: killed after {timeout:g} s"
    elif os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        cpu = usage.ru_utime + usage.ru_stime
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= math.ceil(timeout) + 1):
            status, note = "timeout", f"[sandbox] timeout: CPU limit hit after {cpu:.1f} s"
        else:
            name = signal.Signals(sig).name if sig in signal.valid_signals() and sig < signal.SIGRTMIN else sig
            status, note = "crash", f"[sandbox] killed by signal {name}"
    elif ctl_status == "memory":
        status = "memory"
    else:
        status = "ok" if os.WEXITSTATUS(wstatus) == 0 else "error"
    stdout = bufs[out_r].decode(errors="replace")
    stderr = bufs[err_r].decode(errors="replace")
    notes = [f"[sandbox] {name} truncated: {dropped[fd]} more bytes dropped (cap {cap})"
             for name, fd in (("stdout", out_r), ("stderr", err_r)) if dropped[fd]] + ([note] if note else [])
    if notes:
        stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + "\n".join(notes)
    value = value if has_value and not stdout else ""
    return {"status": status, "stdout": stdout, "stderr": stderr, "value": value, "duration": duration}


def _child(code, tmp, timeout, cfg, vm, libc, fds):
    """The forked child: lock down, then run `code` as __main__. Never returns into the worker.
    (_prepare_calls did the rest once: environment, no_new_privs, signals, stdio wrappers, argv.)"""
    exit_code = 70
    try:
        os.setsid()
        cpu = math.ceil(timeout) + 1  # the wall deadline normally fires first; this is the backstop
        for res, v in ((resource.RLIMIT_AS, vm + cfg["memory"]), (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_FSIZE, cfg["memory"]), (resource.RLIMIT_NOFILE, NOFILE),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, NPROC)):
            resource.setrlimit(res, (v, v + (res == resource.RLIMIT_CPU)))  # CPU: SIGXCPU, then SIGKILL
        uid = cfg["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # from root to non-root: all capabilities are dropped too
        elif os.geteuid() == 0:  # root of a user namespace (unshare as a normal user): drop its capabilities
            if libc.capset(struct.pack("Ii", 0x20080522, 0), bytes(24)) != 0:
                raise OSError(ctypes.get_errno(), "capset")
        if cfg["mode"] == "none":  # elsewhere the namespace ends with its worker
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
        os.chdir(tmp)
        for i, fd in enumerate(fds):  # stdin memfd, stdout, stderr, control pipe -> 0, 1, 2, 3
            os.dup2(fd, i)
        os.closerange(4, 1 << 16)  # fds 0-3 were taken when the pipes were made, so no source was clobbered
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        status, value = "ok", None
        try:
            # a trailing expression is evaluated apart so that its value can be shown, IPython-style
            tree = ast.parse(code, "<code>")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
            exec(compile(tree, "<code>", "exec"), main.__dict__)
            if last is not None:
                v = eval(compile(ast.Expression(last.value), "<code>", "eval"), main.__dict__)
                value = None if v is None else repr(v)[:cfg["output_cap"]]
            exit_code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                exit_code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                exit_code = 1
        except BaseException as e:
            status, exit_code = ("memory" if isinstance(e, MemoryError) else "error"), 1
            if isinstance(e, SyntaxError):
                sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
            else:  # skip our own frame: the traceback starts in <code>
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                pass
        msg = ("\0" + status + ("" if value is None else "\n" + value)).encode(errors="backslashreplace")
        while msg:
            msg = msg[os.write(3, msg):]
    except BaseException:
        try:
            os.write(2, traceback.format_exc().encode())
        except BaseException:
            pass
    finally:
        os._exit(exit_code & 0xFF)  # skip atexit and stray threads: the call is over


def _rmtree(path):
    if os.path.islink(path) or not os.path.isdir(path):  # the code moved it, or put something in its place
        if os.path.lexists(path):
            os.unlink(path)  # (never chmod through a link it planted)
        return
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):  # the code chmod-ed something shut: open directories up and retry
        os.chmod(path, 0o700)
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                p = os.path.join(root, d)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
        shutil.rmtree(path, ignore_errors=True)


def _needed_paths():
    """Python's directories and this file: what a worker and its calls must be able to read."""
    import site
    return {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
                                          *site.getsitepackages(), __file__) if os.path.exists(p)}


def _under_tmp():
    """Needed directories under /tmp (a checkout or venv there): the private /tmp covers the host's, so
    they are bound back read-only."""
    tmp = sorted({p if os.path.isdir(p) else os.path.dirname(p) for p in _needed_paths() if p.startswith("/tmp/")})
    return [p for p in tmp if not any(p.startswith(q + "/") for q in tmp)]


# A worker stops reading this file here: what follows is the pool's side (threads, asyncio, subprocess),
# ~6 MB that every fork would otherwise copy and free again (about a quarter of a trivial call's cost).
if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main(json.loads(sys.argv[2]))
    sys.exit(0)


import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402

STATUSES = ("ok", "error", "timeout", "memory", "crash", "overloaded")
ISOLATIONS = ("auto", "bwrap", "unshare", "none")
GRACE = 2.0        # seconds past a call's timeout before its worker counts as wedged and is replaced
START_TIMEOUT = 120.0  # seconds for a worker to import and warm numpy + sympy (slow on a busy box)
# worker capabilities when the pool runs as root: enough to drop to a uid, hand it a directory,
# kill its leftovers and remove what it wrote; the child itself keeps none of them
ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")


@dataclasses.dataclass
class Result:
    status: str      # one of STATUSES
    stdout: str
    stderr: str      # traceback, or a "[sandbox] ..." line saying why the call was stopped
    value: str       # repr of a trailing expression when nothing was printed, else ""
    duration: float  # seconds the call ran (for overloaded: seconds it waited)


# ------------------------------------------------------------------------------------------------
# the pool: lives in the trainer; one thread per slot moves calls from a FIFO to its workers


class SandboxPool:
    """A pool of sandboxed Python workers. Use `with` (sync `map`) or `async with` (`await run`)."""

    def __init__(self, workers=None, timeout=4.0, memory=1 << 30, output_cap=1 << 16,
                 queue_timeout=60.0, isolation="auto"):
        workers = os.cpu_count() if workers is None else workers
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"SandboxPool: workers must be a positive int, got {workers!r}")
        for name, v, lo in (("timeout", timeout, 1e-3), ("queue_timeout", queue_timeout, 1e-3),
                            ("memory", memory, 16 << 20), ("output_cap", output_cap, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
                raise ValueError(f"SandboxPool: {name} must be a number >= {lo}, got {v!r}")
        if isolation not in ISOLATIONS:
            raise ValueError(f"SandboxPool: isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.workers, self.timeout, self.memory = workers, float(timeout), int(memory)
        self.output_cap, self.queue_timeout, self.isolation = int(output_cap), float(queue_timeout), isolation
        self.mode = None  # the isolation actually in use, once started
        self._cond = threading.Condition()
        self._queue = collections.deque()  # calls: (t_submit, request line, future, timeout, needs rich)
        self._threads, self._ready, self._errors = [], [], {}
        self._running = self._closed = False

    # -- lifecycle

    def start(self):
        """Start the workers (blocks until all are warm). Raises if they cannot be isolated."""
        if self._running or self._closed:
            raise RuntimeError("SandboxPool.start: a pool can be started once")
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"sandbox-{i}")
                         for i in range(self.workers)]
        self._ready = [threading.Event() for _ in range(self.workers)]
        # worker 0 settles the isolation mode (for "auto": bwrap, else unshare), the rest follow it
        self._threads[0].start()
        self._ready[0].wait()
        if not self._errors:
            for t in self._threads[1:]:
                t.start()
            for e in self._ready[1:]:
                e.wait()
        if self._errors:
            self._running = True
            self.close()
            raise RuntimeError(self._errors[min(self._errors)])
        self._running = True
        return self

    def close(self):
        """Stop the workers; calls still queued are answered `crash`. Leaves no processes or files."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join()
        with self._cond:
            while self._queue:
                self._answer(self._queue.popleft(), "crash", "[sandbox] the pool shut down before this call ran")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        await asyncio.to_thread(self.start)  # warming takes seconds: keep the event loop free
        return self

    async def __aexit__(self, *exc):
        await asyncio.to_thread(self.close)

    # -- calls

    async def run(self, code, stdin="", timeout=None):
        """Run `code` with `stdin`; always returns a Result (never raises for bad code)."""
        call = self._submit(code, stdin, timeout)
        fut = asyncio.wrap_future(call[2])
        try:
            done, _ = await asyncio.wait({fut}, timeout=self.queue_timeout)
            if not done:
                self._expire(call)  # answers `overloaded` unless a worker already took it
            return await fut
        except asyncio.CancelledError:
            call[2].cancel()  # a queued call nobody waits for is skipped (a started one finishes)
            raise

    def map(self, items, timeout=None):
        """Synchronous helper: items are (code, stdin) pairs or code strings; results in order."""
        calls = [self._submit(*((it, "") if isinstance(it, str) else it), timeout) for it in items]
        for call in calls:
            try:
                call[2].result(timeout=max(0.0, call[0] + self.queue_timeout - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self._expire(call)
        return [call[2].result() for call in calls]

    def _submit(self, code, stdin, timeout):
        if not isinstance(code, str):
            raise TypeError(f"SandboxPool.run: code must be str, got {type(code).__name__}")
        if not isinstance(stdin, str):
            raise TypeError(f"SandboxPool.run: stdin must be str, got {type(stdin).__name__}")
        timeout = self.timeout if timeout is None else float(timeout)
        if not timeout > 0:
            raise ValueError(f"SandboxPool.run: timeout must be > 0 seconds, got {timeout!r}")
        if not self._running or self._closed:
            raise RuntimeError("SandboxPool is not running: use it inside `with` / `async with`, or call start()")
        line = (json.dumps({"code": code, "stdin": stdin, "timeout": timeout}) + "\n").encode()
        call = (time.monotonic(), line, concurrent.futures.Future(), timeout, _needs_rich(code))
        with self._cond:
            self._queue.append(call)
            self._cond.notify()
        return call

    def _answer(self, call, status, stderr):
        # claim a call that no worker has taken yet and answer it; a no-op if it is taken or done
        fut = call[2]
        if not fut.done() and not fut.running() and fut.set_running_or_notify_cancel():
            fut.set_result(Result(status, "", stderr, "", time.monotonic() - call[0]))

    def _expire(self, call):
        with self._cond:
            self._answer(call, "overloaded", f"[sandbox] not started within queue_timeout={self.queue_timeout:g} s")

    def _take(self):
        with self._cond:
            while True:
                while self._queue and not self._closed:
                    call = self._queue.popleft()
                    fut = call[2]
                    if not fut.done() and fut.set_running_or_notify_cancel():
                        return call
                if self._closed:
                    return None
                self._cond.wait()

    # -- one thread per slot (the thread also spawns its workers: bwrap --die-with-parent follows it)

    def _serve(self, slot):
        procs = {False: None, True: None}  # the slot's lean and rich worker
        try:
            for rich in procs:
                procs[rich] = self._spawn(slot, rich)
        except Exception as e:
            self._errors[slot] = e
        self._ready[slot].set()
        if self._errors.get(slot):
            for proc in procs.values():
                _stop(proc, kill=True)
            return
        while True:
            try:  # replace a worker that died (idle, or in the last call) before taking a call
                for rich, proc in procs.items():
                    if proc is None or proc.poll() is not None:
                        _stop(proc, kill=True)
                        procs[rich] = None
                        procs[rich] = self._spawn(slot, rich)
            except Exception:
                # could not restart: back off; queued calls go to other slots or expire as overloaded
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=1.0)
                    if self._closed:
                        break
                continue
            call = self._take()
            if call is None:
                break
            _, line, fut, timeout, rich = call
            proc, start, result = procs[rich], time.monotonic(), None
            try:
                _write_all(proc.stdin.fileno(), line, start + timeout + GRACE)
                reply = _read_line(proc.stdout.fileno(), proc.buf, start + timeout + GRACE)
                if reply is not None:
                    result = Result(**json.loads(reply))
            except (OSError, ValueError, TypeError):  # a broken pipe (it died) or a garbled reply
                pass
            if result is None:  # died, or no answer in time: answer the call, replace the worker
                _stop(proc, kill=True)
                procs[rich] = None
                result = Result("crash", "", "[sandbox] the worker died or stopped answering; it was replaced", "",
                                time.monotonic() - start)
            fut.set_result(result)
        for proc in procs.values():
            _stop(proc, kill=False)

    def _spawn(self, slot, rich):
        root = os.geteuid() == 0
        cfg = {"uid": 65534 - slot % 535 if root else None, "rich": rich, "memory": self.memory,
               "output_cap": self.output_cap, "hidden": _hidden_paths() if root else {}}
        modes = [self.mode] if self.mode else ["bwrap", "unshare"] if self.isolation == "auto" else [self.isolation]
        failures = []
        for mode in modes:
            argv = _wrapper(mode, root, self.memory) + [sys.executable, "-I", os.path.realpath(__file__),
                                                        "--worker", json.dumps({**cfg, "mode": mode})]
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=_worker_env(), close_fds=True)
            except OSError as e:
                failures.append(f"{mode}: {e}")
                continue
            proc.buf = bytearray()
            os.set_blocking(proc.stdin.fileno(), False)
            os.set_blocking(proc.stdout.fileno(), False)
            try:
                hello = _read_line(proc.stdout.fileno(), proc.buf, time.monotonic() + START_TIMEOUT)
            except OSError:
                hello = None
            if hello is not None and json.loads(hello).get("ready"):
                proc.stderr.close()  # the worker points its own stderr at /dev/null once ready
                self.mode = mode
                return proc
            _stop(proc, kill=True)
            why = (hello and json.loads(hello).get("error")) or proc.stderr.read().decode(errors="replace").strip()
            proc.stderr.close()
            failures.append(f"{mode}: {why.splitlines()[-1] if why else 'worker exited'}")
        if not self.mode and self.isolation != "none":
            raise RuntimeError("sandbox: refusing to start: cannot isolate the workers (" + "; ".join(failures) +
                               "); install bubblewrap (apt-get install -y bubblewrap) or pass isolation='none' "
                               "to run untrusted code on this host without isolation")
        raise RuntimeError(f"sandbox: worker {slot} failed to start ({'; '.join(failures)})")


def _needs_rich(code):
    """Code that imports anything outside the standard library (numpy, sympy, scipy, ...) runs in the
    rich worker, where numpy and sympy are warm; the rest forks from the lean one."""
    if "import" not in code:
        return False
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False  # it fails at once either way
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n.split(".")[0] not in sys.stdlib_module_names for n in names):
            return True
    return "__import__" in code or "import_module" in code  # a computed name: assume the worst


def _wrapper(mode, root, memory):
    """The command prefix that puts a worker in its own namespaces with a read-only view of the host."""
    if mode == "bwrap":
        if root:  # no user namespace: the worker needs real uids to drop the child to
            ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                  "--cap-drop", "ALL"] + [a for c in ROOT_CAPS for a in ("--cap-add", c)]
            for above, paths in _hidden_paths().items():  # e.g. a Python or this repo under /root (700)
                between = {d for p in paths for d in _parents(p, above)}  # --dir makes them 755
                ns += ["--tmpfs", above] + [a for d in sorted(between) for a in ("--dir", d)]
                ns += [a for p in paths for a in ("--ro-bind", p, p)] + ["--remount-ro", above]
        else:
            ns = ["--unshare-all"]
        tmp = _under_tmp()
        between = sorted({d for p in tmp for d in _parents(p, "/tmp")})
        binds = [a for d in between for a in ("--dir", d)] + [a for p in tmp for a in ("--ro-bind", p, p)]
        return ["bwrap", "--ro-bind", "/", "/", *ns, "--new-session", "--die-with-parent", "--as-pid-1",
                "--proc", "/proc", "--dev", "/dev", "--size", str(max(memory, 64 << 20)), "--tmpfs", "/tmp",
                *binds, "--"]
    if mode == "unshare":  # the worker itself then makes / read-only and mounts a /tmp
        user = [] if root else ["--user", "--map-root-user"]
        return ["unshare", *user, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                "--mount-proc", "--"]
    return []


def _parents(path, above):
    """The directories strictly between `above` and `path`."""
    out = []
    while (path := os.path.dirname(path)) != above and path != "/":
        out.append(path)
    return out


def _hidden_paths():
    """What a worker and its calls need (Python's directories, this file) but a non-root uid cannot reach,
    keyed by the topmost ancestor that blocks it, e.g. {"/root": ["/root/.pyenv/versions/3.11.7"]} for a
    pyenv under /root (mode 700). The sandbox covers such an ancestor with an empty tmpfs and binds only
    these paths back, so the rest of it (keys, tokens) stays out of sight."""
    paths = _needed_paths()
    hidden = {}
    for p in sorted(paths):
        parts = p.split("/")
        above = next(("/".join(parts[:i]) for i in range(2, len(parts))
                      if not os.stat("/".join(parts[:i])).st_mode & 0o001), None)
        if above and not any(p.startswith(k + "/") for k in hidden.get(above, [])):
            hidden.setdefault(above, []).append(p)
    return hidden


def _worker_env():
    # a fresh environment: nothing of the trainer's (tokens, keys, paths) reaches the workers
    return {"PATH": os.path.dirname(sys.executable) + ":/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "HOME": "/tmp", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}


def _write_all(fd, data, deadline):
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("worker did not read its request")
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            pass


def _read_line(fd, buf, deadline):
    """One line from a non-blocking fd, or None if it did not come before `deadline`. Raises on EOF."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while (i := buf.find(b"\n")) < 0:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if poller.poll(left * 1000):
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                raise BrokenPipeError("worker closed its pipe")
            buf += chunk
    line = bytes(buf[:i])
    del buf[:i + 1]
    return line


def _stop(proc, kill):
    if proc is None:
        return
    try:
        proc.stdin.close()  # a worker exits on EOF; as pid 1 its exit ends its whole namespace
    except OSError:
        pass
    if not kill:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill = True
    if kill:
        proc.kill()  # bwrap/unshare pass the SIGKILL on to the worker (--die-with-parent, --kill-child)
        proc.wait()
    proc.stdout.close()


# ------------------------------------------------------------------------------------------------
# benchmark: the pool vs the released executor's pattern (a fresh python3 per call, same rlimits)

BENCH_SNIPPETS = {  # {i} makes every call different, so no cache of the warm parent can answer it
    "trivial": "print(sum(range({i} % 100)))",
    "sympy": "import sympy as sp\nx = sp.Symbol('x')\nprint(sp.factor(x**4 - {i}**4))",
}
PRELUDE = """import os, resource, signal
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
signal.signal(signal.SIGALRM, lambda *a: os.killpg(0, signal.SIGKILL))
signal.alarm({cpu})
"""


async def _fresh_run(code, sem, timeout, memory):
    # code-judge's executor: write the script to a temp dir, start a new python3 in a new session with
    # a prelude that sets the rlimits, wait with a timeout, then kill the process group
    async with sem:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "source.py")
            with open(path, "w") as f:
                f.write(PRELUDE.format(cpu=math.ceil(timeout), mem=memory + (128 << 20)) + code)
            p = await asyncio.create_subprocess_exec(sys.executable, path, cwd=d, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, env=_worker_env(),
                                                     start_new_session=True)
            try:
                out, _ = await asyncio.wait_for(p.communicate(), timeout + 1)
                status = "ok" if p.returncode == 0 else "error"
            except asyncio.TimeoutError:
                out, status = b"", "timeout"
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await p.wait()
        return Result(status, out.decode(), "", "", time.monotonic() - t0)


async def _bench_cell(run, kind, conc, n):
    """n calls of one kind with at most `conc` in flight: throughput, end-to-end and in-sandbox latency."""
    sem = asyncio.Semaphore(conc)
    lat, run_s = [], []

    async def one(i):
        async with sem:
            t = time.monotonic()
            r = await run(BENCH_SNIPPETS[kind].format(i=i + 1))
            lat.append(time.monotonic() - t)
            run_s.append(r.duration)
            if r.status != "ok":
                raise RuntimeError(f"bench call failed: {r}")

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    rate = n / (time.monotonic() - t0)
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1e3  # noqa: E731 (ms)
    return {"rate": rate, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "run50": pct(run_s, 0.5),
            "run99": pct(run_s, 0.99)}


def _bench(args):
    cores = args.workers or os.cpu_count()
    print(f"sandbox bench: {cores} pool workers vs {cores} fresh-process executors, {os.cpu_count()} cores\n"
          f"latency = end to end (incl. queueing); run = inside the sandbox (Result.duration); ms")
    rows = {}

    async def main():
        async with SandboxPool(workers=cores, timeout=args.timeout, isolation=args.isolation) as pool:
            print(f"pool isolation: {pool.mode}")
            fresh_sem = asyncio.Semaphore(cores)  # code-judge runs one process at a time per executor

            async def fresh(code):
                return await _fresh_run(code, fresh_sem, args.timeout, pool.memory)

            for kind in BENCH_SNIPPETS:
                for conc in args.concurrency:
                    n_pool = max(args.calls, conc)
                    # fresh processes are slow: fewer of them, so the whole run stays ~3 minutes
                    n_fresh = min(n_pool, args.fresh_sympy if kind == "sympy" else args.fresh_trivial)
                    load = os.getloadavg()[0]
                    p = await _bench_cell(pool.run, kind, conc, n_pool)
                    f = await _bench_cell(fresh, kind, conc, n_fresh)
                    rows[kind, conc] = p, f
                    print(f"{kind:7s} c={conc:<4d} | pool n={n_pool:<4d} {p['rate']:6.1f}/s "
                          f"lat p50 {p['p50']:7.1f} p99 {p['p99']:7.1f} run p50 {p['run50']:5.1f} p99 {p['run99']:5.1f} "
                          f"| fresh n={n_fresh:<3d} {f['rate']:5.1f}/s lat p50 {f['p50']:7.1f} p99 {f['p99']:7.1f} "
                          f"| x{p['rate'] / f['rate']:4.1f} | load {load:.1f}", flush=True)

    asyncio.run(main())
    print(f"load average after: {os.getloadavg()[0]:.2f} (other jobs on the machine make the numbers noisy)")

    best = {(kind, who): max(v[who == "fresh"]["rate"] for (k, _), v in rows.items() if k == kind)
            for kind in BENCH_SNIPPETS for who in ("pool", "fresh")}
    print("\nseconds to drain 45,000 calls (best measured throughput, scaled linearly with cores):")
    targets = (2, 16, 64, 256, 1024)
    print(f"{'kind':7s} {'executor':8s} " + " ".join(f"{c:>7d} cores" for c in targets))
    for (kind, who), rate in best.items():
        print(f"{kind:7s} {who:8s} " + " ".join(f"{45000 / (rate / cores * c):11.1f} s" for c in targets))

    ratio = {kind: best[kind, "pool"] / best[kind, "fresh"] for kind in BENCH_SNIPPETS}
    print("\ngoals (2 cores, isolation on):")
    print(f"  sympy   >= 30x fresh process : x{ratio['sympy']:.1f}")
    print(f"  trivial >= 4x fresh process  : x{ratio['trivial']:.1f}")
    print(f"  trivial >= 500 calls/s       : {best['trivial', 'pool']:.0f}/s")
    if ("trivial", 64) in rows:
        p = rows["trivial", 64][0]
        print(f"  trivial p99 < 50 ms at c=64  : in sandbox {p['run99']:.1f} ms, end to end {p['p99']:.1f} ms "
              f"(= queueing: 64 in flight / {p['rate']:.0f} per s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="sandbox pool benchmark (see the module docstring)")
    ap.add_argument("--bench", action="store_true", help="run the benchmark")
    ap.add_argument("--workers", type=int, default=None, help="pool workers and fresh executors (default: cores)")
    ap.add_argument("--timeout", type=float, default=4.0, help="per-call timeout, seconds")
    ap.add_argument("--isolation", default="auto", choices=ISOLATIONS)
    ap.add_argument("--calls", type=int, default=1024, help="pool calls per cell (at least the concurrency)")
    ap.add_argument("--fresh-trivial", type=int, default=256, help="fresh-process trivial calls per cell")
    ap.add_argument("--fresh-sympy", type=int, default=32, help="fresh-process sympy calls per cell")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 1024])
    args = ap.parse_args()
    if not args.bench:
        ap.error("nothing to do: pass --bench")
    _bench(args)

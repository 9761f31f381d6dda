"""
sandbox_worker.py: the half of the sandbox that runs inside the namespace (sandbox.py is the pool).

A worker is `python -I sandbox_worker.py '<json config>'`, started by sandbox.py inside bubblewrap or
`unshare`. It serves one call at a time over JSON lines on stdin/stdout: fork a child, lock it down
(setsid, rlimits, a non-root uid, an empty directory of its own), run the code as __main__, collect its
output until it exits or the wall deadline passes, then kill everything else in the namespace.

What the code prints is what the release's code harness prints for it (the model was trained on that):
errors as "ErrType at line N: msg\n  <line>", the code compiled as "<string>", a trailing expression's
repr after all other output, what print() left buffered lost on an error and kept on a timeout (the
call's own alarm flushes it at the deadline). _run_as_release says how the harness runs the code.

It also owns what a call can see. `view()` (run by the pool, on the host, once per process) lists it;
bwrap gets the list as arguments, and with the unshare fallback `_build_root` (run here, as root of a
fresh mount namespace) mounts the same list on an empty tmpfs and pivots into it. The list:
  - the interpreter: its executable and the symlinks that lead to it, pyvenv.cfg for a venv, the
    standard library (with its own site-packages covered by an empty tmpfs);
  - the distributions in RICH_DISTS (numpy, scipy, sympy, mpmath) and what they require: only the
    top-level files and directories their RECORD lists (numpy/, numpy.libs/, ...), not site-packages;
  - the shared libraries all of these link, as the loader resolves them (ldd), each file on its own;
  - /etc/ld.so.cache and /etc/localtime; /dev/null, /dev/zero, /dev/urandom (and /dev/fd, /dev/stdin,
    ... as links into /proc/self); this file, on its own;
  - from the mode: a fresh /proc of the worker's pid namespace and a private, size-capped /tmp.
Every path keeps its host name (tracebacks read as usual); all is read-only except /tmp. Nothing else
of the host is there: no home directories, no checkout, no run data, nothing of the host's /tmp.
"""

import ast
import contextlib
import ctypes
import functools
import gc
import json
import math
import os
import resource
import select
import signal
import struct
import sys
import tempfile
import time
import traceback
import types

NPROC = 64         # processes + threads one call may have (per uid, so per slot when we run as root)
NOFILE = 256       # open files per call process
LAST_WORDS = 0.25  # seconds past a call's deadline the worker waits for the call's own alarm (_deadline) to
#                    flush what it printed and end it, before it kills the call itself

# ------------------------------------------------------------------------------------------------
# the worker: runs inside the sandbox, one call at a time, forking a locked-down child per call

# what every worker imports before it forks its first call; the rich one adds RICH (sandbox.py's
# docstring says why there are two)
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq",
           "bisect", "random", "statistics", "re", "string", "json")
RICH = ("numpy", "sympy", "scipy")  # scipy's top level only (~1 MB): preloading its submodules
# (optimize, integrate, special, linalg) doubled the rich worker's memory and so its fork time
MOUNT_SETATTR = 442  # syscall numbers: the same on x86_64 and aarch64; pivot_root is not
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def main(cfg):
    # the pool speaks JSON lines over our stdin/stdout; move them aside so nothing else writes there
    req = os.fdopen(os.dup(0), "rb")
    rep = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    sys.dont_write_bytecode = True  # (-I keeps this file's directory off sys.path)
    libc = _libc()
    try:
        if cfg["mode"] == "unshare":  # bwrap does this for us; with unshare we are root of a mount ns
            _build_root(libc, cfg)
        problems = _isolation_problems(cfg)
        if problems:
            raise RuntimeError(f"{cfg['mode']} sandbox is not isolated: " + "; ".join(problems))
        _prepare_calls(cfg, libc)
        _warm(cfg["rich"])
        if cfg["mode"] != "none":  # the call's uid must be able to import what the worker did not preload
            canary = _call("import os, sys\nfor p in sys.path:\n    p.endswith('.zip') or os.listdir(p)", "", 30,
                           cfg, _vmsize(), libc)
            if canary["status"] != "ok":  # (the first line of the harness's report is the error)
                raise RuntimeError(f"code running as uid {cfg['uid']} cannot read the Python installation: "
                                   + (canary["stderr"].strip().splitlines() or [canary["status"]])[0])
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
    signal.signal(signal.SIGALRM, _deadline)  # armed by each child for its own deadline
    # the call's stdio: its child puts its pipes on fds 0-2 under these (still empty) wrappers, buffered as
    # python3's own are on pipes (what a timeout or an error loses depends on it): stdout by blocks,
    # stderr by lines
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", 1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.argv = ["<string>"]


def _vmsize():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmSize")).split()[1]) * 1024


def _build_root(libc, cfg):
    """For the unshare fallback (bwrap does the same from its arguments): mount the view on an empty tmpfs,
    with a fresh /proc and a private /tmp, and make it our root. We are root of a new mount namespace."""
    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src.encode(), dst.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {src} on {dst} failed")

    def read_only(path, recursive):  # mount_setattr(path, AT_RECURSIVE?, MOUNT_ATTR_RDONLY)
        attr = struct.pack("QQQQ", 1, 0, 0, 0)
        if libc.syscall(ctypes.c_long(MOUNT_SETATTR), ctypes.c_int(-100), path.encode(),
                        ctypes.c_uint(0x8000 * recursive), attr, ctypes.c_size_t(len(attr))) != 0:
            raise OSError(ctypes.get_errno(), f"mount_setattr({path}, read-only) failed (needs Linux >= 5.12)")

    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 2, 4, 8, 4096, 16384
    os.umask(0o022)  # directories made below stay traversable for the call uid
    # hold every source before the new root covers /tmp (a venv or checkout may live there)
    src = {op[-1]: os.open(op[-1], os.O_PATH) for op in cfg["view"] if op[0] in ("bind", "dev")}
    new = "/tmp"  # any directory would do: the tmpfs only hides it in this namespace
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    for d in ("proc", "tmp"):
        os.mkdir(new + "/" + d)
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(cfg['memory'], 64 << 20)},mode=1777")
    for op in cfg["view"]:
        kind, path = op[0], new + op[-1]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "symlink":
            os.symlink(op[1], path)
        elif kind == "mask":
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
        else:
            fd = src.pop(op[-1])
            os.makedirs(path, exist_ok=True) if os.path.isdir(f"/proc/self/fd/{fd}") else open(path, "a").close()
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            os.close(fd)
            if kind == "bind":
                read_only(path, recursive=True)
    for op in cfg["view"]:
        if op[0] == "mask":
            read_only(new + op[1], recursive=False)
    read_only(new, recursive=False)  # the root itself; /tmp stays writable
    os.chdir(new)
    if libc.syscall(ctypes.c_long(PIVOT_ROOT[os.uname().machine]), b".", b".") != 0:  # the old root goes on top
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    if libc.umount2(b".", 2) != 0:  # MNT_DETACH: and now it is gone
        raise OSError(ctypes.get_errno(), "umount of the old root failed")
    os.chdir("/")


def _isolation_problems(cfg):
    if cfg["mode"] == "none":
        return []
    problems = []
    extra = set(os.listdir("/")) - {op[-1].split("/")[1] for op in cfg["view"]} - {"proc", "tmp"}
    if extra:
        problems.append(f"the root holds more than the view: {sorted(extra)[:5]}")
    if os.getpid() != 1:
        problems.append("the worker is not the init of its own pid namespace")
    # this file is bound from the host: it must be read-only (its directory may be a fresh one in the private
    # /tmp when the checkout lives under /tmp, and that one is writable)
    if os.access("/", os.W_OK) or os.access(os.path.abspath(__file__), os.W_OK):
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
        except ImportError as e:  # e.g. a library the view lacks: the pool refuses to start, saying which
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]  # numpy's message ends with the cause
            raise RuntimeError(f"cannot import {name} in the sandbox: {why}") from None
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
        _child(code, tmp, t0 + timeout, timeout, cfg, vm, libc, (stdin_fd, out_w, err_w, ctl_w))  # no return
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
        left = t0 + timeout + LAST_WORDS - time.monotonic()
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
    _drop_ipc(cfg, libc)
    # 3) decide the status (the rules are in the module docstring)
    # the child's last word: NUL, status, newline, value (repr escapes NUL; the code may write to fd 3 too)
    ctl_status, has_value, value = bufs[ctl_r].decode(errors="replace").rpartition("\0")[2].partition("\n")
    note = ""
    if timed_out or ctl_status == "timeout":  # killed here, or by its own alarm
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
    value = value if has_value else ""
    return {"status": status, "stdout": stdout, "stderr": stderr, "value": value, "duration": duration}


def _child(code, tmp, deadline, timeout, cfg, vm, libc, fds):
    """The forked child: lock down, then run `code` as __main__, as the release's harness runs it
    (_run_as_release). Never returns into the worker.
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
        main.__file__ = "<string>"  # as in the release's globals for the code
        sys.modules["__main__"] = main
        status, value, flush = "ok", None, (sys.stdout, sys.stderr)
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-3))  # -> _deadline
        try:
            value = _run_as_release(code, main.__dict__)
            if value is not None:
                value = value[:cfg["output_cap"]]
            exit_code = 0
        except SystemExit as e:  # not caught by the release's harness either: python3 exits as usual
            if e.code is None or isinstance(e.code, int):
                exit_code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                exit_code = 1
        except _Reported as e:  # the harness prints its report and ends with os._exit(1): what print()
            # left in stdout's buffer is lost (only what was flushed stays)
            status = "memory" if isinstance(e.error, MemoryError) else "error"
            exit_code, flush = 1, (sys.stderr,)
            try:
                print(str(e), file=sys.stderr)
            except MemoryError:
                os.write(2, type(e.error).__name__.encode() + b"\n")
        except BaseException as e:  # the harness prints a traceback (then os._exit(1)); python3 does the same for
            # a KeyboardInterrupt and the like (and then flushes stdout)
            status, exit_code = ("memory" if isinstance(e, MemoryError) else "error"), 1
            flush = (sys.stderr,) if isinstance(e, Exception) else flush
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the code's frame on
        signal.setitimer(signal.ITIMER_REAL, 0)
        for f in flush:
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


class _Reported(Exception):
    """An exception raised by the call's code, with the words the release's harness writes for it."""
    def __init__(self, error, words):
        super().__init__(words)
        self.error = error


def _run_as_release(code, scope):
    """
    Run `code` in `scope` as the release's code harness does (rStar's rstar2_agent/tools/code_judge_utils.py,
    python_code_with_standard_io; the code is written anew here, to its behaviour): return the repr of the
    value of a trailing expression (None when there is none or it is None; the harness prints it after all
    other output), or raise _Reported for an exception of the code. The steps, each one visible in the
    output for some code:
      - the code is parsed once whole (a SyntaxError there is reported against the whole code, in the
        words of an ast.parse: "(<unknown>, line N)");
      - if its last statement is an expression, the code is cut by *lines*: the lines before the
        expression's first line run first, then its lines (`x = 1; x` on one line: the whole line is the
        "expression", which fails to eval and so runs as a statement, printing nothing);
      - each piece is compiled from its text as "<string>" (warnings read "<string>:3: ...", and no
        source line follows: the harness registers no source);
      - the expression is eval-ed; if that raises (the eval or the repr), its lines run again with exec,
        side effects and all, and only an exception from that second run is reported, with the line
        count of the first piece added to its line number.
    """
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise _Reported(e, _release_words(e, code)) from None
    head, tail = code, None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        lines, last = code.splitlines(), tree.body[-1]
        head = "\n".join(lines[:last.lineno - 1])
        tail = "\n".join(lines[last.lineno - 1:last.end_lineno])
    if head:
        try:
            exec(compile(head, "<string>", "exec"), scope)
        except Exception as e:
            raise _Reported(e, _release_words(e, head)) from None
    if tail:
        try:
            value = eval(compile(tail, "<string>", "eval"), scope)
            return None if value is None else repr(value)
        except Exception:
            try:
                exec(compile(tail, "<string>", "exec"), scope)
            except Exception as e:
                raise _Reported(e, _release_words(e, tail, len(head.splitlines()))) from None
    return None


def _release_words(e, code, offset=0):
    """How the release's harness words an exception of `code`: "ErrType at line N: message\\n  <line N of
    code>", where N is the exception's own `lineno` if it has one (a SyntaxError's, but also e.g. a
    JSONDecodeError's line in the JSON text) or else the line of the innermost frame of its traceback
    (which may be a library's, or a function's defined elsewhere), plus `offset`; when line N is not a
    line of `code` (a trailing expression's error after other code, a library's line 900): "ErrType:
    message"."""
    if hasattr(e, "lineno"):
        n = e.lineno
    else:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        n = -1 if tb is None else tb.tb_lineno
    name, lines = type(e).__name__, code.splitlines()
    if isinstance(n, int) and n != -1 and 0 <= n + offset - 1 < len(lines):
        return f"{name} at line {n + offset}: {e}\n  {lines[n + offset - 1]}"
    return f"{name}: {e}"


def _deadline(signum, frame):
    """A call's own alarm, due at its deadline (a moment before the worker would kill it): flush what the
    code printed and end the call, as the release's alarm handler does (it prints "Suicide from timeout."
    with flush=True, which the tool response adds). The worker reads the call's status from fd 3."""
    try:
        sys.stdout.flush()
    except BaseException:  # e.g. the code was inside a write to stdout: what is in the buffer is lost
        pass
    try:
        os.write(3, b"\0timeout")
    finally:
        os.killpg(0, signal.SIGKILL)  # the call's process group, this process included


def _rmtree(path):
    """Remove what a call left, without recursion and by short relative names (shutil.rmtree recursed: 5,000
    nested directories raised RecursionError and killed the worker, and their full paths pass PATH_MAX),
    opening up directories the code chmod-ed shut, and never following a link it planted."""
    if os.path.islink(path) or not os.path.isdir(path):  # the code moved it, or put something in its place
        if os.path.lexists(path):
            os.unlink(path)
        return
    back = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    names, stuck = [], set()  # the directories we are in, below path; inodes that cannot be entered or removed
    try:
        os.chmod(path, 0o700)
        os.chdir(path)
        while True:
            sub = None
            for e in list(os.scandir(".")):
                if not e.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(e.name)
                elif sub is None and e.inode() not in stuck:
                    sub = e
            if sub is not None:  # go down
                try:
                    os.chmod(sub.name, 0o700)
                    os.chdir(sub.name)
                    names.append((sub.name, sub.inode()))
                except OSError:
                    stuck.add(sub.inode())
                continue
            if not names:
                break
            name, inode = names.pop()  # this one is empty: go up and remove it
            os.chdir("..")
            try:
                os.rmdir(name)
            except OSError:
                stuck.add(inode)
    except OSError:
        pass
    finally:
        os.fchdir(back)
        os.close(back)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _drop_ipc(cfg, libc):
    """SysV shared memory, message queues and semaphores outlive the process that made them (and sit outside
    every memory limit): remove those the call's uid made, so the next call starts from none. Removing needs
    the owner's uid, so it is done by a child that takes it (as root; otherwise the call ran as our own uid).
    With isolation "none" and no uid of its own the namespace is the host's, and those objects are not ours."""
    uid = cfg["uid"]
    if uid is None and cfg["mode"] == "none":
        return
    uid = os.getuid() if uid is None else uid
    found = []  # (kind, id); the columns: key, id, perms, ... and "cuid" (the creator, which no call can change)
    for kind in ("shm", "msg", "sem"):
        with contextlib.suppress(OSError), open(f"/proc/sysvipc/{kind}") as f:
            head, *rows = f.read().splitlines()
            at = head.split().index("cuid")
            found += [(kind, int(r.split()[1])) for r in rows if int(r.split()[at]) == uid]
    if not found:  # the usual case: no fork
        return
    pid = os.fork()
    if pid == 0:
        try:
            if cfg["uid"] is not None:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            for kind, i in found:
                if kind == "sem":
                    libc.semctl(i, 0, 0)  # IPC_RMID = 0
                else:
                    getattr(libc, kind + "ctl")(i, 0, None)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


# ------------------------------------------------------------------------------------------------
# the view: what a call can see (computed by the pool, on the host; see the module docstring)

RICH_DISTS = ("numpy", "scipy", "sympy", "mpmath")  # the paper's tool environment, plus what they require
ETC = ("/etc/ld.so.cache", "/etc/localtime")  # the loader's cache of library paths; local time
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
DEV_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0", "/dev/stdout": "/proc/self/fd/1",
             "/dev/stderr": "/proc/self/fd/2"}  # into the call's own /proc, as on any Linux


@functools.cache
def view(dists=RICH_DISTS):
    """The paths a call may see, in mount order, as ("bind", path) (read-only), ("dev", path),
    ("symlink", target, path) and ("mask", path) (an empty read-only tmpfs over a bound directory).
    Raises RuntimeError naming what cannot be found."""
    import importlib.metadata
    import re
    import sysconfig
    links, paths, missing = {}, set(), []

    def need(path, follow=True):  # follow: also recreate the symlinks on the way (names the loader uses)
        if os.path.exists(path):
            paths.add(_resolve(path, links) if follow else os.path.realpath(path))
        else:
            missing.append(path)

    # 1) the interpreter, as the pool runs it (a venv's bin/python keeps its name: that is how it finds
    # pyvenv.cfg, and so its site-packages), and the standard library without its site-packages
    exe = python()
    need(exe)
    if sys.prefix != sys.base_prefix:
        need(os.path.join(os.path.realpath(sys.prefix), "pyvenv.cfg"))
    stdlib, dynload = sysconfig.get_path("stdlib"), sysconfig.get_config_var("DESTSHARED")
    need(stdlib, follow=False)
    need(dynload, follow=False)
    masks = [p for p in [os.path.join(os.path.realpath(stdlib), "site-packages")] if os.path.isdir(p)]
    # 2) the distributions and their requirements (extras aside): the top-level entries of their RECORD
    todo, seen, sos = list(dists), set(), []
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"the {name} package (pip install {name})") if name in dists else None
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            need(str(dist.locate_file(top)), follow=False)
        sos += [str(dist.locate_file(f)) for f in dist.files or [] if f.parts[0] != ".." and ".so" in f.name]
        todo += [re.match(r"[\w.-]+", r).group() for r in dist.requires or [] if "extra" not in r]
    # 3) the shared libraries they link from outside those trees, as the loader finds them
    if os.path.isdir(dynload):
        sos += [os.path.join(dynload, n) for n in os.listdir(dynload) if ".so" in n]
    bundled = {os.path.basename(p) for p in sos}  # e.g. numpy.libs/libscipy_openblas64_-*.so
    for lib in _linked([os.path.realpath(exe)] + sos, bundled):
        need(lib)
    for p in ETC:
        os.path.exists(p) and need(p)
    for p in DEVICES:
        need(p, follow=False)
    need(os.path.realpath(__file__), follow=False)
    if missing:
        raise RuntimeError("sandbox: refusing to start: the tool's view lacks " + ", ".join(missing))
    # the ops: a path inside a bound directory is already there (unless it is under a mask)
    under = lambda p, d: p.startswith(d + "/")  # noqa: E731
    covered = lambda p: any(under(p, d) for d in paths) and not any(under(p, m) for m in masks)  # noqa: E731
    ops = [("symlink", t, p) for p, t in {**links, **DEV_LINKS}.items() if not covered(p)]
    ops += [("dev" if p in DEVICES else "bind", p) for p in paths if not covered(p)] + [("mask", m) for m in masks]
    return tuple(sorted(ops, key=lambda op: (op[0] == "symlink", op[-1])))  # parents before children


def python():
    """The interpreter the workers run: the pool's own, by its name in a real (symlink-free) directory."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


def _resolve(path, links):
    """os.path.realpath(path), recording each symlink met on the way in `links` {path: target}."""
    done, todo = "/", path.split("/")
    for _ in range(1000):  # a loop of links ends here
        if not todo:
            return done
        part = todo.pop(0)
        if part in ("", "."):
            continue
        nxt = os.path.dirname(done) if part == ".." else os.path.join(done, part)
        if part != ".." and os.path.islink(nxt):
            links[nxt] = target = os.readlink(nxt)
            todo = target.split("/") + todo
            done = "/" if target.startswith("/") else done
        else:
            done = nxt
    raise OSError(f"too many symlinks under {path}")


def _linked(files, bundled):
    """The shared libraries `files` link from outside themselves (sonames not in `bundled`), with what those
    link in turn, as ldd resolves them. ldd runs only on a few files that together need every such soname
    (ldd on all ~200 extension modules takes seconds); the sonames come from each file's ELF header."""
    import subprocess
    cover, names = [], set(bundled)
    for f in files:
        new = set(_elf_needed(f)) - names
        if new:
            cover.append(f)
            names |= new
    try:
        out = subprocess.run(["ldd", *cover], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"}).stdout
    except FileNotFoundError:
        raise RuntimeError("sandbox: refusing to start: ldd is missing (it finds the libraries the tool needs)")
    # lines: "\tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)", "\t/lib64/ld-linux-x86-64.so.2 (0x...)"
    found = (line.split("=>")[-1].split("(")[0].strip() for line in out.splitlines() if line.startswith("\t"))
    return sorted({p for p in found if p.startswith("/") and os.path.basename(p) not in bundled})


def _elf_needed(path):
    """The DT_NEEDED sonames of a 64-bit little-endian ELF file; () for anything else."""
    import mmap
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:6] != b"\x7fELF\x02\x01":
                return ()
            (phoff,), (phsize, phnum) = struct.unpack_from("<Q", m, 32), struct.unpack_from("<HH", m, 54)
            loads, dyn = [], None
            for i in range(phnum):  # program headers: PT_LOAD maps addresses to offsets, PT_DYNAMIC
                kind, _, off, addr, _, size = struct.unpack_from("<IIQQQQ", m, phoff + i * phsize)
                loads += [(addr, off, size)] if kind == 1 else []
                dyn = (off, size) if kind == 2 else dyn
            if dyn is None:
                return ()
            tags = [struct.unpack_from("<qQ", m, dyn[0] + i) for i in range(0, dyn[1], 16)]
            strtab = next(v for t, v in tags if t == 5)  # DT_STRTAB (an address)
            base = next(off + strtab - addr for addr, off, size in loads if addr <= strtab < addr + size)
            return tuple(m[base + v:m.find(b"\0", base + v)].decode() for t, v in tags if t == 1)  # DT_NEEDED
    except (OSError, ValueError, StopIteration, struct.error):
        return ()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

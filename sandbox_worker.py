"""
sandbox_worker.py: the half of the sandbox that runs inside bubblewrap (sandbox.py is the pool).

A worker is `python -I sandbox_worker.py '<json config>'`, started by sandbox.py inside bubblewrap. It serves
one call at a time over JSON lines on stdin/stdout, and every call starts from nothing (`_call`, step by step):
  1. an empty, size-capped tmpfs of its own on /tmp/call (its cwd, $HOME and $TMPDIR; the rest of /tmp is
     read-only), unmounted after the call: nothing it wrote is left anywhere, however deep or shut;
  2. a pid namespace of its own, held open by an init that does nothing (a clone of the worker that shares its
     memory, so it costs no copy): the code is pid 2 there and cannot name its worker, the trainer or any
     other call, so it cannot signal, re-limit (prlimit), renice or ptrace them;
  3. a forked child that joins the call's cgroup where the pool could make one (it caps the memory and processes
     of the whole call, and the worker is not in it), takes its rlimits and oom_score_adj 1000 (the first the
     kernel kills), an IPC namespace of its own (no SysV object or POSIX message queue of anyone else), then the
     slot's uid and no capabilities in any namespace, and runs the code as the release's harness runs it
     (_run_as_release). The syscall filter (sandbox.DENIED: no keyring call, no user namespace, no io_uring, ...)
     is bwrap's, loaded once for the worker and inherited by every call at no cost: the worker's own per-call
     steps (mount, umount2, unshare and setns without CLONE_NEWUSER) it allows, and the kernel refuses them to a
     call, which holds no capability and cannot make a user namespace to get one;
  4. its output is read until it exits or its deadline passes; killing the init then ends every process the
     call started (a pid namespace dies with its init), and the status is decided (rules in sandbox.py).

What the code prints is what the release's code harness prints for it (the model was trained on that):
errors as "ErrType at line N: msg\n  <line>", the code compiled as "<string>", a trailing expression's
repr after all other output, what print() left buffered lost on an error and kept on a timeout (the
call's own alarm flushes it at the deadline).

It also owns what a call can see. `view()` (run by the pool, on the host, once per process) lists it, and bwrap
gets the list as arguments:
  - the interpreter: its executable, pyvenv.cfg for a venv, the standard library (with its own site-packages
    covered by an empty tmpfs);
  - the distributions in RICH_DISTS (numpy, scipy, sympy, mpmath) and what they require: only the
    top-level files and directories their RECORD lists (numpy/, numpy.libs/, ...), not site-packages;
  - the shared libraries all of these link, as the loader resolves them (its `--list`, ldd's way), each file on
    its own;
  - /etc/ld.so.cache and /etc/localtime; /dev/null, /dev/zero, /dev/urandom (and /dev/fd, /dev/stdin,
    ... as links into /proc/self); this file, on its own;
  - a fresh /proc of the worker's pid namespace and a read-only /tmp holding only /tmp/call.
Every path is bound read-only under the name the host uses for it (tracebacks read as usual), from the file it
names (a link is followed on the host, so the loader finds each library where its listing found it). Nothing else
of the host is there: no home directories, no checkout, no run data, nothing of the host's /tmp.
"""

import ast
import contextlib
import ctypes
import functools
import gc
import json
import math
import mmap
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types

NPROC = 64         # processes + threads a call may have (its cgroup's pids.max, else RLIMIT_NPROC)
NOFILE = 256       # open files per call process
# seconds past a call's deadline the worker waits for the call's own alarm (_deadline) to flush what it printed
# and end it, before it kills the call itself
LAST_WORDS = 0.25
# each call's own tmpfs (bwrap makes the directory; /tmp around it is read-only)
CALL_DIR = "/tmp/call"
CLONE_VM, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x100, 0x08000000, 0x10000000, 0x20000000
# the stack of each call's init, which only ever calls pause()
INIT_STACK = ctypes.create_string_buffer(1 << 16)
# each call's last word (its status, a newline, its value, a NUL; 1 MiB at most), in memory the
# worker shares with the call's child (mmap's MAP_SHARED): not on an fd, which the code would see
# and could close (a fresh python3 has none past its stdio)
LAST_WORD = mmap.mmap(-1, 1 << 20)
# the C library, for what os lacks (mount, umount2, unshare, setns, clone, capset, prctl, madvise)
libc = ctypes.CDLL(None, use_errno=True)
libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

# ------------------------------------------------------------------------------------------------
# the worker: runs inside the sandbox, one call at a time, forking a locked-down child per call

# what every worker imports before it forks its first call; the rich one adds RICH (sandbox.py's
# docstring says why there are two)
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections",
           "heapq", "bisect", "random", "statistics", "re", "string", "json")
RICH = ("numpy", "sympy", "scipy")  # scipy's top level only (~1 MB): preloading its submodules
# (optimize, integrate, special, linalg) doubled the rich worker's memory and so its fork time


def _check(result, what):
    if result < 0:  # (libc's -1, with errno set)
        raise OSError(ctypes.get_errno(), f"{what} failed")


def main(cfg):
    # the pool speaks JSON lines over our stdin/stdout; move them aside so nothing else writes there
    req = os.fdopen(os.dup(0), "rb")
    rep = os.fdopen(os.dup(1), "w", buffering=1)  # a reply a line, sent at its newline
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    sys.dont_write_bytecode = True  # (-I keeps this file's directory off sys.path)
    try:
        problems = _isolation_problems(cfg)
        if problems:
            raise RuntimeError("the sandbox is not isolated: " + "; ".join(problems))
        _prepare_calls(cfg)
        _warm(cfg["rich"])
        # the call's uid must be able to import what the worker did not preload
        if cfg["mode"] != "none":
            canary = _call("import os, sys\nfor p in sys.path:\n    p.endswith('.zip') or os.listdir(p)", "", 30,
                           cfg, _vmsize())
            # the first line of the harness's report, or the last of a traceback
            if canary["status"] != "ok":
                lines = canary["stderr"].strip().splitlines() or [canary["status"]]
                raise RuntimeError(f"a call (uid {cfg['uid']}) cannot start or read the Python installation: "
                                   + lines[-1 if lines[0].startswith("Traceback") else 0])
    except Exception as e:
        rep.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        os._exit(1)
    # PR_SET_DUMPABLE 0: nothing running as our uid can ptrace us or write our /proc
    libc.prctl(4, 0, 0, 0, 0)
    vm = _vmsize()
    rep.write(json.dumps({"ready": True}) + "\n")
    os.dup2(null, 2)
    # the serving loop, one call a line; the pool closing our stdin ends it (and, as pid 1, the namespace)
    for line in req:
        # the request ({"code", "stdin", "timeout"}: _call's own arguments), run from nothing in a
        # forked child; the answer is its Result's fields
        out = _call(**json.loads(line), cfg=cfg, vm=vm)
        rep.write(json.dumps(out) + "\n")
    if cfg["mode"] == "none":
        shutil.rmtree(os.path.dirname(cfg["tmp"]), ignore_errors=True)  # on the host's /tmp


def _prepare_calls(cfg):
    """What every call's child would otherwise set up itself: done once here, inherited by each fork
    (each step a child skips is pages it does not copy-on-write)."""
    # the call's directory: with bwrap, CALL_DIR, where each call gets a tmpfs of its own; with isolation "none"
    # (trusted code), a directory on the host's /tmp, made and removed per call
    if cfg["mode"] == "none":
        cfg["tmp"] = os.path.join(tempfile.mkdtemp(prefix="call-"), "cwd")
        os.chmod(os.path.dirname(cfg["tmp"]), 0o711)  # the call's uid may pass
    else:
        cfg["tmp"], cfg["pid_ns"] = CALL_DIR, os.open("/proc/self/ns/pid", os.O_RDONLY)
        if cfg["uid"] is None:  # a normal user: its own uid
            cfg["uid"] = os.getuid()
    os.environ.update(HOME=cfg["tmp"], TMPDIR=cfg["tmp"])
    tempfile.tempdir = cfg["tmp"]
    # PR_SET_NO_NEW_PRIVS (inherited): setuid binaries give no privileges back
    libc.prctl(38, 1, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (and so each call's init has no handler at all)
    # a too-big file gets EFBIG (an error), not a kill
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.argv = ["<string>"]


def _vmsize():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmSize")).split()[1]) * 1024


def _isolation_problems(cfg):
    """What shows that bwrap did not isolate the worker as asked: each a sentence (none with isolation "none")."""
    if cfg["mode"] == "none":
        return []
    extra = set(os.listdir("/")) - {op[-1].split("/")[1] for op in cfg["view"]} - {"proc", "tmp"}
    with open("/proc/net/dev") as f:
        ifaces = {line.split(":")[0].strip() for line in f.readlines()[2:]} - {"lo"}
    writable = any(os.access(path, os.W_OK) for path in ("/", "/tmp", __file__))
    checks = {f"the root holds more than the view: {sorted(extra)[:5]}": extra,
              "the worker is not the init of its own pid namespace": os.getpid() != 1,
              "the host filesystem is writable": writable,
              f"network interfaces are visible: {sorted(ifaces)}": ifaces}
    return [problem for problem, found in checks.items() if found]


def _warm(rich):
    import importlib
    # import each preloaded module, or refuse to start naming the one that failed
    for name in PRELOAD + (RICH if rich else ()):
        try:
            importlib.import_module(name)
        except ImportError as e:
            # e.g. a library the view lacks: the pool refuses to start, saying which (numpy's message ends with the
            # cause)
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise RuntimeError(f"cannot import {name} in the sandbox: {why}") from None
    # the rich worker runs the common paths once so lazy imports and caches fill here, not per call
    if rich:
        import numpy as np
        import sympy as sp
        x = sp.Symbol("x")
        sp.factor(x**4 - 1), sp.expand((x + 1)**5), sp.solve(x**2 - 2, x), sp.simplify(sp.sin(x)**2 + sp.cos(x)**2)
        sp.integrate(x * sp.exp(x), x), sp.diff(sp.sin(x) * x, x), sp.limit(sp.sin(x) / x, x, 0)
        sp.series(sp.exp(x), x, 0, 4), sp.Matrix([[1, 2], [3, 4]]).det(), sp.nsimplify(0.5), sp.N(sp.pi, 30)
        sp.isprime(97), sp.factorint(360), sp.Rational(1, 3) + sp.Rational(1, 6), sp.latex(sp.sqrt(8) / x)
        sp.sympify("x**2 + 2*x + 1"), sp.Poly(x**3 - 1, x).all_coeffs(), sp.binomial(10, 3), sp.summation(x, (x, 1, 10))
        np.linalg.solve(np.eye(3), np.ones(3)), np.arange(10).sum(), np.sqrt(np.array([4.0]))
    gc.collect()
    # keep the collector from touching (and so copying) the parent's pages in every child
    gc.freeze()
    # back the warm heap with huge pages where the kernel can (MADV_COLLAPSE, Linux >= 6.1; elsewhere a
    # no-op): fork then copies one page-table entry per 2 MiB instead of 512, and fork is most of a call
    # (trivial calls took ~40% less time on a 2-core VM)
    huge = 2 << 20
    with open("/proc/self/maps") as f:
        # one mapping a line: keep the writable anonymous ones and the heap
        for line in f:
            fields = line.split()
            # (anonymous)
            if fields[1].startswith("rw") and (len(fields) < 6 or fields[5] == "[heap]"):
                # its whole 2 MiB pages, if it holds any, collapsed into huge pages
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                lo, hi = -(-lo // huge) * huge, hi // huge * huge
                # (none: the length is 0 or wraps below 0, and the kernel refuses it, EINVAL)
                libc.madvise(lo, hi - lo, 25)  # MADV_COLLAPSE


def _call(code, stdin, timeout, cfg, vm):
    """Run one call from nothing, in a forked child; return the Result fields as a dict."""
    isolated, tmp = cfg["mode"] != "none", cfg["tmp"]
    # 1) an empty directory of its own: with bwrap a fresh tmpfs, whose size is all the file space it gets
    if isolated:
        # MS_NOSUID | MS_NODEV
        _check(libc.mount(b"tmpfs", tmp.encode(), b"tmpfs", ctypes.c_ulong(2 | 4),
                          f"size={cfg['memory']},mode=700,uid={cfg['uid']},gid={cfg['uid']}".encode()), "mount")
    else:
        os.mkdir(tmp, 0o700)
        if cfg["uid"] is not None:
            os.chown(tmp, cfg["uid"], cfg["uid"])
    # 2) its stdin (a memfd, written whole), pipes for its stdout and stderr, an empty last word
    stdin_fd = os.memfd_create("stdin")
    # (its offset stays at 0, where the child reads)
    os.pwrite(stdin_fd, stdin.encode(errors="replace"), 0)
    # the pipes' read ends (ours) and write ends (the child's), each in the order stdout, stderr
    reads, writes = zip(os.pipe(), os.pipe())
    child_fds = (stdin_fd, *writes)  # its 0, 1 and 2
    LAST_WORD[0] = 0  # (an empty last word, unless the child writes one)
    _went_past_cap(cfg)  # (a late signal of an earlier call is not this call's)
    # 3) with bwrap, a pid namespace whose init holds it open; the child is born in it as pid 2
    init = _start_init() if isolated else None
    # the child inherits our stdio wrappers (it makes its own): nothing of ours in them
    sys.stdout.flush(), sys.stderr.flush()
    # the CPU seconds each of its processes may use (RLIMIT_CPU): the wall deadline normally fires
    # first; this is the backstop
    cpu_limit = math.ceil(timeout) + 1
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        # no return
        _child(code, t0 + timeout, cpu_limit, cfg, vm, child_fds)
    if isolated:
        # our next children are in our namespace again
        _check(libc.setns(cfg["pid_ns"], CLONE_NEWPID), "setns")
    for fd in child_fds:
        os.close(fd)
    # 4) collect its output until it exits or its deadline passes
    outputs, dropped, timed_out = _collect(pid, reads, t0 + timeout + LAST_WORDS, cfg)
    # 5) end it: killing the init ends every process of the namespace; unmounting its tmpfs frees its files
    if isolated:
        os.kill(init, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # its process group (isolation "none": trusted code)
    _, wstatus, usage = os.wait4(pid, 0)
    duration = time.monotonic() - t0
    if isolated:
        os.waitpid(init, 0)
        _check(libc.umount2(tmp.encode(), 2), "umount")  # MNT_DETACH
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    # 6) decide the status (the rules are in sandbox.py's docstring)
    # the child's last word: status, newline, value, NUL (repr escapes NUL)
    ctl_status, _, value = LAST_WORD[:LAST_WORD.find(b"\0")].decode(
        errors="replace").partition("\n")
    note, cpu = "", usage.ru_utime + usage.ru_stime
    sig = os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else None
    # the cgroup's cap: the kernel killed one of its processes, and we the rest
    if _went_past_cap(cfg):
        status, note = "memory", "[sandbox] memory: the call went past its cgroup's cap and was killed"
    # killed here, or by its own alarm (a SIGKILL once its time was up)
    elif timed_out or (sig == signal.SIGKILL and duration >= timeout):
        status, note = "timeout", f"[sandbox] timeout: killed after {timeout:g} s"
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cpu_limit):
        status, note = "timeout", f"[sandbox] timeout: CPU limit hit after {cpu:.1f} s"
    elif sig is not None:
        name = signal.Signals(sig).name if sig in signal.valid_signals() and sig < signal.SIGRTMIN else sig
        status, note = "crash", f"[sandbox] killed by signal {name}"
    elif ctl_status == "memory":
        status = "memory"
    else:
        status = "ok" if os.WEXITSTATUS(wstatus) == 0 else "error"
    notes = [f"[sandbox] {name} truncated: {n} more bytes dropped (cap {cfg['output_cap']})"
             for name, n in zip(("stdout", "stderr"), dropped) if n] + ([note] if note else [])
    stderr = outputs[1] + ("\n" if notes and outputs[1] and not outputs[1].endswith("\n") else "") + "\n".join(notes)
    return {"status": status, "stdout": outputs[0], "stderr": stderr,
            "value": value[:cfg["output_cap"]], "duration": duration}


def _start_init():
    """A pid namespace for our next child, and its init: a clone of this process sharing its memory (so nothing
    is copied), sitting in pause() until it is killed. As init it ignores every signal sent from inside its
    namespace (it has no handlers), and when it dies every process of the namespace dies with it."""
    _check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    top = (ctypes.addressof(INIT_STACK) + len(INIT_STACK)) & ~15
    init = libc.clone(ctypes.cast(libc.pause, ctypes.c_void_p), top, CLONE_VM | signal.SIGCHLD, None)
    _check(init, "clone of the call's init")
    return init


def _went_past_cap(cfg):
    """Whether the kernel killed a process of the call's cgroup for memory since this was last asked: on cgroup v1
    the pool's eventfd for memory.oom_control was signalled (reading it resets it); on v2 the oom_kill count in
    memory.events (cfg's memory_events: an fd of it) grew. Without a cgroup nothing signals the eventfd."""
    if cfg.get("memory_events"):  # (an fd the pool passed: 3 or more)
        kills = cfg.get("oom_kills", 0)
        # "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\noom_group_kill 1\n"
        events = os.pread(cfg["memory_events"], 4096, 0)
        cfg["oom_kills"] = int(events.split(b"oom_kill ")[1].split()[0])
        return cfg["oom_kills"] > kills
    with contextlib.suppress(BlockingIOError):  # (nothing signalled)
        return bool(os.read(cfg["oom_event"], 8))
    return False


def _collect(pid, fds, deadline, cfg):
    """Read the call's pipes until it exits, its v1 cgroup runs out of memory (cfg's oom_event is readable) or
    `deadline` passes: (texts, bytes dropped past the output cap per pipe, timed out)."""
    bufs, dropped, live = {fd: bytearray() for fd in fds}, dict.fromkeys(fds, 0), set(fds)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (*fds, pidfd, cfg["oom_event"]):
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)

    def pump(fd, reads=1):  # read what is there, keep up to the cap, count the rest
        for _ in range(reads):
            # one read: nothing there yet, or the end of the pipe (it is closed: stop watching it)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                poller.unregister(fd)
                live.discard(fd)
                return
            # keep what fits under the cap, count the rest as dropped
            keep = max(0, cfg["output_cap"] - len(bufs[fd]))
            bufs[fd] += chunk[:keep]
            dropped[fd] += len(chunk[keep:])

    timed_out, exited = False, False
    while not exited and not timed_out:
        # the time left: none left is a timeout (the poll below then only looks, without waiting)
        left = deadline - time.monotonic()
        timed_out = left <= 0
        # what is ready: the pidfd says the call's process exited (or the eventfd that it hit its memory cap: then
        # it ends here, whole), a pipe has output to pump
        for fd, _ in poller.poll(max(left, 0) * 1000):
            if fd in (pidfd, cfg["oom_event"]):
                exited = True
            elif fd in live:
                pump(fd)
    for fd in live.copy():  # what it wrote before it exited is still in the pipes
        pump(fd, reads=64)
    for fd in (*fds, pidfd):
        os.close(fd)
    return [bufs[fd].decode(errors="replace") for fd in fds], list(dropped.values()), timed_out and not exited


def _child(code, deadline, cpu_limit, cfg, vm, fds):
    """The forked child: lock down, then run `code` as __main__, as the release's harness runs it
    (_run_as_release). Never returns into the worker.
    (_prepare_calls did the rest once: environment, no_new_privs, signals, argv.)"""
    exit_code = 70
    try:
        # the call's own memory and pids cgroups (as root: the uid is still the worker's)
        for fd in cfg["cgroups"]:
            os.write(fd, b"0")
        # stdin memfd, stdout, stderr -> 0, 1, 2 (first: a failure below is reported in the call's
        # stderr)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        # fds 0-2 were taken when the pipes were made, so no source was clobbered
        os.closerange(3, 1 << 16)
        # the call's stdio, buffered as python3's own are on pipes (what a timeout or an error
        # loses depends on it): stdout by blocks, stderr by lines. Made here, on the pipes: made
        # on the worker's /dev/null, which can seek, a wrapper later asked the pipe its position
        # and failed, OSError: Illegal seek (sys.stdout.reconfigure(), a TextIOWrapper over
        # sys.stdout.buffer)
        sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="backslashreplace",
                                           closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", 1, encoding="utf-8", errors="backslashreplace",
                                           closefd=False)
        # 1) a session and limits of its own; with a cgroup, pids.max counts its processes, so that no per-uid count
        # (kernel-wide: other pools, in other namespaces, may run as the same uid) decides anything
        os.setsid()
        # with a cgroup, the worker's own RLIMIT_NPROC (no tighter count by uid)
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1] if cfg["cgroups"] else NPROC
        # its limits: address space, processes, CPU seconds, no core file, file size, open files
        limits = {resource.RLIMIT_AS: vm + cfg["memory"], resource.RLIMIT_NPROC: nproc,
                  resource.RLIMIT_CPU: cpu_limit, resource.RLIMIT_CORE: 0,
                  resource.RLIMIT_FSIZE: cfg["memory"], resource.RLIMIT_NOFILE: NOFILE}
        for res, v in limits.items():
            # CPU: SIGXCPU, then SIGKILL
            resource.setrlimit(res, (v, v + (res == resource.RLIMIT_CPU)))
        # first in line when memory runs out, never the worker; written while we may still pin it (as root the worker
        # holds CAP_SYS_RESOURCE, so the kernel keeps 1000 as the least the call may set; a normal user cannot)
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE 1: our /proc/self files are ours to write
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        # 2) with bwrap, an IPC namespace of its own (no SysV object or POSIX message queue of anyone else; it takes
        # the call's with it), made while we still hold the worker's capabilities
        if cfg["mode"] != "none":
            _check(libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
        # 3) the slot's uid (None only with isolation "none" as a normal user: that user's, unchanged), and no
        # capability in any namespace; the syscall filter (sandbox.DENIED), bwrap's for the worker, is inherited
        # and lets no call make a user namespace, where it would hold them all again
        uid = cfg["uid"]
        if uid is not None:
            if os.geteuid() == 0:
                os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # from root to non-root: all capabilities are dropped too
        # PR_SET_DUMPABLE 1 again (a uid change reset it): our /proc/self files are ours; then no capabilities (a
        # normal user's child held those bwrap gave the worker)
        libc.prctl(4, 1, 0, 0, 0)
        _check(libc.capset(struct.pack("Ii", 0x20080522, 0), bytes(24)), "capset")
        if cfg["mode"] == "none":  # elsewhere the namespace ends with its init
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
        # its own deadline (only here: the worker never runs it), and python3's KeyboardInterrupt
        # for a SIGINT (the worker has no handler, so that no call's init runs one in its memory)
        signal.signal(signal.SIGALRM, _deadline)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(cfg["tmp"])
        main = types.ModuleType("__main__")
        main.__file__ = "<string>"  # as in the release's globals for the code
        sys.modules["__main__"] = main
        status, value, stdout_kept = "ok", "", True
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-3))  # -> _deadline
        try:
            value = _run_as_release(code, main.__dict__) or ""
            exit_code = 0
        except SystemExit as e:
            # not caught by the release's harness either: python3 exits as usual
            if e.code is None or isinstance(e.code, int):
                exit_code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                exit_code = 1
        except _Reported as e:
            # the harness prints its report and ends with os._exit(1): what print() left in stdout's buffer is lost
            # (only what was flushed stays)
            status = "memory" if isinstance(e.__cause__, MemoryError) else "error"
            exit_code, stdout_kept = 1, False
            try:
                print(e, file=sys.stderr)
            except MemoryError:
                os.write(2, type(e.__cause__).__name__.encode() + b"\n")
        except BaseException as e:
            # the harness prints a traceback (then os._exit(1)); python3 does the same for a KeyboardInterrupt and
            # the like (and then flushes stdout)
            status, exit_code = ("memory" if isinstance(e, MemoryError) else "error"), 1
            stdout_kept = not isinstance(e, Exception)
            # from the code's frame on
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        signal.setitimer(signal.ITIMER_REAL, 0)
        # what was printed: through the stdout and stderr the code left in sys (python3 flushes
        # those at exit), then through the call's own stdout, were it set aside
        for f in (sys.stdout, sys.stderr, sys.__stdout__) if stdout_kept else (sys.stderr,):
            with contextlib.suppress(BaseException):
                f.flush()
        # (cut here, before it is encoded whole; and by the worker, which trusts no last word)
        msg = (status + "\n" + value[:cfg["output_cap"]]).encode(errors="backslashreplace")
        LAST_WORD.write(msg[:len(LAST_WORD) - 1] + b"\0")
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(exit_code & 0xFF)  # skip atexit and stray threads: the call is over


class _Reported(Exception):
    """The release harness's words for an exception of the call's code (its __cause__)."""


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
        raise _Reported(_release_words(e, code)) from e
    head, tail = code, None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        lines, last = code.splitlines(), tree.body[-1]
        head = "\n".join(lines[:last.lineno - 1])
        tail = "\n".join(lines[last.lineno - 1:last.end_lineno])
    if head:
        try:
            exec(compile(head, "<string>", "exec"), scope)
        except Exception as e:
            raise _Reported(_release_words(e, head)) from e
    if tail:
        try:
            value = eval(compile(tail, "<string>", "eval"), scope)
            return None if value is None else repr(value)
        except Exception:
            try:
                exec(compile(tail, "<string>", "exec"), scope)
            except Exception as e:
                raise _Reported(_release_words(e, tail, len(head.splitlines()))) from e
    return None


def _release_words(e, code, offset=0):
    """How the release's harness words an exception of `code`: "ErrType at line N: message\\n  <line N of
    code>", where N is the exception's own `lineno` if it has one (a SyntaxError's, but also e.g. a
    JSONDecodeError's line in the JSON text) or else the line of the innermost frame of its traceback
    (which may be a library's, or a function's defined elsewhere), plus `offset`; when line N is not a
    line of `code` (a trailing expression's error after other code, a library's line 900): "ErrType:
    message"."""
    # outermost frame first
    frame_lines = [lineno for _, lineno in traceback.walk_tb(e.__traceback__)]
    n = getattr(e, "lineno", frame_lines[-1] if frame_lines else -1)
    name, lines = type(e).__name__, code.splitlines()
    if isinstance(n, int) and n != -1 and 0 <= n + offset - 1 < len(lines):
        return f"{name} at line {n + offset}: {e}\n  {lines[n + offset - 1]}"
    return f"{name}: {e}"


def _deadline(signum, frame):
    """A call's own alarm, due at its deadline (a moment before the worker would kill it): flush what the
    code printed and end the call, as the release's alarm handler does (it prints "Suicide from timeout."
    with flush=True, which the tool response adds). The worker reads a SIGKILL past the deadline
    as a timeout."""
    # (it fails e.g. when the code was inside a write to stdout: what is in the buffer is then lost)
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)  # the call's process group, this process included


# ------------------------------------------------------------------------------------------------
# the view: what a call can see (computed by the pool, on the host; see the module docstring)

# the paper's tool environment, plus what they require
RICH_DISTS = ("numpy", "scipy", "sympy", "mpmath")
ETC = ("/etc/ld.so.cache", "/etc/localtime")  # the loader's cache of library paths; local time
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
# /dev/fd, /dev/stdin, ...: into the call's own /proc, as on any Linux
DEV_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0",
             "/dev/stdout": "/proc/self/fd/1", "/dev/stderr": "/proc/self/fd/2",
             # POSIX shared memory and semaphores (multiprocessing's locks): the call's tmpfs
             "/dev/shm": CALL_DIR}


@functools.cache
def view(dists=RICH_DISTS):
    """The paths a call may see, in mount order, as ("bind", real path, name) (read-only), ("dev", path, path),
    ("symlink", target, name) and ("mask", path) (an empty read-only tmpfs over a bound directory).
    Raises RuntimeError naming what cannot be found."""
    import importlib.metadata
    import re
    import sysconfig
    names, missing = {}, []  # {name in the sandbox: the file or directory it is on the host}

    def need(path):
        if os.path.exists(path):
            names[os.path.normpath(path)] = os.path.realpath(path)
        else:
            missing.append(path)

    # 1) the interpreter, as the pool runs it (a venv's bin/python keeps its name: that is how it finds
    # pyvenv.cfg, and so its site-packages), and the standard library without its site-packages
    need(python())
    if sys.prefix != sys.base_prefix:
        need(os.path.join(os.path.realpath(sys.prefix), "pyvenv.cfg"))
    stdlib, dynload = sysconfig.get_path("stdlib"), sysconfig.get_config_var("DESTSHARED")
    need(stdlib)
    need(dynload)
    masks = [p for p in [f"{stdlib}/site-packages"] if os.path.isdir(p)]
    # 2) the distributions and their requirements (extras aside): the top-level entries of their RECORD
    todo, seen, sos = list(dists), set(), [os.path.realpath(python())]
    while todo:
        # the next distribution not yet seen, or a note of it missing (only the asked-for ones must be there)
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if name in dists:
                missing.append(f"the {name} package (pip install {name})")
            continue
        # its top-level files and directories, bound under the real site-packages
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            # under the real site-packages: the one the worker's sys.path holds
            need(os.path.join(os.path.realpath(dist.locate_file(top).parent), top))
        # its shared objects (for the loader's listing below) and its requirements (to visit next)
        sos += [os.path.realpath(dist.locate_file(f)) for f in dist.files or []
                if f.parts[0] != ".." and ".so" in f.name]
        todo += [re.match(r"[\w.-]+", r).group() for r in dist.requires or [] if "extra" not in r]
    # 3) the shared libraries all of these link, as the loader finds them: the loader this interpreter runs under
    # (mapped into this process) lists each file's (`--list`: what ldd runs for a file, after a --verify run and
    # its shell's work: 0.2 s instead of 1.0 s for ~210 files, a third of a pool's start)
    if os.path.isdir(dynload):
        sos += [f"{dynload}/{n}" for n in os.listdir(dynload) if ".so" in n]
    with open("/proc/self/maps") as f:
        loader = next(path for path in f.read().split() if os.path.basename(path).startswith("ld-"))
    out = subprocess.run(["sh", "-c", 'for f; do "$0" --list "$f"; done', loader, *sos], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
    # lines: "\tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)", "\t/usr/lib/.../ld-linux-x86-64.so.2 (0x...)"
    # and, for the interpreter, "\t/lib64/ld-linux-x86-64.so.2 => /usr/lib/.../ld-linux-x86-64.so.2 (0x...)": every
    # path on them, spaces and all (a library's, and the name an executable asks for its loader by); "=> not found"
    # is none
    for lib in re.findall(r"(/[^\n]*?)(?= => | \(0x)", out.stdout):
        need(lib)
    # ETC: where the host has them
    for path in [*filter(os.path.exists, ETC), *DEVICES, os.path.realpath(__file__)]:
        need(path)
    if missing:
        raise RuntimeError("sandbox: refusing to start: the tool's view lacks " + ", ".join(missing))
    # the ops: a name inside a bound directory is already there (unless it is under a mask)
    under = lambda p, d: p.startswith(d + "/")  # noqa: E731
    covered = lambda p: any(under(p, d) for d in names) and not any(under(p, m) for m in masks)  # noqa: E731
    ops = [("symlink", target, name) for name, target in DEV_LINKS.items()]
    ops += [("dev" if name in DEVICES else "bind", real, name) for name, real in names.items() if not covered(name)]
    return tuple(sorted(ops + [("mask", m) for m in masks], key=lambda op: (op[0] == "symlink", op[-1])))


def python():
    """The interpreter the workers run: the pool's own, by its name in a real (symlink-free) directory."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

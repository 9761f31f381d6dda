"""
sandbox.py: an isolated, high-throughput pool that runs untrusted Python snippets (the agent's tool).

rStar2-Agent's code service answers up to 45K tool calls per RL step at ~0.3 s mean latency; its
released executor (code-judge) starts a fresh `python3` per call and isolates nothing by default.
Here a few warm worker interpreters fork a short-lived child per call, so imports are paid once per
worker instead of once per call, and every worker lives inside bubblewrap. A fork
costs in proportion to the parent's resident memory, so each slot keeps two workers: a lean one (the
math stdlib, ~9 MB) for code that imports only the standard library, and a rich one with numpy
and sympy imported and warmed (~57 MB) for the rest (scipy too). Trivial calls then cost ~2.5 ms, not ~6.

    with SandboxPool(workers=2, timeout=4.0) as pool:                   # scripts and tests
        results = pool.map([("print(int(input()) * 2)", "21\\n"), "1 + 1"])
        fut = pool.submit("print(6 * 7)", "")                           # the rollout engine: no loop needed
        fut.result().stdout                                             # '42\\n'
    async with SandboxPool() as pool:                                   # from an event loop
        r = await pool.run("import sympy as sp\\nsp.factor(sp.Symbol('x')**2 - 1)", stdin="")
        r.status, r.stdout, r.stderr, r.value, r.duration    # 'ok', '', '', '(x - 1)*(x + 1)', 0.004

    python bench.py sandbox       # throughput/latency vs a fresh python3 per call (~3 minutes)

Layout (one box per worker, two workers per slot; the worker's code is sandbox_worker.py):

    trainer process                          bwrap: an empty root with only the view below
      run() / map() / submit() ─► FIFO       ┌────────────────────────────────────────────────────┐
      one thread per slot ─── JSON line ──► │ worker = pid 1 of the namespace, lean or rich warm │
        watchdog: timeout + 2 s   ◄───────── │  per call, from nothing: a tmpfs, a pid namespace, │
                                             │  fork ─► child: cgroup, rlimits, IPC namespace,    │
                                             │  the slot's uid, no capabilities, exec(code)       │
                                             │  wall deadline, then the call's namespace is killed │
                                             └────────────────────────────────────────────────────┘

How a status is decided (first rule that matches):
    overloaded  the call waited more than `queue_timeout` seconds for a worker (it never ran; it is answered
                when a worker takes it)
    crash       the worker died or stopped answering (timeout + 2 s), or the pool shut down first
    memory      the call went past its cgroup's cap (v1: the kernel killed one of its processes, its worker the
                rest; v2: the kernel killed them all)
    timeout     the wall-clock deadline passed (CPU limits miss `sleep`; the call's own alarm then kills it, or the
                worker does), or the CPU rlimit killed it
    crash       killed by any other signal (segfault, abort, a self-kill)
    memory      a MemoryError reached the top level (the address-space limit was hit)
    error       an exception reached the top level (stderr: the release harness's words; for a SIGINT, python3's
                KeyboardInterrupt traceback) or a non-zero exit
    ok          anything else, including sys.exit(0) and os._exit(0)
Knobs (keyword arguments; the training configs set them):
    workers        slots, each running one call at a time in its lean or rich worker (default: the node's CPU
                   cores shared by the ranks on it, os.cpu_count() // LOCAL_WORLD_SIZE)
    timeout        wall-clock seconds per call (default 4: rStar's README starts code-judge with
                   MAX_EXECUTION_TIME=4; at most MAX_TIMEOUT, a day); run() can override it
    memory         the memory of one call, capped twice: (1) where the pool may make cgroups (cgroup v1's memory
                   and pids hierarchies, writable as root; or, on cgroup v2, the pool's own group where it may
                   write it and it offers memory and pids: see _new_cgroup), all the memory of the call's processes, files, memfds and IPC
                   together, at `memory` + 64 MiB (the calls of each worker have a cgroup, which the worker is not
                   in; on v2 swap is off for it), past which the kernel kills the call (status memory); (2) everywhere, each process's
                   address space on top of the warm interpreter (~20 / ~175 MiB lean / rich), the largest file it
                   may write and the size of its tmpfs. Default 256 MiB: code-judge's MAX_MEMORY default, which rStar does not
                   override. Its limit is on a fresh python3 (+128 MiB for the interpreter) and ours on top of a
                   warm one, so allocations between ~256 and ~350 MiB can differ; the test pins ones that fail and
                   succeed in both (tests/test_sandbox.py: list(range(10**7)) and [0] * 75_000_000 fail, 80 MB
                   succeed)
    output_cap     bytes kept of stdout and of stderr each (default 64 KiB)
    queue_timeout  seconds a call may wait for a free worker before it is answered `overloaded` (default 60)
    isolation      "auto" or "bwrap" (bubblewrap; without it the pool refuses to start, saying how to get it), or
                   "none": no isolation at all, for trusted code only
run() may be awaited from any event loop in any thread; map() blocks; submit() returns a
concurrent.futures.Future at once.

The code runs as the release's harness runs it and prints what it prints (sandbox_worker._run_as_release).
`value` is the repr of a trailing expression (like IPython's Out[]; "" when there is none or it is None), which
the harness prints last; it is cut at `output_cap` characters and 1 MiB of UTF-8. A call's only fds are its stdin,
stdout and stderr, as in a fresh python3: its status and value come back through memory it shares with its worker
(sandbox_worker.LAST_WORD).
`duration` is the seconds the call ran in its worker (for overloaded: the seconds it waited).
stdout and stderr are cut at `output_cap` bytes each; a line in stderr says how much was dropped.

Every call starts from nothing: no file, process, IPC object, keyring, limit or signal of an earlier call reaches
it, and nothing it does reaches its worker, the next call, another pool or the trainer (sandbox_worker._call
says how, step by step; each is a test in tests/test_sandbox_fresh.py, run as root and as a normal user).
What a call can see (sandbox_worker.view(); every path read-only but its own tmpfs, under its host name):
  the interpreter (executable, standard library, pyvenv.cfg), the top-level directories of numpy,
  scipy, sympy, mpmath and what they require (numpy/, numpy.libs/, ...: not the rest of site-packages),
  each shared library these link (as the loader finds it), /etc/ld.so.cache, /etc/localtime, /dev/null, zero
  and urandom, sandbox_worker.py alone, the worker's /proc, and /tmp/call, a fresh tmpfs per call.
What it cannot see: anything else of the host: home directories, the checkout, the run's data,
  checkpoints and outputs (wherever they are, the host's /tmp included), /srv, /opt, /mnt, the trainer and
  other calls (other pid namespaces), the trainer's environment (workers get a fresh minimal one).
What it protects against (each one is a test in tests/test_sandbox.py or tests/test_sandbox_fresh.py, which run
its attacks as root and as a normal user):
  - reading the host: the view above;
  - the kernel's wider surface: a seccomp filter (built by libseccomp, _seccomp; loaded by bwrap for the worker,
    so every call inherits it at no cost) denies the keyring calls, new user namespaces (unshare and clone with
    CLONE_NEWUSER), io_uring, userfaultfd, bpf, perf_event_open, ptrace and the process_vm calls, the new mount
    API, kexec, modules and the rest of DENIED with EPERM, and clone3 with ENOSYS (its flags are out of the
    filter's reach: glibc falls back to clone, whose flags it reads); a syscall through another ABI than the machine's
    (i386's int 0x80, x32) kills the call. mount, umount2, setns and other unshares, which the worker makes for
    each call, the filter allows and the kernel refuses to a call: it holds no capability in any namespace and
    cannot make a user namespace. Threads, subprocesses, multiprocessing, numpy, scipy and sympy work as usual
    (within 64 processes and threads a call: multiprocessing.Pool() with no count fails on a node of more than
    about 58 CPUs, docs/sandbox.md says why and what to do);
  - hangs and busy loops (wall deadline, then the call's pid namespace is killed), fork bombs (with a cgroup, its
    pids.max; without one, RLIMIT_NPROC), memory blow-ups (the cgroup, RLIMIT_AS), huge files and outputs
    (RLIMIT_FSIZE, the sized tmpfs, output caps), crashes and self-kills of the worker (it is replaced and the
    call answered `crash`), stray threads and processes after the code returns (killed with the namespace,
    setsid or not);
  - the OOM killer aimed at the worker: with a cgroup, the call's is its own (the worker is not in it), so the
    kernel's kill at the cap finds only the call's processes; on cgroup v1 its out-of-memory event (an eventfd on
    memory.oom_control) makes the worker end the rest of the call at once, on v2 the kernel kills the whole call
    itself (memory.oom.group) and the worker counts it in memory.events; each call's processes start at
    oom_score_adj 1000 (first in line when the host runs out), which as root holding CAP_SYS_RESOURCE it cannot lower;
  - writes to the host (nothing of it is writable), network access (empty network namespace: no
    interfaces but loopback, which is not the host's), signals, prlimit, renice or ptrace of the worker, the
    trainer or other calls (none of them has a pid in the call's namespace);
  - keys: no keyring call at all, and /proc/keys and /proc/key-users are empty;
  - privilege and shared uids: as root, each slot's calls run as a uid of the pool's own, from 2,000,000,000 up
    in blocks of 1,024, a block claimed per pool (a lock file in /run, where only root may make one, names it; a
    uid that /etc/passwd or any host process uses is skipped), with no capabilities and no_new_privs; two pools
    in separate namespaces of one kernel (containers) may take the same block, and then no per-uid count decides
    anything where a pids cgroup bounds each call; as a normal user, with that user's uid and no capabilities;
  - refusals in bwrap's own words (e.g. a normal user where user namespaces are closed).
What it does not protect against:
  - kernel bugs in what the filter allows (files, sockets, memory, signals, futexes: what Python needs);
  - where the pool cannot make cgroups (a normal user on v1, or on v2 outside a delegated group, e.g. a systemd
    scope with Delegate=yes; a v2 group without memory or pids to offer; a container whose /sys/fs/cgroup is
    read-only), which it says once at start, naming why: no cap on the whole call's memory: RLIMIT_AS is
    per process, so a call may use (processes allowed) x `memory`, plus memfds and SysV segments, which count
    against no rlimit, up to the size of RAM; RLIMIT_NPROC counts a uid's processes kernel-wide, so two pools in
    separate containers that took the same uid block (or, as a normal user, every pool and host process of the
    user) share it; and the global OOM killer may pick the worker or the trainer if a call lowered its
    oom_score_adj (only a root holding CAP_SYS_RESOURCE pins it; docker's root does not hold it);
  - CPU: a call may use as many cores as it runs threads and processes (RLIMIT_CPU counts each process's own
    CPU time, the wall deadline ends them all), and can starve other workers' calls on a busy machine;
  - with isolation="none" (the explicit opt-out, for trusted code): none of the namespace protections above
    apply (the call sees the whole host), no syscall filter, and a process that leaves its process group
    (setsid) can outlive the call.
Needs Linux >= 5.3 (pidfd; for a cgroup on v2, a kernel that checks a move into a cgroup against the credentials
and cgroup namespace that opened cgroup.procs: 5.16, and the stable kernels since early 2022, CVE-2021-4197),
bubblewrap, libseccomp with its Python bindings (pyseccomp), as root a writable
/run (the uid claims' lock files stay there, one per block used), and, as a normal user, user namespaces open to
unprivileged processes (bwrap makes one; where a policy forbids it, e.g. Ubuntu 24.04's
kernel.apparmor_restrict_unprivileged_userns, the pool refuses to start in bwrap's own words).
"""

import ast
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import pathlib
import pwd
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import sandbox_worker

STATUSES = ("ok", "error", "timeout", "memory", "crash", "overloaded")
ISOLATIONS = ("auto", "bwrap", "none")
# seconds past a call's timeout before its worker counts as wedged and is replaced
GRACE = 2.0
START_TIMEOUT = 120.0  # seconds for a worker to import and warm numpy + sympy (slow on a busy box)
# the most seconds a call may be given: the pool's waits on a worker take at most ~24 days
# (poll()'s int of milliseconds; a longer one raised OverflowError in the slot's thread, whose
# calls then waited forever)
MAX_TIMEOUT = 86400.0
# worker capabilities when the pool runs as root: enough to mount each call's tmpfs, make its namespaces, drop it
# to the slot's uid and pin its oom_score_adj (CAP_SYS_RESOURCE); the child itself keeps none of them
ROOT_CAPS = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SYS_RESOURCE")
# a call's cgroup holds `memory` and this: the pages of the warm interpreter a call dirties, so that a single
# process meets its own limits (MemoryError, a full tmpfs) first
CGROUP_SLACK = 64 << 20
# the syscalls no call may make (each fails with EPERM; sandbox_worker._child loads the filter, _seccomp builds it)
DENIED = (
    # the kernel's keyrings: a key outlives its call (it is freed asynchronously) and some are shared per user
    "add_key keyctl request_key "
    # (new user namespaces, where a call would hold every capability (nf_tables, raw sockets, mounts): unshare and
    # clone by their flags, clone3 always, in _seccomp; mount, umount2, setns and unshare without CLONE_NEWUSER the
    # worker makes itself for each call, and the kernel refuses them to a call, which holds no capability)
    # interfaces with a long record of local privilege escalations, which Python code never needs
    "io_uring_setup io_uring_enter io_uring_register userfaultfd bpf perf_event_open "
    # the new mount API, changing the root
    "pivot_root chroot fsopen fsconfig fsmount fspick move_mount open_tree mount_setattr "
    # reading or steering another process
    "ptrace process_vm_readv process_vm_writev pidfd_getfd kcmp "
    # the machine's own: kernels, modules, clocks, swap, the kernel log, raw I/O ports, file handles
    "kexec_load kexec_file_load init_module finit_module delete_module reboot swapon swapoff acct "
    "quotactl syslog settimeofday clock_settime clock_adjtime adjtimex iopl ioperm modify_ldt "
    "open_by_handle_at name_to_handle_at lookup_dcookie uselib vhangup nfsservctl"
).split()
# slot uids as root: pool k of the node takes FIRST_UID + k * UID_BLOCK..
FIRST_UID, UID_BLOCK = 2_000_000_000, 1024
# bound alone into the sandbox (the view lists it)
WORKER = os.path.realpath(sandbox_worker.__file__)


@dataclasses.dataclass
class Result:
    status: str      # one of STATUSES
    stdout: str
    # the error in the harness's words, or a "[sandbox] ..." line saying why the call stopped
    stderr: str
    value: str       # repr of a trailing expression (printed last by the harness), else ""
    duration: float  # seconds the call ran (for overloaded: seconds it waited)


# ------------------------------------------------------------------------------------------------
# the pool: lives in the trainer; one thread per slot moves calls from a FIFO to its workers


class SandboxPool:
    """A pool of sandboxed Python workers. Use `with` or start()/close() (sync `map`, `submit`), or
    `async with` (`await run`)."""

    def __init__(self, workers=None, timeout=4.0, memory=256 << 20, output_cap=1 << 16,
                 queue_timeout=60.0, isolation="auto"):
        if workers is None:
            workers = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if not isinstance(workers, int) or not 1 <= workers <= UID_BLOCK:
            raise ValueError(f"SandboxPool: workers must be an int in [1, {UID_BLOCK}], got {workers!r}")
        for name, v, lo in (("timeout", timeout, 1e-3), ("queue_timeout", queue_timeout, 1e-3),
                            ("memory", memory, 16 << 20), ("output_cap", output_cap, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
                raise ValueError(f"SandboxPool: {name} must be a number >= {lo}, got {v!r}")
        if not timeout <= MAX_TIMEOUT:
            raise ValueError(f"SandboxPool: timeout must be <= {MAX_TIMEOUT:g} s, got {timeout!r}")
        if isolation not in ISOLATIONS:
            raise ValueError(f"SandboxPool: isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.workers, self.timeout, self.memory = workers, float(timeout), int(memory)
        self.output_cap, self.queue_timeout = int(output_cap), float(queue_timeout)
        self.mode = "none" if isolation == "none" else "bwrap"  # the isolation in use
        self.uids = [None] * workers  # each slot's uid (as root), claimed at start()
        self._cond = threading.Condition()
        # calls: (t_submit, request line, future, timeout, needs rich)
        self._queue = collections.deque()
        self._threads, self._ready, self._errors = [], [], {}
        self._running = self._closed = False
        self._view, self._uid_lock, self._cgroups = (), None, []
        self._seccomp = b""  # the syscall filter (BPF), built at start()

    # -- lifecycle

    def start(self):
        """Start the workers (blocks until all are warm). Raises if they cannot be isolated."""
        if self._running or self._closed:
            raise RuntimeError("SandboxPool.start: a pool can be started once")
        if self.mode == "bwrap":  # raises, naming what is missing, before anything starts
            self._view = sandbox_worker.view(sandbox_worker.RICH_DISTS)
            self._seccomp = _seccomp()
        if os.geteuid() == 0:
            self._uid_lock, first = _claim_uids(self.workers)
            self.uids = list(range(first, first + self.workers))
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True,
                                          name=f"sandbox-{i}") for i in range(self.workers)]
        self._ready = [threading.Event() for _ in range(self.workers)]
        for thread in self._threads:
            thread.start()
        for ready in self._ready:
            ready.wait()
        self._running = True
        if self._errors:
            self.close()
            raise RuntimeError(self._errors[min(self._errors)])
        if not self._cgroups:  # said once: what then holds is in the module docstring
            print(f"sandbox: no cgroup for the calls ({self._no_cgroup}): "
                  "their memory is capped per process only", file=sys.stderr)
        return self

    def close(self):
        """Stop the workers; calls still queued are answered `crash`. Leaves no processes or files."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        with self._cond:
            while self._queue:
                self._answer(self._queue.popleft(), "crash", "[sandbox] the pool shut down before this call ran")
        # empty once the last killed worker is gone (a moment after bwrap)
        for path in self._cgroups:
            for _ in range(200):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                    break
                time.sleep(0.01)
        if self._uid_lock:
            os.close(self._uid_lock)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        # start() returns the pool; warming takes seconds: keep the event loop free
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc):
        await asyncio.to_thread(self.close)

    # -- calls

    async def run(self, code, stdin="", timeout=None):
        """Run `code` with `stdin`; always returns a Result (never raises for bad code)."""
        # cancelling the await cancels the call: one still queued is skipped (a started one finishes)
        return await asyncio.wrap_future(self.submit(code, stdin, timeout))

    def map(self, items, timeout=None):
        """Synchronous helper: items are (code, stdin) pairs or code strings; results in order."""
        futures = [self.submit(*([it] if isinstance(it, str) else it), timeout=timeout) for it in items]
        return [future.result() for future in futures]

    def submit(self, code, stdin="", timeout=None):
        """Start a call without waiting: returns a concurrent.futures.Future of its Result (for callers
        with no event loop, like the rollout engine). Cancelling it skips the call if it has not started."""
        for name, value in (("code", code), ("stdin", stdin)):
            if not isinstance(value, str):
                raise TypeError(f"SandboxPool.run: {name} must be str, got {type(value).__name__}")
        timeout = self.timeout if timeout is None else float(timeout)
        if not 0 < timeout <= MAX_TIMEOUT:
            raise ValueError(f"SandboxPool.run: timeout {timeout!r} not in (0, {MAX_TIMEOUT:g}]")
        if not self._running or self._closed:
            raise RuntimeError("SandboxPool is not running: use it inside `with` / `async with`, or call start()")
        line = (json.dumps({"code": code, "stdin": stdin, "timeout": timeout}) + "\n").encode()
        call = (time.monotonic(), line, concurrent.futures.Future(), timeout, _needs_rich(code))
        with self._cond:
            self._queue.append(call)
            self._cond.notify()
        return call[2]

    def _answer(self, call, status, stderr):
        # answer a call no worker has taken (a no-op if it was cancelled)
        if call[2].set_running_or_notify_cancel():
            call[2].set_result(Result(status, "", stderr, "", time.monotonic() - call[0]))

    def _overloaded(self, call):
        self._answer(call, "overloaded", f"[sandbox] not started within queue_timeout={self.queue_timeout:g} s")

    def _take(self):
        """The next call to run, or None once the pool closes. A call that waited past queue_timeout is answered
        `overloaded` here, when it would have run."""
        with self._cond:
            while True:
                while self._queue and not self._closed:
                    call = self._queue.popleft()
                    if time.monotonic() - call[0] > self.queue_timeout:
                        self._overloaded(call)
                    elif call[2].set_running_or_notify_cancel():
                        return call
                if self._closed:
                    return None
                self._cond.wait()

    # -- one thread per slot (the thread also spawns its workers: bwrap --die-with-parent follows it)

    def _serve(self, slot):
        procs = {False: None, True: None}  # the slot's lean and rich worker
        while True:
            # start them, or replace one that died or was stopped (idle, or in the last call) before taking a call
            try:
                for rich, proc in procs.items():
                    if proc is None or proc.poll() is not None:
                        _stop(proc, kill=True)  # (a no-op on one stopped already)
                        procs[rich] = self._spawn(slot, rich)
            except Exception as e:
                # at start: the pool refuses to start, saying why
                if not self._ready[slot].is_set():
                    self._errors[slot] = e
                    break
                # could not restart: back off; queued calls go to other slots, or, when none can take them, are
                # answered `overloaded` once they have waited queue_timeout (no call waits forever)
                with self._cond:
                    while self._queue and time.monotonic() - self._queue[0][0] > self.queue_timeout:
                        self._overloaded(self._queue.popleft())
                    if self._cond.wait_for(lambda: self._closed, timeout=1.0):
                        break
                continue
            self._ready[slot].set()
            call = self._take()
            if call is None:
                break
            _, line, future, timeout, rich = call
            proc, start, result = procs[rich], time.monotonic(), None
            # the worker answers by then, or it counts as wedged
            deadline = start + timeout + GRACE
            # a broken pipe (it died) or a garbled reply
            with contextlib.suppress(OSError, ValueError, TypeError):
                write_all(proc.stdin.fileno(), line, deadline)
                reply = read_line(proc.stdout.fileno(), proc.buf, deadline)
                if reply is not None:
                    result = Result(**json.loads(reply))
            # died, or no answer in time: answer the call, stop the worker (replaced above)
            if result is None:
                _stop(proc, kill=True)
                result = Result("crash", "", "[sandbox] the worker died or stopped answering; it was replaced", "",
                                time.monotonic() - start)
            future.set_result(result)
        for proc in procs.values():
            _stop(proc, kill=False)
        self._ready[slot].set()

    def _spawn(self, slot, rich):
        wrapper = _wrapper(self.mode, self._view)
        if wrapper and not shutil.which(wrapper[0]):
            raise RuntimeError("sandbox: refusing to start: bubblewrap is missing (apt-get install -y bubblewrap; "
                               "run.sh installs it as root), or pass isolation='none' to run the tool's code on this "
                               "host without isolation (trusted code only)")
        cfg = {"uid": self.uids[slot], "rich": rich, "memory": self.memory, "output_cap": self.output_cap,
               "view": self._view, "mode": self.mode, "oom_event": os.eventfd(0, os.EFD_NONBLOCK)}
        # where the host lets us, each call of this worker runs in a cgroup of the worker's own (_new_cgroup), else
        # self._no_cgroup says why. The child joins it through the fds of its cgroup.procs files. On v1 the eventfd
        # tells the worker when the call hits the cap (v1's notification of memory.oom_control), and the worker then
        # ends the rest of the call; on v2 the kernel kills the whole call itself, and the worker reads memory.events'
        # count of kills
        try:
            with open("/proc/self/cgroup") as f:
                own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f)
            # named by this process's pid namespace and pid: a later pool of the namespace knows a dead one's
            pid_ns = os.stat("/proc/self/ns/pid").st_ino
            name = f"nano-rstar2-sandbox-{pid_ns}-{os.getpid()}-{id(self)}-{len(self._cgroups)}"
            cgroup = _new_cgroup("/sys/fs/cgroup", own, name, self.memory + CGROUP_SLACK, self._cgroups)
        except (OSError, KeyError) as e:
            # e.g. no v1 memory or pids hierarchy, or not writable here
            self._no_cgroup = f"{type(e).__name__}: {e}"
            cgroup = []
        cfg["cgroups"] = [os.open(f"{d}/cgroup.procs", os.O_WRONLY) for d in cgroup]
        fds = [cfg["oom_event"], *cfg["cgroups"]]
        if len(cgroup) == 1:  # v2
            fds.append(os.open(f"{cgroup[0]}/memory.events", os.O_RDONLY))
            cfg["memory_events"] = fds[-1]
        elif cgroup:
            with open(f"{cgroup[0]}/memory.oom_control") as oom:
                pathlib.Path(f"{cgroup[0]}/cgroup.event_control").write_text(f"{cfg['oom_event']} {oom.fileno()}")
        # the syscall filter (start() built it: a wrapper is bwrap's): bwrap reads it from a memfd and loads it for
        # the worker, and so for its calls
        if wrapper:
            fds.append(os.memfd_create("seccomp"))
            os.pwrite(fds[-1], self._seccomp, 0)  # (its offset stays at 0, where bwrap reads)
            wrapper[-1:] = ["--seccomp", str(fds[-1]), "--"]
        argv = wrapper + [sandbox_worker.python(), "-I", WORKER, json.dumps(cfg)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=WORKER_ENV, pass_fds=fds)
        for fd in fds:
            os.close(fd)
        proc.buf = bytearray()
        try:
            os.set_blocking(proc.stdin.fileno(), False)
            os.set_blocking(proc.stdout.fileno(), False)
            # {"ready": true}, or {"error": why}; {} when it said nothing in time
            hello = json.loads(read_line(proc.stdout.fileno(), proc.buf,
                                         time.monotonic() + START_TIMEOUT) or "{}")
        # it exited: its stderr says why (bwrap's own words, when bwrap refused)
        except BrokenPipeError:
            hello = {}
        except Exception:  # no half-started worker
            _stop(proc, kill=True)
            raise
        if hello.get("ready"):
            proc.stderr.close()  # the worker points its own stderr at /dev/null once ready
            return proc
        _stop(proc, kill=True)
        why = hello.get("error") or proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
        raise RuntimeError(f"sandbox: worker {slot} failed to start ({why.splitlines()[-1] if why else 'it exited'})")


def _new_cgroup(root, own, name, memory, made):
    """A new cgroup `name` below the pool's own for the calls of one worker (one at a time), capped at `memory`
    bytes (swap included, where swap is counted) and NPROC processes: its directories (v1: memory's, then pids';
    v2: one), each added to `made` once made. The worker is not in it: the kernel's kill at the cap finds only the
    call. `own` maps each hierarchy to the pool's group in it (/proc/self/cgroup: "memory" -> "/a" on cgroup v1, a
    hierarchy per controller; "" -> "/a" on v2, one for all), `root` is where they are mounted (/sys/fs/cgroup; a
    tmp dir in the tests' fake trees). Raises OSError or KeyError, naming what is missing or refused."""
    if "memory" in own:  # v1 (on a hybrid host v2 then has no memory controller)
        # (a "//" is as good as a "/")
        dirs = [f"{root}/{c}{own[c]}/{name}" for c in ("memory", "pids")]
        limits = {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory}
    else:  # v2, on `root` itself or, on a hybrid host, on its unified/
        unified = root if os.path.exists(f"{root}/cgroup.controllers") else f"{root}/unified"
        # (a process an earlier pool moved to its leaf, below: the leaf's parent is the group, not a leaf to nest in)
        parent = pathlib.Path(f"{unified}{own['']}".removesuffix("/nano-rstar2-pool"))
        offered = (parent / "cgroup.controllers").read_text().split()
        if {"memory", "pids"} - set(offered):
            raise OSError(f"cgroup v2: {parent} offers {offered}, not memory and pids")
        # v2's "no internal processes" rule: a group hands controllers to its children only while it holds no
        # process itself (the root aside), and the pool's process sits in its own group. Where enabling them is
        # refused (EBUSY), the group's processes (the pool's, and any of the trainer's beside it) move to a leaf of
        # their own, nano-rstar2-pool (a sibling of the workers' groups, left in place at close), and we try again
        try:
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            (parent / "nano-rstar2-pool").mkdir(exist_ok=True)
            for pid in (parent / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    (parent / "nano-rstar2-pool" / "cgroup.procs").write_text(pid)
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        dirs = [str(parent / name)]
        # the whole call is killed at its cap (v1 kills one process; the worker's eventfd then ends the rest)
        limits = {"memory.max": memory, "memory.swap.max": 0, "memory.oom.group": 1}
    for d in dirs:
        # the groups a pool of this pid namespace left when it was killed before its close(): its pid is gone
        for stale in pathlib.Path(d).parent.glob(name.rsplit("-", 3)[0] + "-*"):
            if not os.path.exists(f"/proc/{stale.name.rsplit('-', 3)[1]}"):
                with contextlib.suppress(OSError):  # (rmdir refuses a group that holds a process)
                    stale.rmdir()
        os.mkdir(d)
        made.append(d)
    pathlib.Path(f"{dirs[-1]}/pids.max").write_text(str(sandbox_worker.NPROC))
    for file, value in limits.items():
        # swap (v1's memsw: memory and swap together; v2's swap alone) only where the kernel counts it
        if "sw" not in file or os.path.exists(f"{dirs[0]}/{file}"):
            pathlib.Path(f"{dirs[0]}/{file}").write_text(str(value))
    return dirs


def _claim_uids(workers):
    """A block of UID_BLOCK uids for this pool's slots, no other pool on the node holds and no host account or
    process uses: (the fd of its lock, first uid). Each pool holds a lock (flock) on a file named after its block
    in /run while it lives: only root may make files there, so no other user can hold a block's name and stop a
    pool from starting (an abstract socket's name could be taken by anyone)."""
    # the host's accounts, then its processes' uids
    in_use = {account.pw_uid for account in pwd.getpwall()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:  # (OSError: it exited)
            in_use.update(int(u) for line in f if line.startswith("Uid:") for u in line.split()[1:])
    for block in range(1000):
        first = FIRST_UID + block * UID_BLOCK
        lock = os.open(f"/run/nano-rstar2-sandbox-uids-{first}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        with contextlib.suppress(OSError):  # (OSError: another pool holds it)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if in_use.isdisjoint(range(first, first + workers)):
                return lock, first
        os.close(lock)
    raise RuntimeError(f"sandbox: refusing to start: no free block of slot uids from {FIRST_UID}")


def _seccomp():
    """The syscall filter of the workers and their calls, compiled to BPF by libseccomp (bwrap loads it): DENIED,
    unshare and clone with CLONE_NEWUSER and clone3 fail; everything else is allowed. Its architecture is this machine's: a
    syscall made through another ABI (i386's int 0x80, x32's numbers) kills the process (the filter checks both)."""
    # pyseccomp: the ctypes twin of libseccomp's own Python bindings (the same API); RuntimeError: libseccomp.so.2
    # itself is missing
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as e:
        raise RuntimeError("sandbox: refusing to start: the syscall filter needs libseccomp and pyseccomp "
                           f"(apt-get install libseccomp2; pip install pyseccomp; run.sh does both): {e}") from None
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    rules.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in DENIED:
        rules.add_rule(eperm, name)
    # the flags are the first argument (clone's too, on x86_64 and aarch64)
    newuser = sandbox_worker.CLONE_NEWUSER
    for name in ("unshare", "clone"):
        rules.add_rule(eperm, name, seccomp.Arg(0, seccomp.MASKED_EQ, newuser, newuser))
    # clone3 passes its flags in memory, where a filter cannot look: ENOSYS makes glibc fall back to clone
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as bpf:
        rules.export_bpf(bpf)
        bpf.seek(0)
        return bpf.read()


def _needs_rich(code):
    """Code that imports anything outside the standard library (numpy, sympy, scipy, ...) runs in the
    rich worker, where numpy and sympy are warm; the rest forks from the lean one."""
    if "import" not in code:
        return False
    try:
        tree = ast.parse(code)
    # (a SyntaxError, a ValueError for a NUL, a RecursionError or MemoryError for code nested too deep for the
    # parser, e.g. a sum of 5,000 terms: never an exception of submit())
    except Exception:
        return False  # it fails at once either way
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n.split(".")[0] not in sys.stdlib_module_names for n in names):
            return True
    return "__import__" in code or "import_module" in code  # a computed name: assume the worst


def _wrapper(mode, view):
    """The command prefix that puts a worker in bubblewrap, seeing only `view` (see sandbox_worker.view) plus its
    own /proc and a read-only /tmp holding the empty directory each call mounts its tmpfs on."""
    if mode == "none":
        return []
    # as root, no user namespace (the worker needs real uids to drop the child to); as a normal user, a user
    # namespace, in which the worker may mount each call's tmpfs and make its namespaces
    root = os.geteuid() == 0
    ns = (["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
           "--unshare-cgroup-try"] if root else ["--unshare-all"])
    caps = ROOT_CAPS if root else ("CAP_SYS_ADMIN",)
    ns += ["--cap-drop", "ALL"] + [arg for cap in caps for arg in ("--cap-add", cap)]
    # directories on the way to each name: bwrap would copy their host modes (e.g. /root 700)
    names = [op[-1] for op in view if op[0] in ("bind", "dev")]
    parents = {str(d) for op in view for d in pathlib.PurePath(op[-1]).parents[:-1]}  # all but "/"
    dirs = {d for d in parents if not any(d.startswith(n + "/") for n in names)}
    args = [arg for d in sorted(dirs - set(names)) for arg in ("--dir", d)]
    # each op's bwrap option, then its paths (a mask: an empty tmpfs, made read-only below)
    mounts = {"bind": "--ro-bind", "dev": "--dev-bind", "symlink": "--symlink", "mask": "--tmpfs"}
    args += [arg for op in view for arg in (mounts[op[0]], *op[1:])]
    ro = [arg for op in view if op[0] == "mask" for arg in ("--remount-ro", op[1])]
    # /proc/keys and /proc/key-users covered: they list the keys of every user a reader's namespace maps (a normal
    # user's own, the trainer's); the syscall filter denies every keyring call
    return ["bwrap", *ns, "--new-session", "--die-with-parent", "--as-pid-1", "--proc", "/proc",
            "--dev-bind", "/dev/null", "/proc/keys", "--dev-bind", "/dev/null", "/proc/key-users",
            "--tmpfs", "/tmp", *args, "--dir", sandbox_worker.CALL_DIR, *ro, "--remount-ro", "/tmp",
            "--remount-ro", "/", "--chdir", "/", "--"]


# the workers' environment, fresh: nothing of the trainer's (tokens, keys, paths) reaches them
WORKER_ENV = {"PATH": os.path.dirname(sandbox_worker.python()) + ":/usr/local/bin:/usr/bin:/bin",
              "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp", "OPENBLAS_NUM_THREADS": "1",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}


def write_all(fd, data, deadline):
    """Write all of data to a non-blocking fd by `deadline` (time.monotonic()), else TimeoutError; never blocks
    past it. With read_line, the pipe talk of the pool's workers and of grading.py's math-verify helpers."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("worker did not read its request")
        with contextlib.suppress(BlockingIOError):
            view = view[os.write(fd, view):]


def read_line(fd, buf, deadline):
    """One line from an fd (without its "\\n"; `buf` keeps what came after it), or None if it did not come before
    `deadline`. Raises BrokenPipeError on EOF."""
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
    with contextlib.suppress(OSError):
        proc.stdin.close()  # a worker exits on EOF; as pid 1 its exit ends its whole namespace
    if not kill:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    if proc.poll() is None:  # (killed, or it did not exit in time)
        # bwrap passes the SIGKILL on to the worker (--die-with-parent); with "none" it is the worker
        proc.kill()
        proc.wait()
    proc.stdout.close()


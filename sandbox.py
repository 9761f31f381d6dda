"""
sandbox.py: an isolated, high-throughput pool that runs untrusted Python snippets (the agent's tool).

rStar2-Agent's code service answers up to 45K tool calls per RL step at ~0.3 s mean latency; its
released executor (code-judge) starts a fresh `python3` per call and isolates nothing by default.
Here a few warm worker interpreters fork a short-lived child per call, so imports are paid once per
worker instead of once per call, and every worker lives inside its own namespace sandbox. A fork
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

    trainer process                          bwrap: an empty root with only the view below (or unshare)
      run() / map() / submit() ─► FIFO       ┌────────────────────────────────────────────────────┐
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
    error       an exception reached the top level (stderr: the release harness's words) or a non-zero exit
    ok          anything else, including sys.exit(0) and os._exit(0)
Knobs (keyword arguments; the training configs set them):
    workers        slots, each running one call at a time in its lean or rich worker (default: the node's CPU
                   cores shared by the ranks on it, os.cpu_count() // LOCAL_WORLD_SIZE)
    local_rank     which rank of the node owns the pool (default: LOCAL_RANK): as root, each slot of each rank
                   of a node runs as its own uid, so RLIMIT_NPROC, which counts a uid host-wide, never lets one
                   rank's process-heavy call fail another rank's (65534 down to 65000: 535 slots per node)
    timeout        wall-clock seconds per call (default 4: rStar's README starts code-judge with
                   MAX_EXECUTION_TIME=4); run() can override it
    memory         bytes of address space a call process may add on top of the warm interpreter (~20 / ~175 MiB
                   lean / rich), also the largest file it may write and each worker's /tmp size. Default 256
                   MiB: code-judge's MAX_MEMORY default, which rStar does not override. Its limit is on a fresh
                   python3 (+128 MiB for the interpreter) and ours on top of a warm one, so allocations between
                   ~256 and ~350 MiB can differ; the test pins ones that fail and succeed in both
                   (tests/test_sandbox.py: list(range(10**7)) and [0] * 75_000_000 fail, 80 MB succeed)
    output_cap     bytes kept of stdout and of stderr each (default 64 KiB)
    queue_timeout  seconds a call may wait for a free worker before it is answered `overloaded` (default 60)
    isolation      "auto" (bwrap, else unshare, else refuse to start), "bwrap", "unshare", or "none" (opt-out)
run() may be awaited from any event loop in any thread; map() blocks; submit() returns a
concurrent.futures.Future at once (the pool waits for it on its own event-loop thread).

The code runs as the release's harness runs it and prints what it prints (sandbox_worker._run_as_release).
`value` is the repr of a trailing expression (not None; like IPython's Out[]), which the harness prints last.
`duration` is the seconds the call ran in its worker (for overloaded: the seconds it waited).
stdout and stderr are cut at `output_cap` bytes each; a line in stderr says how much was dropped.

What a call can see (sandbox_worker.view(); every path read-only but /tmp, under its host name):
  the interpreter (executable, standard library, pyvenv.cfg), the top-level directories of numpy,
  scipy, sympy, mpmath and what they require (numpy/, numpy.libs/, ...: not the rest of site-packages),
  each shared library these link (found with ldd), /etc/ld.so.cache, /etc/localtime, /dev/null, zero
  and urandom, sandbox_worker.py alone, the namespace's own /proc, and a private, size-capped /tmp.
What it cannot see: anything else of the host: home directories, the checkout, the run's data,
  checkpoints and outputs (wherever they are, the host's /tmp included), /srv, /opt, /mnt, other
  processes (other pid namespace), the trainer's environment (workers get a fresh minimal one).
What it protects against (each one is a test in tests/test_sandbox.py):
  - reading the host: the view above; the unshare fallback builds the same root and pivots into it;
  - hangs and busy loops (wall deadline kills the whole process group and namespace), fork bombs
    (RLIMIT_NPROC, counted per slot uid), memory blow-ups (RLIMIT_AS), huge files and outputs
    (RLIMIT_FSIZE, a sized /tmp, output caps), crashes and self-kills of the worker (it is replaced
    and the call answered `crash`), stray threads and processes after the code returns (killed),
    processes that ignore SIGTERM or leave the process group (SIGKILL to the whole pid namespace);
  - writes to the host (nothing of it is writable), network access (empty network namespace: no
    interfaces but loopback, which is not the host's), signals to or ptrace of the trainer;
  - privilege: as root, code runs as a non-root uid (65534 - slot index) with no capabilities and
    no_new_privs; as a normal user, with that user's uid in a user namespace.
What it does not protect against:
  - kernel exploits: there is no seccomp filter, so the whole syscall surface is reachable;
  - a strict memory cap per call: RLIMIT_AS is per process, so a call may use up to
    (processes allowed) x `memory`; a cgroup per slot would be the fix;
  - CPU fairness: a call can use its whole time budget on one core, and can starve other workers'
    calls on an oversubscribed machine;
  - with isolation="none" (the explicit opt-out): none of the namespace protections above apply (the
    call sees the whole host), and a process that leaves its process group (setsid) can outlive the call.
Needs Linux >= 5.3 (pidfd) and ldd; the unshare fallback needs Linux >= 5.12 (mount_setattr).
"""

import ast
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
import time

import sandbox_worker

STATUSES = ("ok", "error", "timeout", "memory", "crash", "overloaded")
ISOLATIONS = ("auto", "bwrap", "unshare", "none")
GRACE = 2.0        # seconds past a call's timeout before its worker counts as wedged and is replaced
START_TIMEOUT = 120.0  # seconds for a worker to import and warm numpy + sympy (slow on a busy box)
# worker capabilities when the pool runs as root: enough to drop to a uid, hand it a directory,
# kill its leftovers and remove what it wrote; the child itself keeps none of them
ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
WORKER = os.path.realpath(sandbox_worker.__file__)  # bound alone into the sandbox (the view lists it)


@dataclasses.dataclass
class Result:
    status: str      # one of STATUSES
    stdout: str
    stderr: str      # the error in the harness's words, or a "[sandbox] ..." line saying why the call stopped
    value: str       # repr of a trailing expression (printed last by the harness), else ""
    duration: float  # seconds the call ran (for overloaded: seconds it waited)


# ------------------------------------------------------------------------------------------------
# the pool: lives in the trainer; one thread per slot moves calls from a FIFO to its workers


class SandboxPool:
    """A pool of sandboxed Python workers. Use `with` or start()/close() (sync `map`, `submit`), or
    `async with` (`await run`)."""

    def __init__(self, workers=None, timeout=4.0, memory=256 << 20, output_cap=1 << 16,
                 queue_timeout=60.0, isolation="auto", local_rank=None):
        if workers is None:
            workers = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
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
        self._view, self._loop = (), None  # what calls see; an event loop that times out submit()'s calls

    # -- lifecycle

    def start(self):
        """Start the workers (blocks until all are warm). Raises if they cannot be isolated."""
        if self._running or self._closed:
            raise RuntimeError("SandboxPool.start: a pool can be started once")
        if self.isolation != "none":  # raises, naming what is missing, before anything starts
            self._view = sandbox_worker.view(sandbox_worker.RICH_DISTS)
        self._loop = asyncio.new_event_loop()
        self._threads = [threading.Thread(target=self._loop.run_forever, daemon=True, name="sandbox-timers")]
        self._threads[0].start()
        slots = [threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"sandbox-{i}")
                 for i in range(self.workers)]
        self._threads += slots
        self._ready = [threading.Event() for _ in range(self.workers)]
        # worker 0 settles the isolation mode (for "auto": bwrap, else unshare), the rest follow it
        slots[0].start()
        self._ready[0].wait()
        if not self._errors:
            for t in slots[1:]:
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
        for t in self._threads[1:]:
            if t.is_alive():
                t.join()
        with self._cond:
            while self._queue:
                self._answer(self._queue.popleft(), "crash", "[sandbox] the pool shut down before this call ran")
        if self._loop:  # every call is answered now: its timers can go
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._threads[0].join()
            self._loop.close()

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

    def submit(self, code, stdin="", timeout=None):
        """Start a call without waiting: returns a concurrent.futures.Future of its Result (for callers
        with no event loop, like the rollout engine). Cancelling it skips the call if it has not started."""
        call = self._submit(code, stdin, timeout)
        self._loop.call_soon_threadsafe(self._arm, call)
        return call[2]

    def _arm(self, call):  # on the timer loop: answer `overloaded` if no worker took it in time
        timer = self._loop.call_later(call[0] + self.queue_timeout - time.monotonic(), self._expire, call)
        call[2].add_done_callback(lambda _: self._loop.call_soon_threadsafe(timer.cancel))

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
        uid = 65534 - (self.local_rank * self.workers + slot) % 535 if root else None  # one per slot per node
        cfg = {"uid": uid, "rich": rich, "memory": self.memory,
               "output_cap": self.output_cap, "view": self._view}
        modes = [self.mode] if self.mode else ["bwrap", "unshare"] if self.isolation == "auto" else [self.isolation]
        failures = []
        for mode in modes:
            argv = _wrapper(mode, root, self.memory, self._view) + [
                sandbox_worker.python(), "-I", WORKER, json.dumps({**cfg, "mode": mode})]
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


def _wrapper(mode, root, memory, view):
    """The command prefix that puts a worker in its own namespaces, seeing only `view` (see
    sandbox_worker.view) plus its own /proc and a private /tmp."""
    if mode == "bwrap":
        # as root, no user namespace: the worker needs real uids to drop the child to
        ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL"] + [a for c in ROOT_CAPS for a in ("--cap-add", c)] if root else ["--unshare-all"]
        # directories on the way to each path: bwrap would copy their host modes (e.g. /root 700)
        binds = [op[1] for op in view if op[0] == "bind"]
        dirs = {d for op in view for d in _parents(op[-1]) if not any(d.startswith(b + "/") for b in binds)}
        mounts = {"bind": "--ro-bind", "dev": "--dev-bind", "mask": "--tmpfs"}
        args = [a for d in sorted(dirs - set(binds)) for a in ("--dir", d)]
        args += [a for op in view for a in (["--symlink", *op[1:]] if op[0] == "symlink" else
                                           [mounts[op[0]], op[1]] + [op[1]] * (op[0] != "mask"))]
        ro = [a for op in view if op[0] == "mask" for a in ("--remount-ro", op[1])]
        return ["bwrap", *ns, "--new-session", "--die-with-parent", "--as-pid-1", "--proc", "/proc",
                "--size", str(max(memory, 64 << 20)), "--tmpfs", "/tmp", *args, *ro, "--remount-ro", "/",
                "--chdir", "/", "--"]
    if mode == "unshare":  # the worker itself then mounts the view and pivots into it
        user = [] if root else ["--user", "--map-root-user"]
        return ["unshare", *user, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--"]
    return []


def _parents(path):
    out = []
    while (path := os.path.dirname(path)) != "/":
        out.append(path)
    return out


def _worker_env():
    # a fresh environment: nothing of the trainer's (tokens, keys, paths) reaches the workers
    return {"PATH": os.path.dirname(sandbox_worker.python()) + ":/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
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


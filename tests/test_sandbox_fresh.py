"""
Every call starts from nothing, and nothing a call does reaches its worker, the next call, another pool or the
pool's owner: the five failures a red-team pass found (issue 31), each a test, run as the test's own user (root
here) and as a normal user (a throwaway uid through setpriv, in a private mount namespace where the directory
that hides the interpreter from it, e.g. /root, is covered by a world-readable one holding only the interpreter;
the host is never changed).

    python tests/test_sandbox_fresh.py      # the calls of USER_CASES in one pool, their results as JSON
"""

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script, too
from sandbox import SandboxPool  # noqa: E402

ROOT = os.geteuid() == 0
THROWAWAY_UID = 12345
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
HONEST = ("print(6 * 7)", "ok", "42\n")
FORK_40 = ("import os, time\npids = []\nfor _ in range(40):\n    pid = os.fork()\n    if pid == 0:\n"
           "        time.sleep(1.5)\n        os._exit(0)\n    pids.append(pid)\n"
           "for p in pids:\n    os.waitpid(p, 0)\nprint(len(pids))")

# each case: the calls one pool runs in order, as (code, status, stdout); None: any status or stdout
USER_CASES = {
    # 1. the alarm handler of the call's own deadline, run in its worker, killed the pool's process group
    "alarm": [("import os, signal\ntry:\n    os.kill(1, signal.SIGALRM)\nexcept OSError:\n    pass\nprint('sent')",
               "ok", "sent\n"), HONEST, HONEST],
    # 2. a re-limited worker failed every later call, with empty stderr
    "prlimit_as": [("import resource\ntry:\n    resource.prlimit(1, resource.RLIMIT_AS, (1 << 20, 1 << 20))\n"
                    "except OSError:\n    pass\nprint('tried')", "ok", "tried\n"), HONEST, HONEST],
    "prlimit_cpu": [("import resource\ntry:\n    resource.prlimit(1, resource.RLIMIT_CPU, (1, 1))\n"
                     "except OSError:\n    pass\nprint('tried')", "ok", "tried\n"), HONEST,
                    ("import time\nt = time.process_time()\nwhile time.process_time() - t < 1.1: pass\nprint('spun')",
                     "ok", "spun\n"), HONEST],
    # 3. state that outlived its call: a key in the user and session keyrings, a POSIX queue, a file in /tmp
    "keyring": [(f"import ctypes\nlibc = ctypes.CDLL(None)\nfor ring in (-4, -3):  # @u, @s\n"
                 f"    print(libc.syscall({ADD_KEY}, b'user', b'nano-probe', b'secret', 6, ring) > 0)", "ok",
                 "True\nTrue\n"),
                (f"import ctypes\nlibc = ctypes.CDLL(None)\nfor ring in (-4, -3):  # KEYCTL_SEARCH\n"
                 f"    print(libc.syscall({KEYCTL}, 10, ring, b'user', b'nano-probe', 0))", "ok", "-1\n-1\n")],
    "posix_mq": [("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
                  "q = libc.mq_open(b'/nano-probe', os.O_CREAT | os.O_RDWR, 0o666, None)\nprint(q >= 0, libc.mq_send(q, b'secret', 6, 0) == 0)", "ok", "True True\n"),
                 ("import ctypes, os\nprint(ctypes.CDLL(None).mq_open(b'/nano-probe', os.O_RDONLY))", "ok", "-1\n")],
    "tmp_file": [("import os\nfor d in ('/tmp', os.path.dirname(os.getcwd()), os.getcwd()):\n    try:\n"
                  "        with open(os.path.join(d, 'nano-probe'), 'wb') as f:\n            for _ in range(200):\n"
                  "                f.write(b'x' * 1_000_000)\n"
                  "        print('wrote')\n        break\n    except OSError:\n        pass", "ok", "wrote\n"),
                 ("import os\nprint([d for d in ('/tmp', os.path.dirname(os.getcwd()), os.getcwd())\n"
                  "       if os.path.exists(os.path.join(d, 'nano-probe'))])", "ok", "[]\n")],
}


def run_cases(cases):
    """The cases one after the other in one pool of 1 slot: {name: [(status, stdout, stderr), ..., same workers]}."""
    out = {}
    with SandboxPool(workers=1, timeout=10.0) as pool:  # (a loaded box stretches the 1.1 s of CPU below)
        for name, calls in cases.items():
            workers = worker_pids()
            out[name] = [(r.status, r.stdout, r.stderr) for r in (pool.map([code])[0] for code, _, _ in calls)]
            out[name].append(worker_pids() == workers)  # the same workers: none was killed and replaced
    return out


def worker_pids():
    """Pids of the worker interpreters below this process (a call's init shares its worker's command line)."""
    from test_sandbox import worker_pids as below
    return below()


def check(results, cases):
    for name, calls in cases.items():
        *got, same_workers = results[name]
        assert [(s, o) for s, o, _ in got] == [(s, o) for _, s, o in calls], (name, got)
        assert same_workers, f"{name}: a worker was replaced"


# ------------------------------------------------------------------------------------------------
# as a normal user: the same calls, run by this file as a script under a throwaway uid


def as_throwaway_user(argv, timeout=300):
    """Run argv from the checkout as THROWAWAY_UID: pytest.skip (saying why) where that is impossible."""
    if not ROOT or not shutil.which("setpriv") or not shutil.which("unshare"):
        pytest.skip("running as a throwaway uid needs root, setpriv and unshare")
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the first directory on the way to the interpreter's base install that others may not enter (e.g. /root)
    base = os.path.realpath(sys.base_prefix)
    shut = next((d for d in [*reversed(_parents(base)), base] if not os.stat(d).st_mode & 0o001), None)
    for path in (checkout, os.path.realpath(sys.prefix)):
        if any(not os.stat(d).st_mode & 0o001 for d in _parents(path) + [path]):
            pytest.skip(f"{path} is not open to other users")
    cover = (f'mount -t tmpfs tmpfs /mnt && mkdir /mnt/py && mount --bind "{base}" /mnt/py && '
             f'mount -t tmpfs -o mode=755 tmpfs "{shut}" && mkdir -p "{base}" && mount --move /mnt/py "{base}" && '
             if shut else "")
    script = cover + f'exec setpriv --reuid {THROWAWAY_UID} --regid {THROWAWAY_UID} --clear-groups "$@"'
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "LC_ALL": "C.UTF-8"}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)


def _parents(path):
    out = []
    while (path := os.path.dirname(path)) != "/":
        out.append(path)
    return out


@pytest.fixture(scope="module")
def user_results():
    done = as_throwaway_user([sys.executable, os.path.abspath(__file__)])
    # the script is the pool's owner: had a call killed it, it would have died here without a word
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def owner_results():
    return run_cases(USER_CASES)


@pytest.mark.parametrize("case", list(USER_CASES))
def test_a_call_changes_nothing_for_the_next(case, owner_results):
    check(owner_results, {case: USER_CASES[case]})


@pytest.mark.parametrize("case", list(USER_CASES))
def test_a_call_changes_nothing_for_the_next_as_a_normal_user(case, user_results):
    check(user_results, {case: USER_CASES[case]})


# ------------------------------------------------------------------------------------------------
# as root: slot uids of the pool's own, and a cap on the whole call


@pytest.mark.skipif(not ROOT, reason="slot uids are the root case: a normal user's calls all run as that user")
def test_slot_uids_avoid_host_processes_and_other_pools():
    """60 host processes run as the uid a pool would take first (RLIMIT_NPROC, 64, counts a uid host-wide: with 65534
    they made honest calls fail), and two pools of one node (same local rank) each run a call holding 40 processes at
    the same moment: every call succeeds, and no two slots share a uid."""
    import sandbox
    squatted = getattr(sandbox, "FIRST_UID", 65534)
    squatters = [subprocess.Popen(["setpriv", f"--reuid={squatted}", f"--regid={squatted}", "--clear-groups",
                                   "sleep", "60"]) for _ in range(60)]
    try:
        time.sleep(0.2)  # let them take the uid
        with SandboxPool(workers=1) as a, SandboxPool(workers=1) as b:
            futures = [a.submit(FORK_40, timeout=10.0), b.submit(FORK_40, timeout=10.0)]
            results = [f.result() for f in futures]
            uids = [getattr(a, "uids", [65534])[0], getattr(b, "uids", [65534])[0]]
    finally:
        for proc in squatters:
            proc.kill()
            proc.wait()
    assert [(r.status, r.stdout) for r in results] == [("ok", "40\n")] * 2, results
    assert squatted not in uids and uids[0] != uids[1], uids


@pytest.mark.skipif(not ROOT, reason="a host process as the slot's uid needs root")
def test_a_calls_key_reaches_no_host_process_and_no_new_pool():
    """As root a key a call added to its user keyring was read by a host process running as the slot's uid and
    by the next pool's calls: now the key lives in the call's own user namespace."""
    add, find = USER_CASES["keyring"][0][0], USER_CASES["keyring"][1][0]
    with SandboxPool(workers=1) as pool:
        added = pool.map([add])[0]
        uid = getattr(pool, "uids", [65534])[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a host process as the slot's uid looks in its own user keyring
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        found = ctypes.CDLL(None).syscall(KEYCTL, 10, -4, b"user", b"nano-probe", 0)
        os.write(write, str(found).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    host = os.read(read, 100).decode()
    with SandboxPool(workers=1) as pool:
        later = pool.map([find])[0]
    assert (added.status, added.stdout, host, later.stdout) == ("ok", "True\nTrue\n", "-1", "-1\n-1\n"), \
        (added, host, later)


def cgroups_writable():
    try:
        with open("/proc/self/cgroup") as f:
            own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f)
        return ROOT and all(os.access(f"/sys/fs/cgroup/{c}{own[c]}", os.W_OK) for c in ("memory", "pids"))
    except (OSError, KeyError):
        return False


@pytest.mark.skipif(not cgroups_writable(), reason="a cap per call needs writable cgroup v1 memory and pids")
def test_memory_is_capped_per_call():
    """Under the 256 MiB default, one call held ~600 MB with 4 forked processes of 150 MB (each under its own
    address-space limit), ~600 MB in memfds and ~600 MB in SysV segments (which count against no rlimit): now the
    call is killed past its cgroup's cap and answered `memory`, and the next call is honest."""
    forked = ("import os\nfor _ in range(4):\n    if os.fork() == 0:\n        x = b'x' * 150_000_000\n"
              "        import time\n        time.sleep(2)\n        os._exit(0)\nfor _ in range(4):\n    os.wait()\n"
              "print('held')")
    memfds = ("import os\nfds = [os.memfd_create('m') for _ in range(3)]\nfor fd in fds:\n"
              "    for _ in range(200):\n        os.write(fd, b'x' * 1_000_000)\nprint('held')")
    sysv = ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\nfor key in range(3):\n"
            "    addr = libc.shmat(libc.shmget(0x5EED0 + key, 200_000_000, 0o1600), None, 0)\n"
            "    ctypes.memset(addr, 1, 200_000_000)\n    libc.shmdt(ctypes.c_void_p(addr))\nprint('held')")
    with SandboxPool(workers=1, timeout=3.0) as pool:
        results = pool.map([forked, HONEST[0], memfds, HONEST[0], sysv, HONEST[0]])
    assert [r.status for r in results] == ["memory", "ok"] * 3, results
    assert "cgroup" in results[0].stderr and results[1].stdout == "42\n", results


if __name__ == "__main__":
    print(json.dumps(run_cases(USER_CASES)))

"""
How the pool caps a whole call (issue 43, item 4): the cgroup it makes for each worker's calls
(sandbox._new_cgroup) on cgroup v1 (a hierarchy per controller) or v2 (one hierarchy, with its "no internal
processes" rule), or none, saying why; and how a worker reads v2's out-of-memory kills (sandbox_worker._went_past_cap).
Three kinds of test, each named for what it runs against:
  - fake: a FAKE cgroup tree, a tmp dir holding the files a kernel would show, and FakeKernel, the few rules of the
    kernel's that the code meets (mkdir makes a group's files; a group offers what its parent enables; enabling a
    controller in a non-root group that holds processes is refused, EBUSY; writing a pid to cgroup.procs moves it;
    a file the kernel does not show cannot be written). They check which files are written with what, and when.
  - real_mount: a REAL cgroup2 mount (as root, in a private mount namespace, so the host's mounts stay as they
    are; the group it makes is removed). The controllers this host hands to v2 decide which path is real: on this
    project's CI machine, a cgroup v1 host, memory and pids are v1's, so it is the refusal that names them; on a v2
    host, the whole group with its files. (Enabling a controller in a group that holds processes would need the
    host's own root group changed: only the fake covers the move into a leaf.)
  - real_v2_pool: a pool on a real v2 memory controller, skipped where there is none.
The real v1 path is tests/test_sandbox_fresh.py's memory tests (and, with a real v2 group the pool may write, the
same tests run on v2).
"""

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

import sandbox
import sandbox_worker
from sandbox import SandboxPool

ROOT = os.geteuid() == 0
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC = str(sandbox_worker.NPROC)
FILES = {  # what a group shows for each controller (v1: in that controller's hierarchy)
    1: {"memory": ["memory.limit_in_bytes", "memory.oom_control"], "pids": ["pids.max"]},
    2: {"memory": ["memory.max", "memory.oom.group", "memory.events"], "pids": ["pids.max"]},
}
SWAP = {1: "memory.memsw.limit_in_bytes", 2: "memory.swap.max"}  # shown only where the kernel counts swap


class FakeKernel:
    """A FAKE cgroup tree under `root` (v1: root/memory/..., root/pids/...; v2: root/unified/..., a hybrid host's
    layout, or root itself): the rules of the kernel's the code meets, through os.mkdir, Path.mkdir and
    Path.write_text (patched while a test runs; the tree is made with the real ones first)."""

    def __init__(self, root, version, swap, monkeypatch):
        self.root = pathlib.Path(root)
        self.version = version
        self.swap = swap
        self.mkdir = os.mkdir
        self.write = pathlib.Path.write_text
        monkeypatch.setattr(os, "mkdir", lambda path, mode=0o777: self.make(pathlib.Path(path)))
        monkeypatch.setattr(pathlib.Path, "mkdir", lambda path, exist_ok=False: exist_ok and path.exists()
                            or self.make(path))
        monkeypatch.setattr(pathlib.Path, "write_text", lambda path, text: self.write_file(path, text))

    def make(self, group):
        """mkdir: a new group and the files it shows (v1: of its hierarchy's controller; v2: of what its
        parent enables)."""
        self.mkdir(group)
        if self.version == 1:
            offered = [group.relative_to(self.root).parts[0]]
        else:
            offered = (group.parent / "cgroup.subtree_control").read_text().split()
            self.write(group / "cgroup.controllers", " ".join(offered))
            self.write(group / "cgroup.subtree_control", "")
        names = ["cgroup.procs"] + [name for c in offered for name in FILES[self.version].get(c, [])]
        names += [SWAP[self.version]] if self.swap and "memory" in offered else []
        for name in names:
            self.write(group / name, "oom_kill 0\n" if name == "memory.events" else "")

    def write_file(self, path, text):
        if not path.exists():
            raise PermissionError(errno.EACCES, "Permission denied (no such interface file)", str(path))
        group = path.parent
        if path.name == "cgroup.subtree_control":
            wanted = [word.lstrip("+") for word in text.split()]
            if set(wanted) - set((group / "cgroup.controllers").read_text().split()):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
            if (group / "cgroup.procs").read_text().split() and group != self.tree():
                raise OSError(errno.EBUSY, "Device or resource busy", str(path))
            text = " ".join(sorted(set(path.read_text().split()) | set(wanted)))
        if path.name == "cgroup.procs":  # a move: out of every other group
            for procs in self.root.rglob("cgroup.procs"):
                self.write(procs, "".join(f"{pid}\n" for pid in procs.read_text().split() if pid != text))
            text = path.read_text() + f"{text}\n"
        self.write(path, text)

    def tree(self):
        return self.root / "unified" if self.version == 2 else self.root


def fake_v2_tree(tmp_path, monkeypatch, swap, offered="cpu memory pids", procs=()):
    """A hybrid host's v2 tree with the pool's group /job.slice/job (holding `procs`), as FakeKernel shows it."""
    unified = tmp_path / "unified"
    job = unified / "job.slice" / "job"
    job.parent.mkdir(parents=True)
    for group, controllers, enabled in ((unified, offered, offered), (job.parent, offered, offered)):
        (group / "cgroup.controllers").write_text(controllers)
        (group / "cgroup.subtree_control").write_text(enabled)
        (group / "cgroup.procs").write_text("")
    kernel = FakeKernel(tmp_path, 2, swap, monkeypatch)
    os.mkdir(job)
    for pid in procs:
        (job / "cgroup.procs").write_text(str(pid))
    return kernel, job


def test_the_groups_a_killed_pool_left_are_removed_by_the_next(tmp_path, monkeypatch):
    # a pool killed before its close() leaves its groups behind; the next pool of the same pid namespace removes
    # those whose pid is gone, and leaves a live pool's, another namespace's and any other group alone
    ns = os.stat("/proc/self/ns/pid").st_ino
    dead = 2 ** 22 + 1  # above the largest pid_max: no process has it
    kept = {f"nano-rstar2-sandbox-{ns}-{dead}-7-0": False, f"nano-rstar2-sandbox-{ns}-{os.getpid()}-7-0": True,
            f"nano-rstar2-sandbox-{ns + 1}-{dead}-7-0": True, "other": True}
    for controller in ("memory", "pids"):
        for name in kept:
            (tmp_path / controller / "job" / name).mkdir(parents=True)
    FakeKernel(tmp_path, 1, False, monkeypatch)
    own = {"memory": "/job", "pids": "/job"}
    new = f"nano-rstar2-sandbox-{ns}-{os.getpid()}-8-0"
    sandbox._new_cgroup(str(tmp_path), own, new, 300 << 20, [])
    for controller in ("memory", "pids"):
        left = {path.name for path in (tmp_path / controller / "job").iterdir() if path.is_dir()}
        assert left == {name for name, keep in kept.items() if keep} | {new}


@pytest.mark.parametrize("swap", [True, False])
def test_fake_v1_tree_gets_memory_and_pids_groups(tmp_path, monkeypatch, swap):
    for controller in ("memory", "pids"):
        (tmp_path / controller / "job").mkdir(parents=True)
    FakeKernel(tmp_path, 1, swap, monkeypatch)
    own = {"memory": "/job", "pids": "/job", "cpu": "/", "": "/"}
    made = []
    dirs = sandbox._new_cgroup(str(tmp_path), own, "g", 300 << 20, made)
    assert dirs == made == [f"{tmp_path}/memory/job/g", f"{tmp_path}/pids/job/g"]
    memory, pids = map(pathlib.Path, dirs)
    assert (memory / "memory.limit_in_bytes").read_text() == str(300 << 20)
    assert (memory / "memory.memsw.limit_in_bytes").exists() == swap
    if swap:
        assert (memory / "memory.memsw.limit_in_bytes").read_text() == str(300 << 20)
    assert (pids / "pids.max").read_text() == NPROC


@pytest.mark.parametrize("swap", [True, False])
def test_fake_v2_tree_moves_the_pools_group_into_a_leaf(tmp_path, monkeypatch, swap):
    """The pool's group holds its process (and another of the trainer's): enabling memory and pids there is
    refused (EBUSY) until both move to the leaf nano-rstar2-pool; then each worker's group is their sibling."""
    _, job = fake_v2_tree(tmp_path, monkeypatch, swap, procs=(101, 202))
    made = []
    dirs = sandbox._new_cgroup(str(tmp_path), {"": "/job.slice/job"}, "g", 300 << 20, made)
    assert dirs == made == [str(job / "g")]
    assert (job / "cgroup.procs").read_text() == ""
    assert (job / "nano-rstar2-pool" / "cgroup.procs").read_text().split() == ["101", "202"]
    assert (job / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]
    group = job / "g"
    assert (group / "memory.max").read_text() == str(300 << 20)
    assert (group / "memory.oom.group").read_text() == "1"
    assert (group / "pids.max").read_text() == NPROC
    assert (group / "memory.swap.max").exists() == swap
    if swap:
        assert (group / "memory.swap.max").read_text() == "0"
    # the next worker's group: the controllers are on already, nothing moves
    assert sandbox._new_cgroup(str(tmp_path), {"": "/job.slice/job"}, "g2", 300 << 20, made) == [str(job / "g2")]
    assert made == [str(job / "g"), str(job / "g2")]
    # a later pool of a process now in the leaf: its group is the leaf's parent still (v2 in a VM: each pool of
    # pytest's process nested a leaf in the last, 21 deep, until one offered nothing)
    own = {"": "/job.slice/job/nano-rstar2-pool"}
    assert sandbox._new_cgroup(str(tmp_path), own, "g3", 300 << 20, made) == [str(job / "g3")]
    assert not (job / "nano-rstar2-pool" / "nano-rstar2-pool").exists()


def test_fake_v2_root_group_keeps_its_processes(tmp_path, monkeypatch):
    """The root group is exempt from the rule: its processes stay where they are (no leaf)."""
    kernel, _ = fake_v2_tree(tmp_path, monkeypatch, swap=True)
    unified = kernel.tree()
    (unified / "cgroup.procs").write_text("7")
    dirs = sandbox._new_cgroup(str(tmp_path), {"": "/"}, "g", 300 << 20, [])
    assert dirs == [str(unified / "g")]
    assert not (unified / "nano-rstar2-pool").exists()
    assert (unified / "cgroup.procs").read_text().split() == ["7"]


def test_fake_v2_tree_without_memory_says_why(tmp_path, monkeypatch):
    """A v2 group that offers no memory controller: no group, and the error names what it offers."""
    _, job = fake_v2_tree(tmp_path, monkeypatch, swap=True, offered="cpu pids")
    made = []
    with pytest.raises(OSError, match=r"offers \['cpu', 'pids'\], not memory and pids"):
        sandbox._new_cgroup(str(tmp_path), {"": "/job.slice/job"}, "g", 300 << 20, made)
    assert made == [] and not (job / "g").exists()


def test_worker_reads_v2_oom_kills_and_v1_events(tmp_path):
    """v2: memory.events' oom_kill count (here a regular file in its format) grew since last asked; v1: the eventfd
    was signalled (reading resets it)."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 4\noom 0\noom_kill 0\noom_group_kill 0\n")
    cfg = {"memory_events": os.open(events, os.O_RDONLY), "oom_event": os.eventfd(0, os.EFD_NONBLOCK)}
    seen = [sandbox_worker._went_past_cap(cfg)]
    events.write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 3\noom_group_kill 1\n")
    seen += [sandbox_worker._went_past_cap(cfg), sandbox_worker._went_past_cap(cfg)]
    assert seen == [False, True, False]
    del cfg["memory_events"]
    os.eventfd_write(cfg["oom_event"], 1)
    assert [sandbox_worker._went_past_cap(cfg), sandbox_worker._went_past_cap(cfg)] == [True, False]


REAL_MOUNT = """
import json, os, subprocess, sys, tempfile
sys.path.insert(0, CHECKOUT)
import sandbox
mount = tempfile.mkdtemp()
subprocess.run(["mount", "-t", "cgroup2", "none", mount], check=True)
job = f"/nano-rstar2-test-{os.getpid()}"
os.mkdir(mount + job)
made = []
try:
    offered = open(f"{mount}{job}/cgroup.controllers").read().split()
    try:
        dirs = sandbox._new_cgroup(mount, {"": job}, "g", 64 << 20, made)
        files = {name: open(f"{dirs[0]}/{name}").read().strip() for name in ("memory.max", "memory.oom.group",
                                                                             "pids.max")}
        print(json.dumps([offered, len(dirs), files]))
    except OSError as e:
        print(json.dumps([offered, made, str(e)]))
finally:
    for path in [*reversed(made), mount + job]:  # children first (a group with a child is busy)
        os.rmdir(path)
"""


@pytest.mark.skipif(not ROOT or not shutil.which("unshare") or "cgroup2" not in open("/proc/filesystems").read(),
                    reason="mounting cgroup2 in a private mount namespace needs root, unshare and cgroup2")
def test_real_mount_cgroup2_group_or_the_refusal_that_names_why():
    """On a real cgroup2 mount, a group of the test's own below its root (the pool's group there): where v2 offers
    memory and pids, the worker's group is made with its files; where it does not (a v1 host: they are v1's), the
    refusal names what v2 offers, and nothing is made."""
    script = REAL_MOUNT.replace("CHECKOUT", repr(CHECKOUT))
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    offered, made, outcome = json.loads(done.stdout)
    if {"memory", "pids"} <= set(offered):
        assert (made, outcome) == (1, {"memory.max": str(64 << 20), "memory.oom.group": "1", "pids.max": NPROC})
    else:
        assert made == [] and outcome.endswith(f"offers {offered}, not memory and pids"), outcome


def v2_pool_group():
    """The v2 group a pool here would use (its own), where it may enable memory and pids; else None."""
    try:
        with open("/proc/self/cgroup") as f:
            own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f)
        unified = "/sys/fs/cgroup" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "/sys/fs/cgroup/unified"
        group = pathlib.Path(unified + own[""])
        offered = set((group / "cgroup.controllers").read_text().split())
        usable = "memory" not in own and {"memory", "pids"} <= offered
        return group if usable and os.access(group / "cgroup.subtree_control", os.W_OK) else None
    except (OSError, KeyError):
        return None


@pytest.mark.skipif(v2_pool_group() is None, reason="needs cgroup v2 with memory and pids controllers the pool may "
                    "enable in its own group (root, or a systemd scope with Delegate=yes); this host's memory is v1's"
                    " or not writable")
def test_real_v2_pool_kills_a_call_whole_at_its_cap():
    """On a real v2 memory controller: each worker's group has memory.max and memory.oom.group, a call of 4
    processes past the cap is killed whole at once (status memory, counted in memory.events), the next is honest."""
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        x = b'x' * 150_000_000\n"
            "        time.sleep(20)\n        os._exit(0)\ntime.sleep(8)\nprint('main done')")
    with SandboxPool(workers=1, timeout=10.0) as pool:
        groups = [pathlib.Path(d) for d in pool._cgroups]
        limits = [((g / "memory.max").read_text().strip(), (g / "memory.oom.group").read_text().strip())
                  for g in groups]
        results = pool.map([code, "print(6 * 7)"])
        kills = sum(int((g / "memory.events").read_text().split("oom_kill ")[1].split()[0]) for g in groups)
    assert limits == [(str(pool.memory + sandbox.CGROUP_SLACK), "1")] * 2, limits
    assert [(r.status, r.stdout) for r in results] == [("memory", ""), ("ok", "42\n")], results
    assert results[0].duration < 4.0 and kills >= 1, (results, kills)

"""train_rl.py --resume=true: it resumes only what is there, and a run it refuses leaves its run directory as it
was. Every check that can refuse a run (the checkpoint to resume, the data, the sandbox, the engine's settings)
comes before metrics.jsonl is trimmed or a rollout dump deleted (issues #43 and #46)."""
import fcntl
import gzip
import os

import pytest

import data
import zygote
from sandbox import SandboxPool


def train_rl(d, run_dir, *extra, env=None):
    """train_rl.py on the tiny config, sized down: 2 prompts × 4 samples of 32 tokens a step, from the untrained
    base model (the run directory is what these tests look at, not what the model learns)."""
    args = ["train_rl.py", "configs/tiny_rl.py", f"--model_path={d}/base", f"--data_path={d}/data/train.jsonl",
            f"--run_dir={run_dir}", "--prompts_per_step=2", "--samples_per_prompt=4", "--keep_per_prompt=2",
            "--max_response_tokens=32", "--tool_workers=1", "--save_every=2", "--dump_every=1", *extra]
    return zygote.run(args, env=env)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny base model and its data, and a run of 2 steps (its checkpoint at step 2, a dump per step)."""
    d = tmp_path_factory.mktemp("resume")
    with SandboxPool(workers=1) as pool:
        data.prepare(str(d / "base"), 0, pool.map, data_dir=str(d / "data"), n_train=8, n_heldout=2, n_sft=4,
                     hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    out = train_rl(d, d / "run", "--steps=2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return d


def state(run_dir):
    """What a refused run must leave as it was: metrics.jsonl's bytes and the rollout dumps' names."""
    with open(run_dir / "metrics.jsonl", "rb") as f:
        metrics = f.read()
    return metrics, sorted(os.listdir(run_dir / "rollouts"))


def test_resume_with_no_checkpoint_says_so_and_stops(made, tmp_path):
    # a run killed before its first checkpoint: one metrics row, one dump, no step_*/
    run_dir = tmp_path / "killed"
    (run_dir / "rollouts").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 0.0}\n')
    with gzip.open(run_dir / "rollouts" / "step_000001.jsonl.gz", "wt") as f:
        f.write("{}\n")
    (run_dir / "step_000002.tmp").mkdir()  # a save that never completed is no checkpoint
    before = state(run_dir)
    out = train_rl(made, run_dir, "--steps=2", "--resume=true")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{run_dir} holds no complete checkpoint" in out.stderr and "drop --resume" in out.stderr, out.stderr
    assert state(run_dir) == before
    assert not os.path.exists(run_dir / "step_000002")


def test_a_refused_resume_leaves_the_run_directory_as_it_was(made, tmp_path):
    # the 2-step run, plus what a run killed in step 3 leaves: its metrics row and its dump, both about to be
    # made again by a resume from step 2
    run_dir = made / "run"
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "time": 0.0}\n')
    with gzip.open(run_dir / "rollouts" / "step_000003.jsonl.gz", "wt") as f:
        f.write("{}\n")
    before = state(run_dir)
    assert before[1] == ["step_000001.jsonl.gz", "step_000002.jsonl.gz", "step_000003.jsonl.gz"]
    bin_without_bwrap = tmp_path / "bin"
    bin_without_bwrap.mkdir()
    refusals = {
        # the sandbox cannot start (no bubblewrap on PATH): refused with its reason, before the model loads
        "sandbox": ([], {"PATH": str(bin_without_bwrap)}, "sandbox error: "),
        # the data file is not there
        "data": ([f"--data_path={tmp_path}/missing.jsonl"], None, "data error: "),
        # a setting the engine refuses, checked after the checkpoint has loaded
        "engine": (["--kv_reserve=2.0"], None, "config error: reserve (train_rl's kv_reserve)"),
        # another seed: the cursor would count prompts in another order, some of this epoch's
        # trained twice
        "seed": (["--seed=1"], None, "(data_path, prompts that fit, seed) = "),
    }
    for name, (extra, env, says) in refusals.items():
        out = train_rl(made, run_dir, "--steps=4", "--resume=true", *extra, env=env)
        assert state(run_dir) == before, name
        assert out.returncode != 0 and says in out.stderr, (name, out.stdout[-1000:], out.stderr[-2000:])
        assert "Traceback" not in out.stderr, (name, out.stderr[-2000:])
    # the same resume that may run: the rows and dumps after step 2 go, those up to it stay. It
    # reads its checkpoint alone: model_path, where the run started (an earlier stage's
    # checkpoint), may be gone
    out = train_rl(made, run_dir, "--steps=2", "--resume=true", f"--model_path={made}/deleted")
    assert out.returncode == 0 and f"resumed from {run_dir}/step_000002 at step 2" in out.stdout, out.stderr[-2000:]
    metrics, dumps = state(run_dir)
    assert [line.split(b",")[0] for line in metrics.splitlines()] == [b'{"step": 1', b'{"step": 2']
    assert dumps == ["step_000001.jsonl.gz", "step_000002.jsonl.gz"]


def test_a_new_run_in_the_directory_of_an_earlier_one_is_refused(made):
    # without --resume, into a run directory that holds checkpoints: it emptied metrics.jsonl, its rotation
    # deleted its own checkpoints before the earlier run's, and a later --resume took the earlier run's newest
    run_dir = made / "run"
    before = state(run_dir), sorted(path for path in os.listdir(run_dir) if path.startswith("step_"))
    out = train_rl(made, run_dir, "--steps=1", "--keep_checkpoints=1")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{run_dir} holds the checkpoints of an earlier run" in out.stderr, out.stderr[-2000:]
    assert "--resume=true continues it" in out.stderr
    assert (state(run_dir), sorted(path for path in os.listdir(run_dir) if path.startswith("step_"))) == before


def test_a_second_run_in_a_run_directory_in_use_is_refused(made, tmp_path):
    # a run in progress holds run_dir/lock (this test stands in for it): two runs started at once wrote one
    # metrics.jsonl, rows 1, 3, 2, 4, 3, 4, both ending "successfully", their checkpoints overwriting each other
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    with open(run_dir / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = train_rl(made, run_dir, "--steps=1")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"another run is using {run_dir}" in out.stderr, out.stderr[-2000:]
    assert os.listdir(run_dir) == ["lock"]
    # refused before anything loads: a model_path that does not exist is not even looked at (the
    # lock was taken after the model, the sandbox and the engine: minutes of loading at 14B)
    with open(run_dir / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = train_rl(made, run_dir, "--steps=1", f"--model_path={tmp_path}/missing")
    assert f"another run is using {run_dir}" in out.stderr, out.stderr[-2000:]
    # a model_path that is a run directory: refused, naming it (it was a transformers traceback)
    out = train_rl(made, run_dir, "--steps=1", f"--model_path={made}/run")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"model_path='{made}/run' holds no model" in out.stderr, out.stderr[-2000:]
    # the run's own lock goes with it: the next run there starts
    out = train_rl(made, run_dir, "--steps=1")
    assert out.returncode == 0, out.stderr[-2000:]

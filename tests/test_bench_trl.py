"""bench.py trl's pieces that need no trl: the message where trl is missing, train_rl's settings
as the benchmark reads them, their mapping onto TRL's GRPOConfig, and the single-turn task's
reward."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import grading  # noqa: E402


def test_without_trl_it_says_so_and_exits_0(capsys, tmp_path):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    assert bench.trl_bench(missing, 1, 1, 32, "out/tiny-sft", "out/data/train.jsonl") == 0
    out = capsys.readouterr().out
    assert "(trl) skipped: trl is not installed" in out and missing in out
    assert "does not exist" in bench.trl_missing(missing)


def test_a_python_without_trl_is_named():
    if importlib.util.find_spec("trl") is not None:
        pytest.skip("this python has trl")
    assert "cannot import trl" in bench.trl_missing(sys.executable)


def test_train_rl_config_reads_defaults_then_files_then_overrides(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = bench.train_rl_config(["configs/tiny_rl.py", "--roc=false", "--max_turns=1"])
    assert cfg["lr"] == 2e-4  # the config file's
    assert cfg["eps_high"] == 0.28  # train_rl.py's default
    assert cfg["tool_memory"] == 256 << 20  # a constant expression
    assert cfg["roc"] is False and cfg["max_turns"] == 1  # the overrides


def test_trl_config_mirrors_ours_and_names_what_it_cannot(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = bench.train_rl_config(["configs/tiny_rl.py", "--roc=false"])
    kwargs, unequal = bench.trl_config(cfg, 16)
    assert unequal == []
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == 64
    assert kwargs["num_generations"] == 8 and kwargs["max_completion_length"] == 192
    assert (kwargs["beta"], kwargs["epsilon"], kwargs["epsilon_high"]) == (0.0, 0.2, 0.28)
    assert kwargs["gradient_checkpointing"] is False and kwargs["bf16"] is False
    assert kwargs["max_tool_calling_iterations"] == cfg["max_turns"] - 1
    roc, _ = bench.trl_config(dict(cfg, roc=True), 32)  # TRL trains all 2G
    assert roc["num_generations"] == 16 and roc["gradient_accumulation_steps"] == 4
    _, unequal = bench.trl_config(dict(cfg, kl_coef=0.05), 16)
    assert unequal == ["kl_coef = 0.05 (TRL runs 0.0)"]
    with pytest.raises(ValueError, match="must divide the step's 64 samples"):
        bench.trl_config(cfg, 48)


def test_the_copy_task_rewards_the_share_copied(tmp_path, monkeypatch):
    path = tmp_path / "copy_task.py"
    path.write_text(bench.TRL_TASK)
    monkeypatch.chdir(ROOT)
    task = grading.load_task(str(path))
    row = {"question": "What is 716 - 997 - 885?", "answer": "-1166"}
    assert task.grade(row, None, ['{"code": "print(716 - 997 - 885)"}'], None, None) == (1.0, True)
    # a miscopy earns the longest run of the expression it holds ("716 - 997 - 8": 13 of 15 characters)
    assert task.grade(row, None, ['{"code": "print(716 - 997 - 85)"}'], None, None) == (13 / 15, False)
    assert task.grade(row, None, ["<answer>\\boxed{42}</answer>"], None, None) == (0.0, False)
    # the prompt is math_no_tool's: no tool offered
    assert task.prompt(row) == grading.load_task("tasks/math_no_tool.py").prompt(row)
    assert task.TOOLS == {}


def test_ours_clock_wraps_what_train_rl_calls():
    # OURS_CLOCK marks the CPU clock where train_rl.py makes its Logger (right before the step
    # loop), logs a step and joins a rollout dump: those names must still be there, and called by
    # train_rl
    import common
    import scheduler
    with open(os.path.join(ROOT, "train_rl.py")) as f:
        source = f.read()
    assert "logger = Logger(" in source and "logger.log(step, metrics)" in source
    assert "join_parts(path, world)" in source
    assert callable(common.Logger.log) and callable(scheduler.join_parts)
    compile(bench.OURS_CLOCK, "OURS_CLOCK", "exec")

"""bench.py gpu's RL section (5) judged from train_rl.py's metrics, without running it: a GPU run whose
steps never updated the weights (every group's rewards equal) fails and says why; its --cpu dry run does not
judge (a toy step may keep nothing). The whole dry run is in tests/test_train.py."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402


def metrics(kept):
    return {"rollout/reward": 0.5 if kept else 0.0, "roc/kept": kept, "loss/grad_norm": 1.0 if kept else None,
            "tool/calls": 1.0, "rollout/response_len": 60.0, "time/rollout": 8.0, "time/train": 0.5 if kept else None,
            "rollout/tok_per_s": 900.0}


@pytest.mark.parametrize("kept, dry, fails", [((0, 0), False, True), ((0, 8), False, False), ((0, 0), True, False)])
def test_the_rl_section_fails_when_no_step_updated_the_weights(tmp_path, monkeypatch, capsys, kept, dry, fails):
    model, rows = tmp_path / "sft", tmp_path / "train.jsonl"
    model.mkdir()
    rows.write_text("{}\n")
    monkeypatch.setattr(bench.subprocess, "run", lambda args, **kw: subprocess.CompletedProcess(args, 0, "", ""))
    monkeypatch.setattr(bench.data, "read_metrics", lambda run_dir: [metrics(k) for k in kept])
    report = bench.gpu_rl_steps(str(model), str(rows), len(kept), dry, "none")
    assert report["updated"] == sum(k > 0 for k in kept)
    assert ("failed" in report) == fails
    if fails:
        with pytest.raises(RuntimeError, match="no step updated the weights"):
            bench.print_gpu_rl(report)
    else:
        bench.print_gpu_rl(report)
    assert f"{report['updated']} of {len(kept)} step(s) updated the weights" in capsys.readouterr().out

"""bench.py gpu's RL section (5) judged from train_rl.py's metrics, without running it: a GPU run whose
steps never updated the weights (every group's rewards equal) fails and says why; its --cpu dry run does not
judge (a toy step may keep nothing). The whole dry run is in tests/test_train.py."""
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from model import load_model  # noqa: E402


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


def test_the_random_models_greedy_tokens_depend_on_the_context(tmp_path):
    """bench.py gpu compares greedy tokens (sections 2 and 3b) on random_qwen3's model, so they
    must depend on what attention reads, or a step that read the wrong keys would give the same
    tokens. With its embedding scaled up, every greedy token was its input token (here and at
    Qwen3-0.6B's shapes)."""
    bench.random_qwen3(str(tmp_path), dry=True)
    model = load_model(str(tmp_path)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 512, (4, 8), generator=g)
    # the same prompts but for their first token
    others = torch.cat([(prompts[:, :1] + 1) % 512, prompts[:, 1:]], 1)
    with torch.no_grad():
        tokens, other_tokens = (model(ids)[:, -1].argmax(-1) for ids in (prompts, others))
    assert not (tokens == prompts[:, -1]).all()
    assert (tokens != other_tokens).any()


CARDS = [("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H100 PCIe", 2.0), ("NVIDIA H100 NVL", 3.9),
         ("NVIDIA H200", 4.8), ("NVIDIA H20", 4.0), ("NVIDIA L40S", None)]


@pytest.mark.parametrize("card, tbps", CARDS)
def test_the_roofline_takes_the_cards_own_hbm_bandwidth(card, tbps):
    """an H100 PCIe's HBM is 2.0 TB/s, not the SXM card's 3.35 (its roofline share read 40% low)"""
    assert bench.hbm_of(card) == tbps

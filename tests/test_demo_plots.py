"""demo.py's curves.png, drawn from a made-up finished run (every stage's output present, so nothing trains): each
panel's tick labels are short and sit at ticks inside its frame, at the size the demo writes (issue #46 item 5),
and summary.md says where its rows fall against what the same command printed before (item 1). And --seeds refuses
the one-seed run's flags it would not use, and a count that is no whole number."""
import json
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def made_up_run(base, gap, sft_acc=0.474):
    """The files demo.py reads, as a finished default run leaves them; gap: every step's mismatch/abs_mean."""
    for path in ("data/sft.jsonl", "tiny-sft/model.safetensors", "tiny-rl/step_000100/model.safetensors"):
        os.makedirs(os.path.dirname(base / path), exist_ok=True)
        (base / path).write_text("")
    with open(base / "tiny-rl" / "metrics.jsonl", "w") as f:
        for step in range(1, 101):
            f.write(json.dumps({"step": step, "rollout/reward": 0.5 + step / 400, "tool/err_pos": 0.1 / step,
                                "rollout/response_len": 40 + step % 7, "mismatch/abs_mean": gap * (1 + step % 9 / 50)}) + "\n")
    for name, acc in (("sft", sft_acc), ("GRPO-RoC", 0.611)):
        os.makedirs(base / "demo" / f"eval_{name}")
        summary = {"avg@k": acc, "avg@k_se": 0.02, "pass@k": 0.85, "samples": 4, "temperature": 1.0, "problems": 256,
                   "tool/calls": 1.1, "tool/err": 0.1, "rollout/response_len": 45.0}
        (base / "demo" / f"eval_{name}" / "summary.json").write_text(json.dumps(summary))


def test_the_curves_keep_their_tick_labels_inside_their_frames(tmp_path, monkeypatch):
    # fp32 gaps only (~5e-7, all inside symlog's linear part: the demo's default), and a bf16 engine's (~1e-2)
    for gap in (5.4e-7, 8e-3):
        base = tmp_path / f"gap{gap}"
        made_up_run(base, gap)
        monkeypatch.chdir(ROOT)
        monkeypatch.setattr(sys, "argv", ["demo.py", f"--out={base}"])
        demo = runpy.run_path(os.path.join(ROOT, "demo.py"), run_name="__main__")
        fig, axes = demo["fig"], demo["axes"]
        assert tuple(fig.get_size_inches() * fig.dpi) == (2200, 400)  # what savefig(dpi=100) writes
        renderer = fig.canvas.get_renderer()
        widest_linear = max(label.get_window_extent(renderer).width for ax in axes[:3]
                            for label in ax.get_yticklabels() if label.get_text())
        for index, ax in enumerate(axes):
            low, high = ax.get_ylim()
            shown = [(tick, label) for tick, label in zip(ax.get_yticks(), ax.get_yticklabels())
                     if low <= tick <= high and label.get_text()]
            # labels at ticks inside the frame, at least two of them, none wider than the linear panels' widest
            assert len(shown) >= 2, (gap, index, [label.get_text() for _, label in shown])
            for _tick, label in shown:
                box = label.get_window_extent(renderer)
                assert box.width <= widest_linear + 2, (gap, index, label.get_text(), box.width, widest_linear)
                assert box.x0 >= 0 and (index == 0 or box.x0 >= axes[index - 1].get_window_extent(renderer).x1)
        assert os.path.exists(base / "demo" / "curves.png")


def test_the_summary_says_where_its_rows_fall_against_earlier_runs(tmp_path, monkeypatch):
    # the SFT row at 40.0%: 7.4 points under the lowest earlier run; the RL row inside the earlier runs' range
    made_up_run(tmp_path, 5e-7, sft_acc=0.40)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["demo.py", f"--out={tmp_path}"])
    runpy.run_path(os.path.join(ROOT, "demo.py"), run_name="__main__")
    text = (tmp_path / "demo" / "summary.md").read_text()
    assert "- after SFT: 40.0%, 7.4 points outside it (this row's s.e.: 2.0): 47.4-55.0% before" in text, text
    assert "- after GRPO-RoC (100 steps): 61.1%, inside that range: 61.1-67.7% before" in text, text
    # a run with other settings is not compared
    monkeypatch.setattr(sys, "argv", ["demo.py", f"--out={tmp_path}", "--eval.samples=2"])
    runpy.run_path(os.path.join(ROOT, "demo.py"), run_name="__main__")
    assert "against earlier runs" not in (tmp_path / "demo" / "summary.md").read_text()


def test_the_seed_study_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    # --compare and --mismatch add arms to the one-seed run; with --seeds they were dropped without a word
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail(f"a stage ran: {args}"))
    for flags in (["--compare"], ["--mismatch"], ["--compare", "--mismatch"]):
        monkeypatch.setattr(sys, "argv", ["demo.py", f"--out={tmp_path}", "--seeds=2", *flags])
        with pytest.raises(SystemExit) as refused:
            runpy.run_path(os.path.join(ROOT, "demo.py"), run_name="__main__")
        assert f"--seeds=2 and {' '.join(flags)} do not go together" in str(refused.value)
    # a seed count that is no whole number: refused before the data and SFT stages, not in the study after them
    for count in ("-2", "two"):
        monkeypatch.setattr(sys, "argv", ["demo.py", f"--out={tmp_path}", f"--seeds={count}"])
        with pytest.raises(SystemExit, match=f"--seeds takes a whole number of RL seeds .* '{count}'"):
            runpy.run_path(os.path.join(ROOT, "demo.py"), run_name="__main__")
    # and so is a seed that is no whole number (int() raised a traceback)
    monkeypatch.setattr(sys, "argv", ["demo.py", f"--out={tmp_path}", "--seed=abc"])
    with pytest.raises(SystemExit, match="--seed takes a whole number .* 'abc'"):
        runpy.run_path(os.path.join(ROOT, "demo.py"), run_name="__main__")
    assert os.listdir(tmp_path) == []  # refused before any stage ran

"""The entry scripts end to end on the tiny config: SFT -> RL (resume is exact; two gloo ranks match one
process) -> eval, plus start-up errors that name the file and line."""
import json
import os
import random
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

import agent
import data
import grading
import view
import zygote
from sandbox import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, ranks=1, check=True, env=None, torchrun=False):
    # without an environment of its own, children of the zygote (tests/zygote.py), one a rank; else real processes
    p = zygote.run(args, env=env, ranks=ranks, torchrun=torchrun)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


# The math task with a reward that varies within every group whatever the model says (the parity of its answer's
# length), for the tests of resumes, ranks and loss terms: each of their steps trains. The tiny model below earns the
# math reward in some steps on one CPU and in none on another (an AMD EPYC: its kernels round differently)
VARIED_TASK = '''from tasks.math import COLUMNS, TOOLS, predict, prompt  # noqa: F401


def grade(row, pred, turns, grader, trajectory):
    odd = len("".join(turns)) % 2 == 1
    return float(odd), odd
'''


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A tiny model SFT-trained hard on 12 problems; RL then trains on the same problems, so a few
    hundred SFT tokens are enough for groups with both right and wrong answers at T=1."""
    d = tmp_path_factory.mktemp("pipeline")
    with SandboxPool(workers=1) as pool:
        data.prepare(str(d / "base"), 0, pool.map, data_dir=str(d / "data"), n_train=8, n_heldout=4, n_sft=12,
                     hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    with open(d / "data" / "sft.jsonl") as f, open(d / "data" / "rl.jsonl", "w") as g:
        for line in f:
            row = json.loads(line)
            g.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    run("train_sft.py", "configs/tiny_sft.py", f"--model_path={d}/base",
        f"--data_mix=[('{d}/data/sft.jsonl', 'rstar2', 1.0)]",
        f"--out_dir={d}/sft", "--epochs=60", "--batch_size=12", "--lr=1e-2", "--log_every=1000")
    (d / "varied.py").write_text(VARIED_TASK)
    return d


def rl(d, run_dir, *extra, **how):
    return run("train_rl.py", "configs/tiny_rl.py", f"--model_path={d}/sft", f"--data_path={d}/data/rl.jsonl",
               f"--run_dir={run_dir}", "--prompts_per_step=4", "--samples_per_prompt=8", "--keep_per_prompt=4",
               "--max_response_tokens=96", "--lr=1e-3", "--warmup_steps=1", "--tool_workers=1", "--save_every=2", "--save_hf_every=1",
               # tools overlapped with decoding and rollouts claimed by free KV, as at scale (a test may say otherwise)
               "--deterministic=false", *extra, **how)


def weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_rl_resume_is_exact_and_two_ranks_match_one(sft, tmp_path):
    varied = f"--task={sft}/varied.py"
    rl(sft, tmp_path / "a", "--steps=4", varied)
    rl(sft, tmp_path / "b", "--steps=2", varied)
    out = rl(sft, tmp_path / "b", "--steps=4", "--resume=true", varied)
    assert "resumed from" in out.stdout
    metrics = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert sum(m["loss/grad_norm"] > 0 for m in metrics) >= 2  # real updates happened, or this test proves nothing
    a, b = weights(tmp_path / "a" / "step_000004"), weights(tmp_path / "b" / "step_000004")
    start = weights(sft / "sft")
    assert any(not torch.equal(a[k], start[k]) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)  # 4 straight == 2 + resume + 2, bit for bit
    # two gloo ranks (FSDP2 + dynamic rollout claiming) end where one process ends; under the real torchrun
    rl(sft, tmp_path / "c", "--steps=2", varied, ranks=2, torchrun=True)
    one, two = weights(tmp_path / "a" / "step_000002"), weights(tmp_path / "c" / "step_000002")
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4)


def test_plain_grpo_shares_its_rollouts_across_two_ranks(sft, tmp_path):
    # --roc=false samples keep_per_prompt rollouts a prompt (16 a step here, 8 a rank), not
    # samples_per_prompt: each rank's engine was sized to hold 16 at once, and the first rank to
    # claim took every rollout of the step, leaving the other idle
    rl(sft, tmp_path / "g", "--steps=2", "--roc=false", ranks=2)
    metrics = [json.loads(line) for line in open(tmp_path / "g" / "metrics.jsonl")]
    # rank 0's share of each step's 16 rollouts
    assert all(0 < m["rollout/generated_here"] < 16 for m in metrics), metrics


@pytest.mark.parametrize("overlay", ["configs/dr_grpo.py", "configs/gspo.py"])
def test_the_other_losses_run_from_their_configs(sft, tmp_path, overlay):
    # save_every=0: one checkpoint, the last step's (it divided by zero before)
    rl(sft, tmp_path / "r", "--steps=2", overlay, "--save_every=0", f"--task={sft}/varied.py")
    metrics = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and any(m["loss/grad_norm"] > 0 for m in metrics)
    assert [p for p in os.listdir(tmp_path / "r") if p.startswith("step_")] == ["step_000002"]


def test_a_users_estimator_and_loss_term_from_its_own_file(sft, tmp_path):
    # the loss seams without touching the repository: one file outside it, two config keys
    (tmp_path / "my_ideas.py").write_text(
        "def rloo(rewards):\n"
        "    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.size(1) - 1)\n\n\n"
        "def gap(logprobs, engine_logprobs, mask, **_):\n"
        "    return (logprobs - engine_logprobs).abs()\n")
    mine = tmp_path / "my_ideas.py"
    # (at a temperature other than 1: the engine samples from softmax(logits / T), and so must the trainer's
    # log-probs be, or the gap below is ~0.5 where the weights are the same)
    rl(sft, tmp_path / "r", "--steps=2", "--dump_every=1", f"--adv_scale={mine}:rloo", f"--task={sft}/varied.py",
       f"--loss_terms=[('{mine}:gap', 0.01)]", "--temperature=0.7")
    # the estimator: each kept trajectory's advantage is its reward minus the mean of its group's other kept
    for step in (1, 2):
        kept = [r for r in dumped(tmp_path / "r", step) if r["kept"]]
        for group in {r["group"] for r in kept}:
            rewards = [r["reward"] for r in kept if r["group"] == group]
            expected = [x - (sum(rewards) - x) / (len(rewards) - 1) for x in rewards]
            advantages = [r["advantage"] for r in kept if r["group"] == group]
            assert advantages == pytest.approx(expected, abs=1e-6)
    # the term: logged as loss/<function>, the token-mean of the trainer-vs-engine gap (mismatch/ logs it too)
    metrics = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert any(m["roc/kept"] for m in metrics)
    for m in metrics:
        assert m["loss/gap"] == pytest.approx(m["mismatch/abs_mean"], rel=1e-4)
        assert m["mismatch/abs_mean"] < 1e-4  # the engine's weights are the trainer's, in fp32
        assert "loss/kl" not in m
        assert (m["loss/gap"] > 0) == (m["roc/kept"] > 0) and m["time/reference"] == 0.0


def test_the_kl_term_on_two_ranks_repeats_bit_for_bit_and_resumes(sft, tmp_path):
    # kl_coef > 0: a frozen reference (the starting model) sharded over 2 gloo ranks; 3 straight steps
    # and 1 + resume + 2 end on the same weights, bit for bit (the reference is loaded again, not saved)
    kl = ("--kl_coef=0.5", "--deterministic=true", f"--task={sft}/varied.py")
    rl(sft, tmp_path / "a", "--steps=3", *kl, ranks=2)
    rl(sft, tmp_path / "b", "--steps=1", *kl, ranks=2)
    resumed = rl(sft, tmp_path / "b", "--steps=3", "--resume=true", *kl, ranks=2)
    assert "resumed from" in resumed.stdout
    a, b = weights(tmp_path / "a" / "step_000003"), weights(tmp_path / "b" / "step_000003")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in "ab"]
    # step 1's policy is the reference itself: KL exactly 0; once it has moved, > 0 in a step that trains
    # (a step whose groups all got equal rewards trains nothing: no KL, no reference forward), the same resumed
    kls = [[m["loss/kl"] for m in metrics] for metrics in rows]
    trained = [m["roc/kept"] > 0 for m in rows[0]]
    assert kls[0] == kls[1] and kls[0][0] == 0.0 and trained[0] and any(trained[1:]), (kls, trained)
    assert all((x > 0) == t for x, t in zip(kls[0][1:], trained[1:])), (kls, trained)
    assert all((m["time/reference"] > 0) == t for m, t in zip(rows[0], trained))


def test_a_deterministic_run_repeats_on_two_torch_threads(sft, tmp_path):
    # deterministic=true repeats bit for bit with two torch threads too. The trajectories of a prompt share its
    # tokens in a micro-batch (model.Qwen.forward's shared): their attention gathers the prompt's keys and
    # values, and on a CPU with threads the gather's backward adds into them with atomics, in whatever order the
    # threads come, unless torch's deterministic kernels are on (without them: 4 runs of 4 differed, by up to
    # 3e-7 at step 3). Three steps: Adam's first barely shows a gradient's last bits (its update ~ lr x sign).
    # Micro-batches of 4,096 tokens: enough rows that both threads add into one prompt's places
    for run_dir in ("a", "b"):
        rl(sft, tmp_path / run_dir, "--steps=3", "--deterministic=true", "--max_tokens_per_micro=4096",
           f"--task={sft}/varied.py", env={"OMP_NUM_THREADS": "2"})
    a, b = weights(tmp_path / "a" / "step_000003"), weights(tmp_path / "b" / "step_000003")
    assert any(not torch.equal(a[k], weights(sft / "sft")[k]) for k in a)  # the steps trained
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hub_ids_resolve_offline_and_missing_paths_are_named(sft, tmp_path):
    # a Hugging Face cache as huggingface_hub lays it out, holding the SFT model as "acme/tiny-sft"
    snap = tmp_path / "hub" / "models--acme--tiny-sft" / "snapshots" / "0123abc"
    shutil.copytree(sft / "sft", snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0123abc")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    ev = ("eval.py", "configs/tiny_eval.py", f"--data_path={sft}/data/rl.jsonl", f"--out_dir={tmp_path}/ev",
          "--limit=1", "--samples=1", "--max_response_tokens=16", "--tool_workers=1")
    out = run(*ev, "--model_path=acme/tiny-sft", env=env)
    assert f"model {snap}" in out.stdout
    # neither a directory nor an id in the cache: one line naming the key (in one process, not a run each)
    check = ("import common\nfor bad in ('/nonexistent', 'acme/absent'):\n    try:\n"
             "        common.resolve_model(bad)\n    except SystemExit as e:\n        print(e)")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    for bad in ("/nonexistent", "acme/absent"):
        assert f"config error: model_path='{bad}' is no directory" in out.stdout, out.stdout + out.stderr
    # a data file that is not there: one line from each script, as for a bad line
    missing = tmp_path / "missing.jsonl"
    for cmd in [("train_rl.py", "configs/tiny_rl.py", f"--model_path={sft}/sft", f"--data_path={missing}",
                 f"--run_dir={tmp_path}/x"),
                ("eval.py", "configs/tiny_eval.py", f"--model_path={sft}/sft", f"--data_path={missing}"),
                ("train_sft.py", "configs/tiny_sft.py", f"--model_path={sft}/sft", f"--data_mix=[('{missing}', 'rstar2', 1.0)]",
                 f"--out_dir={tmp_path}/y")]:
        out = run(*cmd, check=False)
        assert out.returncode != 0 and f"data error: {missing}: cannot read it" in out.stderr, (cmd[0], out.stderr[-500:])
        assert "Traceback" not in out.stderr, cmd[0]


def test_settings_out_of_range_are_refused_at_start(tmp_path):
    # a trajectory longer than a micro-batch: before, packing retried with one more bin per rank at a time, cubic
    # in their number (weeks at stage 1); RoC keeping more than half of its samples failed after the first
    # step's rollouts; a negative KL coefficient ran, rewarding the drift from the reference
    for cmd, says in [
            (("train_rl.py", "configs/tiny_rl.py", "--max_tokens_per_micro=200", f"--run_dir={tmp_path}/a"),
             "need max_prompt_tokens + max_response_tokens <= max_tokens_per_micro, got max_prompt_tokens = 96, "
             "max_response_tokens = 192, max_tokens_per_micro = 200"),
            (("train_rl.py", "configs/tiny_rl.py", "--keep_per_prompt=12", "--kl_coef=-1", f"--run_dir={tmp_path}/b"),
             "need not roc or samples_per_prompt == 2 * keep_per_prompt, got roc = True, samples_per_prompt = 16, "
             "keep_per_prompt = 12"),
            # a negative count made the rotation's [:-keep] the oldest checkpoints, the one just
            # saved among them
            (("train_rl.py", "configs/tiny_rl.py", "--keep_checkpoints=-1",
              f"--run_dir={tmp_path}/c"),
             "need keep_checkpoints >= 0, got keep_checkpoints = -1"),
            (("train_sft.py", "configs/tiny_sft.py", "--max_tokens_per_micro=200"),
             "need max_seq_len <= max_tokens_per_micro, got max_seq_len = 512, max_tokens_per_micro = 200"),
            (("eval.py", "configs/tiny_eval.py", "--top_p=0"), "need 0 < top_p <= 1, got top_p = 0.0")]:
        out = run(*cmd, check=False)
        assert out.returncode == 2 and out.stderr.splitlines()[-1] == f"config error: {says}", out.stderr
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")  # nothing made
    assert not os.path.exists(tmp_path / "c")


def test_prompts_all_too_long_name_the_key(sft, tmp_path):
    # before: ZeroDivisionError in the data order; an extra tool's schema in the prompt can do this
    out = run("train_rl.py", "configs/tiny_rl.py", f"--model_path={sft}/sft", f"--data_path={sft}/data/rl.jsonl",
              f"--run_dir={tmp_path}/x", "--max_prompt_tokens=20", check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "longer than max_prompt_tokens = 20" in out.stderr and "raise max_prompt_tokens" in out.stderr


def test_eval_after_rl_and_bad_data_names_file_and_line(sft, tmp_path):
    out = run("eval.py", "configs/tiny_eval.py", f"--model_path={sft}/sft", f"--data_path={sft}/data/rl.jsonl",
              f"--out_dir={tmp_path}/ev", "--samples=2", "--max_response_tokens=96", "--tool_workers=1")
    summary = json.load(open(tmp_path / "ev" / "summary.json"))
    assert summary["avg@k"] > 0  # the SFT model solves some of the problems it was trained on
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "x", "answer": 2}\n')
    out = run("train_rl.py", "configs/tiny_rl.py", f"--model_path={sft}/sft", f"--data_path={bad}",
            f"--run_dir={tmp_path}/x", check=False)
    assert out.returncode != 0 and f"{bad}:2" in out.stderr
    good = open(sft / "data" / "sft.jsonl").readline()
    for name, line in [("json", '{"messages": [\n'), ("role", '{"messages": [{"role": "robot", "content": "x"}]}\n'),
                       ("tool", '{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "1"}]}\n')]:
        sft_bad = tmp_path / f"sft_bad_{name}.jsonl"
        sft_bad.write_text(good + line)
        out = run("train_sft.py", "configs/tiny_sft.py", f"--model_path={sft}/sft",
                  f"--data_mix=[('{sft_bad}', 'rstar2', 1.0)]",
                  f"--out_dir={tmp_path}/y", check=False)
        assert out.returncode != 0 and f"{sft_bad}:2:" in out.stderr, (name, out.stderr[-500:])


def rl_task(d, run_dir, overlay, *extra):
    # rl()'s tiny settings with a task's config overlaid first (its model, data and run_dir replaced after it)
    return run("train_rl.py", "configs/tiny_rl.py", overlay, f"--model_path={d}/sft", f"--data_path={d}/data/rl.jsonl",
               f"--run_dir={run_dir}", "--prompts_per_step=4", "--samples_per_prompt=8", "--keep_per_prompt=4",
               "--max_response_tokens=96", "--lr=1e-3", "--warmup_steps=1", "--tool_workers=1", "--steps=2", *extra)


def dumped(run_dir, step=1):
    return view.read_records(str(run_dir / "rollouts" / f"step_{step:06d}.jsonl.gz"))


@pytest.mark.slow
def test_the_code_task_trains_on_its_own_reward(sft, tmp_path):
    # configs/tiny_code.py on the tiny model: its prompt, its rows (hidden tests), its reward. The model was
    # taught arithmetic, not code: its \boxed{} answers earn nothing here (tasks/code.py reads a code block)
    rows = tmp_path / "code.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in data.code_problems(6, seed=0)))
    rl_task(sft, tmp_path / "r", "configs/tiny_code.py", f"--data_path={rows}")
    recs = dumped(tmp_path / "r")
    code = grading.load_task("tasks/code.py")
    assert len(recs) == 4 * 8 and all(code.USER_PREFIX in r["prompt"] for r in recs)
    assert all(r["reward"] == 0.0 and not r["correct"] for r in recs if "```" not in "".join(t for t, m in r["segments"] if m))
    # the same trajectories under the math task would be read for \boxed{}: some of them have one
    assert any("\\boxed{" in t for r in recs for t, m in r["segments"] if m)


@pytest.mark.slow
def test_a_second_tool_is_learned_and_called(sft, tmp_path):
    # a short SFT on traces that call `calculate` (data.task_traces: real tool answers, some failing first),
    # then RL with tasks/calculator.py: the tool is called, its records carry its name, its failures count
    calc = grading.load_task("tasks/calculator.py")
    problems = [json.loads(line) for line in open(sft / "data" / "rl.jsonl")]
    # every problem twice: once calling it right away, once first with a malformed expression (random() < 0.25)
    first = iter([0.0] * len(problems) + [0.9] * len(problems))
    rng = types.SimpleNamespace(random=lambda: next(first), choice=random.Random(0).choice)
    traces = tmp_path / "sft_calc.jsonl"
    traces.write_text("".join(json.dumps(t) + "\n" for t in data.task_traces(calc, problems * 2, rng, sandbox=None)))
    # from the random base: 120 steps (~1 min on 2 cores); the 60 of the fixture's SFT are too few for the tool
    run("train_sft.py", "configs/tiny_sft.py", f"--model_path={sft}/base", f"--data_mix=[('{traces}', 'rstar2', 1.0)]",
        f"--out_dir={tmp_path}/sft", "--epochs=60", "--batch_size=12", "--lr=1e-2", "--log_every=1000")
    rl_task(tmp_path, tmp_path / "r", "configs/tiny_calc.py", f"--data_path={sft}/data/rl.jsonl", "--max_prompt_tokens=512")
    recs = dumped(tmp_path / "r")
    calls = [c for r in recs for c in r["tool_calls"]]
    assert all(calc.CALCULATOR_SCHEMA["function"]["description"] in r["prompt"] for r in recs)
    assert sum(c["tool"] == "calculate" for c in calls) > len(recs) / 2, [c["tool"] for c in calls]
    # the step's tool error ratio is over every tool's calls, the calculator's failures included
    metrics = json.loads(open(tmp_path / "r" / "metrics.jsonl").readline())
    failed = sum(c["status"] in agent.TOOL_ERRORS for c in calls)
    counted = sum(c["status"] != "overloaded" for c in calls)  # our infrastructure's: on neither side
    assert metrics["tool/err"] == pytest.approx(failed / counted)
    assert any(c["tool"] == "calculate" and c["status"] == "error" for c in calls)  # it learned to fail sometimes too
    # and per tool: the calculator's own calls and failures, next to the Python tool's
    calc_calls = [c for c in calls if c["tool"] == "calculate"]
    assert metrics["tool/calls/calculate"] == pytest.approx(len(calc_calls) / len(recs))
    assert metrics["tool/err/calculate"] == pytest.approx(sum(c["status"] == "error" for c in calc_calls) / len(calc_calls))
    assert f"tool/err/{agent.TOOL_NAME}" in metrics


def test_the_gpu_bench_dry_runs_on_the_cpu(sft, tmp_path):
    """`python bench.py gpu` is the prepared command for the first GPU this project is lent; its --cpu dry run
    goes through every section at toy sizes (model and greedy tokens against transformers, decode speed, RL
    steps through train_rl.py), so it is known to run before a GPU exists."""
    run("bench.py", "gpu", "--cpu", f"--model_path={sft}/sft", f"--data_path={sft}/data/rl.jsonl",
        f"--out={tmp_path}/gpu.json")
    with open(tmp_path / "gpu.json") as f:
        report = json.load(f)
    assert report["logits"]["float32"]["max_abs_diff"] < 1e-4
    assert report["greedy_fp32"]["identical"] == report["greedy_fp32"]["prompts"] == 4
    assert {r["side"] for r in report["decode"]} == {"ours", "transformers"}
    assert [r["batch"] for r in report["decode"]] == [1, 1, 2, 2, 4, 4]
    # 3b: the static-shape steps, run eagerly on a CPU, give the eager steps' tokens at every batch
    assert [(r["batch"], r["side"]) for r in report["graphs"]] == [(b, side) for b in (1, 2, 4)
                                                                for side in ("eager", "static")]
    assert all(r["same_tokens"] == r["rows"] for r in report["graphs"])
    (step,) = report["rl"]["steps"]
    assert 0 <= step["reward"] <= 1 and step["t_rollout"] > 0


def test_the_seed_study_records_what_its_table_and_plot_show(sft, tmp_path):
    """`python demo.py --seeds=N` at toy size (2 RL steps, one seed, 2 samples): both arms train from the same SFT
    model and are evaluated; the Fig. 4 curve it plots is each run's own tool_err_pos, its table's means are
    those of the metrics, and its accuracy is the eval's. Stages whose outputs exist are skipped, so the
    fixture's data and SFT model stand in for data.py prepare and train_sft.py. The RoC arm stands as a killed
    demo left it, one step done of two (its metrics.jsonl and a checkpoint): the demo resumes it to the end."""
    root = tmp_path / "demo"
    shutil.copytree(sft / "data", root / "data")
    shutil.copy(sft / "data" / "rl.jsonl", root / "data" / "train.jsonl")  # problems the SFT model solves at times
    shutil.copytree(sft / "sft", root / "tiny-sft")
    toy = ["--prompts_per_step=4", "--samples_per_prompt=8", "--keep_per_prompt=4", "--max_response_tokens=96",
           "--lr=1e-3", "--warmup_steps=1", "--tool_workers=1"]
    # the stopped arm: the demo's own command, as it stands when stopped after step 1's checkpoint
    stopped = root / "seeds" / "grpo-roc-s0"
    run("train_rl.py", "configs/tiny_rl.py", f"--run_dir={stopped}", "--seed=0", "--dump_every=0",
        f"--model_path={root}/tiny-sft", f"--data_path={root}/data/train.jsonl", *toy, "--steps=2", "--save_every=1")
    shutil.rmtree(stopped / "step_000002")
    metrics = (stopped / "metrics.jsonl").read_text().splitlines(keepends=True)
    (stopped / "metrics.jsonl").write_text(metrics[0])
    study = ["demo.py", f"--out={root}", "--seeds=1", "--rl.steps=2", *("--rl." + arg[2:] for arg in toy),
             "--rl.save_every=2", "--eval.max_response_tokens=96", "--eval.tool_workers=1"]
    run(*study, "--eval.samples=2")
    assert (root / "seeds" / "grpo-roc-s0" / "step_000002").is_dir()  # resumed to its last step
    shown = json.load(open(root / "demo" / "seeds.json"))
    table = open(root / "demo" / "seeds.md").read()
    for arm, run_name in [("GRPO-RoC", "grpo-roc"), ("GRPO", "grpo")]:
        metrics = [json.loads(line) for line in open(root / "seeds" / f"{run_name}-s0" / "metrics.jsonl")]
        curve = [m["tool/err_pos"] for m in metrics]
        (row,) = shown["rows"][arm]
        assert len(curve) == 2 and row["curve"] == curve
        assert row["first"] == row["last"] == pytest.approx(sum(curve) / 2)  # 2 steps: both windows hold both
        # one seed: the plotted mean is the 5-step moving average of the run's own curve, with no band
        assert shown["plotted"][arm]["mean"] == pytest.approx([curve[0], (curve[0] + curve[1]) / 2])
        evaluated = json.load(open(root / "demo" / f"eval_seeds_{arm}_s0" / "summary.json"))
        assert row["acc"] == evaluated["avg@k"] and evaluated["samples"] == 2
        assert f"| 0 | {arm} | {row['first']:.4f} | {row['last']:.4f} | {row['acc']:.3f} |" in table
    assert "one seed: no intervals" in table and os.path.getsize(root / "demo" / "seeds.png") > 0
    assert not (root / "demo" / "eval_sft").exists()  # the study needs no eval of the SFT model (--recover does)
    # a misspelt flag is named, not ignored
    out = run("demo.py", f"--out={root}", "--seed=0", "--compre", check=False)
    assert out.returncode != 0 and "'--compre'" in out.stderr
    # fewer steps than the runs made: no weights there to evaluate, said so (not the longer run's, as if shorter)
    out = run("demo.py", f"--out={root}", "--seeds=1", "--rl.steps=1", check=False)
    assert out.returncode != 0 and "holds a longer run" in out.stderr
    # an output made by another command is refused, not shown as this one's: here the evals', with 2 samples
    out = run(*study, "--eval.samples=3", check=False)
    assert out.returncode != 0 and "(its own arguments: --samples=2; this one's: --samples=3)" in out.stderr
    # nor is a stopped run continued by another command
    shutil.rmtree(stopped / "step_000002")
    other_lr = [arg.replace("--rl.lr=1e-3", "--rl.lr=1e-4") for arg in study]
    out = run(*other_lr, "--eval.samples=2", check=False)
    assert out.returncode != 0 and not (stopped / "step_000002").exists()
    assert f"{stopped} was made by another command (its own arguments: --lr=1e-3; this one's: --lr=1e-4)" \
        in out.stderr

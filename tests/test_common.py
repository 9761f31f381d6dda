"""common.py and checkpoint.py: token-balanced packing (the same bins as the linear scan it replaced, a
too-long sequence named at once), checkpoints (written whole or not at all, the newest complete one found,
rotation keeps what it says, weights and optimizer state restored exactly from the shards), and the metrics
log of a resumed run."""
import json
import os
import random
import sys
import types

import pytest
import torch

from checkpoint import (checkpoints, has_weights, latest_checkpoint, load_trainable,
                        load_trainer_state, model_dir, save_checkpoint)
from common import Logger, pack, pack_sorted, read_jsonl, write_jsonl
from model import Config, Qwen, save_model


def pack_by_scan(lengths, max_tokens, world=1):
    # the packing before the heap: longest first into the emptiest bin, found by scanning every bin
    m = max(1, -(-sum(lengths) // (world * max_tokens)))
    while True:
        bins, load = [[] for _ in range(world * m)], [0] * (world * m)
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            j = min(range(len(bins)), key=load.__getitem__)
            bins[j].append(i)
            load[j] += lengths[i]
        if max(load) <= max_tokens or m >= len(lengths):
            return bins
        m += 1


def test_pack_gives_the_scans_bins_and_names_a_too_long_sequence():
    rng = random.Random(0)
    for _ in range(200):
        n, world = rng.randrange(1, 60), rng.choice([1, 2, 3, 8])
        max_tokens = rng.choice([64, 100, 256])
        lengths = [rng.randrange(1, max_tokens + 1) for _ in range(n)]
        bins = pack(lengths, max_tokens, world)
        assert sorted(i for b in bins for i in b) == list(range(n)) and len(bins) % world == 0
        assert all(sum(lengths[i] for i in b) <= max_tokens for b in bins)
        if len(bins) <= 8 * world:  # (the scan grows one bin a rank at a time, the heap faster once there are many)
            assert bins == pack_by_scan(lengths, max_tokens, world)
    # a stage-1 step: 16,384 lengths into 64 ranks' bins (the scan took ~7 s)
    lengths = [min(8192, int(rng.lognormvariate(8.1, 0.6))) for _ in range(16384)]
    bins = pack(lengths, 20480, 64)
    assert all(sum(lengths[i] for i in b) <= 20480 for b in bins)
    # one sequence that fits no bin: named at once (the scan retried with more bins, cubic in their number)
    with pytest.raises(ValueError, match="sequence 3 has 9000 tokens, more than max_tokens_per_micro=8192"):
        pack([10, 20, 30, 9000] + [5] * 188, 8192, 2)


def test_pack_sorted_bins_similar_lengths_within_the_budget_and_balances_the_ranks():
    rng = random.Random(1)
    for _ in range(200):
        n, world = rng.randrange(1, 60), rng.choice([1, 2, 3, 8])
        max_tokens = rng.choice([64, 100, 256])
        lengths = [rng.randrange(1, max_tokens + 1) for _ in range(n)]
        bins = pack_sorted(lengths, max_tokens, world)
        assert sorted(i for b in bins for i in b) == list(range(n)) and len(bins) % world == 0
        assert all(len(b) * max(lengths[i] for i in b) <= max_tokens for b in bins if b)  # padded size
        # each rank's share of the tokens: within one longest sequence of every other rank's
        shares = [sum(lengths[i] for b in bins[r::world] for i in b) for r in range(world)]
        assert max(shares) - min(shares) <= max(lengths)
    with pytest.raises(ValueError, match="sequence 1 has 90 tokens, more than max_tokens_per_micro=64"):
        pack_sorted([10, 90], 64)


class Tok:
    def save_pretrained(self, path):
        open(os.path.join(path, "tokenizer.json"), "w").write("{}")


def tiny(tmp_path):
    cfg = Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    save_model(Qwen(cfg), str(tmp_path / "base"))
    model = load_trainable(str(tmp_path / "base"), "cpu", torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt):
    ids = torch.randint(0, 50, (2, 6))
    (-model(ids, targets=ids).mean()).backward()
    opt.step()
    opt.zero_grad()


def test_checkpoints_whole_or_not_at_all_rotated_and_exact(tmp_path):
    model, opt = tiny(tmp_path)
    run = tmp_path / "run"
    for step in range(1, 6):
        train_step(model, opt)
        save_checkpoint(str(run / f"step_{step:06d}"), model, opt, Tok(), {"step": step, "cursor": 0},
                        hf_dtype=torch.float32 if step == 2 else None, keep=2)
    # the newest 2 and every one with HF weights (step 2) stay; only step 2 has them
    assert [os.path.basename(p) for p in checkpoints(str(run))] == ["step_000002", "step_000004", "step_000005"]
    assert has_weights(str(run / "step_000002")) and not has_weights(str(run / "step_000005"))
    assert latest_checkpoint(str(run)).endswith("step_000005")
    assert latest_checkpoint(str(run), weights=True).endswith("step_000002")
    # a save that died half-way (a process killed in it, a full disk) left a .tmp: it is no checkpoint
    os.makedirs(run / "step_000006.tmp" / "state")
    assert latest_checkpoint(str(run)).endswith("step_000005")
    # nor is a copy a person made beside them (a backup): --resume took step_000005.bak as the newest,
    # and the rotation deleted it with the old checkpoints
    os.makedirs(run / "step_000005.bak" / "state")
    names = [os.path.basename(p) for p in checkpoints(str(run))]
    assert names == ["step_000002", "step_000004", "step_000005"]
    # a model_path names a model directory (a checkpoint is one); a run directory, or the unfinished
    # save, exits naming the key (a transformers traceback in train_rl.py)
    assert model_dir(str(run / "step_000005")) == str(run / "step_000005")
    with pytest.raises(SystemExit, match="kl_ref=.*/run' holds no model .* name one"):
        model_dir(str(run), "kl_ref")
    # the shards give back the weights and the optimizer exactly, without any HF weights
    back = load_trainable(str(run / "step_000005"), "cpu", torch.float32)
    opt2 = torch.optim.AdamW(back.parameters(), lr=1e-2)
    assert load_trainer_state(str(run / "step_000005"), back, opt2)["step"] == 5
    for p, q in zip(model.parameters(), back.parameters()):
        assert torch.equal(p, q)
    torch.manual_seed(1)
    train_step(model, opt)
    torch.manual_seed(1)
    train_step(back, opt2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), back.parameters()))


def test_a_checkpoint_is_on_disk_before_it_is_named_complete(tmp_path, monkeypatch):
    # the rename makes step_X.tmp/ a checkpoint: after a power loss a file not yet written back (the
    # page cache) came back empty or short, under a name that --resume trusts. Each sync records
    # what the run directory then holds (every file and its size), each rename what it renames
    model, opt = tiny(tmp_path)
    run = tmp_path / "run"
    events = []
    rename = os.rename
    monkeypatch.setattr(os, "sync", lambda: events.append(
        ("sync", {str(path.relative_to(run)): path.stat().st_size for path in run.rglob("*")
                  if path.is_file()})))
    monkeypatch.setattr(os, "rename", lambda src, dst: events.append(
        ("rename", str(src))) or rename(src, dst))
    save_checkpoint(str(run / "step_000001"), model, opt, Tok(), {"step": 1, "cursor": 0},
                    hf_dtype=torch.float32)
    # a sync right before the rename, when the save held every file it holds now, at its size
    # (HF weights, config, tokenizer, trainer state, shards); then one after the rename
    saved = {str(path.relative_to(run)).replace("step_000001", "step_000001.tmp"):
             path.stat().st_size for path in run.rglob("*") if path.is_file()}
    # (torch's writer renames a file of its own too)
    completed = events.index(("rename", str(run / "step_000001.tmp")))
    assert events[completed - 1] == ("sync", saved) and len(saved) >= 6
    assert events[completed + 1][0] == "sync"


def test_a_save_before_the_first_optimizer_step_changes_no_step(tmp_path):
    # train_rl.py saves after a step whose groups were all dropped too: no optimizer step yet.
    # torch's optimizer state dict of such an optimizer is made by a step at lr 0, which Adam
    # counted as its first: the next real step's bias correction moved the weights x0.74 as far
    # as a run that did not save (in the run resumed from the checkpoint as well)
    model, opt = tiny(tmp_path)
    unsaved = load_trainable(str(tmp_path / "base"), "cpu", torch.float32)
    unsaved_opt = torch.optim.AdamW(unsaved.parameters(), lr=1e-2)
    path = str(tmp_path / "run" / "step_000001")
    save_checkpoint(path, model, opt, Tok(), {"step": 1, "cursor": 0})
    resumed = load_trainable(path, "cpu", torch.float32)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    load_trainer_state(path, resumed, resumed_opt)
    for net, optimizer in ((model, opt), (unsaved, unsaved_opt), (resumed, resumed_opt)):
        torch.manual_seed(1)
        train_step(net, optimizer)
    for p, q, r in zip(unsaved.parameters(), model.parameters(), resumed.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_a_resume_trains_with_the_configs_optimizer_settings(tmp_path):
    # torch's load_state_dict puts back the saved param_groups' settings too: a resume, or a stage
    # continuing optimizer_from, with another weight_decay or betas in its config went on with the
    # checkpoint's, silently
    model, opt = tiny(tmp_path)
    train_step(model, opt)
    path = str(tmp_path / "run" / "step_000001")
    save_checkpoint(path, model, opt, Tok(), {"step": 1, "cursor": 0})
    resumed = load_trainable(path, "cpu", torch.float32)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.5,
                                    betas=(0.8, 0.9))
    load_trainer_state(path, resumed, resumed_opt)
    [group] = resumed_opt.param_groups
    assert (group["weight_decay"], group["betas"]) == (0.5, (0.8, 0.9))
    # the optimizer's state (the moments) is the checkpoint's, for the same parameters
    assert group["params"] == list(resumed.parameters())
    for p, q in zip(opt.param_groups[0]["params"], group["params"]):
        assert torch.equal(opt.state[p]["exp_avg"], resumed_opt.state[q]["exp_avg"])


def test_a_resumed_run_keeps_one_metrics_row_per_step(tmp_path):
    log = Logger(str(tmp_path))
    for step in range(1, 6):
        log.log(step, {"reward": step / 10})
    log = Logger(str(tmp_path), resume_step=3)  # the checkpoint of step 3: steps 4 and 5 run again
    for step in (4, 5):
        log.log(step, {"reward": 1.0})
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and [r["reward"] for r in rows] == [0.1, 0.2, 0.3, 1.0, 1.0]
    with pytest.raises(ValueError, match="cannot read it"):
        read_jsonl(str(tmp_path / "missing.jsonl"))
    # a run stopped while it wrote step 6's row (a node crash, the disk full) resumes from step 5's checkpoint:
    # the cut row goes with the steps past the checkpoint (it stopped the resume with a ValueError)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')
    Logger(str(tmp_path), resume_step=5).log(6, {"reward": 1.0})
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4, 5, 6]
    # a bad line anywhere else is still named, in a run's metrics as in data
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "rew\n{"step": 8}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:7: not valid JSON"):
        Logger(str(tmp_path), resume_step=6)
    json.dumps(rows)


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    # wandb resumes a run by its id alone: a --resume without one started a new wandb run each time.
    # wandb (not installed here) stands in as a module that records each init and makes a new id
    # per run
    inits = []

    class Run:
        def __init__(self, **kwargs):
            inits.append(kwargs)
            self.id = kwargs["id"] or f"run{len(inits)}"

        def log(self, metrics, step):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=Run))
    Logger(str(tmp_path), "project").log(1, {"reward": 0.5})
    Logger(str(tmp_path), "project", resume_step=1).log(2, {"reward": 0.5})
    Logger(str(tmp_path), "project", resume_step=2)
    assert [init["id"] for init in inits] == [None, "run1", "run1"]
    assert all(init["resume"] == "allow" for init in inits[1:])
    # a new run in the same directory (no checkpoint was left to resume) is a new wandb run
    Logger(str(tmp_path), "project")
    assert inits[-1]["id"] is None


def test_a_jsonl_file_is_replaced_whole_or_not_at_all(tmp_path):
    # a rewrite that stops half-way (here a row that cannot be written; a kill or a full disk alike) leaves
    # the earlier file as it was: the metrics rows a resume keeps are not lost with it
    path = str(tmp_path / "metrics.jsonl")
    write_jsonl(path, [{"step": 1}, {"step": 2}])
    with pytest.raises(TypeError):
        write_jsonl(path, [{"step": 1}, {"step": object()}])
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_a_zygote_child_exits_as_python_does(tmp_path):
    """tests/zygote.py ends a command the way Python ends a process. A script that leaves a ThreadPoolExecutor's
    worker idle (torch.compile does) exits: Python tells such workers to stop before it joins the threads, and a
    child that only joined them waited forever (a compiled eval.py, killed at its timeout). Its atexit handlers
    run too, after the workers are done."""
    import zygote
    script = tmp_path / "idle_pool.py"
    script.write_text(
        "import atexit, concurrent.futures\n"
        "pool = concurrent.futures.ThreadPoolExecutor(1)\n"
        "print(pool.submit(lambda: 6 * 7).result())\n"
        "atexit.register(lambda: print('atexit ran'))\n")
    p = zygote.run([str(script)], timeout=60)
    assert (p.returncode, p.stdout.splitlines()) == (0, ["42", "atexit ran"])

"""Two CPU ranks (gloo), rank 1 slowed down: dynamic claiming from the shared queue splits the work
unevenly, generates every request exactly once, and finishes sooner than the static split."""
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import agent
import checkpoint
import data
import grading
from model import load_model
from rollout import Engine, Request
from scheduler import gather_summaries, generate, summarize

N_REQUESTS, BUDGET, SLOW = 24, 12, 0.03


def make_model(path):
    tok = data.train_tokenizer([agent.prompt_text(f"What is {i} + {i}?") for i in range(20)])
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def worker(rank, path, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = load_model(path)
    if rank == 1:  # an engine on a slow (or busy) accelerator
        fast = model.forward_cached

        def slow(*args, **kwargs):
            time.sleep(SLOW)
            return fast(*args, **kwargs)
        model.forward_cached = slow
    engine = Engine(model, tok, kv_capacity=2 * 128, max_len=128, temperature=1.0, seed=1)
    engine.stop_ids = set()  # always decode the full budget: equal work per request
    reqs = [Request(data.render_prompt(tok, f"What is {i} + {i}?"), key=(0, i, 0), meta={"problem": i})
            for i in range(N_REQUESTS)]
    out = {}
    for mode in ("static", "dynamic"):
        dist.barrier()
        t0 = time.perf_counter()
        mine = generate(engine, reqs, BUDGET, mode, counter=f"test/{mode}")
        dist.barrier()
        t = time.perf_counter() - t0
        # each rank keeps what it generated; every rank learns a summary of everything
        out[mode] = (t, len(mine), [(s.key, s.n_response) for s in gather_summaries([summarize(x, grading.Grade()) for x in mine])],
                     [(x.key, x.response_ids) for x in mine])
    results[rank] = out
    dist.destroy_process_group()


def test_dynamic_claiming_balances_two_ranks():
    with tempfile.TemporaryDirectory() as d:
        make_model(d)
        results = mp.Manager().dict()
        mp.spawn(worker, args=(d, os.path.join(d, "init"), results), nprocs=2, join=True)
        r0, r1 = results[0], results[1]
    for mode in ("static", "dynamic"):
        # every rank ends with the summaries of all trajectories, each request generated exactly once
        assert r0[mode][2] == r1[mode][2]
        assert [k for k, _ in r0[mode][2]] == [(0, i, 0) for i in range(N_REQUESTS)]
        assert r0[mode][1] + r1[mode][1] == N_REQUESTS == len(r0[mode][3] + r1[mode][3])
        assert all(n == BUDGET for _, n in r0[mode][2])
    assert r0["static"][1] == r1["static"][1] == N_REQUESTS // 2
    assert r0["dynamic"][1] > r1["dynamic"][1]  # the fast rank took more of the queue
    # the slow rank alone needs (N/2 requests / 2 rows) × BUDGET steps × SLOW seconds in static mode
    assert r0["dynamic"][0] < 0.8 * r0["static"][0]
    # which rank generated a request does not change its tokens (per-request generators)
    tokens = {mode: sorted(r0[mode][3] + r1[mode][3]) for mode in ("static", "dynamic")}
    assert tokens["dynamic"] == tokens["static"]


def resume_worker(rank, root, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # each rank's own view of the run directory: rank 1's lags a checkpoint behind, as a node's view
    # of a shared file system can (NFS keeps a folder's listing for up to a minute)
    results[rank] = checkpoint.resume_point(f"{root}/view{rank}", resume=True)
    dist.destroy_process_group()


def test_every_rank_resumes_the_checkpoint_rank_0_sees(tmp_path):
    # each rank took its own newest: rank 1 loaded step 1's shards while rank 0 loaded step 2's,
    # and the run went on with a model of two checkpoints, unsaid
    for rank, steps in ((0, (1, 2)), (1, (1,))):
        for step in steps:
            os.makedirs(checkpoint.checkpoint_dir(f"{tmp_path}/view{rank}", step))
    results = mp.Manager().dict()
    mp.spawn(resume_worker, args=(str(tmp_path), f"{tmp_path}/init", results), nprocs=2, join=True)
    assert results[0] == results[1] == f"{tmp_path}/view0/step_000002"

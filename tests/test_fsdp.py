"""FSDP2 on two CPU processes (gloo): one sharded AdamW step equals one single-process step on the
whole batch; meta-device + load_weights reads the same weights as load_model; save_model gathers;
the frozen reference model of the KL term is sharded in bf16 and its log-probs are the whole model's."""

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from checkpoint import load_trainable
from model import Config, Qwen, load_model, load_weights, save_model, shard_model, token_logprobs

WORLD = 2
# odd sizes on purpose: vocab 101 and 3 q heads do not split evenly over 2 ranks
CFG = Config(model_type="qwen2", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=3, num_key_value_heads=1, head_dim=16, rope_theta=10000.0)


def batch():
    """4 rows, right- and left-padded, with next-token targets and a loss mask"""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, :3] = 0
    mask[3, 4:] = 0
    targets = torch.roll(ids, -1, dims=1)
    loss_mask = mask * torch.roll(mask, -1, dims=1)
    loss_mask[:, -1] = 0
    return ids, mask, targets, loss_mask


def adamw_step(model, ids, mask, targets, loss_mask, n_tokens, scale):
    """token-mean loss over the GLOBAL batch; scale undoes FSDP's averaging of gradients over ranks"""
    # eps 1e-3, not 1e-8: Adam's first step is lr * g / (|g| + eps), which makes a gradient near eps a large step,
    # so the same gradient summed in another order (1.7e-10 apart, at -2.2e-9) moved a weight 2.6e-5 apart on an
    # AMD EPYC; at 1e-3 a step follows its gradient smoothly, and the sharded step is still AdamW's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)
    logp = token_logprobs(model, ids, targets, mask, chunk_size=7)
    loss = -(logp * loss_mask).sum() / n_tokens * scale
    loss.backward()
    opt.step()


def worker(rank, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (WORLD,))
        path = os.path.join(tmp, "ckpt")
        ids, mask, targets, loss_mask = batch()
        n_tokens = loss_mask.sum()

        # 1. the reference: one process, whole batch
        ref = load_model(path)
        adamw_step(ref, ids, mask, targets, loss_mask, n_tokens, scale=1.0)

        # 2. meta device -> shard -> each rank reads its rows: same weights as load_model
        m = load_model(path, device="meta")
        shard_model(m, mesh=mesh, param_dtype=None)
        load_weights(m, path, device="cpu")
        full = load_model(path)
        for name, p in m.named_parameters():
            assert torch.equal(p.full_tensor(), full.get_parameter(name)), name
        assert any(p.to_local().shape != p.shape for p in m.parameters())  # really sharded

        # 3. each rank takes half the rows; checkpointed layers under FSDP too
        m.gradient_checkpointing = True
        rows = slice(rank * 2, rank * 2 + 2)
        adamw_step(m, ids[rows], mask[rows], targets[rows], loss_mask[rows], n_tokens, scale=WORLD)
        for name, p in m.named_parameters():
            # grads too: Adam's first step barely depends on the gradient's scale
            assert torch.allclose(p.grad.full_tensor(), ref.get_parameter(name).grad, atol=1e-6), name
            assert torch.allclose(p.full_tensor(), ref.get_parameter(name), atol=1e-5), name

        # 3b. the output layer only at the loss positions (train_rl.py's update), rank 1 asking for none (a
        # micro-batch without sampled tokens): the gradients of the whole head, and no rank left waiting
        where = loss_mask.bool()
        where[2:] = False
        for model, r, scale in ((ref, slice(None), 1.0), (m, rows, WORLD)):
            model.zero_grad()
            logp = token_logprobs(model, ids[r], targets[r], mask[r], chunk_size=7, where=where[r])
            (-(logp * where[r]).sum() / n_tokens * scale).backward()
        for name, p in m.named_parameters():
            assert torch.allclose(p.grad.full_tensor(), ref.get_parameter(name).grad, atol=1e-5), name

        # 4. save gathers one param at a time, rank 0 writes
        save_model(m, os.path.join(tmp, "saved"))
        dist.barrier()
        if rank == 0:
            back = load_model(os.path.join(tmp, "saved"))
            for name, p in back.named_parameters():
                assert torch.allclose(p, ref.get_parameter(name), atol=1e-5), name
    finally:
        dist.destroy_process_group()


def test_fsdp_step_matches_single_process(tmp_path):
    torch.manual_seed(0)
    save_model(Qwen(CFG), str(tmp_path / "ckpt"))
    mp.spawn(worker, args=(str(tmp_path),), nprocs=WORLD, join=True)


def reference_worker(rank, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        path = os.path.join(tmp, "ckpt")
        ids, mask, targets, loss_mask = batch()
        # train_rl.py's reference with dtype bf16: FSDP2 shards held in bf16, no gradients
        ref = load_trainable(path, "cpu", torch.bfloat16, frozen=True)
        for name, p in ref.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == torch.bfloat16, name
            assert not p.requires_grad, name
        assert any(p.to_local().shape != p.shape for p in ref.parameters())  # really sharded
        # its no_grad forward gives the log-probs of the whole model in bf16, bit for bit
        with torch.no_grad():
            logp = token_logprobs(ref, ids, targets, mask, chunk_size=7, where=loss_mask.bool())
            whole_model = load_model(path, dtype=torch.bfloat16)
            whole = token_logprobs(whole_model, ids, targets, mask, chunk_size=7, where=loss_mask.bool())
        assert torch.equal(logp, whole)
        # FSDP2 leaves the root's weights gathered after a forward (for a backward): reshard frees them
        assert not isinstance(ref.model.embed_tokens.weight, DTensor)
        ref.reshard()
        assert isinstance(ref.model.embed_tokens.weight, DTensor)
        # a checkpoint's fp32 shards (state/: a stage's starting model) read into the bf16 reference
        policy = load_trainable(path, "cpu", torch.float32)
        state = os.path.join(tmp, "step", "state")
        dcp.save({"model": get_model_state_dict(policy)}, checkpoint_id=state)
        if rank == 0:
            shutil.copy(os.path.join(path, "config.json"), os.path.join(tmp, "step"))
        dist.barrier()
        ref = load_trainable(os.path.join(tmp, "step"), "cpu", torch.bfloat16, frozen=True)
        for (name, p), master in zip(ref.named_parameters(), policy.parameters()):
            assert torch.equal(p.full_tensor(), master.full_tensor().bfloat16()), name
    finally:
        dist.destroy_process_group()


def test_the_kl_reference_is_sharded_in_bf16_and_frozen(tmp_path):
    torch.manual_seed(0)
    save_model(Qwen(CFG), str(tmp_path / "ckpt"))
    mp.spawn(reference_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)

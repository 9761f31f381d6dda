"""model.py against transformers' own Qwen3 / Qwen2 on tiny random configs (fp32, CPU, no downloads)."""

import itertools
import json
import os
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import model as model_module
from common import pack, pack_sorted
from checkpoint import load_trainable
from grpo_roc import policy_loss
from model import Config, KVCache, Qwen, collate, load_model, save_model, token_logprobs

V = 101  # odd vocab on purpose

# (name, transformers class, config kwargs): GQA ratios 3:1 and 6:2, tied and untied, both families
CONFIGS = [
    ("qwen3-3q1kv", Qwen3ForCausalLM, Qwen3Config, dict(num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    ("qwen3-6q2kv-tied", Qwen3ForCausalLM, Qwen3Config, dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                                             tie_word_embeddings=True)),
    ("qwen2-6q2kv", Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=6, num_key_value_heads=2)),
    ("qwen2-3q1kv-tied", Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=3, num_key_value_heads=1,
                                                             tie_word_embeddings=True)),
]


@torch.no_grad()
def randomize(model, seed):
    """weights that give O(1) activations and peaked logits (HF's 0.02 init makes everything near-uniform)"""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * r)
        elif name.endswith("bias"):
            p.copy_(0.2 * r)
        elif "embed_tokens" in name:
            p.copy_(r)
        else:
            p.copy_(r / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module", params=CONFIGS, ids=[c[0] for c in CONFIGS])
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory, that directory)"""
    name, hf_cls, cfg_cls, kw = request.param
    cfg = cfg_cls(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, **kw)
    torch.manual_seed(0)
    hf = hf_cls._from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32).eval()
    randomize(hf, seed=1)
    path = str(tmp_path_factory.mktemp(name))
    hf.save_pretrained(path)
    return hf, load_model(path), path


def padded_batch():
    """3 rows of length 12: left-padded (7 real), full, right-padded (4 real)"""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, 4:] = 0
    return ids, mask


def test_matches_transformers_on_padded_batch(pair):
    hf, ours, _ = pair
    ids, mask = padded_batch()
    # transformers takes positions from the caller; counting real tokens makes left padding harmless
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = F.log_softmax(hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits, -1)
        got = F.log_softmax(ours(ids, mask), -1)
        unpadded = F.log_softmax(ours(ids[1:2]), -1)  # the full row with no mask at all
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max() < 1e-4
    assert (unpadded[0] - ref[1]).abs().max() < 1e-4
    # the left-padded row equals the same tokens run alone
    with torch.no_grad():
        alone = F.log_softmax(ours(ids[0:1, 5:]), -1)
    assert (alone[0] - got[0, 5:]).abs().max() < 1e-4
    # right padding alone (how collate pads an update's micro-batch) takes plain causal attention, no mask
    with torch.no_grad():
        right = F.log_softmax(ours(ids[1:], mask[1:]), -1)
    assert (right[real[1:]] - ref[1:][real[1:]]).abs().max() < 1e-4


def test_packed_segments_equal_separate_runs(pair):
    _, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (5, 3, 6, 9)]
    # row 0: segments 1, 2, 3 then one pad; row 1: segment 1 (9 tokens) then 6 pads
    ids = torch.zeros(2, 15, dtype=torch.long)
    mask = torch.zeros(2, 15, dtype=torch.long)
    start = 0
    for seg, s in enumerate(seqs[:3], start=1):
        ids[0, start:start + len(s)], mask[0, start:start + len(s)] = s, seg
        start += len(s)
    ids[1, :9], mask[1, :9] = seqs[3], 1
    with torch.no_grad():
        packed = ours(ids, mask)
        start = 0
        for s in seqs[:3]:
            assert (packed[0, start:start + len(s)] - ours(s[None])[0]).abs().max() < 1e-4
            start += len(s)
        assert (packed[1, :9] - ours(seqs[3][None])[0]).abs().max() < 1e-4


def test_shared_prompts_run_once_and_give_transformers_values(pair):
    """collate's prompts: rows of one prompt share its first tokens, which only the first such row runs through
    the layers (what an RL micro-batch does with a prompt's trajectories). Every real place's log-probs are
    transformers' on each row run alone; the layers see the real tokens less the shared ones; gradients are
    those of the rows run whole."""
    hf, ours, _ = pair
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (6, 3, 8)]
    # (prompt, response length): a prompt's rows in any order, one row alone, a response of one token
    rows = [(0, 4), (1, 7), (0, 1), (2, 5), (1, 2), (0, 9)]
    seqs = [{"ids": torch.cat([prompts[k], torch.randint(0, V, (n,), generator=g)]).tolist()} for k, n in rows]
    shared = [(k, len(prompts[k])) for k, _ in rows]
    m = collate(seqs, "cpu", packed=False, prompts=shared)
    assert m["shared"].tolist() == [[0, 1, 0, 3, 1, 0], [0, 0, 6, 0, 3, 6]]
    seen = []
    hook = ours.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    got = F.log_softmax(ours(m["ids"], m["seg"], shared=m["shared"]), -1)
    hook.remove()
    assert seen == [(1, int(m["seg"].sum()) - 15)]
    with torch.no_grad():
        for row, seq in enumerate(seqs):
            ref = F.log_softmax(hf(input_ids=torch.tensor([seq["ids"]])).logits[0], -1)
            assert (got[row, :len(seq["ids"])] - ref).abs().max() < 1e-4, row
    # gradients of the log-probs at every row's own places (the shared ones read from elsewhere)
    own = m["seg"].bool() & (torch.arange(m["ids"].shape[1]) >= m["shared"][1][:, None])
    targets = torch.roll(m["ids"], -1, dims=1)
    grads = []
    for kwargs in ({}, {"shared": m["shared"]}):
        ours.zero_grad()
        lp = token_logprobs(ours, m["ids"], targets, m["seg"], where=own, **kwargs)
        lp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4), n
    ours.zero_grad()
    # a row that does not begin with its prompt's tokens is refused, naming it
    with pytest.raises(ValueError, match="sequence 2 does not begin with the 6 prompt tokens of sequence 0"):
        collate([seqs[0], seqs[1], {"ids": seqs[2]["ids"][::-1]}], "cpu", packed=False, prompts=shared[:3])
    ids, mask = padded_batch()  # a left-padded row: no shared prefix to speak of
    with pytest.raises(ValueError, match="right-padded"):
        ours(ids, mask, shared=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="right-padded"):  # no mask: nothing says where a row's tokens end
        ours(ids, shared=torch.zeros(2, 3, dtype=torch.long))


def test_token_logprobs_values_entropy_and_grad(pair):
    _, ours, _ = pair
    ids, mask = padded_batch()
    targets = torch.roll(ids, -1, dims=1)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4)) * mask  # arbitrary per-token weights

    def naive(temperature=1.0):
        logp = F.log_softmax(ours(ids, mask).float() / temperature, -1)
        return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    ours.zero_grad()
    ref_lp, ref_ent = naive()
    (ref_lp * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    for checkpointing in (False, True):
        ours.zero_grad()
        ours.gradient_checkpointing = checkpointing
        # chunk of 5 tokens over 36: several chunks and a ragged last one
        lp, ent = token_logprobs(ours, ids, targets, mask, chunk_size=5, with_entropy=True)
        assert lp.dtype == torch.float32 and lp.shape == ids.shape and not ent.requires_grad
        assert (lp - ref_lp).abs().max() < 1e-4
        assert (ent - ref_ent).abs().max() < 1e-4
        (lp * w).sum().backward()
        for n, p in ours.named_parameters():
            assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n
    ours.gradient_checkpointing = False
    # the output layer only where asked (the loss mask): the same values there, 0 elsewhere, the same
    # gradients of a loss that reads only there; asked nowhere, the head still gets a (zero) gradient
    where = mask.bool() & (torch.arange(ids.shape[1]) % 3 != 0)
    ours.zero_grad()
    ref_lp, ref_ent = naive()
    (ref_lp * w * where).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    lp, ent = token_logprobs(ours, ids, targets, mask, chunk_size=5, with_entropy=True, where=where)
    assert (lp[where] - ref_lp[where]).abs().max() < 1e-4 and (ent[where] - ref_ent[where]).abs().max() < 1e-4
    assert not lp[~where].any() and not ent[~where].any()
    (lp * w).sum().backward()
    for n, p in ours.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n
    # at a sampling temperature: the log-probs, entropy and gradients of softmax(logits / temperature)
    ours.zero_grad()
    ref_lp, ref_ent = naive(0.7)
    (ref_lp * w * where).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    lp, ent = token_logprobs(ours, ids, targets, mask, chunk_size=5, with_entropy=True, where=where,
                             temperature=0.7)
    assert (lp[where] - ref_lp[where]).abs().max() < 1e-4 and (ent[where] - ref_ent[where]).abs().max() < 1e-4
    (lp * w).sum().backward()
    for n, p in ours.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n
    ours.zero_grad()
    lp = token_logprobs(ours, ids, targets, mask, where=torch.zeros_like(where))
    assert not lp.any()
    lp.sum().backward()
    assert ours.head_weight().grad is not None and not ours.head_weight().grad.any()
    ours.zero_grad()
    with torch.no_grad():  # default chunk size, no entropy: one chunk, a plain tensor back
        assert (token_logprobs(ours, ids, targets, mask) - naive()[0]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(ours, ids, targets[:, :-1])
    with pytest.raises(ValueError, match="where shape"):
        token_logprobs(ours, ids, targets, where=where[:, :-1])
    with pytest.raises(ValueError, match="attention_mask shape"):
        ours(ids, mask[:, :-1])


def test_update_at_loss_positions_from_sorted_micro_batches_matches_the_full_path(pair):
    """train_rl.py's update, today's way against the old one on one mini-batch of trajectories of mixed
    lengths (prompt, sampled tokens, a tool output, more sampled tokens), per-trajectory advantages and
    loss weights, two ranks' plans: the old bins (pack: longest into the emptiest) with the output layer
    at every position vs length-sorted bins (pack_sorted) with it only at the loss mask, and those with a
    prompt run once for its trajectories in a micro-batch (collate's prompts). The summed loss, the entropy
    metric and the gradients agree to float tolerance."""
    _, ours, _ = pair
    g = torch.Generator().manual_seed(5)
    # 5 prompts of 4-11 tokens, taken in turn
    prompt_ids = [torch.randint(0, V, (int(torch.randint(4, 12, (), generator=g)),), generator=g).tolist()
                  for _ in range(5)]
    seqs, prompts = [], []
    for k in range(14):
        prompt = len(prompt_ids[k % 5])
        first, tool, second = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 10), (0, 6), (0, 10)))
        n = prompt + first + tool + second
        ids = prompt_ids[k % 5] + torch.randint(0, V, (n - prompt,), generator=g).tolist()
        prompts.append((k % 5, prompt))
        mask = [0] * (prompt - 1) + [1] * first + [0] * tool + [1] * second
        seqs.append({"ids": ids[:-1], "tgt": ids[1:], "mask": mask,
                     "adv": [float(torch.randn((), generator=g)) * (1 + k % 3)] * (n - 1)})
    n_tokens = sum(sum(s["mask"]) for s in seqs)
    lengths = [len(s["ids"]) for s in seqs]

    def update(bins, at_loss_positions, shared=False):
        ours.zero_grad()
        total, entropy = 0.0, 0.0
        for rank in range(2):  # the two ranks' micro-batches: their gradients add up, as FSDP's reduce does
            for idx in bins[rank::2]:
                m = collate([seqs[i] for i in idx], "cpu", packed=False,
                            prompts=[prompts[i] for i in idx] if shared else ())
                where = m["mask"].bool() if at_loss_positions else None
                lp, ent = token_logprobs(ours, m["ids"], m["tgt"], m["seg"], chunk_size=7, with_entropy=True,
                                         where=where, shared=m.get("shared"))
                loss = policy_loss(lp, lp.detach() - 0.1 * m["mask"], m["adv"], m["mask"], num_tokens=n_tokens)
                loss.backward()
                total, entropy = total + float(loss.detach()), entropy + float((ent * m["mask"]).sum() / n_tokens)
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e9)
        return total, entropy, float(norm), {n: p.grad.clone() for n, p in ours.named_parameters()}
    old_bins, new_bins = pack(lengths, 80, 2), pack_sorted(lengths, 80, 2)
    slots = [sum(len(b) * max(lengths[i] for i in b) for b in bins if b) for bins in (old_bins, new_bins)]
    assert slots[1] < slots[0]  # less padding: what the sorting is for
    old = update(old_bins, False)
    for new in (update(new_bins, True), update(new_bins, True, shared=True)):
        assert abs(new[0] - old[0]) < 1e-5 and abs(new[1] - old[1]) < 1e-4 and abs(new[2] - old[2]) < 1e-4 * old[2]
        for n in old[3]:
            assert torch.allclose(new[3][n], old[3][n], atol=1e-5, rtol=1e-4), n
    # some micro-batch held two trajectories of a prompt: the shared arm shared something
    assert any(len({prompts[i][0] for i in b}) < len(b) for b in new_bins if b)
    ours.zero_grad()


def test_entropy_is_computed_once_off_the_graph(pair, monkeypatch):
    """the entropy metric: one softmax per chunk in the forward, none in the backward's recompute of the
    checkpointed chunks (which rebuilds only the log-probs), whether or not the checkpoint stops its
    recompute early (torch's default, which hid the old recompute); the log-probs' gradients as without it"""
    _, ours, _ = pair
    ids, mask = padded_batch()
    targets = torch.roll(ids, -1, dims=1)
    calls, softmax = [], torch.Tensor.softmax
    monkeypatch.setattr(torch.Tensor, "softmax", lambda self, *a, **k: calls.append(1) or softmax(self, *a, **k))
    for early_stop in (True, False):
        grads = []
        for with_entropy in (False, True):
            ours.zero_grad()
            calls.clear()
            with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
                out = token_logprobs(ours, ids, targets, mask, chunk_size=5, with_entropy=with_entropy)
                lp = out[0] if with_entropy else out
                lp.sum().backward()
            assert len(calls) == (-(-ids.numel() // 5) if with_entropy else 0)  # 8 chunks of <= 5 tokens
            grads.append([p.grad.clone() for p in ours.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    ours.zero_grad()


def test_save_then_transformers_load(pair, tmp_path, monkeypatch):
    hf, ours, _ = pair
    fresh = Qwen(ours.cfg)  # a model only we have touched
    randomize(fresh, seed=5)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = fresh(ids)
    for shard_bytes, n_files in ((5 * 2**30, 1), (20_000, None)):
        out = tmp_path / f"shard{shard_bytes}"
        save_model(fresh, str(out), max_shard_bytes=shard_bytes)
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        if n_files == 1:
            assert files == ["model.safetensors"]
        else:
            assert len(files) > 2
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"]) == set(dict(fresh.named_parameters()))
            assert set(index["weight_map"].values()) == set(files)
        back = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32, attn_implementation="sdpa")
        assert type(back) is type(hf)
        for name, p in fresh.named_parameters():  # bit-identical weights under the same names
            assert torch.equal(back.get_parameter(name), p), name
        with torch.no_grad():
            assert (back(input_ids=ids).logits - ref).abs().max() < 1e-4  # different kernels, same math
            assert torch.equal(load_model(str(out))(ids), ref)
    # re-saving unsharded into the sharded directory must not leave the old index behind
    save_model(fresh, str(out))
    assert sorted(f for f in os.listdir(out) if f.startswith("model")) == ["model.safetensors"]
    # a save cut short (a kill, a full disk) in its second shard leaves no config.json: nothing there
    # reads as a model (train_sft's final save into out_dir left the earlier config beside a short file)
    real_save_file = model_module.save_file
    written = []

    def fail_on_the_second(tensors, filename, metadata):
        if written:
            raise OSError(28, "No space left on device")
        written.append(filename)
        real_save_file(tensors, filename, metadata=metadata)
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "save_file", fail_on_the_second)
        with pytest.raises(OSError, match="No space left"):
            save_model(fresh, str(out), max_shard_bytes=20_000)
    assert not (out / "config.json").exists() and len(written) == 1
    save_model(fresh, str(out))
    # a directory with a config and no weights is refused, named
    os.remove(out / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=f"{out}: neither model.safetensors nor"):
        load_model(str(out))


def test_incremental_decoding_matches_full_forward(pair):
    check_decoding(pair[1], page_size=5)


def test_batched_prefill_of_rows_at_different_lengths(pair):
    check_batched_prefill(pair[1], page_size=4)


def test_paged_rows_longer_than_a_page(pair):
    check_pages(pair[1], page_size=16)


def forward_grown(ours, ids, cache, rows, **kw):
    """forward_cached after giving each row the pages its real tokens need (the engine's job)"""
    idx = list(range(cache.num_rows))[rows] if isinstance(rows, slice) else torch.as_tensor(rows).tolist()
    n = kw.get("n_new") or [ids.shape[1]] * len(idx)
    for r, k in zip(idx, n):
        cache.grow(r, int(cache.lengths[r]) + k)
    return ours.forward_cached(ids, cache, rows, **kw)


def check_batched_prefill(ours, page_size):
    """one forward with right-padded new tokens (n_new) == the full forward over each row's sequence,
    for rows that already hold different lengths; the padding never shows up afterwards"""
    g = torch.Generator().manual_seed(3)
    cache = KVCache(ours.cfg, num_rows=4, max_len=32, device="cpu", dtype=torch.float32, page_size=page_size)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (0, 4, 9, 2)]
    with torch.no_grad():
        for r, p in enumerate(seqs):
            if len(p):
                forward_grown(ours, p[None], cache, slice(r, r + 1))
        new = [torch.randint(0, V, (n,), generator=g) for n in (6, 1, 3, 6)]  # a prompt, tool responses
        ids = torch.stack([F.pad(t, (0, 6 - len(t)), value=V - 1) for t in new])  # right padding
        rows = torch.tensor([2, 0, 3, 1])  # any order of rows
        out = forward_grown(ours, ids[rows], cache, rows, last_only=True, n_new=[len(new[r]) for r in rows])
        assert out.shape == (4, 1, V) and cache.lengths.tolist() == [len(s) + len(t) for s, t in zip(seqs, new)]
        # the padding took no pages: each row holds exactly the pages of its real tokens
        assert cache.npages == [cache.pages(len(s) + len(t)) for s, t in zip(seqs, new)]
        for b, r in enumerate(rows.tolist()):
            seqs[r] = torch.cat([seqs[r], new[r]])
            assert (out[b, 0] - ours(seqs[r][None])[0, -1]).abs().max() < 1e-4, f"row {r}"
        step = torch.randint(0, V, (4, 1), generator=g)  # a decode step after it: the pads are invisible
        out = forward_grown(ours, step, cache, slice(0, 4))
        for r in range(4):
            assert (out[r, 0] - ours(torch.cat([seqs[r], step[r]])[None])[0, -1]).abs().max() < 1e-4, f"row {r}"
        with pytest.raises(ValueError, match="n_new"):
            ours.forward_cached(ids[:2], cache, slice(0, 2), n_new=[7, 1])


def check_decoding(ours, page_size):
    """prefill rows at different lengths, share a prefix, decode over slice and permuted rows, extend
    one row by several tokens: every logit equals the full forward over the row's whole sequence"""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (3, 7, 5, 1)]
    cache = KVCache(ours.cfg, num_rows=5, max_len=24, device="cpu", dtype=torch.float32, page_size=page_size)
    seqs, logits = [], []  # per row: all tokens fed, and the logits each one produced
    with torch.no_grad():
        # 1. prefill rows 0..3 one at a time, at different lengths
        for r, p in enumerate(prompts):
            out = forward_grown(ours, p[None], cache, slice(r, r + 1), last_only=r == 2)
            seqs.append(p.clone())
            if r == 2:  # last_only: just the logits that predict the next token
                full = ours(p[None])[0]
                assert out.shape == (1, 1, V) and (out[0] - full[-1:]).abs().max() < 1e-4
                out = full[None]
            logits.append(out[0])
        assert cache.lengths.tolist() == [3, 7, 5, 1, 0]
        # 2. row 4 shares row 1's prompt (prefix sharing)
        cache.share(1, [4])
        seqs.append(seqs[1].clone())
        logits.append(logits[1].clone())
        # 3. decode steps over all rows: slice rows, then a permuted LongTensor, then a multi-token extension;
        # rows grow a page at a time, in turn, so their pages are scattered through the pool. Two steps in a
        # row over the same rows: the second reuses the first's gather of the keys (SDPA), unless it needs a
        # page more
        gathers, gather = [], cache.gather  # per layer and forward: the rows gathered afresh (None: all of them)
        cache.gather = lambda *a: gathers.append(a[2]) or gather(*a)
        perm = torch.randperm(5, generator=g)
        for step in range(6):
            new = torch.randint(0, V, (5, 1), generator=g)
            if step % 4 < 2:
                order = torch.arange(5)
                out = forward_grown(ours, new, cache, slice(0, 5))
            else:
                order = perm
                out = forward_grown(ours, new[order], cache, order)
            for b, r in enumerate(order.tolist()):  # output row b belongs to cache row order[b]
                seqs[r] = torch.cat([seqs[r], new[r]])
                logits[r] = torch.cat([logits[r], out[b]])
            if step == 2:  # a "tool response" of 4 tokens into row 2 only
                ext = torch.randint(0, V, (1, 4), generator=g)
                out = forward_grown(ours, ext, cache, torch.tensor([2]))
                seqs[2] = torch.cat([seqs[2], ext[0]])
                logits[2] = torch.cat([logits[2], out[0]])
        # a row released and refilled in place (a trajectory ends, the next prompt takes its row) with as many
        # tokens as it held: the step after it gathers that row alone (its version changed, not its length),
        # the others read the keys kept from the step before
        for refill in (False, True):
            if refill:
                cache.release(3)
                seqs[3] = torch.randint(0, V, (len(seqs[3]),), generator=g)
                logits[3] = forward_grown(ours, seqs[3][None], cache, torch.tensor([3]))[0]
            new = torch.randint(0, V, (5, 1), generator=g)
            out = forward_grown(ours, new, cache, slice(0, 5))
            for r in range(5):
                seqs[r], logits[r] = torch.cat([seqs[r], new[r]]), torch.cat([logits[r], out[r]])
        assert cache.lengths.tolist() == [len(s) for s in seqs]
        L = ours.cfg.num_hidden_layers
        assert cache.flash or [s.tolist() for s in gathers[-L:]] == [[3]] * L
        # 8 forwards went through the kept gather: some gathered no row afresh
        assert cache.flash or 0 < sum(s is None or len(s) > 0 for s in gathers) < 8 * L
        for r in range(5):
            ref = F.log_softmax(ours(seqs[r][None])[0], -1)
            assert (F.log_softmax(logits[r], -1) - ref).abs().max() < 1e-4, f"row {r}"
        # 4. tokens beyond a row's pages are an error, and leave lengths alone
        with pytest.raises(ValueError, match="overflow"):
            ours.forward_cached(torch.zeros(1, cache.npages[0] * page_size, dtype=torch.long), cache, slice(0, 1))
        assert cache.lengths.tolist() == [len(s) for s in seqs]
        with pytest.raises(RuntimeError, match="max_len"):
            cache.grow(0, 25)
        # 5. released rows give their pages back; all pages free at the end
        used = cache.num_pages - cache.free_pages()
        cache.release(3)
        assert cache.lengths[3] == 0 and cache.free_pages() == cache.num_pages - used + cache.pages(len(seqs[3]))
        for r in (0, 1, 2, 4):
            cache.release(r)
        assert cache.free_pages() == cache.num_pages and not any(cache.refs)
        # k and v, 2 layers, 5 rows of ceil(24 / page_size) pages + the spare page of static decode steps, fp32
        slots = (5 * cache.pages(24) + 1) * page_size
        pools = [pool for layer in cache.layers for pool in layer]
        assert sum(pool.nbytes for pool in pools) == 2 * 2 * slots * ours.cfg.num_key_value_heads * ours.cfg.head_dim * 4
        assert len({pool.data_ptr() for pool in pools}) == 4  # each pool its own tensor (static_step writes in place)


def check_pages(ours, page_size):
    """rows several pages long: prompts prefilled together, one shared (its full pages by reference, its
    partial page copied), a released row's pages reused by the next prompt, decode steps over all rows in
    a permuted order; every row's last logits equal the full forward, and the page counts add up"""
    g = torch.Generator().manual_seed(11)
    ps = page_size
    lens = (2 * ps + 3, 5, 3 * ps + 1)
    cache = KVCache(ours.cfg, num_rows=4, max_len=4 * ps, device="cpu", dtype=torch.float32, page_size=ps,
                    num_pages=10)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lens]
    with torch.no_grad():
        ids = torch.stack([F.pad(s, (0, max(lens) - len(s))) for s in seqs])
        forward_grown(ours, ids, cache, torch.arange(3), last_only=True, n_new=list(lens))
        assert cache.free_pages() == 10 - 3 - 1 - 4
        cache.share(0, [3])  # 2 full pages shared, the partial third copied
        seqs.append(seqs[0].clone())
        assert cache.free_pages() == 1 and cache.refs[int(cache.table[0, 0])] == 2
        assert cache.table[3, :2].tolist() == cache.table[0, :2].tolist() and cache.table[3, 2] != cache.table[0, 2]
        cache.release(1)  # its page goes to a new prompt of 1.5 pages
        seqs[1] = torch.randint(0, V, (ps + ps // 2,), generator=g)
        forward_grown(ours, seqs[1][None], cache, [1])
        assert cache.free_pages() == 0
        for _ in range(3):
            order = torch.randperm(4, generator=g)
            new = torch.randint(0, V, (4, 1), generator=g)
            # the pool is full, and no row needs a new page for these steps
            assert all(cache.pages(int(cache.lengths[r]) + 1) <= cache.npages[r] for r in range(4))
            out = ours.forward_cached(new[order], cache, order)
            for b, r in enumerate(order.tolist()):
                seqs[r] = torch.cat([seqs[r], new[r]])
                assert (out[b, 0] - ours(seqs[r][None])[0, -1]).abs().max() < 1e-4, f"row {r}"
        for r in range(4):
            cache.release(r)
        assert cache.free_pages() == 10 and not any(cache.refs)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """flash_attn_varlen_func as documented, in loops: (N, H, hd) tokens, sequences cut at cu_seqlens"""
    assert causal and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and cu_q[-1] == q.shape[0]
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    rep, out = q.shape[1] // k.shape[1], torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs = q[s:e].transpose(0, 1)  # (H, n, hd)
        ks, vs = (z[s:e].repeat_interleave(rep, 1).transpose(0, 1) for z in (k, v))  # (H, n, hd)
        scores = (qs @ ks.transpose(1, 2)) / q.shape[-1] ** 0.5  # (H, n, n)
        scores = scores.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def reference_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                      block_table=None, causal=False):
    """flash_attn_with_kvcache as documented, in loops. With block_table (B, max_blocks) int32 the caches are
    pools (num_blocks, page_block_size, Hkv, hd), page_block_size a multiple of 256, and row b's key j lives
    in block block_table[b, j // page_block_size]. k/v, if given, are written at cache_seqlens first; the
    attention is bottom-right causal: query t sees keys j <= seqlen_k - T + t (seqlen_k = cache_seqlens + T
    with k, else cache_seqlens)."""
    assert causal and cache_seqlens.dtype == torch.int32
    B, T, H, hd = q.shape
    rep, out = H // k_cache.shape[2], torch.empty_like(q)
    if block_table is not None:
        assert cache_batch_idx is None and block_table.dtype == torch.int32 and block_table.shape[0] == B
        assert k_cache.shape[1] % 256 == 0, "page_block_size must be a multiple of 256"
    for b in range(B):
        r, n = b if cache_batch_idx is None else int(cache_batch_idx[b]), int(cache_seqlens[b])
        if block_table is None:
            where = [(r, j) for j in range(k_cache.shape[1])]  # (cache row, slot) of key j
        else:
            ps = k_cache.shape[1]
            where = [(int(block_table[b, j // ps]), j % ps) for j in range(block_table.shape[1] * ps)]
        if k is not None:
            for t in range(T):
                k_cache[where[n + t]], v_cache[where[n + t]] = k[b, t], v[b, t]
        S = n + T if k is not None else n
        ks, vs = (torch.stack([c[where[j]] for j in range(S)]).repeat_interleave(rep, 1).transpose(0, 1)
                  for c in (k_cache, v_cache))  # (H, S, hd)
        scores = (q[b].transpose(0, 1) @ ks.transpose(1, 2)) / hd ** 0.5  # (H, T, S)
        visible = torch.arange(S)[None] <= S - T + torch.arange(T)[:, None]
        out[b] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


def test_flash_bookkeeping_against_reference_kernels(pair, monkeypatch):
    """no GPU here: stand in for the two flash-attn kernels with loop implementations of their documented
    semantics, to check everything around them (varlen indices, cu_seqlens, page pool layout, page tables)"""
    _, ours, _ = pair
    ids, mask = padded_batch()
    with torch.no_grad():
        sdpa_padded, sdpa_plain = ours(ids, mask), ours(ids)
        monkeypatch.setattr(model_module, "use_flash", lambda device, dtype: True)
        monkeypatch.setattr(model_module, "flash_attn_varlen_func", reference_varlen)
        monkeypatch.setattr(model_module, "flash_attn_with_kvcache", reference_kvcache)
        assert (ours(ids, mask) - sdpa_padded)[mask.bool()].abs().max() < 1e-4
        assert (ours(ids) - sdpa_plain).abs().max() < 1e-4
        # the paged path: flash-attn wants pages of a multiple of 256 tokens
        with pytest.raises(ValueError, match="256"):
            KVCache(ours.cfg, 2, 8, "cpu", torch.float32, page_size=16)
        check_decoding(ours, page_size=256)
        check_batched_prefill(ours, page_size=256)
        check_pages(ours, page_size=256)
    pool_layout = (256, ours.cfg.num_key_value_heads, ours.cfg.head_dim)  # (page_size, Hkv, hd)
    assert KVCache(ours.cfg, 2, 8, "cpu", torch.float32, page_size=256).layers[0][0].shape[1:] == pool_layout


def test_compiled_steps_go_through_flash_attns_kernel(monkeypatch):
    """flash-attn's paged kernel is a C++ extension torch.compile cannot trace (flash-attention issue 1386), and a
    compiled decode step (fullgraph) through it raised. A stand-in dynamo cannot look into either (the reference
    kernel behind torch.compiler.disable) must now give the compiled steps the eager tokens, through the operator
    model.flash_decode; eager steps call the kernel itself, never the operator (it costs a dispatch a call)."""
    monkeypatch.setattr(model_module, "use_flash", lambda device, dtype: True)
    monkeypatch.setattr(model_module, "flash_attn_with_kvcache", torch.compiler.disable(reference_kvcache))
    model_module.paged_flash.cache_clear()
    cfg = Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    net = Qwen(cfg).eval()

    def tokens(mode):
        net.decode_mode = mode
        cache = KVCache(cfg, 2, 300, "cpu", torch.float32, page_size=256)
        assert cache.flash
        for row in (0, 1):
            cache.grow(row, 300)
        ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
        logits = net.forward_cached(ids, cache, [0, 1], last_only=True, n_new=[5, 3])
        out = []
        for _ in range(4):  # greedy: a flipped token shows
            out.append(logits[:, -1].argmax(-1))
            logits = net.forward_cached(out[-1][:, None], cache, [0, 1])
        return torch.stack(out).tolist(), logits

    operator = model_module.flash_decode

    def no_operator(*args):
        raise AssertionError("an eager step went through the operator")
    monkeypatch.setattr(model_module, "flash_decode", no_operator)
    eager, eager_logits = tokens("eager")
    monkeypatch.setattr(model_module, "flash_decode", operator)
    compiled, compiled_logits = tokens("compile")
    model_module.paged_flash.cache_clear()
    assert compiled == eager and torch.allclose(compiled_logits, eager_logits, atol=1e-5)


def test_load_in_bf16_and_config(pair):
    hf, _, path = pair
    bf = load_model(path, dtype=torch.bfloat16)
    for name, p in bf.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, hf.get_parameter(name).to(torch.bfloat16)), name
    names = set(dict(bf.named_parameters()))
    assert names == set(dict(hf.named_parameters())) - ({"lm_head.weight"} if bf.cfg.tie_word_embeddings else set())
    assert load_model(path, device="meta").model.embed_tokens.weight.is_meta


def test_load_skips_stored_rotary_inv_freq(pair, tmp_path):
    """Older exports store rope's inv_freq buffer beside the weights; it is recomputed from the config, so
    load_model skips it rather than failing on a tensor that matches no parameter."""
    hf, ours, path = pair
    shutil.copy(f"{path}/config.json", tmp_path)
    tensors = load_file(f"{path}/model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(ours.cfg.head_dim // 2)
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(tmp_path))
    for name, p in ours.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name


def test_config_rejects_unsupported(tmp_path):
    base = Config(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=16).to_dict(torch.float32)
    for bad, msg in ((dict(model_type="llama"), "model_type"), (dict(hidden_act="gelu"), "hidden_act"),
                     (dict(use_sliding_window=True), "sliding"),
                     (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **bad}))
        with pytest.raises(ValueError, match=msg):
            Config.from_json(str(tmp_path))
    # a size the file leaves out is an error naming it, not the 14B default
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in base.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match="config.json: no vocab_size"):
        Config.from_json(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(base))
    assert Config.from_json(str(tmp_path)) == Config(**{k: base[k] for k in Config.__dataclass_fields__})


def test_share_hands_every_sample_the_prompt_at_once():
    """KVCache.share(src, dsts), as the engine calls it for a prompt's samples: each holds src's full pages by
    reference and a page of its own with a copy of src's partly filled last one, in every layer's pools, copied for
    all the samples together; a sample writing into its page leaves src and the other samples alone. An empty
    list does nothing, and a row that holds tokens already is refused."""
    cfg = types.SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=4)
    ps = 4
    cache = KVCache(cfg, num_rows=5, max_len=4 * ps, device="cpu", dtype=torch.float32, page_size=ps)
    g = torch.Generator().manual_seed(0)
    for pool in itertools.chain(*cache.layers):
        pool.copy_(torch.randn(pool.shape, generator=g))
    cache.grow(0, 2 * ps + 3)
    cache.lengths[0] = 2 * ps + 3
    before = [pool.clone() for pool in itertools.chain(*cache.layers)]
    cache.share(0, [])
    assert cache.free_pages() == cache.num_pages - 3
    cache.share(0, [1, 3, 4])
    src_pages = cache.table[0, :3].tolist()
    own = [int(cache.table[dst, 2]) for dst in (1, 3, 4)]
    assert len(set(own) | {src_pages[2]}) == 4 and cache.free_pages() == cache.num_pages - 6
    assert [cache.refs[page] for page in src_pages] == [4, 4, 1] and all(cache.refs[p] == 1 for p in own)
    for dst in (1, 3, 4):
        assert cache.table[dst, :2].tolist() == src_pages[:2]
        assert int(cache.lengths[dst]) == 2 * ps + 3 and int(cache.npages[dst]) == 3
    for pool, old in zip(itertools.chain(*cache.layers), before):
        # (Hkv, pages, ps, hd): src's pages as they were, each own page a copy of src's last
        assert torch.equal(pool[:, src_pages], old[:, src_pages])
        for page in own:
            assert torch.equal(pool[:, page], old[:, src_pages[2]])
    cache.layers[0][0][:, own[0], 3] = 7.0  # sample 1's next token
    assert not (cache.layers[0][0][:, [src_pages[2], *own[1:]], 3] == 7.0).any()
    with pytest.raises(ValueError, match="share: row 3 is not empty"):
        cache.share(0, [3])


def test_paged_flash_is_tried_once_and_falls_back_to_sdpa(monkeypatch, capsys):
    """A flash-attn without paged decoding (e.g. its Triton AMD backend) is found out at start, said once, and
    the KV cache is read through SDPA instead of failing at the first decode step."""
    import model
    calls = []

    def no_block_table(q, k, v, cache_seqlens, block_table, causal):
        calls.append(block_table.shape)
        raise NotImplementedError("block_table is not supported")
    model.paged_flash.cache_clear()
    monkeypatch.setattr(model, "flash_attn_with_kvcache", no_block_table)
    assert not model.paged_flash("cpu", torch.bfloat16) and not model.paged_flash("cpu", torch.bfloat16)
    assert calls == [(1, 1)] and capsys.readouterr().out.count("cannot decode through a page table") == 1
    model.paged_flash.cache_clear()
    monkeypatch.setattr(model, "flash_attn_with_kvcache", lambda *a, **k: None)
    assert model.paged_flash("cpu", torch.bfloat16)
    model.paged_flash.cache_clear()


def test_sdpa_takes_whatever_memory_layout_the_kernel_returns(monkeypatch):
    """On the first GPU, fp32 attention with a mask raised in model.sdpa: CUDA's SDPA kernels can return the
    (B, Hkv, rep*T, hd) output laid out as (B, rep*T, Hkv, hd), and unfolding the query heads assumed a
    contiguous result (.view). A CPU kernel returning that layout must give the same values."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, heads, 8, generator=g) for heads in (6, 2, 2))  # GQA 3:1, 5 queries
    mask = torch.rand(2, 5, 5, generator=g) < 0.7
    mask[..., 0] = True  # every query sees a key
    expected = model_module.sdpa(q, k, v, mask)
    kernel = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        y = kernel(*args, **kwargs)
        return y.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads-inner memory layout

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", cuda_layout)
    assert torch.equal(model_module.sdpa(q, k, v, mask), expected)


# -----------------------------------------------------------------------------
# the update's element-wise work fused (issue 45 item 2)

def written_out_rms_norm(norm, x):
    """RMSNorm as model.py wrote it before torch's fused kernel: normalise in fp32, scale in the input dtype"""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_is_bitwise_the_written_out_form(dtype):
    """F.rms_norm gives bitwise the values and gradients of the written-out form, in fp32 (one fused op with the
    weight) and in bf16 (normalised in fp32, scaled in bf16, as transformers does), at the widths of a head
    (q/k norms) and of the hidden state, for small and large activations"""
    g = torch.Generator().manual_seed(7)
    for dim in (16, 32, 48, 128, 5120):
        norm = model_module.RMSNorm(dim, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.2 * torch.randn(dim, generator=g))
        for scale in (1e-3, 1.0, 30.0):
            x = (scale * torch.randn(5, 9, dim, generator=g)).to(dtype).requires_grad_()
            upstream = torch.randn(5, 9, dim, generator=g).to(dtype)
            got, ref = norm(x), written_out_rms_norm(norm, x)
            assert torch.equal(got, ref), (dim, scale)
            grads = [torch.autograd.grad(y, (x, norm.weight), upstream) for y in (got, ref)]
            assert all(torch.equal(a, b) for a, b in zip(*grads)), (dim, scale)


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_gradients(tmp_path):
    """checkpoint.load_trainable(compiled=True) (inductor; the compile_update key): the same
    parameter names as the eager model, and the update's loss and gradients equal the eager path's within float tolerance, on micro-batches of two shapes (one compile serves both: dynamic shapes), with and without activation
    checkpointing; the compiled layers really run (the compiler's frame counter moves)"""
    import torch._dynamo

    cfg = Config(model_type="qwen3", vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    eager = Qwen(cfg)
    randomize(eager, seed=1)
    save_model(eager, str(tmp_path))
    compiled = load_trainable(str(tmp_path), "cpu", torch.float32, compiled=True)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    g = torch.Generator().manual_seed(8)
    batches = []
    for rows, length in ((3, 17), (5, 11)):
        ids = torch.randint(0, V, (rows, length), generator=g)
        seg = (torch.arange(length) < torch.randint(2, length + 1, (rows, 1), generator=g)).long()
        batches.append((ids, torch.roll(ids, -1, 1), seg, torch.randn(rows, length, generator=g) * seg))

    def grads(model, checkpointing):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        for ids, targets, seg, weight in batches:
            (token_logprobs(model, ids, targets, seg, chunk_size=16) * weight).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for checkpointing in (False, True):
        ref, got = grads(eager, checkpointing), grads(compiled, checkpointing)
        for n in ref:
            assert torch.allclose(got[n], ref[n], atol=1e-5, rtol=1e-4), n
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames

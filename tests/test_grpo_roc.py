"""Tests for grpo_roc.py: hand-computed values, an independent loop-based loss, a chi-square test of the
RoC sampling, the released code's sizing rule transcribed as a reference, and a toy policy that learns."""

import itertools
import math
import types

import pytest
import torch

import grading
import grpo_roc
from grpo_roc import advantages, filter_groups, loss_weights, penalty, policy_loss, resample_on_correct


# ----------------------------------------------------------------------------- penalty

def test_penalty_hand_values():
    # penalty(calls, failed calls, answers, turns). no tool call -> p_err 0.5; one answer -> p_format 0
    assert penalty(0, 0, 1, 1) == 0.5
    # 2 failed of 4 calls -> 0.5; 2 answers in 4 turns -> 1/4
    assert penalty(4, 2, 2, 4) == pytest.approx(0.75)
    # no <answer> -> p_format 1; all calls fine -> p_err 0
    assert penalty(2, 0, 0, 3) == 1.0
    # many answers: p_format capped at 1
    assert penalty(1, 1, 5, 2) == 2.0
    # cut by the budget inside the first turn: no turn ended, the worst format penalty (the released
    # code's rule), not an exception that stops the step
    assert penalty(0, 0, 0, 0) == 1.5
    assert penalty(0, 0, 1, 0) == 1.5


def test_overloaded_calls_count_in_neither_side_of_p_err():
    # 1 failed, 1 clean and 2 overloaded calls: p_err 1/2, not 1/4 (overloads counted clean) nor 3/4 (as failures)
    assert penalty(4, 1, 1, 1, num_overloaded=2) == pytest.approx(0.5)
    assert penalty(2, 0, 1, 1, num_overloaded=2) == 0.5  # every call overloaded: as if it made none
    assert penalty(3, 0, 1, 1, num_overloaded=1) == penalty(2, 0, 1, 1) == 0.0
    # the metrics count them the same way: tool/err over the calls that count
    import agent
    assert agent.failed_share(["error", "ok", "overloaded", "overloaded"]) == 0.5
    assert agent.failed_share(["overloaded"]) == 0.0 and agent.failed_share([]) == 0.0
    with pytest.raises(ValueError, match="num_overloaded"):
        penalty(2, 2, 1, 1, num_overloaded=1)  # more failures than calls that count


def test_penalty_bad_input():
    for args in [(1, 2, 1, 1), (0, -1, 1, 1), (0, 0, -1, 1), (0, 0, 1, -1)]:
        with pytest.raises(ValueError, match="num_errors <= num_calls"):
            penalty(*args)


# ----------------------------------------------------------------------------- filter_groups

def test_filter_groups():
    rewards = torch.tensor([[1, 1, 1, 1],
                            [0, 1, 0, 0],
                            [0, 0, 0, 0],
                            [1, 1, 1, 1],
                            [1, 1, 0, 1]])
    keep, n_correct, n_wrong = filter_groups(rewards)
    assert keep.tolist() == [1, 4]
    assert (n_correct, n_wrong) == (2, 1)
    keep, n_correct, n_wrong = filter_groups(torch.zeros(3, 8))
    assert keep.tolist() == [] and (n_correct, n_wrong) == (0, 3)
    # rewards in [0, 1] (partial credit): uniform means all equal
    assert filter_groups(torch.tensor([[0.5, 1.0], [0.5, 0.5]]))[0].tolist() == [0]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        filter_groups(torch.tensor([[1.5, 1.0]]))
    with pytest.raises(ValueError, match="num_groups, 2G"):
        filter_groups(torch.ones(4))


# ----------------------------------------------------------------------------- advantages

def test_advantages_hand_values():
    # mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    # second row: mean 0.5, std sqrt(4 * 0.25 / 3) = 1/sqrt(3)
    s = math.sqrt(3) / 2
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [s, s, -s, -s], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="G >= 2"):
        advantages(torch.ones(3, 1))


def test_advantage_estimators_hand_values_and_one_check():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    centred = torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.5, 0.5, -0.5, -0.5]])
    torch.testing.assert_close(advantages(rewards, "none"), centred)
    # "batch": the centred values over the std of all 8 of them: sqrt((0.75^2 + 3 * 0.25^2 + 4 * 0.25) / 7)
    batch_std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2 + 4 * 0.25) / 7)
    torch.testing.assert_close(advantages(rewards, "batch"), centred / batch_std, atol=1e-5, rtol=1e-5)
    # the shipped estimators are there (a fork may add its own: the user-file test below)
    assert {"std", "none", "batch"} <= set(grpo_roc.ADVANTAGES)
    for key, args in [("adv_scale", ("median", "token", "token")), ("loss_norm", ("std", "tokens", "token")),
                      ("ratio_level", ("std", "token", "group")),
                      ("kl_estimator", ("std", "token", "token", "k4"))]:
        with pytest.raises(ValueError, match=key):
            grpo_roc.check_loss_config(*args)
    grpo_roc.check_loss_config("batch", "group", "sequence")
    # a user's estimator, which train_rl.py loads
    grpo_roc.check_loss_config("my_ideas.py:rloo", "token", "token", "k1")
    with pytest.raises(ValueError, match="scale one of"):
        advantages(rewards, "median")


def test_an_estimator_from_the_users_own_file(tmp_path):
    # the adv_scale seam: "file.py:function" of a file outside the repository, read by the one loader of
    # user code (grading.load_file, which loads the tasks), used as the shipped ones are, RoC's sides too
    (tmp_path / "my_ideas.py").write_text(
        "def doubled(rewards):\n    return 2 * (rewards - rewards.mean(dim=1, keepdim=True))\n")
    doubled = grading.load_file(f"{tmp_path}/my_ideas.py:doubled")
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(advantages(rewards, doubled), torch.tensor([[1.5, -0.5, -0.5, -0.5]]))
    # a kept positive under the kept mean is not pushed down
    side = torch.tensor([[True, False, False, True]])
    torch.testing.assert_close(advantages(rewards, doubled, side), torch.tensor([[1.5, -0.5, -0.5, 0.0]]))
    with pytest.raises(AttributeError, match="'rloo'"):
        grading.load_file(f"{tmp_path}/my_ideas.py:rloo")
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        grading.load_file("nowhere.py:rloo")


def test_rloo_the_worked_example_by_hand():
    # examples/rloo.py (configs/rloo.py): each baseline is the mean of the other G - 1 of the group
    rloo = grading.load_file("examples/rloo.py:rloo")
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.5]])
    expected = torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3],
                             [1 - 1.5 / 3, 1 - 1.5 / 3, -2.5 / 3, 0.5 - 2 / 3]])
    torch.testing.assert_close(advantages(rewards, rloo), expected)
    # = Dr. GRPO's centred rewards x G / (G - 1)
    torch.testing.assert_close(advantages(rewards, rloo), advantages(rewards, "none") * 4 / 3)


def _partial_groups(n, G, seed):
    # n groups of 2G rewards drawn from {0, 0.5, 1}, the uniform ones left out (filter_groups drops them)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (n, 2 * G), generator=g).float() / 2
    return rewards[filter_groups(rewards)[0]], g


def test_advantage_signs_follow_roc_sides_with_partial_rewards():
    # rewards 0 / 0.5 / 1: RoC keeps G of 2G by its sides (positives(): above the 2G mean, or 1); Eq. 7 over the
    # kept G alone gives some kept positive A < 0 (or negative A > 0); with the sides passed, never
    G, flips = 4, 0
    rewards, g = _partial_groups(2000, G, seed=0)
    for row in rewards:
        idx = resample_on_correct(row, torch.rand(2 * G, generator=g), G, g)
        side = grpo_roc.positives(row)[idx]
        plain = advantages(row[idx][None])[0]
        flips += int(((plain < 0) & side).any() | ((plain > 0) & ~side).any())
        adv = advantages(row[idx][None], "std", side[None])[0]
        assert bool((adv[side] >= 0).all()) and bool((adv[~side] <= 0).all()), (row, idx, adv)
    # the rule matters: without it a few percent of the groups disagree (the issue measured 2.8% at G = 8)
    assert 0.005 < flips / len(rewards) < 0.2, flips


def test_sides_change_nothing_for_binary_rewards():
    # 0/1 rewards: a kept 1 is never below the kept mean, a kept 0 never above it: bit for bit the same
    for G in (2, 4, 8):
        for n_pos in range(1, 2 * G):
            rewards, penalties = _group(n_pos, 2 * G - n_pos, seed=n_pos)
            idx = resample_on_correct(rewards, penalties, G, torch.Generator().manual_seed(0))
            for scale in grpo_roc.ADVANTAGES:
                plain = advantages(rewards[idx][None], scale)
                assert torch.equal(advantages(rewards[idx][None], scale, grpo_roc.positives(rewards)[idx][None]), plain)


def test_group_kind_uses_correct_not_reward():
    grade = lambda r, c: types.SimpleNamespace(reward=r, correct=c)  # noqa: E731
    assert grpo_roc.group_kind([grade(1.0, True), grade(0.5, False)]) == "mixed"
    assert grpo_roc.group_kind([grade(0.5, False), grade(0.5, False)]) == "all_wrong"  # uniform, none correct
    assert grpo_roc.group_kind([grade(0.9, True), grade(0.9, True)]) == "all_correct"  # a task's own "correct"


# ----------------------------------------------------------------------------- resample_on_correct

def _group(n_pos, n_neg, seed=0):
    # a shuffled group with n_pos correct and n_neg wrong rollouts and distinct penalties
    g = torch.Generator().manual_seed(seed)
    rewards = torch.cat([torch.ones(n_pos), torch.zeros(n_neg)])[torch.randperm(n_pos + n_neg, generator=g)]
    penalties = torch.rand(n_pos + n_neg, generator=g) * 2
    return rewards, penalties


def test_roc_sample_sizes_every_split():
    # paper rule: k_neg = floor(n_neg/2), k_pos = G - k_neg = ceil(n_pos/2); always exactly G
    gen = torch.Generator().manual_seed(0)
    for G in range(1, 9):
        for n_neg in range(2 * G + 1):
            n_pos = 2 * G - n_neg
            rewards, penalties = _group(n_pos, n_neg, seed=G * 100 + n_neg)
            idx = resample_on_correct(rewards, penalties, G, gen)
            assert idx.dtype == torch.long and len(idx) == G and len(set(idx.tolist())) == G
            assert idx.tolist() == sorted(idx.tolist())
            kept = rewards[idx]
            assert int((kept == 0).sum()) == n_neg // 2, (G, n_neg)
            assert int((kept == 1).sum()) == (n_pos + 1) // 2, (G, n_neg)


def test_roc_sample_hand_sizes_G16():
    gen = torch.Generator().manual_seed(1)
    # n_neg -> (k_pos, k_neg) by hand from floor(n_neg/2), G - that
    for n_neg, (k_pos, k_neg) in {0: (16, 0), 1: (16, 0), 3: (15, 1), 7: (13, 3), 16: (8, 8),
                                  31: (1, 15), 32: (0, 16)}.items():
        rewards, penalties = _group(32 - n_neg, n_neg)
        kept = rewards[resample_on_correct(rewards, penalties, 16, gen)]
        assert (int(kept.sum()), int((kept == 0).sum())) == (k_pos, k_neg), n_neg


def _released_sizes(n_pos, n_neg, n, G, min_pos, min_neg):
    # transcription of the released down_sample/roc.py sizing, as an independent reference
    zero = round(n_neg * G / n)
    nonzero = round(n_pos * G / n)
    if zero < min_neg and nonzero < min_pos:
        return None  # "keep the whole group"; unreachable when min_pos + min_neg <= G
    if zero <= min(min_neg, n_neg):
        zero = min(min_neg, n_neg)
        nonzero = G - zero
    if nonzero <= min(min_pos, n_pos):
        nonzero = min(min_pos, n_pos)
        zero = G - nonzero
    return nonzero, zero


def test_roc_deterministic_hand_sizes_G16():
    # hand-computed: round half to even, then at least 2 of each side (capped by availability)
    # n_neg=5: round(2.5)=2 <= 2 -> 2 neg, 14 pos; n_neg=7: round(3.5)=4, round(12.5)=12;
    # n_neg=9: round(4.5)=4, round(11.5)=12; n_neg=27: pos round(2.5)=2 <= 2 -> 2 pos, 14 neg
    table = {0: (16, 0), 1: (15, 1), 2: (14, 2), 3: (14, 2), 5: (14, 2), 6: (13, 3), 7: (12, 4),
             9: (12, 4), 16: (8, 8), 27: (2, 14), 30: (2, 14), 31: (1, 15), 32: (0, 16)}
    for n_neg, (k_pos, k_neg) in table.items():
        rewards, penalties = _group(32 - n_neg, n_neg)
        kept = rewards[resample_on_correct(rewards, penalties, 16, None, mode="deterministic")]
        assert (int(kept.sum()), int((kept == 0).sum())) == (k_pos, k_neg), n_neg


def test_roc_deterministic_every_split_matches_released_rule():
    for G in (4, 8, 16):
        for n_neg in range(2 * G + 1):
            n_pos = 2 * G - n_neg
            rewards, penalties = _group(n_pos, n_neg, seed=n_neg)
            idx = resample_on_correct(rewards, penalties, G, None, mode="deterministic")
            k_pos, k_neg = _released_sizes(n_pos, n_neg, 2 * G, G, 2, 2)
            assert len(idx) == G and k_pos + k_neg == G
            assert int(rewards[idx].sum()) == k_pos
            assert k_pos >= min(2, n_pos) and k_neg >= min(2, n_neg)
            # positives: the k_pos lowest penalties; negatives: the first k_neg in rollout order
            pos = [i for i in range(2 * G) if rewards[i] == 1]
            neg = [i for i in range(2 * G) if rewards[i] == 0]
            lowest = sorted(pos, key=lambda i: float(penalties[i]))[:k_pos]
            assert sorted(idx.tolist()) == sorted(lowest + neg[:k_neg])


def test_roc_deterministic_ties_keep_rollout_order():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    penalties = torch.tensor([0.5, 0.5, 0.0, 0.5, 0.5, 0.5, 9.0, 9.0])
    idx = resample_on_correct(rewards, penalties, 4, None, mode="deterministic")
    # round(2/2)=1 neg <= 2 -> 2 neg, 2 pos: the 0.0 one, then the first 0.5 in rollout order
    assert idx.tolist() == [0, 2, 6, 7]


def test_roc_bad_input():
    rewards, penalties = _group(5, 3)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="shape"):
        resample_on_correct(rewards, penalties, 5, gen)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        resample_on_correct(rewards * 2, penalties, 4, gen)
    with pytest.raises(ValueError, match=">= 0"):
        resample_on_correct(rewards, -penalties, 4, gen)
    with pytest.raises(ValueError, match="torch.Generator"):
        resample_on_correct(rewards, penalties, 4, None)
    with pytest.raises(ValueError, match="mode"):
        resample_on_correct(rewards, penalties, 4, gen, mode="greedy")
    with pytest.raises(ValueError, match="min_pos"):
        resample_on_correct(rewards, penalties, 4, None, mode="deterministic", min_pos=3, min_neg=2)
    # odd G: the released rule gives round(3.5) + round(3.5) = 8 != 7, the released code asserts too
    rewards, penalties = _group(7, 7)
    with pytest.raises(ValueError, match="even G"):
        resample_on_correct(rewards, penalties, 7, None, mode="deterministic")


def _chi2_sf_5dof(x):
    # exact survival function of the chi-square distribution with 5 degrees of freedom
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2) * (1 + x / 3)


def test_roc_positive_sampling_follows_inverse_penalty():
    # G=4 of 2G=8, 4 positives and 4 negatives: 2 of each kept. Successive draws without replacement
    # with weight w = 1/(p + eps): P({i, j}) = w_i/W * w_j/(W - w_i) + w_j/W * w_i/(W - w_j).
    # The 6 pairs are a multinomial; chi-square with 5 dof at p < 0.001 (critical value 20.515):
    # a correct sampler fails for 1 in 1000 seeds; the seed is fixed, so the test is deterministic.
    # Negatives must be uniform over their 6 pairs, tested the same way.
    eps = 1e-3
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    penalties = torch.tensor([0.25, 3.0, 0.5, 0.0, 1.0, 0.7, 2.0, 0.1])  # negatives' are ignored
    pos, neg = [0, 2, 4, 6], [1, 3, 5, 7]
    w = {i: 1 / (float(penalties[i]) + eps) for i in pos}
    W = sum(w.values())
    pairs = list(itertools.combinations(pos, 2))
    p_pos = {(i, j): w[i] / W * w[j] / (W - w[i]) + w[j] / W * w[i] / (W - w[j]) for i, j in pairs}
    assert sum(p_pos.values()) == pytest.approx(1.0)

    n = 6000
    gen = torch.Generator().manual_seed(1234)
    count_pos, count_neg = {}, {}
    for _ in range(n):
        idx = resample_on_correct(rewards, penalties, 4, gen, eps=eps).tolist()
        kp = tuple(i for i in idx if i in pos)
        kn = tuple(i for i in idx if i in neg)
        count_pos[kp] = count_pos.get(kp, 0) + 1
        count_neg[kn] = count_neg.get(kn, 0) + 1

    def chi2(counts, probs):
        return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())

    assert set(count_pos) <= set(p_pos)
    assert _chi2_sf_5dof(chi2(count_pos, p_pos)) > 0.001
    uniform_neg = {k: 1 / 6 for k in itertools.combinations(neg, 2)}
    assert _chi2_sf_5dof(chi2(count_neg, uniform_neg)) > 0.001
    # power: the same positive counts are far from uniform selection (a sampler ignoring penalties)
    uniform_pos = {k: 1 / 6 for k in pairs}
    assert chi2(count_pos, uniform_pos) > 1000


# ----------------------------------------------------------------------------- policy_loss

def _loss_case():
    # one token per row; ratios 1.5, 0.5, 1.1, 10, 2 with advantages +1, -1, +2, -1, -1
    ratio = torch.tensor([[1.5], [0.5], [1.1], [10.0], [2.0]])
    old = torch.tensor([[-1.0], [-2.0], [-0.5], [-3.0], [-1.5]])
    logprobs = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0, -1.0])
    return logprobs, old, adv, torch.ones(5, 1)


def test_policy_loss_hand_values_and_clipping():
    logprobs, old, adv, mask = _loss_case()
    loss, stats = policy_loss(logprobs, old, adv, mask, return_stats=True)
    # per token: A>0 above 1+0.28 -> -1.28; A<0 below 1-0.2 -> 0.8; inside -> -2.2;
    # A<0 huge ratio is not clipped by plain PPO -> 10; A<0 ratio 2 -> 2
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2 + 10.0 + 2.0) / 5, rel=1e-5)
    loss.backward()
    # d(-rho*A)/dlogp = -rho*A / N on unclipped tokens, 0 on clipped ones
    expected = torch.tensor([[0.0], [0.0], [-2.2 / 5], [10.0 / 5], [2.0 / 5]])
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-5, atol=1e-6)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)


def test_policy_loss_dual_clip():
    logprobs, old, adv, mask = _loss_case()
    loss, stats = policy_loss(logprobs, old, adv, mask, dual_clip=3.0, return_stats=True)
    # the ratio-10 token (A=-1) is capped at -c*A = 3; the ratio-2 token (2 < 3) is untouched
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2 + 3.0 + 2.0) / 5, rel=1e-5)
    loss.backward()
    expected = torch.tensor([[0.0], [0.0], [-2.2 / 5], [0.0], [2.0 / 5]])
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-5, atol=1e-6)
    # the capped token does not count as clipped
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logprobs, old, adv, mask, dual_clip=1.0)


def test_policy_loss_is_token_mean_not_sequence_mean():
    # ratio 1 everywhere, so each token's loss is -A. Row 0 has 1 token (A=+1), row 1 has 3 (A=-1).
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    token_mean = (-1.0 + 3 * 1.0) / 4  # 0.5
    sequence_mean = (-1.0 / 1 + 3 * 1.0 / 3) / 2  # 0.0
    assert token_mean != sequence_mean
    assert policy_loss(lp, lp, adv, mask).item() == pytest.approx(token_mean)


def test_policy_loss_num_tokens_accumulates_to_full_batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    lp = (old + torch.randn(4, 6, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    full = policy_loss(lp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full, lp)
    n = mask.sum()
    micro = policy_loss(lp[:1], old[:1], adv[:1], mask[:1], num_tokens=n) + \
        policy_loss(lp[1:], old[1:], adv[1:], mask[1:], num_tokens=n)
    (g_micro,) = torch.autograd.grad(micro, lp)
    torch.testing.assert_close(micro, full)
    torch.testing.assert_close(g_micro, g_full)
    # without num_tokens the two micro-batch means would weigh rows differently
    naive = policy_loss(lp[:1], old[:1], adv[:1], mask[:1]) + policy_loss(lp[1:], old[1:], adv[1:], mask[1:])
    assert abs(naive.item() - full.item()) > 1e-3


def test_policy_loss_ignores_masked_tokens():
    # tool-output / padding positions (mask 0) may hold anything, even nan or inf: no loss, no gradient
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    lp = torch.tensor([[-0.8, float("nan"), float("inf"), -1.2]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 1]])
    loss = policy_loss(lp, old, torch.tensor([1.0]), mask)
    clean = policy_loss(torch.tensor([[-0.8, -1.2]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([1.0]),
                        torch.ones(1, 2))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(clean.item())
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0
    assert torch.isfinite(lp.grad).all()


def test_policy_loss_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="no 1s"):
        policy_loss(x, x, torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3), num_tokens=0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_loop_formula(dual_clip):
    # the textbook piecewise form of the clipped objective, token by token, as an independent reference:
    # A >= 0: min(rho, 1 + eps_high) * A;  A < 0: max(rho, 1 - eps_low) * A  (and dual: max(that, c * A))
    g = torch.Generator().manual_seed(3)
    B, T = 4, 7
    old = -torch.rand(B, T, generator=g) * 2
    lp = (old + torch.randn(B, T, generator=g) * 0.6).requires_grad_()  # ratios ~0.3..4: clips both sides
    adv = torch.tensor([1.3, -0.7, -2.0, 0.4])
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    loss = policy_loss(lp, old, adv, mask, dual_clip=dual_clip)
    (grad,) = torch.autograd.grad(loss, lp)

    lp2 = lp.detach().clone().requires_grad_()
    total, count = 0.0, 0
    for b in range(B):
        a = float(adv[b])
        for t in range(T):
            if not mask[b, t]:
                continue
            rho = torch.exp(lp2[b, t] - old[b, t])
            if a >= 0:
                obj = torch.clamp(rho, max=1.28) * a
            else:
                obj = torch.clamp(rho, min=0.8) * a
                if dual_clip is not None:
                    obj = torch.clamp(obj, min=dual_clip * a)
            total = total - obj
            count += 1
    direct = total / count
    (grad2,) = torch.autograd.grad(direct, lp2)
    torch.testing.assert_close(loss, direct)
    torch.testing.assert_close(grad, grad2)
    # the example does exercise clipping on both sides
    rho = torch.exp(lp.detach() - old)
    assert ((rho > 1.28) & (adv[:, None] > 0) & (mask > 0)).any()
    assert ((rho < 0.8) & (adv[:, None] < 0) & (mask > 0)).any()


# ----------------------------------------------------------------------------- toy policy

def test_toy_policy_learns_rewarded_sequences():
    # a tiny "policy": an independent categorical over 3 tokens at each of 4 positions. Position 2
    # plays a tool output (mask 0): the policy must never be trained on it. Reward 1 when token 0 is
    # at >= 2 of positions {0, 1, 3}; the whole pipeline runs: filter, RoC 16 -> 8, advantages, loss.
    torch.manual_seed(0)
    logits = torch.zeros(4, 3, requires_grad=True)  # (T, V)
    opt = torch.optim.Adam([logits], lr=0.05)
    gen = torch.Generator().manual_seed(0)
    G, num_groups, T = 8, 4, 4
    mask = torch.tensor([1, 1, 0, 1]).expand(num_groups * G, T)

    def expected_reward():
        p0 = torch.softmax(logits.detach(), -1)[[0, 1, 3], 0]  # (3,)
        return sum(float(p0[0] ** a * (1 - p0[0]) ** (1 - a) * p0[1] ** b * (1 - p0[1]) ** (1 - b)
                         * p0[2] ** c * (1 - p0[2]) ** (1 - c))
                   for a, b, c in itertools.product((0, 1), repeat=3) if a + b + c >= 2)

    start = expected_reward()
    assert start == pytest.approx(7 / 27)
    for step in range(15):
        with torch.no_grad():
            probs = torch.softmax(logits, -1)  # (T, V)
            seqs = torch.stack([torch.multinomial(probs[t], num_groups * 2 * G, replacement=True, generator=gen)
                                for t in range(T)], dim=1)  # (num_groups * 2G, T)
            rewards = ((seqs[:, [0, 1, 3]] == 0).sum(1) >= 2).float().view(num_groups, 2 * G)
            penalties = torch.rand(num_groups, 2 * G, generator=gen)
        keep, _, _ = filter_groups(rewards)
        rows, kept_rewards = [], []
        for gi in keep.tolist():
            idx = resample_on_correct(rewards[gi], penalties[gi], G, gen)
            rows.append(gi * 2 * G + idx)
            kept_rewards.append(rewards[gi, idx])
        if not rows:
            continue
        rows = torch.cat(rows)  # (K * G,)
        adv = advantages(torch.stack(kept_rewards)).flatten()  # (K * G,)
        batch = seqs[rows]  # (K * G, T)
        old = torch.log_softmax(logits.detach(), -1)[torch.arange(T), batch]  # (K * G, T)
        for _ in range(4):  # several updates on one batch, so the ratio leaves 1 and the clip matters
            lp = torch.log_softmax(logits, -1)[torch.arange(T), batch]  # (K * G, T)
            loss = policy_loss(lp, old, adv, mask[: len(rows)])
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert expected_reward() > 0.9 > start  # measured: 0.26 -> 0.99
    # the masked "tool output" position never received a gradient
    assert torch.equal(logits.detach()[2], torch.zeros(3))


# ----------------------------------------------------------------------------- engine vs trainer

def test_mismatch_tis_and_sequence_mask_hand_values():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = torch.tensor([[-1.0, -1.5, -0.5 - math.log(3), 9.0]])  # d = 0, -0.5, ln 3, (masked)
    mask = torch.tensor([[1, 1, 1, 0]])
    m = grpo_roc.mismatch(trainer, engine, mask)
    assert float(m["abs"]) == pytest.approx(0.5 + math.log(3)) and float(m["max"]) == pytest.approx(math.log(3))
    assert float(m["k3"]) == pytest.approx((math.exp(-0.5) - 1 + 0.5) + (3 - 1 - math.log(3)))
    assert int(m["out"]) == 1 and int(m["n"]) == 3  # ratios 1, 0.61 (inside [0.5, 2]), 3 (outside)
    w = grpo_roc.tis_weights(trainer, engine, cap=2.0)
    torch.testing.assert_close(w[0, :3], torch.tensor([1.0, math.exp(-0.5), 2.0]))  # exp(ln 3) = 3, capped at 2
    # two trajectories in one packed row: mean log-ratios -0.25 and ln 3
    seq = torch.tensor([[0, 0, 1, 1]])
    assert grpo_roc.sequence_mask(trainer, engine, mask, seq, band=1.0).tolist() == [[True, True, False, False]]
    assert grpo_roc.sequence_mask(trainer, engine, mask, seq, band=0.2).tolist() == [[False, False, False, False]]
    with pytest.raises(ValueError, match="cap"):
        grpo_roc.tis_weights(trainer, engine, cap=0.5)


def test_corrections_change_nothing_without_mismatch():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 7, generator=g) * 3).requires_grad_()
    old = (lp.detach() + 0.3 * torch.randn(3, 7, generator=g))
    engine = old.clone()  # the engine's log-probs equal the trainer's old ones: nothing to correct
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), (torch.rand(3, 7, generator=g) > 0.3).long()
    loss = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    (grad,) = torch.autograd.grad(loss, lp)
    seq = torch.arange(3)[:, None].expand(3, 7)
    for cap in (1.0, 2.0):
        w = grpo_roc.tis_weights(old, engine, cap)
        m = grpo_roc.sequence_mask(old, engine, mask, seq, band=1e-9)
        loss2 = policy_loss(lp, old, adv, m, dual_clip=3.0, weights=w, num_tokens=mask.sum())
        (grad2,) = torch.autograd.grad(loss2, lp)
        assert torch.equal(loss, loss2) and torch.equal(grad, grad2)  # bitwise
    # and with a given mismatch the weight multiplies each token's loss, capped
    w = torch.tensor([[2.0] * 7, [0.5] * 7, [1.0] * 7])
    want = policy_loss(lp, old, adv * torch.tensor([2.0, 0.5, 1.0]), mask)
    torch.testing.assert_close(policy_loss(lp, old, adv, mask, weights=w), want)


# ----------------------------------------------------------------------------- the loss seam: Dr. GRPO, GSPO

def test_dr_grpo_loss_hand_computed():
    # configs/dr_grpo.py: adv_scale="none", loss_norm="constant". One group, rewards 1 0 0 0, sampled tokens
    # 2 1 1 1, max response tokens 4: A = r - 0.75 = (0.75, -0.25, -0.25, -0.25), no std; on-policy (ratio 1),
    # a token's loss is -A, and the divisor is S x max_tokens = 4 x 4 whatever the lengths
    adv = advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), "none")[0]
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    sampled = [2, 1, 1, 1]
    w = loss_weights(sampled, [0, 0, 0, 0], "constant", max_tokens=4)
    assert w == [5 / 16] * 4  # N / (S max_tokens), N = 5
    lp = torch.zeros(4, 2, requires_grad=True)  # (B, T): row i has sampled[i] tokens
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
    loss = policy_loss(lp, lp.detach(), adv * torch.tensor(w), mask, num_tokens=torch.tensor(5.0))
    assert loss.item() == pytest.approx(-(0.75 * 2 - 0.25 * 3) / 16)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv[:, None] / 16 * mask)
    # the other divisors on the same trajectories: token-mean 1/5, Eq. 6 (one question: the same), per sequence
    assert loss_weights(sampled, [0] * 4, "token") == loss_weights(sampled, [0] * 4, "group") == [1.0] * 4
    assert loss_weights(sampled, [0] * 4, "sequence") == [5 / 8, 5 / 4, 5 / 4, 5 / 4]
    assert loss_weights([2, 6], [0, 1], "group") == [2.0, 2 / 3]  # two questions: each weighs half
    with pytest.raises(ValueError, match="loss_norm"):
        loss_weights(sampled, [0] * 4, "constant")


def test_mini_batches_hold_whole_groups():
    # 3 kept groups of G = 4 (12 trajectories) in 2 mini-batches: 2 groups + 1 (split 6 + 6, the middle
    # group's rollouts went half to each, and Eq. 6 weighed each half as a whole question)
    assert grpo_roc.split_mini_batches(12, 4, 2) == [range(0, 8), range(8, 12)]
    assert grpo_roc.split_mini_batches(12, 4, 1) == [range(0, 12)]
    assert grpo_roc.split_mini_batches(8, 4, 5) == [range(0, 4), range(4, 8)]  # fewer groups than asked
    for parts in (grpo_roc.split_mini_batches(n * 4, 4, count) for n in range(1, 9) for count in range(1, 6)):
        assert all(len(part) % 4 == 0 and part.start % 4 == 0 for part in parts)


def test_gspo_loss_hand_computed():
    # configs/gspo.py: ratio_level="sequence", loss_norm="sequence". Two trajectories packed in one row:
    # log-ratios 0.1, 0.3 (seq 0, A = +1) and -0.5 (seq 1, A = -1); eps 0.2 / 0.28 here, to see one clip
    new = torch.tensor([[0.1, 0.3, -0.5, 0.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    seq = torch.tensor([[0, 0, 1, 1]])
    w = torch.tensor(loss_weights([2, 1], [0, 1], "sequence"))  # N / (S |o_i|) = 3/4, 3/2
    adv = torch.tensor([[1.0, 1.0, -1.0, 0.0]]) * w[seq[0]]
    loss = policy_loss(new, old, adv, mask, num_tokens=torch.tensor(3.0), seq_ids=seq)
    # seq 0: rho = e^0.2 = 1.2214 inside the clip: -1.2214; seq 1: rho = e^-0.5 = 0.6065 < 0.8, A < 0:
    # min(-0.6065, -0.8) = -0.8, loss 0.8, clipped. The mean over the two sequences:
    assert loss.item() == pytest.approx((-math.exp(0.2) + 0.8) / 2, abs=1e-6)
    loss.backward()
    # d/d lp of seq 0's tokens: -(1/2) e^0.2 (1/2) each (the mean spreads it); seq 1 is clipped: no gradient
    torch.testing.assert_close(new.grad, torch.tensor([[-math.exp(0.2) / 4] * 2 + [0.0, 0.0]]))
    # one token per sequence: the sequence ratio is the token ratio
    lp = torch.tensor([[0.1, -0.2]], requires_grad=True)
    a = policy_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    b = policy_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), seq_ids=torch.tensor([[0, 1]]))
    assert a.item() == b.item()


# ----------------------------------------------------------------------------- KL to a frozen reference

def test_kl_estimators_hand_values():
    # two sampled tokens: the policy gives them 1/2 and 1/4, the reference 1/4 and 1/2; d = log(ref/policy).
    # the third is off the mask: both log-probs 0
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 1.0]])).requires_grad_()
    ref_logprobs = torch.log(torch.tensor([[0.25, 0.5, 1.0]]))
    ln2 = math.log(2)
    # k3 = e^d - 1 - d: 1/2 - 1 + ln 2 and 2 - 1 - ln 2, both > 0 though d has either sign
    k3 = grpo_roc.kl_penalty(logprobs, ref_logprobs)
    torch.testing.assert_close(k3, torch.tensor([[ln2 - 0.5, 1 - ln2, 0.0]]))
    torch.testing.assert_close(grpo_roc.kl_penalty(logprobs, ref_logprobs, "k1"),
                               torch.tensor([[ln2, -ln2, 0.0]]))
    torch.testing.assert_close(grpo_roc.kl_penalty(logprobs, ref_logprobs, "k2"),
                               torch.tensor([[ln2 ** 2 / 2, ln2 ** 2 / 2, 0.0]]))
    # its gradient in the policy's log-probs is 1 - e^d; the reference gets none
    k3.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.5, -1.0, 0.0]]))
    # a loss term: called with every tensor of the micro-batch as keywords, reads the two it needs
    term = grpo_roc.kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=None, advantages=None)
    torch.testing.assert_close(term, k3)


def test_k1_and_k3_are_unbiased_on_the_policys_own_tokens():
    # averaged over what the policy samples, k1 and k3 give KL(policy || reference); k2 does not
    policy, reference = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    kl = float((policy * (policy / reference).log()).sum())  # 0.25 ln 2
    assert kl == pytest.approx(0.25 * math.log(2))
    for kind, unbiased in (("k1", True), ("k2", False), ("k3", True)):
        mean = float((policy * grpo_roc.kl_penalty(policy.log(), reference.log(), kind)).sum())
        assert (mean == pytest.approx(kl, abs=1e-7)) is unbiased, (kind, mean, kl)

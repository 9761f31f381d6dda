"""
GRPO-RoC: Group Relative Policy Optimization with Resample-on-Correct (rStar2-Agent, arXiv 2508.20722).

Pure math on tensors and plain records (imports torch only). One RL step uses it in this order:

    keep, n_all_correct, n_all_wrong = filter_groups(rewards)          # (num_groups, 2G) in [0, 1]
    for each kept group:                                                 # 2G rollouts -> G
        p = [penalty(calls, failed_calls, answers, turns) for each rollout]
        idx = resample_on_correct(rewards[g], torch.tensor(p), G, generator)
    adv = advantages(kept_rewards, "std", positives(rewards[g])[idx])   # (num_groups, G)
    parts = split_mini_batches(num_kept, G, mini_batches)               # whole groups each
    for each mini-batch:
        w = loss_weights(sampled_tokens, questions, "token")             # one weight per trajectory
        loss = policy_loss(logprobs, old_logprobs, w * adv, mask)        # clipped, over N sampled tokens

Why each piece (paper §2.2):
1. a group whose 2G rewards are all equal has zero advantage everywhere, so it only costs compute:
   drop it and log how many were all-correct / all-wrong (the paper reports >70% all-correct late in
   stage 2; the released code does this explicitly before RoC).
2. Resample-on-Correct: oversample 2G rollouts, keep G. Negatives are subsampled uniformly, keeping the
   variety of failures; positives are subsampled with probability inversely proportional to a penalty
   p_err + p_format, so correct answers reached through tool errors or with repeated <answer> tags are
   less often reinforced. The reward itself stays a pure 0/1 outcome (Eq. 3): penalising tool errors in
   the reward would discourage exploration.
3. advantages are group-normalised over the G kept rollouts only (Eq. 7), one scalar per trajectory
   (other estimators: adv_scale, below).
4. the loss is PPO-clip with clip-higher (eps_low 0.2, eps_high 0.28), with no KL and no entropy
   term (kl_penalty and train_rl.py's loss_terms add them, off by default).
   Tool-output tokens have mask 0 and never contribute. Normalisation: Eq. 6 divides each question's
   token sum by that question's token count (1/sum|o_i| inside the expectation over questions); the
   released code takes verl's token-mean per micro-batch; policy_loss divides by num_tokens, the sampled
   tokens of the whole mini-batch on all ranks (DAPO's token-mean), and train_rl.py's loss_norm="group"
   gives Eq. 6 by weighting each trajectory.

The loss's three knobs, each one key in train_rl.py (the defaults are the paper's; configs/dr_grpo.py and
configs/gspo.py set the others):
- advantage scale (adv_scale): "std" divides by the group's std (Eq. 7), "none" only subtracts the mean
  (Dr. GRPO, Liu et al. 2025: the std up-weights groups that are nearly all right or all wrong), "batch"
  divides by the std of the whole batch (see ADVANTAGES);
- loss divisor (loss_norm, via loss_weights): "token" (every sampled token of the mini-batch weighs the
  same), "group" (Eq. 6: every question the same), "sequence" (every trajectory the same: GRPO's original
  1/|o_i|, and GSPO's), "constant" (Dr. GRPO: trajectories x max response tokens, so a long response's
  tokens do not weigh less);
- importance ratio (ratio_level): "token" (PPO's, per token) or "sequence" (GSPO, Zheng et al. 2025: one
  ratio per trajectory, the geometric mean of its tokens' ratios, clipped as a whole; with its own much
  smaller eps, 3e-4 / 4e-4).

Rewards may lie anywhere in [0, 1] (a task's partial credit, e.g. the share of unit tests passed), and a
task says separately whether an answer is correct (what eval's avg@k and the metrics count). The rule for
rewards that are not 0/1, one for RoC, the advantages and the labels:
- RoC's positives are the rollouts whose reward is above the mean of their group's 2G, or 1 (positives());
  with 0/1 rewards exactly the reward-1 ones, the paper's rule. Negatives are the rest.
- a kept rollout's advantage never contradicts its side: Eq. 7 over the G kept, then a kept positive's
  A = max(A, 0) and a kept negative's A = min(A, 0). Over the kept G the mean moves, so with 0 / 0.5 / 1
  rewards a kept positive of 0.5 can sit below the kept mean (2.8% of simulated groups): it is then not
  pushed down, only not reinforced. With 0/1 rewards nothing changes (a kept 1 is never below the kept
  mean, a kept 0 never above it). Without RoC (plain GRPO) there are no sides and no such bound.
- a group whose 2G rewards are all equal is dropped (no signal, whatever the value); the dump labels it
  "all_correct" when every rollout is correct, else "all_wrong"; any other group is "mixed" (group_kind()).
- metrics about correct answers (tool/err_pos: tool errors in correct trajectories) use `correct`.

Advantage estimators (adv_scale), one function each in ADVANTAGES: "std" group-normalised (Eq. 7), "none"
group mean only (Dr. GRPO), "batch" centred per group and scaled by the std over the whole batch (REINFORCE++'s
global normalisation). A new one lives in the user's own file, named by the config as
"file.py:function" (examples/rloo.py: RLOO's leave-one-out baseline): a function of the (num_groups,
G) rewards that returns one advantage per trajectory, the same shape; train_rl.py loads it and
passes it to advantages() in place of a name.

Extra loss terms (train_rl.py's loss_terms, and the KL to a frozen reference model, kl_coef):
per-token values of the micro-batch, whose token-mean over the mini-batch, times a coefficient, is
added to policy_loss's. kl_penalty is the one that ships (k1, k2, k3).

Deviations from plain GRPO, and where the paper and the released code differ (both are available):
- mode="sample" (default) is the paper's RoC rule, mode="deterministic" the released code's.
- p_err counts failed calls (train_rl.py reads their statuses), not "error" in the text as the release
  does (that misses timeouts and parse failures, and flags stdout that prints "error").
- dual_clip (verl's default c = 3.0, not in the paper) is off unless asked for.
"""

import collections
import math

import torch


def penalty(num_calls, num_errors, num_answers, num_turns, num_overloaded=0):
    """
    p_total = p_err + p_format of one trajectory, in [0, 2]; lower is better (paper Eq. 4 and Eq. 5).

    p_err (Eq. 4) = failed tool calls / tool calls, and 0.5 when the trajectory made no tool call (the
    paper's nudge towards the tool). What counts as failed (a call that does not parse, raises, or times
    out) is the caller's business: here it is only a count.
    num_overloaded: calls our own infrastructure answered "overloaded" (the sandbox's queue was full: not the
    policy's doing). They count in neither p_err's numerator nor its denominator: counted as clean calls they
    would lower p_err, and RoC would prefer the trajectories that met an overload. A trajectory whose every
    call was overloaded gets the no-call 0.5.
    p_format (Eq. 5) = 1 without any <answer>, else min(1, (num_answers - 1) / num_turns): answering
    more than once is penalised relative to the length of the conversation.

    num_answers: <answer>...</answer> blocks in what the policy sampled (tool output does not count).
    num_turns: assistant turns that ended (the paper's definition). 0 happens when the budget runs out
    inside the first turn: that rollout gets p_format 1, the most there is (as the released code does).
    The released code counts assistant turns - 1 (its first assistant header sits in the prompt), so
    there a single-turn answer also gets p_format 1.0; we follow the paper.
    """
    counted = num_calls - num_overloaded  # the calls whose outcome is the policy's
    if not 0 <= num_errors <= counted <= num_calls or num_answers < 0 or num_turns < 0:
        raise ValueError(f"need 0 <= num_errors <= num_calls - num_overloaded <= num_calls and "
                         f"num_answers, num_turns >= 0, got {num_calls=} {num_errors=} "
                         f"{num_answers=} {num_turns=} {num_overloaded=}")
    p_err = num_errors / counted if counted else 0.5
    # no <answer>, or no assistant turn that ended: the most there is
    p_format = 1.0
    if num_answers and num_turns:
        p_format = min(1.0, (num_answers - 1) / num_turns)
    return p_err + p_format


def _check_rewards(rewards):
    if not ((rewards >= 0) & (rewards <= 1)).all():
        raise ValueError(
            f"rewards must be in [0, 1], got values {rewards.unique().tolist()}")


def filter_groups(rewards):
    """
    Drop groups whose rewards are all equal (paper §4.3; released code `reject_equal_reward`).

    rewards: (num_groups, 2G) tensor in [0, 1], one row per prompt.
    Returns (keep, num_all_correct, num_all_wrong): keep is a (K,) long tensor of the row indices of
    the groups with mixed rewards, the two ints count the dropped all-1 and all-0 groups.
    """
    if rewards.dim() != 2 or rewards.size(1) < 2:
        raise ValueError(
            f"rewards must be (num_groups, 2G) with 2G >= 2, got shape {tuple(rewards.shape)}")
    _check_rewards(rewards)
    uniform = (rewards == rewards[:, :1]).all(dim=1)  # (num_groups,)
    num_all_correct = int((uniform & (rewards[:, 0] == 1)).sum())
    num_all_wrong = int((uniform & (rewards[:, 0] == 0)).sum())
    keep = (~uniform).nonzero().flatten()  # (K,)
    return keep, num_all_correct, num_all_wrong


def resample_on_correct(rewards, penalties, G, generator, *,
                        mode="sample", min_pos=2, min_neg=2, eps=1e-3):
    """
    Resample-on-Correct (paper §2.2.3): keep G of the 2G rollouts of one group. mode="sample" is the
    paper's rule (roc_sample), mode="deterministic" the released code's (roc_released).
    rewards: (2G,) in [0, 1], positives = above the group's mean or 1 (0/1: the correct ones); penalties: (2G,)
    p_err + p_format (see penalty()), only the positives' are used; generator: a torch.Generator
    (mode="sample"). Returns the kept indices, (G,) ascending.
    """
    if mode not in ("sample", "deterministic") or not isinstance(G, int) or G < 1:
        raise ValueError(
            f"need mode 'sample' or 'deterministic' and G a positive int, got {mode!r}, {G!r}")
    if rewards.shape != (2 * G,) or penalties.shape != (2 * G,):
        raise ValueError(f"rewards and penalties must both have shape (2G,) = ({2 * G},), "
                         f"got {tuple(rewards.shape)} and {tuple(penalties.shape)}")
    _check_rewards(rewards)
    if not torch.isfinite(penalties).all() or (penalties < 0).any():
        raise ValueError(f"penalties must be finite and >= 0, got {penalties.tolist()}")
    # the ones the update reinforces (A >= 0: the module docstring's rule)
    above = positives(rewards)
    pos = above.nonzero().flatten()  # (n_pos,) rollout order
    neg = (~above).nonzero().flatten()  # (n_neg,)
    if mode == "sample":
        keep = roc_sample(pos, neg, penalties[pos], G, generator, eps)
    else:
        keep = roc_released(pos, neg, penalties[pos], G, min_pos, min_neg)
    return torch.cat(keep).sort().values  # (G,)


def roc_sample(pos, neg, pos_penalties, G, generator, eps):
    """
    The paper's rule: k_neg = floor(n_neg / 2) negatives drawn uniformly; k_pos = G - k_neg positives
    drawn without replacement, each draw ∝ 1 / (penalty + eps) among those left. eps only guards penalty
    0: a zero-penalty positive weighs 1000 against ~30 for penalty 1/30, so "perfect" ones come first.
    As n_pos + n_neg = 2G, k_pos = ceil(n_pos / 2) <= n_pos: always exactly G, half of each side, the odd
    one out from the positives (n_neg = 1 keeps no negative; that group then has zero advantage).
    """
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"mode='sample' needs a torch.Generator (explicit RNG), got {generator!r}")
    k_neg = len(neg) // 2
    k_pos = G - k_neg
    neg_keep = neg[torch.randperm(len(neg), generator=generator)[:k_neg]]
    # k_pos = 0 only when all 2G are negatives: pos is empty, and multinomial cannot draw 0
    if k_pos == 0:
        return pos, neg_keep
    # (n_pos,) float64: 1/eps must not swamp the rest
    weights = 1.0 / (pos_penalties.double() + eps)
    return pos[torch.multinomial(weights, k_pos, replacement=False, generator=generator)], neg_keep


def roc_released(pos, neg, pos_penalties, G, min_pos, min_neg):
    """
    The released code's rule (down_sample/roc.py), for n = 2G rollouts (Python round: half to even):
      k_neg = round(n_neg * G / n), k_pos = round(n_pos * G / n)
      if k_neg <= min(min_neg, n_neg): k_neg = min(min_neg, n_neg); k_pos = G - k_neg
      if k_pos <= min(min_pos, n_pos): k_pos = min(min_pos, n_pos); k_neg = G - k_pos
    positives: the k_pos lowest penalties (stable sort); negatives: the first k_neg in rollout order
    (after the release's PR #50, which removed a sort). For odd G the sizes can sum to G +- 1 (G = 7,
    7 + 7 gives 4 + 4): the release fails an assert there, and so do we. Its "keep the whole group if
    both sides are under their minimum" branch cannot happen once min_pos + min_neg <= G (required); neither
    can a side asking for more than it has once the sizes sum to G (checked for every split up to G = 40),
    which the check below still refuses.
    """
    if min_pos < 0 or min_neg < 0 or min_pos + min_neg > G:
        raise ValueError(f"need 0 <= min_pos, min_neg and min_pos + min_neg <= G, "
                         f"got {min_pos=} {min_neg=} {G=}")
    n_pos = len(pos)
    n_neg = len(neg)
    # the release's round(n_neg * G / n) with n = 2G
    k_neg = round(n_neg / 2)
    k_pos = round(n_pos / 2)
    if k_neg <= min(min_neg, n_neg):
        k_neg = min(min_neg, n_neg)
        k_pos = G - k_neg
    if k_pos <= min(min_pos, n_pos):
        k_pos = min(min_pos, n_pos)
        k_neg = G - k_pos
    if k_pos + k_neg != G or k_pos > n_pos or k_neg > n_neg:
        raise ValueError(
            f"the released RoC rule cannot split {n_pos} positives / {n_neg} negatives into "
            f"G={G} (got {k_pos} + {k_neg}); use an even G or mode='sample'")

    return pos[pos_penalties.argsort(stable=True)[:k_pos]], neg[:k_neg]


def positives(rewards):
    """RoC's positives of one group's rewards (..., 2G): above the group's mean, or 1 (0/1 rewards: the 1s)."""
    return (rewards > rewards.mean(dim=-1, keepdim=True)) | (rewards == 1)


def group_kind(group):
    """The label of one group's 2G trajectories (anything with .reward and .correct: scheduler.Summary): "mixed"
    when the rewards differ (the group trains), else "all_correct" when every one is correct, else "all_wrong"."""
    if len({traj.reward for traj in group}) > 1:
        return "mixed"
    return "all_correct" if all(traj.correct for traj in group) else "all_wrong"


def adv_group_mean(rewards):
    """rewards (num_groups, G) -> advantages (num_groups, G). Dr. GRPO: A_i = r_i - mean(r) over the group, no
    division by the std (which up-weights groups that are nearly all right or all wrong)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def adv_group_std(rewards, eps=1e-6):
    """rewards (num_groups, G) -> advantages (num_groups, G). Eq. 7: A_i = (r_i - mean(r)) / (std(r) + eps) over
    each group's G kept rollouts (adv_group_mean's, scaled); std is the unbiased one (torch.std, as verl's GRPO
    estimator). A uniform group gets A = 0."""
    return adv_group_mean(rewards) / (rewards.std(dim=1, keepdim=True) + eps)


def adv_batch_std(rewards, eps=1e-6):
    """rewards (num_groups, G) -> advantages (num_groups, G): centred per group, scaled by the std of all the
    centred values of the batch (REINFORCE++'s global normalisation): every group's advantages are on one scale,
    a nearly uniform group stays small. advantages() passes G >= 2: the std is over two values at
    least."""
    centred = adv_group_mean(rewards)
    return centred / (centred.std() + eps)


# the adv_scale key's values
ADVANTAGES = {"std": adv_group_std, "none": adv_group_mean, "batch": adv_batch_std}
LOSS_NORMS = ("token", "group", "sequence", "constant")  # the loss_norm key's values (loss_weights)
RATIO_LEVELS = ("token", "sequence")  # the ratio_level key's values (policy_loss's seq_ids)
KL_ESTIMATORS = ("k1", "k2", "k3")  # the kl_estimator key's values (kl_penalty)


def check_loss_config(adv_scale, loss_norm, ratio_level, kl_estimator="k3"):
    """The loss's keys, checked in one place; raises ValueError naming the key. adv_scale may also
    name a user's estimator, "file.py:function" (train_rl.py loads it)."""
    for key, value, allowed in (("adv_scale", adv_scale, tuple(ADVANTAGES)),
                                ("loss_norm", loss_norm, LOSS_NORMS),
                                ("ratio_level", ratio_level, RATIO_LEVELS),
                                ("kl_estimator", kl_estimator, KL_ESTIMATORS)):
        if value not in allowed and not (key == "adv_scale" and ".py:" in value):
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")


def advantages(rewards, scale="std", positive=None):
    """
    One advantage per kept rollout, by the estimator ADVANTAGES[scale] (default: Eq. 7, group-normalised
    over the G kept), or by scale itself when it is a function (a user's estimator, same contract).
    Each value is broadcast to every token of its trajectory by policy_loss.
    positive: (num_groups, G) bool, RoC's side of each kept rollout (positives() of its 2G group); a
    positive's advantage is then max(A, 0), a negative's min(A, 0) (the module docstring's rule).

    rewards: (num_groups, G) float tensor. Returns the same shape.
    """
    estimator = ADVANTAGES.get(scale, scale)
    if rewards.dim() != 2 or rewards.size(1) < 2 or not callable(estimator):
        raise ValueError(f"rewards must be (num_groups, G) with G >= 2 and scale one of "
                         f"{tuple(ADVANTAGES)}, got shape {tuple(rewards.shape)} and {scale!r}")
    adv = estimator(rewards.float())  # (num_groups, G)
    if positive is None:
        return adv
    return torch.where(positive, adv.clamp(min=0.0), adv.clamp(max=0.0))


def loss_weights(sampled, questions, norm, max_tokens=None):
    """
    One weight per trajectory of a mini-batch, for loss = 1/N sum_i w_i sum_t l_it with N = sum(sampled),
    the mini-batch's sampled tokens (policy_loss's num_tokens, which also stays the denominator of the logged
    clip and entropy means). sampled: sampled tokens of each trajectory; questions: its question's id.
    norm="token": w = 1, every token weighs the same (DAPO's token-mean);
    "group" (paper Eq. 6): N / (Q n_q), every question weighs the same, Q questions with n_q tokens each;
    "sequence": N / (S |o_i|), every one of the S trajectories weighs the same (GRPO's original, and GSPO's);
    "constant" (Dr. GRPO): N / (S max_tokens), a fixed divisor whatever the lengths.
    A positive weight per trajectory commutes with the clip, so it rides on the advantage.
    """
    n = sum(sampled)
    s = len(sampled)
    if norm == "token":
        return [1.0] * s
    if norm == "group":
        size = collections.Counter()
        for q, k in zip(questions, sampled):
            size[q] += k
        return [n / (len(size) * size[q]) for q in questions]
    if norm == "sequence":
        return [n / (s * max(k, 1)) for k in sampled]
    if norm == "constant" and max_tokens:
        return [n / (s * max_tokens)] * s
    raise ValueError(f"loss_norm must be 'token', 'group', 'sequence' or 'constant' "
                     f"(with max_tokens), got {norm!r}")


def split_mini_batches(num_kept, G, count):
    """The kept trajectories (G a group, group after group) as at most `count` mini-batches of whole groups,
    ranges of their indices: with loss_norm="group" Eq. 6's per-question weights then see all of a question's
    kept rollouts (verl, too, counts a mini-batch in prompts). Fewer than count when fewer groups were kept,
    or when count does not divide them: 3 groups in 2 mini-batches are 2 + 1."""
    size = -(-num_kept // G // count) * G  # whole groups a mini-batch, rounded up, in trajectories
    return [range(start, min(start + size, num_kept)) for start in range(0, num_kept, size)]


def policy_loss(logprobs, old_logprobs, advantages, mask, eps_low=0.2, eps_high=0.28, *,
                dual_clip=None, num_tokens=None, weights=None, seq_ids=None, return_stats=False):
    """
    Clipped surrogate loss of GRPO-RoC (the surrogate of paper Eq. 6), to minimise:

        loss = -1/N * sum_{i,t: mask=1} min(rho_it * A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) * A_i)
        rho_it = exp(logprobs_it - old_logprobs_it)

    with clip-higher (eps_high > eps_low lets rare tokens grow), no KL and no entropy term.
    N is a token count, so every sampled token weighs the same, however long its trajectory (not a mean
    per sequence then over sequences). N defaults to mask.sum() of this call. Other divisors (Eq. 6's per
    question, per sequence, Dr. GRPO's constant) scale each trajectory's advantage: see loss_weights.
    seq_ids (B, T), which trajectory each token belongs to, makes the ratio a sequence's (GSPO): rho_i =
    exp(mean over its mask-1 tokens of log-ratio), the same for all its tokens, clipped as a whole.
    For gradient accumulation over micro-batches pass num_tokens = mask-1 tokens of the whole
    mini-batch: the sum of the micro-batch losses is then the token-mean of the mini-batch. Across
    ranks, pass the count summed over all ranks and multiply the loss by the world size, since
    DDP/FSDP average (not sum) the gradients.

    dual_clip=c (> 1, verl default 3.0; not in the paper): for A < 0 the per-token loss is also capped
    at -c * A, so one huge ratio cannot dominate the step.
    weights (B, T), optional, >= 0: multiply each token's clipped loss (truncated importance sampling,
    see tis_weights; not in the paper). All-ones weights leave the loss and its gradient bitwise unchanged.

    logprobs, old_logprobs: (B, T) log-probs of the sampled tokens under the current / sampling policy.
    advantages: (B,) one value per trajectory, or (B, T) already broadcast to the tokens (a packed
    row holds several trajectories). mask: (B, T), 1 exactly on tokens the policy sampled;
    tool outputs, prompt and padding are 0 and get neither loss nor gradient (even if their logprobs
    are inf or nan).
    return_stats=True returns (loss, stats), stats holding detached 0-d tensors, means over this call's
    mask-1 tokens: clip_frac_high (A > 0 and rho > 1 + eps_high), clip_frac_low (A < 0 and
    rho < 1 - eps_low), clip_frac (either: tokens whose gradient the clip zeroes). The KL to the
    old policy: mismatch()'s "k3" (one optimizer step per RL step); to a frozen reference:
    kl_penalty.
    """
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must all be (B, T), got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}")
    if advantages.shape not in ((logprobs.size(0),), logprobs.shape):
        raise ValueError(f"advantages must be (B,) = ({logprobs.size(0)},) or (B, T), "
                         f"got {tuple(advantages.shape)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = mask.bool()
    n_local = mask.sum()
    if num_tokens is None:
        if n_local == 0:
            raise ValueError(
                "mask has no 1s: no token to train on (pass num_tokens for an empty micro-batch)")
        num_tokens = n_local
    elif num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")

    # zero the log-ratio off the mask first, so garbage there cannot turn into nan gradients
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0)  # (B, T)
    # GSPO: each token gets its sequence's mean log-ratio (gradient to all its tokens)
    if seq_ids is not None:
        log_ratio = torch.where(mask, seq_mean(log_ratio, mask, seq_ids), 0.0)
    ratio = torch.exp(log_ratio)  # (B, T)
    # (B, 1): one per trajectory, or (B, T): per token
    adv = advantages.detach().reshape(logprobs.size(0), -1)
    surr = ratio * adv  # (B, T)
    surr_clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv  # (B, T)
    token_loss = -torch.minimum(surr, surr_clipped)  # (B, T)
    if dual_clip is not None:
        # the cap is a constant, so capped tokens get no gradient, like the ordinary clip
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -dual_clip * adv), token_loss)
    if weights is not None:
        token_loss = token_loss * weights.detach()
    loss = torch.where(mask, token_loss, 0.0).sum() / num_tokens
    if not return_stats:
        return loss

    with torch.no_grad():
        n = n_local.clamp(min=1)
        high = (adv > 0) & (ratio > 1.0 + eps_high) & mask  # (B, T)
        low = (adv < 0) & (ratio < 1.0 - eps_low) & mask  # (B, T)
        stats = {
            "clip_frac": (high | low).sum() / n,
            "clip_frac_low": low.sum() / n,
            "clip_frac_high": high.sum() / n,
        }
    return loss, stats


def kl_penalty(logprobs, ref_logprobs, kind="k3", **_):
    """
    Per-token estimates of KL(policy || reference) from tokens the policy sampled (Schulman 2020,
    "Approximating KL divergence"), with d = ref_logprobs - logprobs, the log of the reference's
    probability over the policy's:
        k1 = -d            unbiased, noisy, negative on some tokens
        k2 = d^2 / 2       biased as a value; its gradient is an unbiased one of the KL's
        k3 = e^d - 1 - d   unbiased, >= 0 on every token, low variance (GRPO's; verl's "low_var_kl")
    verl also clamps k3 at 10; here it is not clamped. Off the mask both log-probs are 0
    (token_logprobs' `where`), so every estimate is 0 there. (B, T) in, (B, T) out, differentiable
    in logprobs. A loss term (train_rl.py's loss_terms): called with the micro-batch's tensors as
    keywords, it reads the two it needs.
    """
    d = ref_logprobs.detach() - logprobs  # (B, T)
    return {"k1": -d, "k2": d ** 2 / 2, "k3": torch.exp(d) - 1 - d}[kind]


# -----------------------------------------------------------------------------
# the sampling engine and the trainer are two programs (on GPU: a bf16 copy with the kv-cache kernel vs
# the FSDP model with the varlen kernel). The rollout was sampled from the engine's distribution while the
# loss's "old" policy is the trainer's; none of this is in the paper, all of it is off by default.

def mismatch(trainer_logprobs, engine_logprobs, mask):
    """
    How far the engine's sampling-time log-probs are from the trainer's on the same tokens, as sums over
    mask-1 tokens (add them up over micro-batches and ranks; divide by "n"). With d = trainer - engine:
    "abs" = sum |d|, "max" = max |d|, "k3" = sum(e^d - 1 - d) (the k3 estimate of KL(engine || trainer)
    from the engine's own samples), "out" = tokens whose ratio e^d lies outside [0.5, 2], "n" = tokens.
    """
    mask = mask.bool()
    d = torch.where(mask, trainer_logprobs - engine_logprobs, 0.0)  # (B, T)
    abs_d = d.abs()  # (B, T)
    # d is 0 off the mask, where |d|, e^d - 1 - d and (|d| > log 2) are 0 too: the sums and the max over all of it
    # are those over the mask (the max 0 with no mask-1 token)
    return {"abs": abs_d.sum(), "max": abs_d.max(), "k3": (d.exp() - 1 - d).sum(),
            "out": (abs_d > math.log(2)).sum(), "n": mask.sum()}


def tis_weights(trainer_logprobs, engine_logprobs, cap):
    """
    Truncated importance sampling: per token min(exp(trainer - engine), cap), the weight that turns an
    expectation over the engine's samples into one over the trainer's policy, capped so one token cannot
    dominate. Equal log-probs give exactly 1.0.
    """
    if cap < 1:
        raise ValueError(f"the TIS cap must be >= 1, got {cap}")
    return torch.exp(trainer_logprobs - engine_logprobs).clamp(max=cap)


def seq_mean(values, mask, seq_ids):
    """(B, T): at each token, the mean of `values` over the mask-1 tokens of its sequence (differentiable).
    seq_ids (B, T): which trajectory each token belongs to (ints >= 0)."""
    ids = seq_ids.flatten().long()
    m = mask.flatten().bool()

    n = int(ids.max()) + 1
    total = values.new_zeros(n).scatter_add(0, ids, torch.where(m, values.flatten(), 0.0))
    count = values.new_zeros(n).scatter_add(0, ids, m.to(values.dtype))
    return (total / count.clamp(min=1))[seq_ids.long()]


def sequence_mask(trainer_logprobs, engine_logprobs, mask, seq_ids, band):
    """
    mask with every trajectory dropped whose mean log-ratio (trainer - engine) over its mask-1 tokens lies
    outside [-band, band]: a sequence the trainer would not have sampled is left out of the update.
    """
    mask = mask.bool()
    return mask & (seq_mean(trainer_logprobs - engine_logprobs, mask, seq_ids).abs() <= band)

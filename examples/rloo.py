"""
RLOO, the leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): an
advantage estimator in a user's own file, the worked example of train_rl.py's adv_scale seam. No core
module changes, one config key:

    python train_rl.py configs/tiny_rl.py configs/rloo.py
    python train_rl.py configs/tiny_rl.py --adv_scale=examples/rloo.py:rloo      (the same)

Each trajectory's baseline is the mean reward of the other G - 1 of its group, so its own reward does
not bias its baseline:

    A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(r))

that is, Dr. GRPO's advantage (adv_scale = "none") scaled by G / (G - 1). With RoC on, a kept
positive's A stays >= 0 and a kept negative's <= 0 (grpo_roc.advantages), as for the shipped
estimators; with 0/1 rewards that changes nothing.
"""


def rloo(rewards):
    """rewards: (num_groups, G) float tensor, the kept trajectories' rewards; returns their
    advantages, the same shape."""
    G = rewards.size(1)
    # (num_groups, G): the mean reward of the other G - 1 of the group
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)
    return rewards - others

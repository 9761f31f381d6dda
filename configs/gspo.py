# GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per trajectory, the
# geometric mean of its tokens' ratios, clipped as a whole with GSPO's much smaller range, and every
# trajectory weighing the same in the loss. A config overlay, after the stage's or the tiny run's config:
#   python train_rl.py configs/tiny_rl.py configs/gspo.py --run_dir=out/tiny-gspo
# With one optimizer step per rollout batch the ratio is always 1 and nothing is clipped: GSPO takes several
# (the paper's setting splits each batch into mini-batches), so this overlay does too.
ratio_level = "sequence"
loss_norm = "sequence"
eps_low = 3e-4
eps_high = 4e-4
mini_batches = 4

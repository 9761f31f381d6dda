# Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): no std in the advantage, and a constant
# loss divisor (trajectories x max response tokens) instead of a per-token or per-sequence mean. A config
# overlay: put it after the stage's or the tiny run's config, e.g.
#   python train_rl.py configs/tiny_rl.py configs/dr_grpo.py --run_dir=out/tiny-drgrpo
#   torchrun --nnodes 8 --nproc_per_node 8 train_rl.py configs/stage1.py configs/dr_grpo.py
# Resample-on-Correct stays on: with these two keys it is GRPO-RoC on Dr. GRPO's loss (--roc=false for plain).
adv_scale = "none"
loss_norm = "constant"

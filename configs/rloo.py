# RLOO's leave-one-out baseline as the advantage estimator, from a user's own file (examples/rloo.py): the
# worked example of the adv_scale seam. A config overlay: put it after the stage's or the tiny run's config, e.g.
#   python train_rl.py configs/tiny_rl.py configs/rloo.py --run_dir=out/tiny-rloo
# Resample-on-Correct stays on (--roc=false for plain RLOO on G samples).
adv_scale = "examples/rloo.py:rloo"

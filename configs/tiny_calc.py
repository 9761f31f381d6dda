# a second tool: the tiny run's RL with tasks/calculator.py (Python + a `calculate` tool), after a short SFT that
# teaches the calculator's call (README "Fork it"):
#   python data.py traces --task=tasks/calculator.py --n_sft=2000
#   python train_sft.py configs/tiny_sft.py --model_path=out/tiny-sft --out_dir=out/tiny-sft-calc --epochs=1 \
#       --data_mix="[('out/data/sft_calculator.jsonl', 'rstar2', 1.0)]"
#   python train_rl.py configs/tiny_rl.py configs/tiny_calc.py
task = "tasks/calculator.py"
model_path = "out/tiny-sft-calc"
run_dir = "out/tiny-rl-calc"
max_prompt_tokens = 192  # the second tool's schema: 155 tokens with the tiny tokenizer (96 without it)

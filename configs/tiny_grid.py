# a stateful environment: the tiny run's RL with tasks/gridworld.py, one GridWorld per trajectory, a `move` tool
# whose answer depends on the moves before it, reward = shortest path / moves when the goal is reached (README
# "Fork it"). SFT first, on traces whose tool messages the real environment answered:
#   python data.py grid-set
#   python data.py traces --task=tasks/gridworld.py --problems=out/data/grid_train.jsonl --n_sft=2000
#   python train_sft.py configs/tiny_sft.py --model_path=out/tiny-base --out_dir=out/tiny-sft-grid \
#       --data_mix="[('out/data/sft_gridworld.jsonl', 'rstar2', 1.0)]" --max_seq_len=704
#   python train_rl.py configs/tiny_rl.py configs/tiny_grid.py
task = "tasks/gridworld.py"
model_path = "out/tiny-sft-grid"
data_path = "out/data/grid_train.jsonl"
run_dir = "out/tiny-rl-grid"
max_prompt_tokens = 200  # the move tool's schema and the grid's question: 190 tokens with the tiny tokenizer
max_response_tokens = 384  # a walk of up to ~8 moves (one move and its answer: ~48 tokens)
max_turns = 10
steps = 60  # held-out success 60.6% -> 76.6% (docs/results.md); 20 steps had not moved it yet

# a code-writing task: the tiny run's RL with tasks/code.py, reward = the share of hidden unit tests passed in the
# sandbox (README "Fork it"):
#   python data.py code-set
#   python train_rl.py configs/tiny_rl.py configs/tiny_code.py
task = "tasks/code.py"
data_path = "out/data/code_train.jsonl"
run_dir = "out/tiny-rl-code"
max_prompt_tokens = 128  # the code task's prompt: 100 tokens with the tiny tokenizer

# held-out avg@4 of the tiny model on CPU (the demo runs this before and after RL):
#   python eval.py configs/tiny_eval.py --model_path=out/tiny-sft
#   python eval.py configs/tiny_eval.py --model_path=out/tiny-rl     (a run dir: its latest step_*/)
model_path = "out/tiny-rl"
data_path = "out/data/heldout.jsonl"
out_dir = "out/eval_tiny"
samples = 4
temperature = 1.0            # the RL sampling temperature: what the policy was trained at
max_response_tokens = 192
max_prompt_tokens = 128
max_turns = 4
tool_max_chars = 256
kv_capacity = 0              # 0 = up to 256 rows on CPU
tool_workers = 2
tool_timeout = 4.0
dtype = "float32"

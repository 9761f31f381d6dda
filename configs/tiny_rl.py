# the tiny CPU run's RL: GRPO-RoC on the arithmetic task, same code path as configs/stage1.py
#   python train_rl.py configs/tiny_rl.py            (plain GRPO: add --roc=false --run_dir=out/tiny-grpo)
model_path = "out/tiny-sft"
data_path = "out/data/train.jsonl"
run_dir = "out/tiny-rl"
steps = 100
prompts_per_step = 8
samples_per_prompt = 16   # 2G
keep_per_prompt = 8       # G
max_prompt_tokens = 96
max_response_tokens = 192
max_turns = 4
temperature = 1.0
lr = 2e-4                 # a tiny model; the 14B recipe uses 1e-6
warmup_steps = 3
# right-padded rows on a CPU (SDPA): a micro-batch pads its rows to its longest, and smaller ones group closer
# lengths (bench.py u's batch: 15% padding at 4096, 4% at 1024); the update's step 1 ran x1.4 faster than at 4096
max_tokens_per_micro = 1024
tool_timeout = 2.0
# await every tool answer before the next forward, as the demo's runs do (and runs repeat bit for bit): where the
# sandbox shares the trainer's cores, overlapping tools with decoding saved no wall time and cost a RoC step
# up to a third more CPU, in more and smaller forwards (docs/speed.md); the GPU configs overlap them
deterministic = True
tool_max_chars = 256
save_every = 20

# stage 3: the hard subset — problems the step-385 policy does not solve 8/8 (17.3K of 42K in the
# paper), 12K budget, 15 turns, 125 steps, optimizer state reset. Make the subset first, in an
# out_dir of its own (eval_aime.py's out/eval_aime24 holds the AIME eval's summary, which it would
# overwrite) and without the 336K trajectories' dump:
#   torchrun --nproc_per_node 8 eval.py configs/eval_aime.py --model_path=out/stage2/step_000085 \
#       --data_path=data/rl_42k.jsonl --samples=8 --temperature=1.0 --max_turns=10 \
#       --max_response_tokens=12288 --keep_unsolved=data/rl_hard.jsonl \
#       --out_dir=out/stage3_filter --save_trajectories=false
#   torchrun --nnodes 8 --nproc_per_node 8 train_rl.py configs/stage1.py configs/stage3.py
model_path = "out/stage2/step_000085"
optimizer_from = ""          # reset
data_path = "data/rl_hard.jsonl"
run_dir = "out/stage3"
steps = 125
max_response_tokens = 12288
max_turns = 15
warmup_steps = 0              # the paper's only warm-up is stage 1's first 20 steps; none after the reset
data_restart = True          # new data: its own stream from the start

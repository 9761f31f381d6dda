# stage 2: same data, 12K response budget, 85 steps (ends at global step 385), optimizer continued.
#   torchrun --nnodes 8 --nproc_per_node 8 train_rl.py configs/stage1.py configs/stage2.py
model_path = "out/stage1/step_000300"
optimizer_from = "out/stage1/step_000300"
run_dir = "out/stage2"
steps = 85
max_response_tokens = 12288
warmup_steps = 0

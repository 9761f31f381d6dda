# rStar2-Agent stage 1 on Qwen3-14B-Base (after non-reasoning SFT), 64 GPUs:
#   torchrun --nnodes 8 --nproc_per_node 8 train_rl.py configs/stage1.py
# paper §4.3-4.4: all 42K problems, 8K response budget, 10 turns, 300 steps
model_path = "out/qwen3-14b-sft"
data_path = "data/rl_42k.jsonl"
run_dir = "out/stage1"
steps = 300
prompts_per_step = 512       # B
samples_per_prompt = 32      # 2G
keep_per_prompt = 16         # G after Resample-on-Correct
max_prompt_tokens = 2048
max_response_tokens = 8192   # model + tool tokens of one trajectory
max_turns = 10
temperature = 1.0
lr = 1e-6                    # constant after warm-up
warmup_steps = 20
weight_decay = 0.01
mini_batches = 1             # one optimizer step per RL step, on fresh on-policy data
loss_norm = "group"          # Eq. 6: each question weighs the same (1/sum|o_i| inside it); stages 2-3 inherit it
max_tokens_per_micro = 20480 # verl's ppo_max_token_len_per_gpu in the released script
activation_checkpointing = True
dtype = "bfloat16"
kv_capacity = 0              # 0 = from free accelerator memory after weights
tool_workers = 0             # the node's cores shared by its 8 ranks: ~0.5 calls are in flight per rank (docs/scale.md)
save_every = 20
dump_every = 50              # a dump holds all 16,384 rollouts of a step: ~1 GB of JSON at 4K tokens each (estimate)

# non-reasoning SFT of Qwen3-14B-Base (paper §4.1): 3 epochs, LR 5e-6, 4% warm-up, cosine, batch 128
#   torchrun --nnodes 8 --nproc_per_node 8 train_sft.py configs/sft.py
model_path = "models/Qwen3-14B-Base"
data_path = "data/sft.jsonl"
out_dir = "out/qwen3-14b-sft"
epochs = 3
lr = 5e-6
warmup_ratio = 0.04
batch_size = 128
max_seq_len = 8192
max_tokens_per_micro = 16384
activation_checkpointing = True
dtype = "bfloat16"

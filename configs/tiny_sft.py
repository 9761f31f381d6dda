# the tiny CPU run's SFT: teaches a random 1.1M-param Qwen3 the protocol on 5,000 arithmetic traces
#   python train_sft.py configs/tiny_sft.py
model_path = "out/tiny-base"
data_mix = [("out/data/sft.jsonl", "rstar2", 1.0)]  # rStar2-protocol traces made by data.py, rendered by agent.py
out_dir = "out/tiny-sft"
epochs = 4           # 5,000 traces × 4 = 1,250 steps: copying numbers into code and answers emerges after ~300
lr = 3e-3            # a tiny model wants a large LR; the 14B recipe uses 5e-6
lr_min_ratio = 0.1
batch_size = 16
max_tokens_per_micro = 4096
max_seq_len = 512
weight_decay = 0.01
log_every = 50

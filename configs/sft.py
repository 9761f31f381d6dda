# non-reasoning SFT of Qwen3-14B-Base (paper §4.1): 3 epochs, LR 5e-6, 4% warm-up, cosine, batch 128
#   torchrun --nnodes 8 --nproc_per_node 8 train_sft.py configs/sft.py
model_path = "models/Qwen3-14B-Base"
data_mix = [  # (JSONL, format, passes per epoch): the paper's ~222K conversations, converted as docs/data.md says
    ("data/sft/toolace.jsonl", "chat", 1.0),          # ToolACE-11K        } 117K function-call
    ("data/sft/apigen_mt.jsonl", "chat", 1.0),        # APIGen-MT-5K       } conversations
    ("data/sft/glaive_v2.jsonl", "chat", 1.0),        # Glaive-function-calling-v2-101K
    ("data/sft/magicoder_calls.jsonl", "chat", 1.0),  # 48K Magicoder samples as JSON function calls
    ("data/sft/tulu3_if.jsonl", "chat", 1.0),         # 30K instruction following (Tulu 3)
    ("data/sft/nemotron_chat.jsonl", "chat", 1.0),    # 27K chat (Llama-Nemotron)
]
# Qwen3's own template re-renders past turns (an empty <think></think> on the last turn only), so assistant
# tokens cannot be found by prefixes; this one is its layout without the <think> handling
chat_template = "configs/chat_template_qwen.jinja"
out_dir = "out/qwen3-14b-sft"
epochs = 3
lr = 5e-6
warmup_ratio = 0.04
batch_size = 128
max_seq_len = 8192
max_tokens_per_micro = 16384
activation_checkpointing = True
dtype = "bfloat16"
# ~5,200 steps: a checkpoint (weights + AdamW state, ~177 GB, the newest kept) every 250 for --resume=true
save_every = 250

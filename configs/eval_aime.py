# the paper's evaluation protocol (§5.1): avg@16 at temperature 0.6, 30K tokens, 30 turns (top-p is not
# stated; 1.0 = no nucleus truncation, verl's default)
#   python data.py convert aime_2024/train-00000-of-00001.parquet data/aime24.jsonl
#   torchrun --nproc_per_node 8 eval.py configs/eval_aime.py --model_path=out/stage3/step_000125 --data_path=data/aime24.jsonl
# the released weights load unchanged: --model_path=<your download of rStar2-Agent-14B>
model_path = ""              # give --model_path=DIR
data_path = "data/aime24.jsonl"  # made with `python data.py convert ...` from files you downloaded
out_dir = "out/eval_aime24"
samples = 16
temperature = 0.6
top_p = 1.0
max_response_tokens = 30720  # the released eval scripts' max_response_length
max_prompt_tokens = 2048
max_turns = 30
max_calls_per_turn = 1
tool_max_chars = 256         # the release trains and evaluates with verl's default max_tool_response_length
kv_capacity = 0              # 0 = 90% of the free GPU memory after the weights
tool_workers = 0             # the node's cores shared by its ranks
tool_timeout = 4.0           # rStar's README runs code-judge with MAX_EXECUTION_TIME=4 (the paper gives none)
seed = 0
dtype = "bfloat16"

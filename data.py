"""
Datasets and the tiny task: integer arithmetic that a tiny model can only get right by calling the tool.

The tiny task is "What is 482 * 907 - 66?": integers of up to max_digits digits joined by up to max_ops
of + - *, integer answer (the demo: 3 digits, 2 operators; make_problems goes up to 6 and 3).
A 1-3M parameter model cannot multiply six-digit numbers in its head, but it can learn to copy the
numbers into print(...) and copy the printed result into \\boxed{}: exactly the skill rStar2-Agent's
RL sharpens, at a size that trains on a laptop CPU.

This module makes, offline and from a seed:
- problems (train / held-out, disjoint) as JSONL {"question", "answer"};
- SFT conversations in the exact rStar2-Agent protocol (agent.py), whose tool messages are the *real*
  outputs of running the code: with probability error_rate the first call has a bug and the model sees
  the real traceback, then fixes it;
- a byte-level BPE tokenizer trained on that text: numbers split into chunks of up to 3 digits, each
  one token (copying a number is then a short, rarely ambiguous run of tokens; with single digits a
  1M model did not learn to copy within the demo's budget), while merges cross whitespace elsewhere, so the long fixed system prompt and tool
  schema shrink to a handful of tokens; the protocol tags are added tokens;
- a random-init tiny Qwen3 saved as an HF directory (safetensors + tokenizer + our chat template).

CPU command (about a minute):  python data.py prepare --out=out/tiny-base --seed=0

For a task file (README "Fork it"), more commands:

    python data.py traces --task=tasks/calculator.py --n_sft=2000     # SFT traces from the task's trace(row, rng)
    python data.py code-set                                           # tasks/code.py's tiny problem set
    python data.py grid-set                                           # tasks/gridworld.py's tiny grids
    python data.py guess-set                                          # tasks/guess.py's games

`traces` runs every tool call of the traces through the task's own tool table (the sandbox for Python), so
the tool messages are the real answers; for a task whose environment answers turns (tasks/guess.py's
referee), the user turns after the question are its real replies. It writes rows with "tools": the schemas
the task's prompt lists (train_sft.py's "rstar2" format renders them).

It also converts benchmark files you downloaded yourself (we never download) into eval.py's and
train_rl.py's JSONL, {"question", "answer"(, "id")}:

    python data.py convert IN.parquet [IN2.jsonl ...] OUT.jsonl

It reads parquet or JSONL rows in these layouts:
  question + answer                          opencompass/AIME2025 (aime2025-I.jsonl, aime2025-II.jsonl)
  problem + answer (+ solution, id, ...)     HuggingFaceH4/aime_2024, HuggingFaceH4/MATH-500
  prompt (chat messages) + reward_model.ground_truth   the rStar2-Agent repo's preprocessed parquet
Integer answers become strings; an `id` / `unique_id` / `problem_idx` column is kept as "id". A bad row
stops the conversion with "file:row: what is wrong" (rows counted from 1, = the line in JSONL).

And it builds the paper's RL problem set (§4.2) from the public sources you downloaded:

    python data.py rl-set OUT.jsonl --from SRC.parquet [SRC2.jsonl ...] --decontaminate BENCH.jsonl [...]

It reads, besides the layouts above (the rStar2 parquet's layout is also DAPO-Math-17k's original one):
  prompt (a string) + solution (+ reward_model ...)   open-r1/DAPO-Math-17k-Processed (en / all / cn)
  problem + expected_answer (+ problem_source, ...)   nvidia/OpenMathReasoning (AoPS problems)
  problem + numerical_answer (+ id, title, ...)       a Project Euler dump (alexandonian/project-euler)
DAPO's instruction wrapper ("Solve the following math problem step by step. ... after "Answer:".") is taken
off the question wherever it is there. Parquet files are read one row group at a time and only the columns
above (not OpenMathReasoning's solutions, one row each), and the candidates stream through. Then, in order:
  1. integer answers only (rule verifiers cannot match equivalent algebraic forms, paper §4.2); see
     integer_answer() for which spellings count: 42, -7, +7, 0042, 1,000, 1{,}000, $42$, \boxed{12},
     12.0 are kept (written 42, -7, 7, 42, 1000, 1000, 42, 12, 12); 12.5, 1/2, 2^{10}, 1,00, 1, 2 and
     text are dropped;
  2. duplicates: the same question text as a kept one, exactly, then after collapsing whitespace;
  3. decontamination: a problem sharing any 8-gram of normalised words (lower case, runs of letters and
     digits; LaTeX commands and punctuation split words) with any problem of the benchmark files is dropped.
It prints what each filter removed, and writes {"question", "answer", "source"(, "id")}: what train_rl.py and
eval.py read, with the source file's name kept. The label check (a problem stays when at least 2 of 16
answers of a strong model match its label) is a run of eval.py with --keep_solved (docs/data.md, "RL data").
"""

import argparse
import contextlib
import json
import os
import random
import re
import sys

import agent

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
              "<reason>", "</reason>", "<answer>", "</answer>"]

# our chat template: renders prompts and tool conversations byte-identically to the reference template
# (reference/rstar2_chat_template.jinja) but an assistant turn without tool calls is rendered as an
# assistant turn (the reference wraps it in the user prefix), and string arguments are passed through
CHAT_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] }}
{%- else %}
    {{- '<|im_start|>system\nA conversation between User and Assistant. The User asks a question, and the Assistant solves it. The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. The reasoning process is enclosed within <reason> </reason> and answer is enclosed within <answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>.' }}
{%- endif %}
{%- if tools %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
    {%- if message.role == "system" and not loop.first %}
        {{- raise_exception('only one system message, first, is supported') }}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\nYou must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<reason>' }}
{%- endif %}"""

# -----------------------------------------------------------------------------
# the tiny task

def make_problems(n, seed, max_digits=6, max_ops=3, exclude=()):
    """n distinct problems {"question", "answer"} (answer: the integer as a string), none in exclude (problems
    of the same sizes); ValueError when fewer than n such problems exist, which the draws would never end."""
    if max_digits < 1 or max_ops < 1:
        raise ValueError(f"max_digits and max_ops must be >= 1, got {max_digits} and {max_ops}")
    # every problem there is: k operators (3 kinds) between k + 1 numbers of 10 ** max_digits values
    distinct = sum(3 ** k * (10 ** max_digits) ** (k + 1) for k in range(1, max_ops + 1))
    seen, problems = set(exclude), []
    if n > distinct - len(seen):
        excluded = f", {len(seen)} of them excluded" if seen else ""
        raise ValueError(f"{n} problems asked, but only {distinct} exist with up to {max_digits} digits "
                         f"and {max_ops} operators{excluded}")
    rng = random.Random(seed)
    while len(problems) < n:
        n_ops = rng.randint(1, max_ops)
        nums = []
        for _ in range(n_ops + 1):
            d = rng.randint(1, max_digits)  # digit count first, so short and long numbers are equally common
            nums.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1))
        expr = str(nums[0])
        for x in nums[1:]:
            expr += f" {rng.choice('+-*')} {x}"
        question = f"What is {expr}?"
        if question in seen:
            continue
        seen.add(question)
        problems.append({"question": question, "answer": str(eval(expr))})  # expr: our ints and + - * only
    return problems


# -----------------------------------------------------------------------------
# SFT conversations in the exact protocol, with real tool outputs

def _call(reason, code):
    # one assistant turn: a short reasoning, then one tool call
    fn = {"name": agent.TOOL_NAME, "arguments": {"code": code, "input": ""}}
    return {"role": "assistant", "content": f"<reason>{reason}</reason>", "tool_calls": [{"type": "function", "function": fn}]}


# the first calls that fail, by kind. "typo": the expression is typed into a buggy line, and the fix types it
# again (a NameError, a wrong variable, a missing parenthesis). "undefined": the call prints a variable that no
# earlier call defined in this process (each call runs fresh, a classic agent mistake), and the fix is the first
# to type the expression: recovering then costs a turn but no extra copy, so it pays as well as a clean call.
BUGS = {"typo": ("prnt({expr})", "result = {expr}\nprint(reslt)", "print({expr}"),
        "undefined": ("print(result)", "print(answer)", "print(value)")}


def sft_conversation(problem, rng, run, error_rate=0.25, bug_kind="typo"):
    """
    OpenAI-format messages solving problem with the tool: [user, assistant+call, tool, (assistant+call,
    tool,) assistant answer]. With probability error_rate the first call has a bug of BUGS[bug_kind] and the
    next turn fixes it. run(list[(code, stdin)]) -> list[result] executes the calls (the sandbox pool's map);
    tool messages are agent.tool_response_text of the real results.
    """
    q = problem["question"]
    if not (q.startswith("What is ") and q.endswith("?")):
        raise ValueError(f"sft_conversation needs a tiny-task problem 'What is <expr>?', got {q!r}")
    expr = q.removeprefix("What is ").removesuffix("?")
    good = f"print({expr})"
    bad = None
    if rng.random() < error_rate:
        bad = rng.choice(BUGS[bug_kind]).format(expr=expr)
    codes = [bad, good] if bad else [good]
    results = run([(code, "") for code in codes])
    texts = [agent.tool_response_text(r) for r in results]
    if bad and results[0].status != "error":
        raise RuntimeError(f"buggy code {bad!r} did not fail: {results[0].status} {texts[0]!r}")
    if results[-1].status != "ok" or results[-1].stdout.strip() != problem["answer"]:
        raise RuntimeError(f"code {good!r} gave {results[-1].status} {texts[-1]!r}, expected {problem['answer']!r}")
    messages = [{"role": "user", "content": problem["question"]}]
    if bad:
        messages += [_call("I will compute this with Python.", bad), {"role": "tool", "content": texts[0]},
                     _call("The code failed. I will fix it and run it again.", good)]
    else:
        messages += [_call("I will compute this with Python.", good)]
    messages += [{"role": "tool", "content": texts[-1]},
                 {"role": "assistant", "content": f"<reason>The tool gave the result.</reason>\n<answer>\\boxed{{{problem['answer']}}}</answer>"}]
    return messages


# -----------------------------------------------------------------------------
# the tokenizer and the tiny model

def read_metrics(run_dir):
    """The rows of a run's metrics.jsonl (train_sft.py and train_rl.py write one a step)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def render_prompt(tokenizer, question):
    """Token ids of the math task's prompt for a question (agent.prompt_text): where its trajectories
    start. The entry points tokenize a row's task's prompt(row) themselves (train_rl.py, eval.py)."""
    return tokenizer.encode(agent.prompt_text(question), add_special_tokens=False)


def train_tokenizer(texts, vocab_size=4096):
    """A byte-level BPE (PreTrainedTokenizerFast) trained on texts: numbers split into chunks of up to
    three digits, left to right (as Llama 3's and GPT-4's tokenizers), every such chunk one token;
    merges cross whitespace elsewhere; chat tokens special, protocol tags added tokens, our chat
    template attached."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # no regex split for text: merges may cross spaces, so a fixed sentence can become one token.
    # numbers: 3-digit chunks make copying a number a short, rarely ambiguous run of tokens (with
    # single digits, repeated digits make "which one comes next" ambiguous for a tiny model)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAG_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # training does not split on added tokens, encoding does: cut them out here so no merge spans a tag
    split = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TAG_TOKENS))
    chunks = [" ".join(f"{i:0{n}d}" for i in range(10 ** n)) for n in (1, 2, 3)]  # every chunk gets its token
    tok.train_from_iterator(chunks + [piece for text in texts for piece in split.split(text) if piece], trainer)
    # tags are added but not special, so decode(skip_special_tokens=True) keeps <answer> etc. (as Qwen)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def prepare(out_dir, seed, run, data_dir=None, n_train=20000, n_heldout=256, n_sft=2000, max_digits=3, max_ops=2,
            error_rate=0.25, bug_kind="typo", vocab_size=4096,
            hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=384,
            max_position_embeddings=1024, rope_theta=10000.0):
    """
    Make everything the tiny runs need: data_dir/{train,heldout,sft}.jsonl (data_dir defaults to 'data'
    next to out_dir) and out_dir = a random-init tiny Qwen3 HF directory with our tokenizer.
    run executes tool calls for the SFT traces (see sft_conversation).
    """
    import torch
    import transformers

    from common import write_jsonl  # imports torch: here, so that convert and rl-set start without it

    data_dir = data_dir or os.path.join(os.path.dirname(os.path.abspath(out_dir)), "data")
    # 1. problems: held-out disjoint from train and from the SFT problems
    train = make_problems(n_train, seed, max_digits, max_ops)
    heldout = make_problems(n_heldout, seed + 1, max_digits, max_ops, exclude={p["question"] for p in train})
    sft_problems = make_problems(n_sft, seed + 2, max_digits, max_ops, exclude={p["question"] for p in heldout})
    # 2. SFT conversations with the real outputs of the code
    rng = random.Random(seed)
    sft = [dict(p, messages=sft_conversation(p, rng, run, error_rate, bug_kind)) for p in sft_problems]
    # 3. the tokenizer, trained on exactly the text the model will see
    texts = ["".join(text for text, _ in agent.conversation_segments(c["messages"])) for c in sft]
    tokenizer = train_tokenizer(texts, vocab_size)
    # 4. the tiny model, random init from the seed
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_jsonl(os.path.join(data_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(data_dir, "heldout.jsonl"), heldout)
    write_jsonl(os.path.join(data_dir, "sft.jsonl"), sft)
    n_params = sum(p.numel() for p in model.parameters())
    prompt_len = len(render_prompt(tokenizer, train[0]["question"]))
    print(f"{out_dir}: qwen3 {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}, prompt {prompt_len} tokens | "
          f"{data_dir}: train {len(train)}, heldout {len(heldout)}, sft {len(sft)}")
    return tokenizer, model


# -----------------------------------------------------------------------------
# data for a task file: SFT traces from its trace(), and the code task's problems

def task_traces(task, rows, rng, sandbox, timeout=60.0):
    """SFT rows for a task: each row + "messages" (task.trace(row, rng), every tool message filled with the real
    answer of its call, run through task.TOOLS; a task with an environment(row) gets a new one per trace, as each
    rollout does, closed after it; with a respond(), each user message after an assistant turn without calls is
    filled with its real reply, as the engine would append it) + "tools" (the schemas its prompt lists, in
    order). A call unanswered after `timeout` seconds stops it with TimeoutError, and a trace that goes on where
    the environment ended the episode (or ends where it answered) with ValueError: a trace must not carry an
    answer its environment never gave."""
    out = []
    for row in rows:
        messages, answers = task.trace(row, rng), []
        world = task.environment(row) if hasattr(task, "environment") else None
        respond = getattr(world, "respond", None)
        for i, m in enumerate(messages):
            # each call of an assistant turn runs as a rollout would run it; its answer goes to the next tool message
            for call in m.get("tool_calls") or []:
                name, args = agent.read_tool_call(call, i)
                record, future = agent.start_call(agent.ToolCall(name, args), task.TOOLS, sandbox, world)
                answers.append(record.output if future is None else agent.tool_response_text(future.result(timeout)))
            if m["role"] == "tool":
                m["content"] = answers.pop(0)
            # a turn without calls goes to the environment's respond() as the engine gives it: the text after the
            # forced <reason>, up to <|im_end|>; its reply is the next user message, None ends the episode
            if respond and m["role"] == "assistant" and not m.get("tool_calls"):
                reply = respond(m["content"].removeprefix("<reason>") + agent.END)
                goes_on = i + 1 < len(messages)
                if (reply is None) == goes_on:
                    raise ValueError(f"message {i}: the trace {'goes on' if goes_on else 'ends'} where "
                                     f"the environment {'ended the episode' if goes_on else 'answered'}")
                # (a next message of another role is left for train_sft's checks to refuse)
                if goes_on and messages[i + 1]["role"] == "user":
                    messages[i + 1]["content"] = reply
        if world is not None:
            world.close()
        out.append(dict(row, messages=messages, tools=[t.schema for t in task.TOOLS.values()]))
    return out


def code_problems(n, seed, n_tests=4):
    """n rows of tasks/code.py: "Write a Python function f(x) that returns x * 482 - 66." with n_tests hidden
    tests [[x], f(x)] each (the tiny arithmetic, now as a function of x)."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n:
        expr = "x" + "".join(f" {rng.choice('+-*')} {rng.randint(1, 999)}" for _ in range(rng.randint(1, 2)))
        if expr in seen:
            continue
        seen.add(expr)
        tests = [[[x], eval(expr, {"x": x})] for x in rng.sample(range(-99, 1000), n_tests)]  # our ints and + - * only
        rows.append({"question": f"Write a Python function f(x) that returns {expr}.", "entry": "f", "tests": tests})
    return rows


# -----------------------------------------------------------------------------
# the benchmark converter

# the instruction DAPO-Math-17k wraps around every problem (its original rows, and its Processed copies)
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# the columns any layout reads: a parquet file is read with these only (its other columns can be huge)
FIELDS = ("question", "problem", "prompt", "answer", "expected_answer", "numerical_answer", "solution",
          "reward_model", "id", "unique_id", "problem_idx")


def convert_row(row):
    """(question, answer) from one row in a layout listed in the module docstring; raises ValueError(what)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    if "question" in row or "problem" in row:
        question = row.get("question", row.get("problem"))
    elif "prompt" in row:
        prompt = row["prompt"]
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"] \
            if isinstance(prompt, list) else [prompt] if isinstance(prompt, str) else []
        if not users:
            raise ValueError("'prompt' must be a string or a list of chat messages with a user message")
        question = users[-1]
    else:
        raise ValueError(f"no question: expected 'question', 'problem' or 'prompt'; the row has {sorted(row)}")
    answer_keys = [key for key in ("answer", "expected_answer", "numerical_answer") if key in row]
    if answer_keys:
        answer = row[answer_keys[0]]
    elif isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
        answer = row["reward_model"]["ground_truth"]
    elif isinstance(row.get("prompt"), str) and "solution" in row:  # DAPO-Math-17k-Processed: the answer
        answer = row["solution"]
    else:
        raise ValueError("no answer: expected 'answer', 'expected_answer', 'numerical_answer', "
                         f"'reward_model.ground_truth' or (with a string 'prompt') 'solution'; the row has {sorted(row)}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"the question must be a non-empty string, got {question!r:.80}")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"the answer must be a non-empty string or an integer, got {answer!r:.80}")
    return question.strip().removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX).strip(), answer.strip()


def read_rows(path):
    """(row number from 1, row) of a parquet or JSONL file, one at a time; a row that is not JSON raises
    ValueError("path:row: ..."). Parquet: only the columns in FIELDS, one row group at a time (iter_batches
    over a whole file held the read columns of all its row groups until the end: 48 MiB for 93K problems)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # only the converters need it
        table = pq.ParquetFile(path)
        columns = [name for name in table.schema_arrow.names if name in FIELDS]
        if not columns:
            raise ValueError(f"{path}: none of the columns {list(FIELDS)}; it has {table.schema_arrow.names}")
        row_number = 0
        for group in range(table.num_row_groups):
            for batch in table.iter_batches(batch_size=4096, row_groups=[group], columns=columns):
                for row in batch.to_pylist():
                    row_number += 1
                    yield row_number, row
    elif path.endswith((".jsonl", ".json")):
        # bytes, decoded line by line: a line that is not UTF-8 is named by its row number too
        with open(path, "rb") as f:
            for row_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{row_number}: not valid JSON ({e})") from None
                yield row_number, row
    else:
        raise ValueError(f"{path}: expected a .parquet or .jsonl file")


def read_problems(path):
    """(row number, question, answer, row) of every row of a file in a known layout; a bad row raises
    ValueError("path:row: what is wrong")."""
    for row_number, row in read_rows(path):
        try:
            question, answer = convert_row(row)
        except ValueError as e:
            raise ValueError(f"{path}:{row_number}: {e}") from None
        yield row_number, question, answer, row


def row_id(row):
    """The row's own id column as {"id": ...}, or {}."""
    ids = [row[key] for key in ("id", "unique_id", "problem_idx") if row.get(key) is not None]
    return {"id": ids[0]} if ids else {}


def convert(in_paths, out_path):
    """Read benchmark rows from parquet / JSONL files and write our {"question", "answer"(, "id")} JSONL."""
    out = []
    for path in in_paths:
        for _, question, answer, row in read_problems(path):
            out.append({"question": question, "answer": answer, **row_id(row)})
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        for row in out:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(out)


# -----------------------------------------------------------------------------
# the RL problem set (paper §4.2): integer answers, no duplicates, no benchmark 8-grams

def integer_answer(answer):
    """The label as a plain integer string ("0042" -> "42"), or None when it is not an integer. Counted as
    integers: an optional sign and digits, with thousands commas in groups of three (1,000 or LaTeX's
    1{,}000 and 1,\\!000), and a decimal point followed by zeros only (12.0); inside $...$ and/or \\boxed{}.
    Anything else is not: 12.5, 1/2, 2^{10}, 10^3, units, 1,00 and "1, 2" (a list, or a typo: not a label a
    rule verifier can trust)."""
    text = answer.strip()
    if len(text) > 1 and text[0] == text[-1] == "$":
        text = text[1:-1].strip()
    if text.startswith("\\boxed{") and text.endswith("}"):
        text = text[len("\\boxed{"):-1].strip()
    text = text.replace("{,}", ",").replace(",\\!", ",")
    match = re.fullmatch(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.0+)?", text)
    return None if match is None else str(int(match.group(1) + match.group(2).replace(",", "")))


def ngram_hashes(text, n=8):
    """The hashes of every n-gram of the text's normalised words (lower case, runs of letters and digits);
    a text of fewer than n words is one gram. Python's 64-bit string hashes instead of the grams keep the
    benchmark set small (38K grams for AIME 24/25 + MATH-500 sized sets); a candidate gram matches an
    unrelated one with odds 38K / 2^64 ~ 2e-15, ~2e-8 over the 8M grams of 110K candidates."""
    words = re.findall(r"[^\W_]+", text.lower())
    return {hash(" ".join(words[i:i + n])) for i in range(max(1, len(words) - n + 1))}


@contextlib.contextmanager
def written_whole(path):
    """The text file to write `path` through: `path` + ".part", renamed `path` when the block ends; an exception
    in the block (a bad row, an interrupt) removes the part and goes on up: no half-written file is left."""
    part_path = path + ".part"
    try:
        with open(part_path, "w", encoding="utf-8") as f:
            yield f
    except BaseException:
        if os.path.exists(part_path):
            os.remove(part_path)
        raise
    os.replace(part_path, path)


def rl_set(in_paths, bench_paths, out_path, n=8):
    """
    Build the RL problem set: read the candidates of in_paths in order, keep integer answers, drop
    duplicates, drop every problem sharing an n-gram with a problem of bench_paths, write out_path.
    The candidates stream through (memory: the benchmark grams and two 64-bit hashes per kept question, its
    text and its whitespace-collapsed text, not the rows). Returns the counts {filter: problems it removed, ...} and prints them.
    """
    if os.path.abspath(out_path) in {os.path.abspath(path) for path in in_paths + bench_paths}:
        raise ValueError(f"{out_path}: the output is also an input; writing it would erase it")
    # 1. every n-gram of every benchmark problem, hashed
    bench_grams, n_bench = set(), 0
    for path in bench_paths:
        for _, question, _, _ in read_problems(path):
            bench_grams |= ngram_hashes(question, n)
            n_bench += 1
    # 2. the candidates through the filters, in order; the first of duplicates is kept
    removed = {"not an integer answer": 0, "exact duplicate": 0, "duplicate up to whitespace": 0,
               f"shares an {n}-gram with a benchmark": 0}
    read, kept = {}, {}  # per source file
    seen_exact, seen_spaced = set(), set()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with written_whole(out_path) as out:  # a bad row leaves no OUT, whole or half
        for path in in_paths:
            source = os.path.basename(path)
            read[source], kept[source] = read.get(source, 0), kept.get(source, 0)
            for _, question, answer, row in read_problems(path):
                read[source] += 1
                answer = integer_answer(answer)
                spaced = " ".join(question.split())
                # each problem is counted by the first filter that drops it
                if answer is None:
                    reason = "not an integer answer"
                elif hash(question) in seen_exact:
                    reason = "exact duplicate"
                elif hash(spaced) in seen_spaced:
                    reason = "duplicate up to whitespace"
                elif not bench_grams.isdisjoint(ngram_hashes(question, n)):
                    reason = f"shares an {n}-gram with a benchmark"
                else:
                    reason = None
                if reason:
                    removed[reason] += 1
                    continue
                seen_exact.add(hash(question))
                seen_spaced.add(hash(spaced))
                kept[source] += 1
                out.write(json.dumps({"question": question, "answer": answer, "source": source, **row_id(row)},
                                     ensure_ascii=False) + "\n")
    # 3. what each filter removed
    total_read, total_kept = sum(read.values()), sum(kept.values())
    print(f"rl-set: {total_read} candidates from {len(in_paths)} file(s); {n_bench} benchmark problems "
          f"({len(bench_grams)} distinct {n}-grams) from {len(bench_paths)} file(s)")
    for reason, count in removed.items():
        print(f"  - {reason:<36} {count:>9}")
    print(f"  = {'kept':<36} {total_kept:>9}  -> {out_path}")
    for source in read:
        print(f"    {source}: {read[source]} read, {kept[source]} kept")
    return {"read": total_read, **removed, "kept": total_kept}


if __name__ == "__main__":
    if sys.argv[1:2] == ["convert"]:
        if len(sys.argv) < 4:
            sys.exit("usage: python data.py convert IN.parquet|IN.jsonl [IN2 ...] OUT.jsonl")
        try:
            n = convert(sys.argv[2:-1], sys.argv[-1])
        except (ValueError, OSError) as e:
            sys.exit(f"convert error: {e}")
        print(f"wrote {n} problems to {sys.argv[-1]}")
        sys.exit(0)
    if sys.argv[1:2] == ["rl-set"]:
        parser = argparse.ArgumentParser(prog="python data.py rl-set", description="the RL problem set (paper §4.2): "
                                         "integer answers, de-duplicated, decontaminated by 8-gram overlap")
        parser.add_argument("out", help="the JSONL to write")
        parser.add_argument("--from", dest="sources", nargs="+", required=True, help="candidate files (parquet / JSONL)")
        parser.add_argument("--decontaminate", nargs="+", required=True, help="benchmark files (parquet / JSONL)")
        args = parser.parse_args(sys.argv[2:])
        try:
            rl_set(args.sources, args.decontaminate, args.out)
        except (ValueError, OSError) as e:
            sys.exit(f"rl-set error: {e}")
        sys.exit(0)
    parser = argparse.ArgumentParser(description="make the tiny task data, tokenizer and model")
    parser.add_argument("command", choices=["prepare", "traces", "code-set", "grid-set", "guess-set"])
    parser.add_argument("--task", default="tasks/math.py", help="traces: the task file whose trace() and tools to use")
    parser.add_argument("--problems", default="", help="traces: the rows to trace (default: data_dir/train.jsonl)")
    parser.add_argument("--out", default="out/tiny-base", help="model + tokenizer directory")
    parser.add_argument("--data_dir", default=None, help="JSONL directory (default: data/ next to --out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_train", type=int, default=20000)
    parser.add_argument("--n_heldout", type=int, default=256)
    parser.add_argument("--n_sft", type=int, default=2000)
    # 3-digit numbers, 2 operators: beyond what 1M parameters compute in their head, and short enough
    # that copying them into the code and the answer is learned within the CPU demo's SFT budget
    parser.add_argument("--max_digits", type=int, default=3)
    parser.add_argument("--max_ops", type=int, default=2)
    # the share of SFT traces whose first call fails (a typo, a wrong name, a missing parenthesis) and whose
    # next turn fixes it; `python demo.py --seeds=N --recover` raises it so that recovering is practised
    parser.add_argument("--error_rate", type=float, default=0.25)
    parser.add_argument("--bug_kind", choices=sorted(BUGS), default="typo", help="which first calls fail (see BUGS)")
    args = parser.parse_args()
    for count in ("n_train", "n_heldout", "n_sft"):
        if getattr(args, count) < 0:
            parser.error(f"--{count} is a number of rows, got {getattr(args, count)}")
    if not 0 <= args.error_rate <= 1:
        parser.error(f"--error_rate is a share in [0, 1], got {args.error_rate}")
    from common import write_jsonl  # imports torch: here, so that convert and rl-set start without it
    from sandbox import SandboxPool
    data_dir = args.data_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "data")
    if args.command == "code-set":
        rows = code_problems(args.n_train + args.n_heldout, args.seed)
        write_jsonl(os.path.join(data_dir, "code_train.jsonl"), rows[:args.n_train])
        write_jsonl(os.path.join(data_dir, "code_heldout.jsonl"), rows[args.n_train:])
        print(f"{data_dir}: code_train {args.n_train}, code_heldout {args.n_heldout}")
        sys.exit(0)
    # an environment task's own rows, from its problems(n, seed): grid_train.jsonl, guess_heldout.jsonl, ...
    if args.command in ("grid-set", "guess-set"):
        from grading import load_task
        name = args.command.removesuffix("-set")
        task_file = {"grid": "tasks/gridworld.py", "guess": "tasks/guess.py"}[name]
        # a task with fewer distinct rows than asked (the grid's ~21K layouts) says so, in a line
        try:
            rows = load_task(task_file).problems(args.n_train + args.n_heldout, args.seed)
        except ValueError as error:
            parser.error(f"--n_train + --n_heldout: {error}")
        write_jsonl(os.path.join(data_dir, f"{name}_train.jsonl"), rows[:args.n_train])
        write_jsonl(os.path.join(data_dir, f"{name}_heldout.jsonl"), rows[args.n_train:])
        print(f"{data_dir}: {name}_train {args.n_train}, {name}_heldout {args.n_heldout}")
        sys.exit(0)
    if args.command == "traces":
        from common import read_jsonl
        from grading import load_task
        task = load_task(args.task)
        if not hasattr(task, "trace"):
            sys.exit(f"traces error: {args.task} has no trace(row, rng) to write traces from")
        name = os.path.splitext(os.path.basename(args.task))[0]
        # a row that is not the task's (a math row for the grid: --problems left out), or that the task
        # refuses (its check()), ends the command with one line naming it, as the other commands do
        try:
            rows = read_jsonl(args.problems or os.path.join(data_dir, "train.jsonl"), required=task.COLUMNS)
            with SandboxPool(timeout=4.0) as pool:
                # the last n_sft rows (RL starts at the file's front); rows[-0:] would be every row
                last = rows[max(0, len(rows) - args.n_sft):]
                traces = task_traces(task, last, random.Random(args.seed), pool)
        except ValueError as e:
            sys.exit(f"traces error: {e}")
        write_jsonl(os.path.join(data_dir, f"sft_{name}.jsonl"), traces)
        print(f"wrote {len(traces)} traces to {os.path.join(data_dir, f'sft_{name}.jsonl')}")
        sys.exit(0)
    # the SFT traces' tool outputs come from the same sandbox RL uses, so the model sees the same texts
    with SandboxPool(timeout=4.0) as pool:
        try:
            prepare(args.out, args.seed, pool.map, data_dir=args.data_dir, n_train=args.n_train,
                    n_heldout=args.n_heldout, n_sft=args.n_sft, max_digits=args.max_digits,
                    max_ops=args.max_ops, error_rate=args.error_rate, bug_kind=args.bug_kind)
        except ValueError as e:  # sizes that cannot be met (more problems than exist)
            sys.exit(f"prepare error: {e}")

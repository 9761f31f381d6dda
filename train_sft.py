"""
Non-reasoning SFT (paper §4.1): teach a base model instruction following, many tools' call format and
the agent protocol before RL, with no reasoning traces. Loss on the assistant's tokens only.

CPU (tiny model):  python train_sft.py configs/tiny_sft.py
8+ GPUs:           torchrun --nproc_per_node 8 train_sft.py configs/sft.py

Data: JSONL files, one conversation per line, in the OpenAI / Hugging Face chat format:
    {"messages": [...], "tools": [...]}
messages: system (optional), user, assistant ("content" and/or "tool_calls": [{"type": "function",
"function": {"name", "arguments"}}], arguments a JSON object or a string holding one), tool (the results
of the calls before it, one message per call, in order); any number of turns; the last message is an
assistant reply without tool calls. tools: the JSON schemas of the functions the conversation may call.

Each file of the mix declares how it is rendered, data_mix = [(path, format, weight), ...]:
  "rstar2"  agent.render_conversation: the rStar2-Agent protocol exactly as an RL rollout builds its
            tokens (the answer-format user prefix, replies starting with <reason>; the mask is 1 on what
            the policy samples). "tools", if given, are the schemas the prompt lists, in order (a task's
            tools: `python data.py traces --task=...` writes such files); absent, agent.py's Python tool.
            The tiny run's data.
  "chat"    the tokenizer's own chat template (or the file in chat_template): any roles, turns and
            tools. The mask is 1 on each assistant message's tokens, found from the template itself:
            where it has {% generation %} markers, from those (return_assistant_tokens_mask); otherwise
            by rendering the conversation up to each assistant message, without it, and as a generation
            prompt: both renderings must be prefixes of the whole (else an error), the message's tokens
            are what it adds, less the generation prompt's header (mask 0, the model never samples it)
            and trailing whitespace (the newline between turns). Each stretch is tokenized on its own,
            the way a rollout appends tokens.
weight w: each epoch takes every conversation of the file ⌊w⌋ times plus a fresh random (w - ⌊w⌋)
share of them; the epoch is then shuffled. One file of weight 1 gives exactly the old single-file order.

Every line is parsed and checked before training (errors name file:line: bad JSON, an unknown role, a
tool message with no call before it, a call to a tool not in "tools", a conversation that does not end
on an assistant reply, ...); nothing is dropped silently. Conversations are then streamed: each step
reads its lines by byte offset; each rank renders 1/world of them and all ranks gather the whole batch
(a chat template is slow Python: ~9 ms for a 4-turn tool conversation on our CPU). Conversations longer
than max_seq_len are skipped and counted. Sequences are packed into
token-budget micro-batches; cosine LR with 4% warm-up; FSDP2 under torchrun; the result is an HF
directory (with the tokenizer and the chat template it was trained with) that every other script loads.
With save_every = N, every N-th step also writes a checkpoint to out_dir/step_*/ (weights and AdamW state,
checkpoint.py's, the newest one kept); --resume=true continues from it and ends on the weights the
uninterrupted run ends on, bit for bit (the data order is a function of the seed, the epoch and the step).
A resume whose steps would read other conversations than the run's (other files or weights in the mix,
another seed or batch_size) is refused; the schedule's settings (lr, epochs, ...) may change.
Importing this file runs nothing: the tests use the functions below.
"""
import json
import math
import os
import re
import sys
import time

import jinja2
import torch

import agent

# the template marks the assistant's tokens itself
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_chat(messages, tools):
    """
    Check a "chat" conversation (agent.check_messages, its calls only to the functions in tools); return its
    messages with tool-call arguments as JSON objects. Raises ValueError naming the message.
    """
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(schema, dict) for schema in tools)):
        raise ValueError('"tools" must be a list of JSON schemas (objects)')
    # the names in OpenAI schemas {"type": "function", "function": {...}} or in bare function objects
    names = {(tool["function"] if isinstance(tool.get("function"), dict) else tool).get("name")
             for tool in tools or []}
    return agent.check_messages(messages, names)


def render_chat(tokenizer, messages, tools=None):
    """(ids, mask) of a checked "chat" conversation through the tokenizer's chat template; mask 1 on the
    assistant's tokens (the rule is in the module docstring). Raises ValueError naming the message when
    the template does not let the assistant's tokens be told apart."""
    if GENERATION_TAG.search(tokenizer.get_chat_template(None, tools)):
        out = tokenizer.apply_chat_template(messages, tools=tools, return_dict=True,
                                            return_assistant_tokens_mask=True)
        # two lists of ints (no return_tensors asked for)
        return out["input_ids"], out["assistant_masks"]

    def render(conversation, generation_prompt=False):
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    full = render(messages)
    pieces = []  # (text, mask) stretches that make up full, in order
    done = 0  # how much of full the pieces cover
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:index])
        prompt = render(messages[:index], True)
        after = render(messages[:index + 1])
        if not (full.startswith(before) and full.startswith(after) and len(after) > len(before)):
            raise ValueError(
                f"message {index}: the chat template renders this assistant turn differently once "
                "later messages follow (Qwen3's own template does: an empty <think></think> on the "
                "last turn only), so its tokens cannot be found; use a template with "
                "{% generation %} markers or one that renders every message the same wherever it "
                "stands (config key chat_template, e.g. configs/chat_template_qwen.jinja)")
        turn = after[len(before):]
        # the header the generation prompt would have forced ('<|im_start|>assistant\n') is not trained
        head = (len(os.path.commonprefix([prompt[len(before):], turn]))
                if prompt.startswith(before) else 0)
        body = turn[head:].rstrip()  # what the model samples, up to its end-of-turn token
        start = len(before) + head
        pieces += [(full[done:start], 0), (body, 1)]
        done = start + len(body)
    pieces.append((full[done:], 0))
    # an empty piece encodes to no tokens
    return agent.encode_segments(tokenizer, pieces)


def parse(line, fmt):
    """One JSONL line of a file in format fmt -> (messages, tools), checked. Raises ValueError."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(row, dict) or "messages" not in row:
        raise ValueError('expected a JSON object with "messages"')
    # the JSON schemas of the functions the conversation may call (None: not given), in either format
    tools = row.get("tools")
    if fmt == "rstar2":
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(schema, dict) and isinstance(schema.get("function"), dict)
                and isinstance(schema["function"].get("name"), str) for schema in tools)):
            raise ValueError('"tools" must be a list of schemas '
                             '{"type": "function", "function": {"name": ...}}')
        # the prompt's tool table: the schemas only (nothing runs in SFT)
        table = (agent.PYTHON_TOOLS if tools is None
                 else {schema["function"]["name"]: agent.Tool(schema, None) for schema in tools})
        # agent.check_messages' checks, then the protocol's
        agent.conversation_segments(row["messages"], table)
        return row["messages"], table
    return check_chat(row["messages"], tools), tools


def index_file(path, fmt):
    """[(byte offset, line number)] of the conversations (non-empty lines) of a JSONL file, each parsed and
    checked on the way. Raises ValueError 'path:line: what is wrong'."""
    rows = []
    offset = 0
    with open(path, "rb") as file:
        for line_number, line in enumerate(file, 1):
            if line.strip():
                try:
                    parse(line, fmt)
                except ValueError as error:
                    raise ValueError(f"{path}:{line_number}: {error}") from None
                rows.append((offset, line_number))
            offset += len(line)
    return rows


def load(tokenizer, file, path, fmt, row):
    """(ids, mask) of the conversation at row = (offset, line) of the open file. Raises ValueError
    'path:line: what is wrong' (a chat template that cannot mask this conversation, for one)."""
    offset, line_number = row
    file.seek(offset)
    try:
        messages, tools = parse(file.readline(), fmt)
        if fmt == "rstar2":
            return agent.render_conversation(tokenizer, messages, tools)
        return render_chat(tokenizer, messages, tools)
    except ValueError as error:
        raise ValueError(f"{path}:{line_number}: {error}") from None
    except (TypeError, jinja2.TemplateError) as error:
        # raised while rendering (a template's raise_exception)
        raise ValueError(f"{path}:{line_number}: chat template: "
                         f"{type(error).__name__}: {error}") from None


def epoch_order(sizes, weights, seed, epoch):
    """The (file, conversation) pairs of one epoch, shuffled: file j gives weights[j] × sizes[j] of them."""
    items = []
    for file_index, (size, weight) in enumerate(zip(sizes, weights)):
        # every conversation ⌊weight⌋ times
        rows = list(range(size)) * int(weight)
        # plus a fresh random share of weight - ⌊weight⌋ each epoch (none for a whole weight; int tuples hash
        # the same in every process)
        generator = torch.Generator().manual_seed(hash((seed, epoch, file_index)))
        share = round((weight - int(weight)) * size)
        rows += torch.randperm(size, generator=generator)[:share].tolist()
        items += [(file_index, row) for row in rows]
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(items), generator=generator).tolist()
    return [items[index] for index in order]


# -----------------------------------------------------------------------------
# the script

if __name__ == "__main__":
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from checkpoint import (checkpoint_dir, load_trainable, load_trainer_state, lock_run, model_dir,
                            resume_point, save_checkpoint)
    from common import Logger, compute_cleanup, compute_init, pack, pack_sorted, print0
    from configurator import configure, require
    from model import collate, full_value, save_model, token_logprobs, use_flash
    from scheduler import gather

    model_path = "out/tiny-base"  # HF directory of the base model (weights + tokenizer)
    # [(JSONL path, "rstar2" | "chat", weight), ...]
    data_mix = [("out/data/sft.jsonl", "rstar2", 1.0)]
    # a jinja file used instead of the tokenizer's own chat template ("chat" files)
    chat_template = ""
    out_dir = "out/tiny-sft"  # the SFT model is written here in HF format
    epochs = 3  # paper: 3
    lr = 5e-6  # paper: 5e-6 (peak; cosine decay to lr_min_ratio · lr)
    lr_min_ratio = 0.0
    warmup_ratio = 0.04  # paper: 4 %
    batch_size = 128  # conversations per optimizer step, all ranks together (paper: 128)
    max_tokens_per_micro = 8192  # tokens per micro-batch and rank, any padding included
    max_seq_len = 8192  # longer conversations are skipped (and counted)
    weight_decay = 0.0
    grad_clip = 1.0
    activation_checkpointing = False
    dtype = "float32"  # compute dtype: "bfloat16" on GPU
    log_every = 10
    # a checkpoint (out_dir/step_*/: weights and AdamW state, the newest one kept) every N steps; 0: none
    save_every = 0
    resume = False  # continue from the newest checkpoint in out_dir, exactly
    seed = 0
    wandb_project = ""
    cfg = configure(globals())
    # the ranges of the settings (a conversation fits one micro-batch)
    require(globals(), "epochs >= 1", "lr >= 0", "0 <= lr_min_ratio <= 1", "0 <= warmup_ratio <= 1",
            "batch_size >= 1", "max_seq_len <= max_tokens_per_micro", "grad_clip > 0", "log_every >= 1")
    rank, world, device = compute_init(seed)
    # a model directory or Hub id (a run directory: one of its checkpoints)
    model_path = model_dir(model_path)
    # packed rows for flash-attn's varlen kernel, padded batches for SDPA
    ptdtype = getattr(torch, dtype)
    packed = use_flash(device, ptdtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if chat_template:
        with open(chat_template) as template_file:
            tokenizer.chat_template = template_file.read()

    # data: every line is checked up front (errors name the file and line), then streamed by offset
    mix = []
    for entry in data_mix:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3
                and entry[1] in ("rstar2", "chat")
                and isinstance(entry[2], (int, float)) and entry[2] >= 0):
            sys.exit("config error: data_mix entries are (path, 'rstar2' | 'chat', weight >= 0), "
                     f"got {entry!r}")
        path, fmt, weight = entry
        if fmt == "chat" and not tokenizer.chat_template:
            sys.exit(f"config error: {path} is a 'chat' file, but {model_path}'s tokenizer has no "
                     "chat template; set chat_template=FILE")
        try:
            rows = index_file(path, fmt)
        except ValueError as error:
            sys.exit(f"data error: {error}")
        except OSError as error:
            sys.exit(f"data error: {path}: cannot read it ({error.strerror})")
        mix.append((path, fmt, rows, open(path, "rb")))
        print0(f"{path}: {len(rows)} conversations, format {fmt}, weight {weight}")
    # mix holds (path, format, rows, open file); the weights are data_mix's
    sizes = [len(entry[2]) for entry in mix]
    weights = [entry[2] for entry in data_mix]
    epoch_len = len(epoch_order(sizes, weights, seed, 0))
    if epoch_len == 0:
        sys.exit("data error: the mix has no conversations")
    # what decides the conversations of each step (epoch_order's inputs and the batch size): a resumed
    # run must have it as the checkpoint's run had
    order_key = [sizes, weights, seed, batch_size]

    # the checkpoint to resume (--resume=true), or None; a new run where an earlier one left
    # checkpoints stops here
    start = resume_point(out_dir, resume)
    # out_dir is this run's alone from here while it lives: a second run stops here, before it loads a
    # model for minutes (and reads a checkpoint the first one's rotation may delete meanwhile)
    if rank == 0:
        lock_run(out_dir)
    model = load_trainable(start or model_path, device, ptdtype, activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    step = 0
    skipped = 0  # conversations longer than max_seq_len
    trained = 0  # assistant tokens trained on
    if start:
        state = load_trainer_state(start, model, optimizer)
        step, skipped, trained = state["step"], state["skipped"], state["trained"]
        if state["order_key"] != order_key:
            sys.exit(f"config error: {start} was saved by a run with (conversations per file, "
                     f"weights, seed, batch_size) = {state['order_key']}, this has {order_key}: "
                     f"from step {step} on it trains other conversations; resume with the run's")
        print0(f"resumed from {start} at step {step}")
    steps_per_epoch = math.ceil(epoch_len / batch_size)
    total = epochs * steps_per_epoch
    warmup = max(1, round(warmup_ratio * total))
    logger = Logger(out_dir, wandb_project, cfg, rank, resume_step=step if start else None)
    print0(f"sft: {epochs} epochs × {steps_per_epoch} steps of {batch_size} conversations "
           f"({epoch_len} per epoch), {world} rank(s)")

    # from the step the run is at (a resumed run: its checkpoint's), in its epoch
    for epoch in range(step // steps_per_epoch, epochs):
        # this epoch's (file, conversation) pairs, shuffled: the same on every rank
        order = epoch_order(sizes, weights, seed, epoch)
        for step_in_epoch in range(step % steps_per_epoch, steps_per_epoch):
            step_start = time.perf_counter()

            # 1. the learning rate: cosine schedule with linear warm-up
            progress = max(0.0, (step - warmup) / max(1, total - warmup))
            cosine = lr_min_ratio + (1 - lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
            lr_now = lr * min((step + 1) / warmup, cosine)
            for group in optimizer.param_groups:
                group["lr"] = lr_now

            # 2. render this step's conversations: each rank renders every world-th one (a chat
            # template is slow Python), then all ranks gather them all, in batch order, so all agree
            # on the packing
            step_items = order[step_in_epoch * batch_size:(step_in_epoch + 1) * batch_size]
            my_renders = []  # (ids, mask) of each conversation this rank renders, or its error text
            for file_index, row_index in step_items[rank::world]:
                path, fmt, rows, file = mix[file_index]
                try:
                    my_renders.append(load(tokenizer, file, path, fmt, rows[row_index]))
                except ValueError as error:
                    my_renders.append(str(error))  # every rank must reach the gather, then all stop
            # renders_by_rank[r] is rank r's list: item k of the step was rendered by rank k % world
            renders_by_rank = gather(my_renders)

            # 3. the batch in order, shifted for next-token targets; too long ones skipped, counted
            batch = []
            for position in range(len(step_items)):
                rendered = renders_by_rank[position % world][position // world]
                if isinstance(rendered, str):
                    sys.exit(f"data error: {rendered}")
                ids, mask = rendered
                if len(ids) > max_seq_len:
                    skipped += 1
                    continue
                batch.append({"ids": ids[:-1], "tgt": ids[1:], "mask": mask[1:]})
            # the loss is a token-mean over the whole batch, all ranks together
            n_tokens = sum(sum(example["mask"]) for example in batch)
            trained += n_tokens

            # 4. forward and backward, one micro-batch at a time (this rank's share of the bins;
            # every rank gets as many bins, so all run the same number of passes). A packed row
            # (flash-attn) costs its tokens; right-padded rows (SDPA) cost count x the longest, so
            # conversations of similar length share one (pack_sorted): max_tokens_per_micro bounds both
            lengths = [len(example["ids"]) for example in batch]
            bins = (pack if packed else pack_sorted)(lengths, max_tokens_per_micro, world)
            # the step's loss, summed over this rank's micro-batches (then over the ranks, below): a
            # tensor from the first one on (either packing gives every rank one bin at least)
            loss_sum = 0
            for micro_bin in bins[rank::world]:
                micro_batch = collate([batch[index] for index in micro_bin], device, packed)
                # the output layer runs on the trained (assistant) tokens alone: log-probs are 0 elsewhere
                logprobs = token_logprobs(model, micro_batch["ids"], micro_batch["tgt"],
                                          micro_batch["seg"], where=micro_batch["mask"] > 0)
                loss = -logprobs.sum() / max(1, n_tokens)
                # FSDP averages over ranks; we already divided by the global count
                (loss * world).backward()
                loss_sum += loss.detach()

            # 5. the optimizer step (the gradient norm clipped to grad_clip), then the loss summed
            # over the ranks
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if dist.is_initialized():
                dist.all_reduce(loss_sum)
            step += 1

            # 6. logging: metrics.jsonl every step, a progress line every log_every steps
            # the gradient norm: a DTensor made whole (a collective, every rank calls it)
            logger.log(step, {"loss": loss_sum, "lr": lr_now, "grad_norm": full_value(grad_norm),
                              "skipped": skipped})
            if step % log_every == 0 or step == total:
                print0(f"step {step:04d}/{total} | loss {loss_sum.item():.4f} | lr {lr_now:.2e} | "
                       f"dt {time.perf_counter() - step_start:.2f}s")

            # 7. the checkpoint, every save_every steps: what --resume continues from
            if save_every and step % save_every == 0:
                save_checkpoint(checkpoint_dir(out_dir, step), model, optimizer, tokenizer,
                                {"step": step, "skipped": skipped, "trained": trained,
                                 "order_key": order_key}, keep=1)

    save_model(model, out_dir)
    if rank == 0:
        tokenizer.save_pretrained(out_dir)  # with the chat template the "chat" data was rendered by
    print0(f"saved {out_dir}: {trained} assistant tokens trained; {skipped} conversation(s) longer "
           f"than {max_seq_len} tokens skipped")
    compute_cleanup()

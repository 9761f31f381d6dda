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

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # the template marks assistant tokens itself


def check_chat(messages, tools):
    """
    Check a "chat" conversation (agent.check_messages, its calls only to the functions in tools); return its
    messages with tool-call arguments as JSON objects. Raises ValueError naming the message.
    """
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError('"tools" must be a list of JSON schemas (objects)')
    names = {(t["function"] if isinstance(t.get("function"), dict) else t).get("name") for t in tools or []}
    return agent.check_messages(messages, names)


def render_chat(tokenizer, messages, tools=None):
    """(ids, mask) of a checked "chat" conversation through the tokenizer's chat template; mask 1 on the
    assistant's tokens (the rule is in the module docstring). Raises ValueError naming the message when
    the template does not let the assistant's tokens be told apart."""
    if GENERATION_TAG.search(tokenizer.get_chat_template(None, tools)):
        out = tokenizer.apply_chat_template(messages, tools=tools, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])

    def render(msgs, generation_prompt=False):
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    full = render(messages)
    pieces, pos = [], 0  # (text, mask) stretches that make up full, in order
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, prompt, after = render(messages[:k]), render(messages[:k], True), render(messages[:k + 1])
        if not (full.startswith(before) and full.startswith(after) and len(after) > len(before)):
            raise ValueError(
                f"message {k}: the chat template renders this assistant turn differently once later messages "
                "follow (Qwen3's own template does: an empty <think></think> on the last turn only), so its "
                "tokens cannot be found; use a template with {% generation %} markers or one that renders "
                "every message the same wherever it stands (config key chat_template, e.g. "
                "configs/chat_template_qwen.jinja)")
        turn = after[len(before):]
        # the header the generation prompt would have forced ('<|im_start|>assistant\n') is not trained
        head = len(os.path.commonprefix([prompt[len(before):], turn])) if prompt.startswith(before) else 0
        body = turn[head:].rstrip()  # what the model samples, up to its end-of-turn token
        start = len(before) + head
        pieces += [(full[pos:start], 0), (body, 1)]
        pos = start + len(body)
    pieces.append((full[pos:], 0))
    return agent.encode_segments(tokenizer, [(text, m) for text, m in pieces if text])


def parse(line, fmt):
    """One JSONL line of a file in format fmt -> (messages, tools), checked. Raises ValueError."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(row, dict) or "messages" not in row:
        raise ValueError('expected a JSON object with "messages"')
    if fmt == "rstar2":
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
                for t in tools)):
            raise ValueError('"tools" must be a list of schemas {"type": "function", "function": {"name": ...}}')
        # the prompt's tool table: the schemas only (nothing runs in SFT)
        table = agent.PYTHON_TOOLS if tools is None else {t["function"]["name"]: agent.Tool(t, None) for t in tools}
        agent.conversation_segments(row["messages"], table)  # agent.check_messages' checks, then the protocol's
        return row["messages"], table
    return check_chat(row["messages"], row.get("tools")), row.get("tools")


def index_file(path, fmt):
    """[(byte offset, line number)] of the conversations (non-empty lines) of a JSONL file, each parsed and
    checked on the way. Raises ValueError 'path:line: what is wrong'."""
    rows, offset = [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    parse(line, fmt)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                rows.append((offset, lineno))
            offset += len(line)
    return rows


def load(tokenizer, f, path, fmt, row):
    """(ids, mask) of the conversation at row = (offset, line) of the open file f. Raises ValueError
    'path:line: what is wrong' (a chat template that cannot mask this conversation, for one)."""
    f.seek(row[0])
    try:
        messages, tools = parse(f.readline(), fmt)
        if fmt == "rstar2":
            return agent.render_conversation(tokenizer, messages, tools)
        return render_chat(tokenizer, messages, tools)
    except ValueError as e:
        raise ValueError(f"{path}:{row[1]}: {e}") from None
    except (TypeError, jinja2.TemplateError) as e:  # raised while rendering (a template's raise_exception)
        raise ValueError(f"{path}:{row[1]}: chat template: {type(e).__name__}: {e}") from None


def epoch_order(sizes, weights, seed, epoch):
    """The (file, conversation) pairs of one epoch, shuffled: file j gives weights[j] × sizes[j] of them."""
    items = []
    for j, (n, w) in enumerate(zip(sizes, weights)):
        idx = list(range(n)) * int(w)
        if w > int(w):  # a fresh random share each epoch (int tuples hash the same in every process)
            g = torch.Generator().manual_seed(hash((seed, epoch, j)))
            idx += torch.randperm(n, generator=g)[:round((w - int(w)) * n)].tolist()
        items += [(j, i) for i in idx]
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [items[i] for i in order]


# -----------------------------------------------------------------------------
# the script

if __name__ == "__main__":
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from checkpoint import load_trainable
    from common import Logger, compute_cleanup, compute_init, full_value, pack, print0, resolve_model
    from configurator import configure
    from model import collate, save_model, token_logprobs, use_flash
    from scheduler import gather

    model_path = "out/tiny-base"  # HF directory of the base model (weights + tokenizer)
    data_mix = [("out/data/sft.jsonl", "rstar2", 1.0)]  # [(JSONL path, "rstar2" | "chat", weight), ...]
    chat_template = ""  # a jinja file used instead of the tokenizer's own chat template ("chat" files)
    out_dir = "out/tiny-sft"  # the SFT model is written here in HF format
    epochs = 3  # paper: 3
    lr = 5e-6  # paper: 5e-6 (peak; cosine decay to lr_min_ratio · lr)
    lr_min_ratio = 0.0
    warmup_ratio = 0.04  # paper: 4 %
    batch_size = 128  # conversations per optimizer step, all ranks together (paper: 128)
    max_tokens_per_micro = 8192  # packed tokens per micro-batch and rank
    max_seq_len = 8192  # longer conversations are skipped (and counted)
    weight_decay = 0.0
    grad_clip = 1.0
    activation_checkpointing = False
    dtype = "float32"  # compute dtype: "bfloat16" on GPU
    log_every = 10
    seed = 0
    wandb_project = ""
    cfg = configure(globals())

    if max_seq_len > max_tokens_per_micro:  # a conversation must fit one micro-batch
        sys.exit(f"config error: max_seq_len={max_seq_len} > max_tokens_per_micro={max_tokens_per_micro}: raise "
                 "max_tokens_per_micro or lower max_seq_len")
    rank, world, device = compute_init(seed)
    model_path = resolve_model(model_path)
    packed = use_flash(device, getattr(torch, dtype))  # packed rows for flash-attn's varlen kernel, padded batches for SDPA
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if chat_template:
        with open(chat_template) as f:
            tokenizer.chat_template = f.read()

    # data: every line is checked up front (errors name the file and line), then streamed by offset
    mix = []
    for entry in data_mix:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and entry[1] in ("rstar2", "chat")
                and isinstance(entry[2], (int, float)) and entry[2] >= 0):
            sys.exit(f"config error: data_mix entries are (path, 'rstar2' | 'chat', weight >= 0), got {entry!r}")
        path, fmt, weight = entry
        if fmt == "chat" and not tokenizer.chat_template:
            sys.exit(f"config error: {path} is a 'chat' file, but {model_path}'s tokenizer has no chat template; "
                     "set chat_template=FILE")
        try:
            rows = index_file(path, fmt)
        except ValueError as e:
            sys.exit(f"data error: {e}")
        except OSError as e:
            sys.exit(f"data error: {path}: cannot read it ({e.strerror})")
        mix.append((path, fmt, float(weight), rows, open(path, "rb")))
        print0(f"{path}: {len(rows)} conversations, format {fmt}, weight {weight}")
    sizes, weights = [len(m[3]) for m in mix], [m[2] for m in mix]
    epoch_len = len(epoch_order(sizes, weights, seed, 0))
    if epoch_len == 0:
        sys.exit("data error: the mix has no conversations")

    model = load_trainable(model_path, device, getattr(torch, dtype), activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(epoch_len / batch_size)
    total = epochs * steps_per_epoch
    warmup = max(1, round(warmup_ratio * total))
    logger = Logger(out_dir, wandb_project, cfg, rank)
    print0(f"sft: {epochs} epochs × {steps_per_epoch} steps of {batch_size} conversations "
           f"({epoch_len} per epoch), {world} rank(s)")

    step, skipped, trained = 0, 0, 0
    for epoch in range(epochs):
        order = epoch_order(sizes, weights, seed, epoch)
        for b in range(steps_per_epoch):
            t0 = time.perf_counter()
            # cosine schedule with linear warm-up
            progress = max(0.0, (step - warmup) / max(1, total - warmup))
            lr_now = lr * min((step + 1) / warmup, lr_min_ratio + (1 - lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            # render this step's conversations: each rank renders every world-th one (a chat template is
            # slow Python), then all ranks gather them all, in batch order, so all agree on the packing
            items, mine = order[b * batch_size:(b + 1) * batch_size], []
            for j, i in items[rank::world]:
                path, fmt, _, rows, f = mix[j]
                try:
                    mine.append(load(tokenizer, f, path, fmt, rows[i]))
                except ValueError as e:
                    mine.append(str(e))  # every rank must reach the gather, then all stop
            shares = gather(mine)
            batch = []
            for k in range(len(items)):
                rendered = shares[k % world][k // world]
                if isinstance(rendered, str):
                    sys.exit(f"data error: {rendered}")
                ids, mask = rendered
                if len(ids) > max_seq_len:
                    skipped += 1
                    continue
                batch.append({"ids": ids[:-1], "tgt": ids[1:], "mask": mask[1:]})
            n_tokens = sum(sum(e["mask"]) for e in batch)  # token-mean over the whole batch, all ranks
            trained += n_tokens
            bins = pack([len(e["ids"]) for e in batch], max_tokens_per_micro, world)
            loss_sum = torch.zeros((), device=device)
            for bin_ in bins[rank::world]:
                mb = collate([batch[i] for i in bin_], device, packed)
                lp = token_logprobs(model, mb["ids"], mb["tgt"], mb["seg"])  # (1, N)
                loss = -(lp * mb["mask"]).sum() / max(1, n_tokens)
                (loss * world).backward()  # FSDP averages over ranks; we already divided by the global count
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if dist.is_initialized():
                dist.all_reduce(loss_sum)
            step += 1
            grad_norm = full_value(grad_norm)
            logger.log(step, {"loss": loss_sum.item(), "lr": lr_now, "grad_norm": float(grad_norm),
                              "skipped": skipped})
            if step % log_every == 0 or step == total:
                print0(f"step {step:04d}/{total} | loss {loss_sum.item():.4f} | lr {lr_now:.2e} | "
                       f"dt {time.perf_counter() - t0:.2f}s")

    save_model(model, out_dir)
    if rank == 0:
        tokenizer.save_pretrained(out_dir)  # with the chat template the "chat" data was rendered by
    print0(f"saved {out_dir}: {trained} assistant tokens trained; {skipped} conversation(s) longer than "
           f"{max_seq_len} tokens skipped")
    compute_cleanup()

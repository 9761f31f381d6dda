"""
How big the core is, counted the way the README states it.

    python tests/codelines.py        # per module, then the totals and the budgets

Core = the run-time import closure of train_sft.py, train_rl.py and eval.py over the repository's
top-level modules (an import inside a function counts: it runs), plus the default task file they load
(tasks/math.py; the other task files are examples, outside the core like the tools). The ceiling is on code
tokens: Python's tokens other than comments, docstrings, newlines and indentation, so explaining costs nothing
and joining two lines into one saves nothing. A code line is a line that holds such a token; lines are only
reported, with the share of code lines over 100 characters (the anchors: nanochat 6.5%, nanoGPT 4.9%,
nano-vllm 3.2%). The tools (bench, demo, data, simulate, view) are outside the core, and
tests/test_codelines.py keeps them there.

It also prints the reading path: what a newcomer reads to follow one prompt to one gradient step, in order,
with its code lines and how many files it spans: train_rl.py's step loop (the loop that calls everything
else), the functions it calls, and the records they pass between them (a request, a trajectory, its summary
and tokens, a tool call and the sandbox's result); counted the way nanochat's chat_rl would be, loop included. The sandbox and the grader are read through
their contracts only (sandbox.Result's statuses, Grader.grade), not their insides. A name that no longer
resolves fails tests/test_codelines.py, as does a stale anchor in the README's "Where is it in the code".
"""
import ast
import io
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = ("train_sft", "train_rl", "eval")
TOOLS = ("bench", "demo", "data", "simulate", "view")
SANDBOX = ("sandbox", "sandbox_worker")
DEFAULT_TASK = "tasks/math"  # what the `task` key loads unless told otherwise
TOKEN_BUDGET = 38500  # the core's code tokens: a ceiling (DESIGN.md), not a goal
SANDBOX_BUDGET = 800  # the sandbox pair's code lines: a ceiling
LONG_LINE = 100  # characters: a code line longer than this counts as long
# prompt -> rollout -> tool call -> reward -> kept rollouts -> micro-batches -> loss -> new weights
READING_PATH = (
    # the loop that calls everything below, once per RL step
    "train_rl.py:while",
    # the records that cross the functions: what a rollout is asked for and what it gives back, its grade,
    # what every rank learns of it, a tool call and the sandbox's answer
    "rollout.py:Request", "rollout.py:Trajectory", "grading.py:Grade", "scheduler.py:Summary",
    "scheduler.py:Tokens",
    "agent.py:ToolCall", "agent.py:CallRecord", "sandbox.py:Result",
    # the prompt and its rollouts, spread over the ranks
    "train_rl.py:prompt_at", "tasks/math.py:prompt", "agent.py:prompt_text", "scheduler.py:generate",
    "scheduler.py:make_claim", "rollout.py:Engine.run", "rollout.py:Pager.admit", "rollout.py:Engine.prefill",
    "rollout.py:Engine.decode", "model.py:Qwen.forward_cached", "rollout.py:Engine.sample",
    "rollout.py:Engine.step_row",
    # a turn ends: its tool call goes to the sandbox (the contract: agent.TOOL_STATUSES), its answer comes back
    "rollout.py:Engine.end_turn", "agent.py:parse_tool_calls", "agent.py:start_call", "agent.py:run_python",
    "rollout.py:Engine.resume", "agent.py:tool_response_text", "agent.py:tool_suffix_ids",
    # the reward (the grader's contract), then what every rank learns of every trajectory
    "grading.py:Grader.grade", "tasks/math.py:predict", "tasks/math.py:grade", "scheduler.py:gather_summaries",
    # GRPO-RoC: which rollouts are kept, and their advantages
    "grpo_roc.py:filter_groups", "grpo_roc.py:penalty", "grpo_roc.py:resample_on_correct",
    "grpo_roc.py:advantages",
    # micro-batches, the loss and its gradient, the new weights handed to the engine
    "train_rl.py:plan", "scheduler.py:exchange", "train_rl.py:micro_batch", "model.py:collate",
    "grpo_roc.py:loss_weights", "train_rl.py:micro_logprobs", "model.py:token_logprobs", "model.py:Qwen.forward",
    "model.py:chunk_logprobs", "grpo_roc.py:policy_loss", "train_rl.py:sync_rollout_model",
)

# files read as one stop: the task file through grading's contract (Grader.grade calls its predict and grade),
# the sandbox's two halves as one sandbox (one budget, one contract: agent.TOOL_STATUSES)
ONE_STOP = {"tasks/math.py": "grading.py", "sandbox_worker.py": "sandbox.py"}


def stops(files):
    """The stops a reader makes to open these files (ONE_STOP's pairs count once)."""
    return len({ONE_STOP.get(path, path) for path in files})


def code_lines(path):
    return len(code_line_numbers(path))


def code_line_numbers(path):
    """The numbers of the code lines of a file (see the module docstring)."""
    lines = set()
    for token in code_tokens(path):
        lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def code_tokens(path):
    """The code tokens of a file, in order: every token but comments, docstrings, newlines and indentation.
    A token over several lines (a triple-quoted string that is code) makes each of its lines a code line."""
    src = open(path, encoding="utf-8").read()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    free = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER)
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    return [token for token in tokens if token.type not in free and token.start[0] not in docs]


def size(path):
    """(code tokens, code lines, code lines over LONG_LINE characters) of one file."""
    lines = code_line_numbers(path)
    text = open(path, encoding="utf-8").read().splitlines()
    long_lines = sum(len(text[number - 1]) > LONG_LINE for number in lines)
    return len(code_tokens(path)), len(lines), long_lines


def resolve(anchor):
    """The ast node that `file.py:name` (a function, class or module-level name; `Class.method` inside a class;
    `while`: the module's top-level while loop, e.g. train_rl.py's step loop) names, relative to the repository
    root; `file.py` alone is the module. Raises LookupError, naming the anchor, when it does not resolve."""
    path, _, name = anchor.partition(":")
    full = os.path.join(ROOT, path)
    if not path.endswith(".py") or not os.path.isfile(full):
        raise LookupError(f"{anchor}: no file {path}")
    node = ast.parse(open(full, encoding="utf-8").read())
    for part in name.split(".") if name else []:
        found = None
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child
            elif isinstance(child, ast.Assign) and any(getattr(t, "id", None) == part for t in child.targets):
                found = child
            elif isinstance(child, ast.While) and part == "while" and found is None:
                found = child
        if found is None:
            raise LookupError(f"{anchor}: {path} has no {part!r} there")
        node = found
    return node


def reading_path():
    """(the code lines of each READING_PATH function, in order; the number of files they span; and of stops)."""
    counts = []
    for anchor in READING_PATH:
        node = resolve(anchor)
        path = os.path.join(ROOT, anchor.partition(":")[0])
        counts.append(len(code_line_numbers(path) & set(range(node.lineno, node.end_lineno + 1))))
    files = {anchor.partition(":")[0] for anchor in READING_PATH}
    return counts, len(files), stops(files)


def local_imports(module):
    """The repository's top-level modules that `module` imports anywhere in its file."""
    local = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, module + ".py"), encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out & local - {module}


def core():
    seen, todo = set(), list(ENTRIES)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(local_imports(m) - seen)
    return sorted(seen)


def report():
    """The lines `python tests/codelines.py` prints after its per-module table: the README quotes them and
    tests/test_codelines.py checks that it quotes them as they are."""
    sizes = {m: size(os.path.join(ROOT, m + ".py")) for m in core() + [DEFAULT_TASK]}
    tokens = sum(s[0] for s in sizes.values())
    lines = sum(s[1] for s in sizes.values())
    long_lines = sum(s[2] for s in sizes.values())
    box = sum(sizes[m][1] for m in SANDBOX if m in sizes)
    path_lines, path_files, path_stops = reading_path()
    ok = tokens <= TOKEN_BUDGET and box <= SANDBOX_BUDGET
    return sizes, [
        f"core {tokens} code tokens (ceiling {TOKEN_BUDGET}) in {lines} code lines, "
        f"{100 * long_lines / lines:.1f}% of them over {LONG_LINE} characters",
        f"sandbox pair {box} code lines (ceiling {SANDBOX_BUDGET}): {'within' if ok else 'over'} the ceilings",
        f"reading path (prompt -> gradient): the step loop, {len(READING_PATH) - 1} functions and records, "
        f"{sum(path_lines)} code lines "
        f"in {path_files} files, {path_stops} stops (the task file read with grading's contract)",
    ]


if __name__ == "__main__":
    sizes, summary = report()
    print("tokens  lines  long  module")
    for m, (tokens, lines, long_lines) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
        print(f"{tokens:6d} {lines:6d} {long_lines:5d}  {m}.py")
    print("\n".join(summary))
    sys.exit(0)

"""
The rStar2-Agent protocol: the prompt, tool calls, tool responses, reading the answer. The tool seam (a
table of tools, name -> Tool: schema + run) is here too; a task's reward is in its task file (tasks/math.py
is this protocol's), run under grading.py's bounds.

Everything here is text and token ids; no model and no sandbox is imported. The format is the one the
released rStar2-Agent-14B was trained with (tests/fixtures/rstar2_chat_template.jinja, rendered by hand):

    <|im_start|>system\n{SYSTEM_PROMPT}{tools block}<|im_end|>\n
    <|im_start|>user\n{USER_PREFIX}{question}<|im_end|>\n
    <|im_start|>assistant\n<reason>                                   <- forced, mask 0
    ... </reason>\n<tool_call>\n{"name": ..., "arguments": {"code": ..., "input": ...}}\n</tool_call><|im_end|>
    <|im_start|>user\n<tool_response>\nTool call success\nstdout: 42\n\nexecution time: 0.01s\n</tool_response>
    <|im_end|>\n<|im_start|>assistant\n<reason>                         <- the tool turn, mask 0
    ... </reason>\n<answer>\\boxed{42}</answer><|im_end|>

A trajectory is built token-in/token-out: the prompt ids, then the ids the policy sampled (mask 1), then
the tool-response suffix (mask 0), and so on. Nothing is ever re-rendered from messages, which is why
render_conversation (for SFT) builds ids from the very same pieces the rollout appends.

In this file, top to bottom:
    the protocol text      SYSTEM_PROMPT, USER_PREFIX, the Python tool's schema: the release's, verbatim
    the tool seam          Tool, TOOL_STATUSES (the contract every tool meets), the Python tool, the prompt
    tool calls             parse_tool_calls in, tool_response_text / tool_suffix_ids out (the release's
                           words for each sandbox status: the table in the notes at the end)
    reading the answer     sampled_turns, extract_answer (what a task's grade reads)

The tool turn is the release's, token for token, so that the released model runs here unchanged; where
it differs from the paper, and what we could not make identical, is in the release-fidelity notes at the
end of this file and in docs/fidelity.md's table.
"""

import itertools
import json
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

# -----------------------------------------------------------------------------
# the protocol text, identical to the released rStar2-Agent-14B

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves "
    "it. The Assistant first thinks about the reasoning process in the mind and then provides the "
    "User with the answer. The reasoning process is enclosed within <reason> </reason> and answer "
    "is enclosed within <answer> </answer> tags, respectively, i.e., <reason> reasoning process "
    "here </reason> <answer> answer here </answer>."
)
USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here "
    "</answer>. And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem:\n"
)
# paper Fig. 3 and the HF model card (the repo says python_code_with_standard_io)
TOOL_NAME = "execute_python_code_with_standard_io"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description":
            "Execute Python code with standard input and capture standard output. This function "
            "takes a Python code string and an input string, provides the input string through "
            "standard input (stdin) to the code, and captures and returns any output produced "
            "through standard output (stdout). If the executed code raises an exception, the "
            "error message will be captured and returned instead.",
        "parameters": {
            "type": "object",
            # key order matters: the prompt lists them as json.dumps writes this dict
            "properties": {
                "code": {"type": "string",
                         "description": "A string containing Python code to be executed. The code "
                                        "can read from standard input using the input() function."},
                "input": {"type": "string",
                          "description": "A string that will be provided as standard input to the "
                                         "code when it calls input()."},
            },
            "required": ["code", "input"],
        },
    },
}
GENERATION_PROMPT = "<|im_start|>assistant\n<reason>"  # <reason> is forced, not sampled
END = "<|im_end|>"  # the policy samples this itself at the end of every turn

# -----------------------------------------------------------------------------
# the tool seam: a table of tools, name -> Tool. The prompt lists their schemas, the parser accepts their
# names, the engine runs a call with its tool's run(), and every tool answers with a ToolResult.

# The status of a tool call: the contract every tool meets (its ToolResult's status), plus "invalid" for a call
# that never ran. p_err (grpo_roc.penalty) and every tool-error metric count the failures, TOOL_ERRORS.
# Who answers which: the tool itself (the sandbox: sandbox_worker._call for ok / error / timeout / memory /
# crash, sandbox.SandboxPool._serve for a worker that died (crash) and _overloaded for a long queue);
# start_call below for invalid; rollout.Engine.resume for timeout when a call is still unanswered at the
# engine's call_timeout (any tool).
TOOL_STATUSES = {
    "ok": "it ran to the end (stdout, and the repr of a trailing expression as `value`)",
    "error": "it ran and failed: an exception or a non-zero exit (stderr says what)",
    "timeout": "it ran past its time limit and was stopped",
    "memory": "it ran past its memory limit",
    "crash": "it was killed by a signal",
    "invalid": "it never ran: bad JSON, an unknown tool or bad arguments "
               "(answered with the release's text)",
    "overloaded": "our own infrastructure was too busy to run it: not the policy's failure",
}
TOOL_ERRORS = frozenset({"invalid", "error", "timeout", "memory", "crash"})


def n_failed(statuses):
    """How many of these call statuses are failures (TOOL_ERRORS)."""
    return sum(status in TOOL_ERRORS for status in statuses)


def failed_share(statuses):
    """The share of these calls that failed (TOOL_ERRORS): what tool/err reports. A call answered
    "overloaded" (our infrastructure, not the policy) counts on neither side, as in p_err."""
    return n_failed(statuses) / max(1, len(statuses) - statuses.count("overloaded"))


@dataclass
class ToolResult:
    """What one tool call answered: what tool_response_text words for the model. A tool that runs in the
    trainer (tasks/calculator.py, tasks/gridworld.py) answers with one of these, e.g. ToolResult("ok", text)
    or ToolResult("error", "", why). The Python tool answers with the sandbox's own sandbox.Result, which
    has these fields in this order (sandbox.py is a library that imports nothing of ours; tests/test_agent.py
    checks the two agree), so its answer goes to the model as it is."""
    status: str  # one of TOOL_STATUSES
    stdout: str
    stderr: str = ""
    # the repr of a trailing expression (the Python tool prints it after stdout), else ""
    value: str = ""
    # seconds the call ran (the text shows it only for a timeout: see tool_response_text)
    duration: float = 0.0


@dataclass
class Tool:
    """One tool: `schema`, the OpenAI-format function schema the prompt lists (its function.name is the name
    the model calls it by), and `run(arguments, sandbox)`: the call's "arguments" object and the sandbox pool
    in, a concurrent.futures.Future of a ToolResult (status from TOOL_STATUSES, stdout, stderr, value,
    duration; the Python tool's is the sandbox's Result, of the same fields) out. A run that raises (bad
    arguments) is answered EXEC_ERROR + the exception's text, as the release answers a tool that raises, and counts as "invalid". run() is called on the decode loop: start
    the work and return, never wait on it (a Future still not done after the engine's call_timeout is
    answered "timeout").

    stateful=True: a tool of the trajectory's environment (a task's environment(row), one object per
    trajectory: tasks/gridworld.py), called as run(arguments, environment) with that object in place of the
    sandbox pool; its calls see and change that trajectory's state only, in the order the model made them."""
    schema: dict
    # (arguments, the sandbox pool or the trajectory's environment) -> Future of a ToolResult
    run: Callable[[object, object], Future]
    stateful: bool = False


EXEC_ERROR = "Error when executing tool: "  # the release's text when running a parsed call raises
# chars code-judge keeps of stdout and of stderr each (its MAX_STDOUT_ERROR_LENGTH)
OUTPUT_CAP = 1000
OVERLOADED = EXEC_ERROR + "run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts."


def run_python(args, sandbox):
    # the release's Python tool: the checks its client makes, in its order, raising what it raises
    # arguments that are not an object: .get raises
    code = args.get("code", "")
    stdin = args.get("input", "")
    # the client base64-encodes code.encode(): what it cannot encode (not a string, a lone surrogate) raises
    code.encode()
    # code-judge answers 422, the client gives up
    if stdin is not None and not isinstance(stdin, str):
        raise RuntimeError(OVERLOADED[len(EXEC_ERROR):])
    return sandbox.submit(code, stdin or "")


# the rStar2 task's table: the one Python tool
PYTHON_TOOLS = {TOOL_NAME: Tool(TOOL_SCHEMA, run_python)}


def tools_text(tools):
    """The Hermes/Qwen2.5 tool block the chat template appends to the system turn, one schema a line as
    jinja's tojson writes it in transformers; "" for an empty table (the template then writes none)."""
    if not tools:
        return ""
    return ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            + "".join("\n" + json.dumps(t.schema, ensure_ascii=False) for t in tools.values())
            + "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
            "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def prompt_text(question, system=SYSTEM_PROMPT, tools=PYTHON_TOOLS, user_prefix=USER_PREFIX):
    """The full prompt string for one question, ending in the forced '<|im_start|>assistant\\n<reason>'.
    The defaults are the rStar2 task's: its system prompt, its Python tool and its user prefix."""
    if not isinstance(question, str) or not isinstance(system, str):
        raise TypeError(f"question and system must be strings, got {type(question).__name__} "
                        f"and {type(system).__name__}")
    return (f"<|im_start|>system\n{system}{tools_text(tools)}{END}\n"
            f"<|im_start|>user\n{user_prefix}{question}{END}\n" + GENERATION_PROMPT)


# -----------------------------------------------------------------------------
# tool calls in, tool responses out

@dataclass
class ToolCall:
    name: str
    arguments: object  # the call's "arguments", as the model wrote them (run() checks them)


@dataclass
class CallRecord:
    """One tool call of a trajectory as the engine answered it (rollout.Trajectory.tool_calls: what the
    task's grade, the metrics and the dumps read)."""
    tool: str  # the tool's name; "" when the call did not parse or named no tool of the table
    arguments: object  # as the model wrote them; None when the call did not parse
    # once answered: TOOL_STATUSES' status (or "invalid"), the text the model read, seconds it took
    status: str = ""
    output: str = ""
    duration: float = 0.0


def _parse_one_call(block, tools):
    # returns a ToolCall, or the text the release answers instead of running anything. The checks are the
    # ones its code makes, in its order, and the messages are those of the exceptions it would raise.
    try:
        call = json.loads(block)  # not stripped: a JSON error's line and column count from the "\n"
        name = call["name"]
        args = call["arguments"]
    except Exception as e:
        return f"Failed to decode tool call: {e}"
    if not isinstance(name, str):  # verl's FunctionCall (pydantic) refuses it, inside the same try
        return f"Failed to decode tool call: the name must be a string, not {type(name).__name__}"
    if name not in tools:
        return EXEC_ERROR + repr(name)  # a KeyError in the tools dict prints as the key's repr
    return ToolCall(name, args)


def _blocks(text, start, end):
    # (begin, end) of the content of each start...end block of text, left to right: what re.findall with
    # start + "(.*?)" + end finds, in linear time (that lazy regex rescans the rest of the text from every
    # unclosed start tag: quadratic in a turn that repeats one)
    i = 0
    while (s := text.find(start, i)) >= 0 and (e := text.find(end, s + len(start))) >= 0:
        yield s + len(start), e
        i = e + len(end)


def parse_tool_calls(turn_text, max_calls=1, tools=PYTHON_TOOLS):
    """
    The tool calls of a finished assistant turn: its first max_calls <tool_call>...</tool_call> blocks,
    in order. Each item is a ToolCall of a tool in `tools` or a str to answer with verbatim (bad JSON,
    unknown tool). Blocks beyond max_calls are dropped, and a turn without both tags has no calls, as in
    the release. It runs on the decode loop, so it is linear in the turn's length and parses only the
    blocks it returns.
    """
    if max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    blocks = itertools.islice(_blocks(turn_text, "<tool_call>", "</tool_call>"), max_calls)
    return [_parse_one_call(turn_text[a:b], tools) for a, b in blocks]


def start_call(call, tools, sandbox, environment=None):
    """One item of parse_tool_calls started: (its CallRecord, the Future of its ToolResult), or (record, None) when
    it is answered at once (it did not parse, or its tool's run() raised): the record's output is then the
    answer. environment: the trajectory's own (Tool's `stateful`), None when its task has none."""
    if isinstance(call, str):
        return CallRecord("", None, "invalid", call), None
    record = CallRecord(call.name, call.arguments)
    tool = tools[call.name]
    try:
        return record, tool.run(call.arguments, environment if tool.stateful else sandbox)
    except Exception as e:  # bad arguments: the release answers what the tool raised
        record.status = "invalid"
        record.output = EXEC_ERROR + str(e)
        return record, None


def call_faults(records):
    """The tool-format health of a trajectory's calls (their records, in order), one label a call: "unparsed"
    (no JSON object with a string name), "unknown_tool" (a name the table lacks), "repeat" (the same tool and
    arguments as the call before it), else "". The first two are start_call's records without a tool."""
    faults = []
    previous = None
    for record in records:
        call = (record.tool, record.arguments)
        if not record.tool and record.status == "invalid":
            faults.append("unknown_tool" if record.output.startswith(EXEC_ERROR) else "unparsed")
        else:
            faults.append("repeat" if call == previous else "")
        previous = call if record.tool else None
    return faults


def truncate(text, max_chars):
    """The release's cut: the first and last max_chars // 2 characters around "...(truncated)..."."""
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2, got {max_chars}")
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[-half:]


def _without_notes(stderr):
    # drop the pool's trailing "[sandbox] ..." lines: the release has nothing like them
    lines = stderr.splitlines(keepends=True)
    while lines and lines[-1].startswith("[sandbox] "):
        lines.pop()
    return "".join(lines)


def tool_response_text(result, max_chars=256):
    """
    The text the model sees for one ToolResult (or the sandbox's Result, of the same fields), worded as
    the release's client words code-judge's report of the same run (the mapping is in the release-fidelity
    notes at the end of this file), then cut to max_chars.
    """
    status = result.status
    if status == "overloaded":
        return OVERLOADED
    stdout = result.stdout + (result.value + "\n" if result.value else "")
    if status == "ok":
        head = ["Tool call success"]
    elif status == "timeout":
        head = ["Tool call failure", "reason: worker_timeout"]
        stdout += "Suicide from timeout.\n"
    elif status in ("error", "memory", "crash"):
        # stdout: only what the harness had flushed (the sandbox's)
        head = ["Tool call failure", "reason: "]
    else:
        raise ValueError(f"unknown sandbox result status {status!r}")
    stdout = stdout[:OUTPUT_CAP]
    stderr = _without_notes(result.stderr)[:OUTPUT_CAP]
    parts = (head
             + ([f"stdout: {stdout}"] if stdout else [])
             + ([f"stderr: {stderr}"] if stderr else []))
    # not measured: see the release-fidelity notes at the end of this file
    seconds = round(result.duration) if status == "timeout" else 0.01
    return truncate("\n".join(parts + [f"execution time: {seconds:.2f}s"]), max_chars)


def tool_suffix_text(responses):
    """What follows an assistant turn that ended with <|im_end|>: one user turn with all responses, then
    the forced start of the next assistant turn. No "\n" after the model's <|im_end|>: the release
    appends the tool messages rendered alone, minus the rendered default system turn."""
    body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in responses)
    return f"<|im_start|>user{body}{END}\n{GENERATION_PROMPT}"


def user_turn_text(text):
    """What follows an assistant turn that an environment answered (its respond(): a referee, a simulated user):
    its text as a user turn of the chat template, then the forced start of the next assistant turn. No "\n"
    after the model's <|im_end|>, as after a tool turn."""
    return f"<|im_start|>user\n{text}{END}\n{GENERATION_PROMPT}"


def tool_suffix_ids(tokenizer, responses):
    """Token ids appended (mask 0) after a tool-calling assistant turn."""
    if not responses or not all(isinstance(r, str) for r in responses):
        raise ValueError("responses must be a non-empty list of strings")
    return tokenizer.encode(tool_suffix_text(responses), add_special_tokens=False)

# -----------------------------------------------------------------------------
# SFT: OpenAI-format messages -> the same ids a rollout would produce, plus the loss mask

def read_tool_call(call, i):
    """(name, arguments as a dict) of one OpenAI-format tool call of message i ({"function": {"name",
    "arguments"}} or the function object itself; arguments may be a JSON string). Raises ValueError."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
        raise ValueError(f"message {i}: a tool call needs function.name and function.arguments")
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"message {i}: tool call arguments are not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"message {i}: tool call arguments must be a JSON object")
    return fn["name"], args


def check_messages(messages, tool_names=None):
    """
    The checks every SFT conversation passes, whatever renders it: a non-empty list of system / user / assistant /
    tool messages, string contents (an assistant's may be None when it calls tools, and is not blank when it does
    not), the first assistant after a user, each assistant turn's tool calls answered by exactly that many tool
    messages right after it, the last message an assistant reply without tool calls. tool_names: the names a
    call may use (None: any). Returns the messages with each call's arguments as a JSON object (what a
    template's `tojson` expects: a string would be encoded twice). Raises ValueError naming the offending message index.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    out = []
    # calls of the last assistant turn not yet answered
    pending = 0
    seen_user = False
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"message {i}: unknown role {role!r} (system, user, assistant or tool)")
        calls = (m.get("tool_calls") or []) if role == "assistant" else []
        if not isinstance(calls, list):
            raise ValueError(f"message {i}: tool_calls must be a list")
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise ValueError(f"message {i}: {role} content must be a string")
        if role == "tool" and not pending:
            raise ValueError(f"message {i}: tool message without a preceding tool call")
        if role != "tool" and pending:
            raise ValueError(
                f"message {i}: {role} message while {pending} tool call(s) have no tool message")
        if role == "assistant" and not seen_user:
            raise ValueError(f"message {i}: assistant message before any user message")
        # a blank reply would train the model to answer nothing
        if role == "assistant" and not calls and not m["content"].strip():
            raise ValueError(f"message {i}: an assistant reply without tool calls must not be blank")
        seen_user |= role == "user"
        # a tool message answers one call (there is one: checked above)
        pending = pending - 1 if role == "tool" else len(calls)
        fixed = []
        for call in calls:
            name, args = read_tool_call(call, i)
            if tool_names is not None and name not in tool_names:
                raise ValueError(
                    f"message {i}: calls {name!r}, which is not in the conversation's tools")
            fn = dict(call.get("function", call), arguments=args)
            fixed.append(dict(call, function=fn) if "function" in call else fn)
        out.append(dict(m, tool_calls=fixed) if calls else m)
    if pending or messages[-1]["role"] != "assistant":
        last = "unanswered tool calls" if pending else f"a {messages[-1]['role']} message"
        raise ValueError(f"message {len(messages) - 1}: the conversation must end with an "
                         f"assistant reply without tool calls, not {last}")
    return out


def conversation_segments(messages, tools=PYTHON_TOOLS):
    """
    Split a conversation into (text, mask) pieces in rollout order: the prompt (0), each assistant turn
    after its forced <reason> (1), each group of tool responses with the next forced prefix (0), and each
    user message after an assistant turn without calls (an environment's reply: user_turn_text) (0).
    Messages: check_messages' rules, and the protocol's: an optional system message, one user question,
    then assistant turns (contents starting with <reason>, calls in tool_calls), their tool messages, and
    the environment's user turns. Raises ValueError naming the offending message index.
    """
    messages = check_messages(messages)
    first = 1 if messages[0]["role"] == "system" else 0  # the user question's index
    if messages[first]["role"] != "user":
        raise ValueError(f"message {first}: expected the user question")
    system = messages[0]["content"] if first else SYSTEM_PROMPT
    segments = [(prompt_text(messages[first]["content"], system, tools), 0)]
    responses = []
    for i, m in enumerate(messages[first + 1:], first + 1):
        # a tool message: its response joins the others of its turn, all written once the last is in
        if m["role"] == "tool":
            responses.append(m["content"])
            # the last message is an assistant's: there is an i + 1
            if messages[i + 1]["role"] != "tool":
                segments.append((tool_suffix_text(responses), 0))
                responses = []
            continue
        # a user message after a turn without calls (check_messages: a turn with calls has its tool
        # messages next): the environment's reply, as the engine appends it
        if m["role"] == "user" and messages[i - 1]["role"] == "assistant":
            segments.append((user_turn_text(m["content"]), 0))
            continue
        if m["role"] != "assistant":
            raise ValueError(f"message {i}: unexpected {m['role']} message (one leading system, one "
                             "user question, then a user message only after an assistant turn)")
        # an assistant turn: its text after the forced <reason>, then its calls as the template writes them
        content = m["content"]
        if not isinstance(content, str) or not content.startswith("<reason>"):
            raise ValueError(
                f"message {i}: assistant content must be a string starting with <reason>")
        if "<tool_call>" in content:
            raise ValueError(
                f"message {i}: put tool calls in 'tool_calls', not as <tool_call> text in content")
        if not m.get("tool_calls") and i != len(messages) - 1 and messages[i + 1]["role"] != "user":
            raise ValueError(f"message {i + 1}: the conversation goes on after a final assistant "
                             "turn (no tool calls)")
        text = content[len("<reason>"):]
        for call in m.get("tool_calls") or []:
            name, args = read_tool_call(call, i)
            # same bytes as the template: {"name": "...", "arguments": <tojson>}
            text += ("\n<tool_call>\n"
                     + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                     + "\n</tool_call>")
        segments.append((text + END, 1))
    return segments


def render_conversation(tokenizer, messages, tools=PYTHON_TOOLS):
    """(ids, mask) for SFT, built exactly like a rollout: mask is 1 on the tokens the policy would sample.
    tools: the table whose schemas the prompt lists (the default: the rStar2 task's Python tool)."""
    return encode_segments(tokenizer, conversation_segments(messages, tools))


def encode_segments(tokenizer, segments):
    """(ids, mask) of (text, mask) pieces, each tokenized on its own, the way a rollout appends tokens."""
    ids = []
    mask = []
    for text, m in segments:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [m] * len(piece)
    return ids, mask

# -----------------------------------------------------------------------------
# reading the answer (grading.py scores it)

def mask_runs(tokenizer, ids, mask):
    """[[text, m], ...]: the response decoded in runs of equal loss-mask value (1: sampled by the policy,
    0: tool responses and forced glue)."""
    runs = []
    start = 0
    # each run of equal mask values, from start to end
    for m, run in itertools.groupby(mask):
        end = start + len(list(run))
        runs.append([tokenizer.decode(ids[start:end]), m])
        start = end
    return runs


def sampled_turns(tokenizer, ids, mask):
    """The text of each run of tokens the policy sampled (mask 1), in order: one per assistant turn.
    Answers are read from these only: code that prints '<answer>\\boxed{7}</answer>' must not supply the
    answer, and a block cannot span a tool response."""
    return [text for text, m in mask_runs(tokenizer, ids, mask) if m]


def _answers(text):
    # the contents of the complete <answer> blocks of each turn of a text or a list of sampled
    # turns, read from the pieces of the turn outside its <tool_call> blocks: what comes before the
    # first, and after each call's first </tool_call> (an unclosed call runs to the end of its turn)
    out = []
    for turn in [text] if isinstance(text, str) else text:
        before, *calls = turn.split("<tool_call>")
        pieces = [before] + [call.partition("</tool_call>")[2] for call in calls]
        out.append([p[a:b] for p in pieces for a, b in _blocks(p, "<answer>", "</answer>")])
    return out


def count_answers(text):
    """Number of complete <answer>...</answer> blocks outside tool calls, over all the turns of a text or a
    list of sampled turns (the paper allows one: RoC's p_format counts the extra ones of the trajectory)."""
    return sum(len(blocks) for blocks in _answers(text))


def answer_block(text):
    """The content of the last <answer> block of the final turn (a text is one turn; of a list of sampled
    turns, the last), outside its tool calls; else None. An answer written in an earlier turn, or in a tool
    call's code, is not the final answer."""
    final = (_answers(text) or [[]])[-1]
    return final[-1] if final else None


def extract_answer(text):
    """The content of the last \\boxed{...} (balanced braces) inside answer_block(text); else None."""
    # no answer block: no \boxed{} either
    block = answer_block(text) or ""
    start = block.rfind("\\boxed{")
    if start < 0:
        return None
    begin = start + len("\\boxed{")
    depth = 1
    # the braces after it, left to right, until the one that closes it; a backslash and the character after it
    # are skipped as one (\{ and \} are literal braces, not grouping)
    for token in re.finditer(r"\\.|[{}]", block[begin:]):
        depth += (token[0] == "{") - (token[0] == "}")
        if depth == 0:
            return block[begin:begin + token.start()].strip()
    return None  # unbalanced



# -----------------------------------------------------------------------------
# release-fidelity notes (docs/fidelity.md's table has the rest: the tool name, the schema without
# "return", the tool-response length, surplus and malformed calls, where the answer is read)
#
# The tool turn is the release's code, token for token (rStar repo: rstar2_agent/rollout/
# rstar2_agent_loop.py, tools/tool_parser.py, tools/code_judge_utils.py; its verl fork's multi_turn
# defaults; code-judge). That code is not what trained rStar2-Agent-14B: the release's README says the model
# was trained on verl v0.2 with the authors' own multi-turn framework and that the released port "hasn't
# been used to train a complete model yet"; the paper's traces of the trained model (Figs. 10-11) show
# another response format. The release's chat demo (examples/chat_with_tool_call.py) feeds the released
# weights the release's format, and so do we; what the model saw in training is not published.
#
# The release's format, item by item:
# - no "\n" between the model's <|im_end|> and "<|im_start|>user": the release renders the tool messages
#   alone and cuts off the rendered default system turn, which ends in the "\n";
# - a response is code-judge's verdict in the client's words: "Tool call success" or "Tool call failure"
#   + "reason: " (worker_timeout or empty), then "stdout: ..." and "stderr: ..." when not empty (each cut
#   to 1000 chars by code-judge, kept with their trailing newline), then "execution time: 0.01s";
# - the whole text is cut to max_chars characters: first and last max_chars // 2 around
#   "...(truncated)..."; the texts of a call that did not parse or raised are not cut.
#
# How a sandbox result maps onto code-judge's report (run with rStar's MAX_EXECUTION_TIME=4):
#     ok        success; stdout is what was printed, then the repr of a trailing expression (our `value`,
#               which the release's harness prints too: IPython-style, and only when it is not None)
#     error     failure, reason "", stderr "ErrType at line N: msg" + the line (the harness's words);
#               stdout only what was flushed: the harness ends with os._exit(1), which drops what print()
#               left in the buffer (sandbox_worker.py runs code the same way, so Result.stdout is just that)
#     memory    failure, reason "", the same (the MemoryError is an error to the harness)
#     crash     failure, reason "", the same (a process killed by a signal does not flush either)
#     timeout   failure, reason worker_timeout, stdout = what was printed + "Suicide from timeout.\n" (the
#               alarm handler's words, printed with flush=True)
#     overloaded  the release retries a queue timeout 4 times, then the call raises: "Error when executing
#               tool: run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts."
# Lines of stderr starting "[sandbox] " are our pool's notes (why a call was stopped, what was cut): the
# release has no such lines, so they are left out.
#
# Different on purpose (none changes the form of what the released model sees):
# - "execution time" is not measured: 0.01s (the release shows that for a quick call, 0.05-0.2s for its
#   failures: the start of a fresh python3), and a timeout's limit in whole seconds (4.00s; the release
#   shows ~4.1s). A measured time would make the same rollout tokenize differently from run to run;
# - the reference template's quirk (an assistant message without tool calls is rendered with the user
#   prefix) is not reproduced by render_conversation.
# Where we cannot be identical (the release's text depends on things we do not have):
# - a non-string "name" is answered "Failed to decode tool call: ..." as in the release, but not with
#   pydantic's (version-dependent) wording; "overloaded" says "1 tool calls" where the release counts
#   the whole failed batch, other trajectories' calls included;
# - a timeout always adds "Suicide from timeout.": the release's 4 s CPU rlimit races its 4 s alarm and
#   counts the interpreter's start-up, so a long C call often reports nothing and a busy Python loop an
#   empty report (3 of 6 tries in the issue-23 audit). The status (timeout), so p_err, is the same;
# - the sandbox runs this environment's Python (3.11 in the tests) where rStar's README asks for 3.12 and
#   code-judge's workers run that environment's python3, so a few error messages differ;
# - a call runs in a fork of a warm worker, not in a fresh python3: numpy, scipy and sympy are already
#   imported (their import costs nothing against the 4 s limit), `random`'s and sympy's generator state,
#   the `hash()` seed and so set iteration order are the worker's (the same in every call of one worker,
#   where a fresh python3 draws new ones; a worker is replaced only when it dies), and code runs as
#   __main__, so classes it defines pickle as they would in a script.

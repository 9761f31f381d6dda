"""
The rStar2-Agent protocol: prompt, tool calls, tool responses, answer extraction and the 0/1 reward.

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

The tool turn is the release's, token for token (rStar repo: rstar2_agent/rollout/rstar2_agent_loop.py,
tools/tool_parser.py, tools/code_judge_utils.py; its verl fork's multi_turn defaults; code-judge):
- there is no "\n" between the model's <|im_end|> and "<|im_start|>user": the release renders the tool
  messages alone and cuts off the rendered default system turn, which ends in the "\n";
- a response is code-judge's verdict in the client's words: "Tool call success" or "Tool call failure"
  + "reason: " (worker_timeout or empty), then "stdout: ..." and "stderr: ..." when not empty (each cut
  to 1000 chars by code-judge, kept with their trailing newline), then "execution time: 0.01s";
- the whole text is cut to max_chars characters (verl's max_tool_response_length, 256, not overridden
  in training or in the eval scripts): first and last max_chars // 2 around "...(truncated)...";
- a block whose JSON fails to load or is not an object with "name" and "arguments" is answered
  "Failed to decode tool call: <exception>"; an unknown tool or bad arguments get "Error when executing
  tool: <exception>" (the exception the release's code raises, e.g. for arguments given as a JSON
  string: "'str' object has no attribute 'get'"); neither is cut to max_chars;
- only the first max_calls <tool_call> blocks of a turn count (verl's max_parallel_calls, 1): the rest
  get no response and no record; a turn without a closed block has no calls, so the trajectory ends.

How a sandbox result maps onto code-judge's report (run with the README's MAX_EXECUTION_TIME=4):
    ok        success; stdout is what was printed, then the repr of a trailing expression (our `value`,
              which the release's harness prints too: IPython-style, and only when it is not None)
    error     failure, reason "", stderr "ErrType at line N: msg" + the line (the harness's words); stdout
              only what was flushed: the harness ends with os._exit(1), which drops what print() left
              in the buffer (sandbox_worker.py runs code the same way, so Result.stdout is just that)
    memory    failure, reason "", the same (the MemoryError is an error to the harness)
    crash     failure, reason "", the same (a process killed by a signal does not flush either)
    timeout   failure, reason worker_timeout, stdout = what was printed + "Suicide from timeout.\n" (the
              alarm handler's words, printed with flush=True)
    overloaded  the release retries a queue timeout 4 times, then the call raises: "Error when executing
              tool: run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts."
Lines of stderr starting "[sandbox] " are our pool's notes (why a call was stopped, what was cut): the
release has no such lines, so they are left out.

Choices that differ from the release on purpose (none changes the form of what the released model sees):
- "execution time" is not measured: it is 0.01s (what the release shows for a quick call; its
  failures show 0.05-0.2s, the start of a fresh python3), and for a timeout the duration in whole
  seconds, i.e. the limit (4.00s; the release shows ~4.1s). A measured time would make the same
  rollout tokenize differently from run to run: no exact resume, no reproducible tiny run. Only the
  digits can differ from what the released model saw, not the format;
- tool name execute_python_code_with_standard_io (paper Fig. 3, the HF model card) where the repo's
  yaml registers python_code_with_standard_io: the released weights call the former, and the repo's
  loop would answer every such call "Error when executing tool: 'execute_python_code_with_standard_io'";
- the reward reads the last \\boxed{} inside the last <answer> block (the paper's rule), and uses
  math-verify only (the code OR-s it with the PRIME grader);
- the reference template's quirk (an assistant message without tool calls is rendered with the user
  prefix) is not reproduced by render_conversation.
Where we cannot be identical (the release's text depends on things we do not have):
- a non-string "name" is answered "Failed to decode tool call: ..." as in the release, but not with
  pydantic's (version-dependent) wording; "overloaded" says "1 tool calls" where the release counts
  the whole failed batch, other trajectories' calls included;
- a timeout always adds "Suicide from timeout." (the release's CPU-rlimit kill, which can come first
  inside a long C call, prints nothing);
- the sandbox runs Python 3.11 where code-judge's image has 3.12, so a few error messages differ
  (sandbox_worker.py lists what else of its harness cannot be the same).
"""

import atexit
import concurrent.futures
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass

# -----------------------------------------------------------------------------
# the protocol text, identical to the released rStar2-Agent-14B

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <reason> </reason> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer "
    "here </answer>."
)
USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
)
TOOL_NAME = "execute_python_code_with_standard_io"  # paper Fig. 3 and the HF model card (the repo says python_code_with_standard_io)
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Execute Python code with standard input and capture standard output. This function takes a "
            "Python code string and an input string, provides the input string through standard input "
            "(stdin) to the code, and captures and returns any output produced through standard output "
            "(stdout). If the executed code raises an exception, the error message will be captured and "
            "returned instead."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": "A string containing Python code to be executed. The code can read from "
                    "standard input using the input() function.",
                },
                "input": {
                    "type": "string",
                    "description": "A string that will be provided as standard input to the code when it "
                    "calls input().",
                },
            },
            "required": ["code", "input"],
        },
    },
}
# the Hermes/Qwen2.5 tool block that the template appends to the system turn
TOOLS_TEXT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL_SCHEMA, ensure_ascii=False)  # what jinja's tojson gives in transformers
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)
GENERATION_PROMPT = "<|im_start|>assistant\n<reason>"  # <reason> is forced, not sampled
END = "<|im_end|>"  # the policy samples this itself at the end of every turn


def prompt_text(question, system=SYSTEM_PROMPT):
    """The full prompt string for one question, ending in the forced '<|im_start|>assistant\\n<reason>'."""
    if not isinstance(question, str) or not isinstance(system, str):
        raise TypeError(f"question and system must be strings, got {type(question).__name__} and {type(system).__name__}")
    return (f"<|im_start|>system\n{system}{TOOLS_TEXT}{END}\n"
            f"<|im_start|>user\n{USER_PREFIX}{question}{END}\n" + GENERATION_PROMPT)


def render_prompt(tokenizer, question, system=SYSTEM_PROMPT):
    """Token ids of prompt_text(question): where every trajectory starts."""
    return tokenizer.encode(prompt_text(question, system), add_special_tokens=False)

# -----------------------------------------------------------------------------
# tool calls in, tool responses out

@dataclass
class ToolCall:
    code: str
    stdin: str = ""


# the status of a tool-call record: a sandbox result's status (ok, error, timeout, memory, crash, overloaded)
# or "invalid", a call that did not parse. The paper's p_err counts the failed ones; "overloaded" is our
# own infrastructure being busy, not the policy's fault.
TOOL_ERRORS = frozenset({"invalid", "error", "timeout", "memory", "crash"})

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
EXEC_ERROR = "Error when executing tool: "  # the release's text when running a parsed call raises
OUTPUT_CAP = 1000  # chars code-judge keeps of stdout and of stderr each (its MAX_STDOUT_ERROR_LENGTH)
OVERLOADED = EXEC_ERROR + "run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts."


def _parse_one_call(block):
    # returns a ToolCall, or the text the release answers instead of running anything. The checks are the
    # ones its code makes, in its order, and the messages are those of the exceptions it would raise.
    try:
        call = json.loads(block)  # not stripped: a JSON error's line and column count from the "\n"
        name, args = call["name"], call["arguments"]
    except Exception as e:
        return f"Failed to decode tool call: {e}"
    if not isinstance(name, str):  # verl's FunctionCall (pydantic) refuses it, inside the same try
        return f"Failed to decode tool call: the name must be a string, not {type(name).__name__}"
    if name != TOOL_NAME:
        return EXEC_ERROR + repr(name)  # a KeyError in the tools dict prints as the key's repr
    if not isinstance(args, dict):  # e.g. the arguments object sent as a JSON string
        return EXEC_ERROR + f"'{type(args).__name__}' object has no attribute 'get'"
    code, stdin = args.get("code", ""), args.get("input", "")
    if not isinstance(code, str):  # the client base64-encodes code.encode()
        return EXEC_ERROR + f"'{type(code).__name__}' object has no attribute 'encode'"
    if stdin is not None and not isinstance(stdin, str):  # code-judge answers 422, the client gives up
        return OVERLOADED
    return ToolCall(code=code, stdin=stdin or "")


def parse_tool_calls(turn_text, max_calls=1):
    """
    The tool calls of a finished assistant turn: its first max_calls <tool_call>...</tool_call> blocks,
    in order. Each item is a ToolCall to execute or a str to answer with verbatim (bad JSON, unknown
    tool, bad arguments). Blocks beyond max_calls are dropped, and a turn without both tags has no
    calls, as in the release.
    """
    if max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    if "<tool_call>" not in turn_text or "</tool_call>" not in turn_text:
        return []
    return [_parse_one_call(block) for block in _TOOL_CALL_RE.findall(turn_text)[:max_calls]]


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
    The text the model sees for one sandbox result (duck-typed: .status, .stdout, .stderr, .value,
    .duration), worded as the release's client words code-judge's report of the same run (the mapping
    is in the module docstring), then cut to max_chars.
    """
    status = result.status
    if status == "overloaded":
        return OVERLOADED
    stdout = result.stdout + (result.value + "\n" if result.value else "")
    if status == "ok":
        head = ["Tool call success"]
    elif status == "timeout":
        head, stdout = ["Tool call failure", "reason: worker_timeout"], stdout + "Suicide from timeout.\n"
    elif status in ("error", "memory", "crash"):
        head = ["Tool call failure", "reason: "]  # stdout: only what the harness had flushed (the sandbox's)
    else:
        raise ValueError(f"unknown sandbox result status {status!r}")
    stdout, stderr = stdout[:OUTPUT_CAP], _without_notes(result.stderr)[:OUTPUT_CAP]
    parts = head + ([f"stdout: {stdout}"] if stdout else []) + ([f"stderr: {stderr}"] if stderr else [])
    seconds = round(result.duration) if status == "timeout" else 0.01  # not measured: see the module docstring
    return truncate("\n".join(parts + [f"execution time: {seconds:.2f}s"]), max_chars)


def tool_suffix_text(responses):
    """What follows an assistant turn that ended with <|im_end|>: one user turn with all responses, then
    the forced start of the next assistant turn. No "\n" after the model's <|im_end|>: the release
    appends the tool messages rendered alone, minus the rendered default system turn."""
    body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in responses)
    return f"<|im_start|>user{body}{END}\n{GENERATION_PROMPT}"


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


def conversation_segments(messages):
    """
    Split a conversation into (text, mask) pieces in rollout order: the prompt (0), each assistant turn
    after its forced <reason> (1), each group of tool responses with the next forced prefix (0).
    Messages: optional system, one user, then assistant (with optional tool_calls) / tool ... ending in an
    assistant turn without tool calls. Raises ValueError naming the offending message index.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {i}: unknown role {m.get('role') if isinstance(m, dict) else m!r}")
        if m["role"] != "assistant" and not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: {m['role']} content must be a string")
    i = 0
    system = SYSTEM_PROMPT
    if messages[0]["role"] == "system":
        system, i = messages[0]["content"], 1
    if i >= len(messages) or messages[i]["role"] != "user":
        raise ValueError(f"message {i}: expected the user question")
    segments = [(prompt_text(messages[i]["content"], system), 0)]
    i += 1
    pending = 0  # tool calls of the last assistant turn still waiting for their tool messages
    while i < len(messages):
        m = messages[i]
        if m["role"] == "assistant":
            if pending:
                raise ValueError(f"message {i}: assistant turn while {pending} tool call(s) have no tool message")
            content = m.get("content")
            if not isinstance(content, str) or not content.startswith("<reason>"):
                raise ValueError(f"message {i}: assistant content must be a string starting with <reason>")
            if "<tool_call>" in content:
                raise ValueError(f"message {i}: put tool calls in 'tool_calls', not as <tool_call> text in content")
            text = content[len("<reason>"):]
            calls = m.get("tool_calls") or []
            for call in calls:
                name, args = read_tool_call(call, i)
                # same bytes as the template: {"name": "...", "arguments": <tojson>}
                text += "\n<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
            segments.append((text + END, 1))
            pending = len(calls)
            if not calls and i != len(messages) - 1:
                raise ValueError(f"message {i + 1}: the conversation goes on after a final assistant turn (no tool calls)")
            i += 1
        elif m["role"] == "tool":
            if not pending:
                raise ValueError(f"message {i}: tool message without a preceding tool call")
            responses = []
            while i < len(messages) and messages[i]["role"] == "tool":
                responses.append(messages[i]["content"])
                i += 1
            if len(responses) != pending:
                raise ValueError(f"message {i - 1}: {len(responses)} tool message(s) answer {pending} tool call(s)")
            segments.append((tool_suffix_text(responses), 0))
            pending = 0
        else:
            raise ValueError(f"message {i}: unexpected {m['role']} message (only one leading system and one user)")
    if len(segments) == 1 or pending or segments[-1][1] == 0:
        raise ValueError(f"message {len(messages) - 1}: the conversation must end with an assistant turn without tool calls")
    return segments


def render_conversation(tokenizer, messages):
    """(ids, mask) for SFT, built exactly like a rollout: mask is 1 on the tokens the policy would sample."""
    ids, mask = [], []
    for text, m in conversation_segments(messages):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [m] * len(piece)
    return ids, mask

# -----------------------------------------------------------------------------
# answer extraction and the 0/1 reward

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def mask_runs(tokenizer, ids, mask):
    """[[text, m], ...]: the response decoded in runs of equal loss-mask value (1: sampled by the policy,
    0: tool responses and forced glue)."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs.append([tokenizer.decode(ids[start:i]), mask[start]])
            start = i
    return runs


def sampled_turns(tokenizer, ids, mask):
    """The text of each run of tokens the policy sampled (mask 1), in order. Answers are read from these
    only: code that prints '<answer>\\boxed{7}</answer>' must not supply the answer, and a block cannot
    span a tool response."""
    return [text for text, m in mask_runs(tokenizer, ids, mask) if m]


def _texts(text):
    return [text] if isinstance(text, str) else list(text)


def count_answers(text):
    """Number of complete <answer>...</answer> blocks in a text or a list of sampled turns (the paper
    allows one)."""
    return sum(len(_ANSWER_RE.findall(t)) for t in _texts(text))


def extract_answer(text):
    """The content of the last \\boxed{...} (balanced braces) inside the last <answer> block of a text or
    a list of sampled turns, else None."""
    blocks = [b for t in _texts(text) for b in _ANSWER_RE.findall(t)]
    if not blocks:
        return None
    block = blocks[-1]
    start = block.rfind("\\boxed{")
    if start < 0:
        return None
    depth, j = 1, start + len("\\boxed{")
    begin = j
    while j < len(block):
        c = block[j]
        if c == "\\":  # \{ and \} are literal braces, not grouping
            j += 2
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return block[begin:j].strip()
        j += 1
    return None  # unbalanced


def _plain_int(s):
    # '-0012' -> '-12', '+0' -> '0'; None if s is not a plain integer
    m = re.fullmatch(r"([+-]?)0*(\d+)", s.strip())
    if m is None:
        return None
    return ("-" if m.group(1) == "-" and m.group(2) != "0" else "") + m.group(2)


# math-verify runs in one persistent helper process (this file run as a script): its own timeouts use
# signal.alarm, which fails off the main thread and cannot interrupt long C-level sympy/bigint work, so
# we disable them and instead kill the helper when it overruns, restarting it on the next call.
_verifier = None
_verifier_pid = None  # the process that started it: a forked child must not share its pipes
_verifier_lock = threading.Lock()


def _stop_verifier():
    global _verifier
    if _verifier is not None and _verifier_pid == os.getpid():
        _verifier.kill()
        _verifier.wait()
    _verifier = None


atexit.register(_stop_verifier)


def _read_line(proc, timeout):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


def _math_verify(gold, answer, timeout, start_timeout=120.0):
    global _verifier, _verifier_pid
    with _verifier_lock:  # one request in flight at a time, from any thread
        if _verifier is None or _verifier_pid != os.getpid() or _verifier.poll() is not None:
            # own session, so a Ctrl-C reaches only the caller; atexit (or EOF on its stdin) ends the helper
            _verifier = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--verify-server"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
            _verifier_pid = os.getpid()
            if _read_line(_verifier, start_timeout) != "ready\n":  # sympy import happens here, not in timeout
                _stop_verifier()
                raise RuntimeError("the math-verify helper process did not start (is math-verify installed?)")
        try:
            _verifier.stdin.write(json.dumps([gold, answer]) + "\n")
            _verifier.stdin.flush()
            line = _read_line(_verifier, timeout)
        except BrokenPipeError:  # it died since the poll() above
            line = ""
        if line not in ("1\n", "0\n"):  # overran (None) or died (""): kill it, count as wrong
            _stop_verifier()
            return False
        return line == "1\n"


def _serve_verifier():
    # the helper's loop: one JSON [gold, answer] per line in, "1" or "0" per line out
    from math_verify import parse, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: we know
    out, sys.stdout = sys.stdout, sys.stderr  # nothing but answers goes down the pipe
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, answer = json.loads(line)
        g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        p = parse("\\boxed{" + answer + "}", parsing_timeout=None)
        ok = bool(g) and bool(p) and verify(g, p, timeout_seconds=None)
        out.write("1\n" if ok else "0\n")
        out.flush()


def reward(response_text, gold, timeout=5.0):
    """
    1.0 if the answer extracted from response_text (a text or a list of sampled turns) equals gold per math-verify, else 0.0. Never hangs:
    verification that takes longer than timeout seconds counts as wrong. Safe to call from any thread.
    """
    if not isinstance(gold, str):
        raise ValueError(f"gold answer must be a string, got {type(gold).__name__}: {gold!r}")
    answer = extract_answer(response_text)
    if not answer:  # None or empty
        return 0.0
    if answer == gold.strip():
        return 1.0
    a, g = _plain_int(answer), _plain_int(gold)
    if a is not None and g is not None:  # integer vs integer needs no sympy
        return float(a == g)
    return float(_math_verify(gold, answer, timeout))


class Grader:
    """
    The engine's on_finish callback: grades each finished trajectory on a background thread, so the decode
    loop never waits for math-verify (the paper's §3.1 verifies asynchronously too). The answer is read from
    the sampled turns only. A trajectory cut by the response budget gets reward 0 without being read (paper
    §4.3.1: truncated rollouts are kept with a negative outcome, a signal against rambling) unless
    score_truncated, the released code's rule (it grades the text whatever the finish).
    results() waits for the grades of the trajectories this process finished: {key: {reward, answers, pred}}.
    """

    def __init__(self, tokenizer, score_truncated=False, timeout=5.0):
        self.tok, self.score_truncated, self.timeout = tokenizer, score_truncated, timeout
        # one thread: the math-verify helper takes one request at a time anyway
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grader")
        self.pending = {}

    def __call__(self, traj):
        # everything, decoding included, on the grader's thread: the engine only hands the trajectory over
        self.pending[traj.key] = self.pool.submit(self.grade, traj.response_ids, traj.mask, traj.finish,
                                                  traj.meta["answer"])
        return self.pending[traj.key]

    def grade(self, ids, mask, finish, gold):
        turns = sampled_turns(self.tok, ids, mask)
        graded = finish != "length" or self.score_truncated
        return {"reward": reward(turns, gold, self.timeout) if graded else 0.0, "answers": count_answers(turns),
                "pred": extract_answer(turns)}

    def results(self):
        out = {key: fut.result() for key, fut in self.pending.items()}
        self.pending = {}
        return out


if __name__ == "__main__" and sys.argv[1:] == ["--verify-server"]:
    _serve_verifier()

"""
A code-writing task (`task = "tasks/code.py"`, configs/tiny_code.py): the model writes a Python function, the
reward is the share of the row's hidden unit tests it passes, run in the sandbox. The Python tool is offered
for trying things out, as in the math task.

A row: {"question": "Write a Python function f(x) that returns ...", "entry": "f",
        "tests": [[[3], 1380], [[0], -66], ...]}    (arguments, expected result: JSON values)
(`python data.py code-set` writes a tiny set.) The tests never reach the prompt; grade() reads them. A row no
solution could pass (no tests, a test of another shape, an entry that is no name) is refused with its question
(check()) before a run starts.

Safe from the solution: the solution's own code cannot make a test pass that it does not pass.
- every test is its own sandbox call, a fresh process (one test's crash, exit or patched builtins cannot
  reach the next);
- in that call the solution is exec'd in a namespace of its own, after the harness took its own reference to
  json.dumps: redefining `type`, `json.dumps` or `print` changes nothing the harness uses;
- above all, the expected result is never in the sandbox: the call gives the solution's result as JSON, and the
  comparison with the expected JSON happens here, in the trainer, on strings (both written with their keys
  sorted: an object's key order is not part of its value). An object with an `__eq__`
  that always says yes is not JSON (the call fails); a solution that prints lines of its own cannot know the
  value to print. The result is the call's trailing expression, which the sandbox carries apart from stdout
  (Result.value, the repr of the JSON text): what the solution prints, 64 KiB of it or more, is only stdout,
  cut at the sandbox's output cap, and never cuts the result off. Whatever the solution patches (even the
  harness's frame), passing a test means producing its expected value.
A solution can still waste its calls' time: every call has the sandbox's time and memory bounds.

reward = passed tests / tests (partial credit: grpo_roc's docstring has the rule for rewards that are not
0/1); correct = every test passed.

maj@k (eval.py) votes on vote(): the solution as a program, not as text (see vote()).
"""
import ast
import hashlib
import json

import agent

COLUMNS = {"question": str, "entry": str, "tests": list}
TOOLS = agent.PYTHON_TOOLS
USER_PREFIX = ("Put your final answer inside <answer> </answer> tags as one ```python code block that defines "
               "the function asked for.\nThis is the problem:\n")
# one test: the solution in a namespace of its own, its result as JSON the trailing expression (Result.value)
HARNESS = """
import json as _json
_dumps = _json.dumps
_namespace = {"__name__": "solution"}
exec(compile(SOLUTION, "solution.py", "exec"), _namespace)
_dumps(_namespace[ENTRY](*ARGS), sort_keys=True)
"""

def check(row):
    """A ValueError naming the row when no solution could pass it: an entry that is no function name, no
    tests, or a test that is not [arguments, expected] with the arguments a list ([[3], 1380]; [3, 1380] ran
    f(*3) and failed every solution without a word). prompt() checks: train_rl.py and eval.py make every
    prompt before their first step."""
    where = f"code row {row['question']!r:.80}"
    if not row["entry"].isidentifier():
        raise ValueError(f"{where}: entry {row['entry']!r} is not a function name")
    if not row["tests"]:
        raise ValueError(f"{where}: it has no tests")
    for i, test in enumerate(row["tests"]):
        if not (isinstance(test, list) and len(test) == 2 and isinstance(test[0], list)):
            raise ValueError(f"{where}: test {i} must be [arguments, expected] with the arguments a list "
                             f"(e.g. [[3], 1380]), got {test!r:.60}")


def prompt(row):
    check(row)
    return agent.prompt_text(row["question"], tools=TOOLS, user_prefix=USER_PREFIX)


def predict(turns):
    """The code of the final <answer> block, without its ```python fence; None if there is none."""
    block = agent.answer_block(turns)
    if block is None:
        return None
    code = block.strip()
    if code.startswith("```"):
        code = code.split("\n", 1)[1] if "\n" in code else ""
        code = code.rsplit("```", 1)[0]
    return code.strip() or None


def grade(row, pred, turns, grader, trajectory):
    tests = row["tests"]
    if not pred or not tests:
        return 0.0, False
    # all tests at once, each its own call
    calls = [grader.sandbox.submit(f"SOLUTION = {pred!r}\nENTRY = {row['entry']!r}\nARGS = {args!r}\n" + HARNESS)
             for args, _ in tests]
    passed = 0
    for call, (_, expected) in zip(calls, tests):
        result = call.result()
        # the trailing expression's repr: the JSON text, quoted as a Python string
        expected_value = repr(json.dumps(expected, sort_keys=True))
        passed += result.status == "ok" and result.value == expected_value
    return passed / len(tests), passed == len(tests)


def vote(row, pred, trajectory):
    """What maj@k groups a sample by: the solution's syntax tree, without its layout, comments and docstrings,
    with every name it binds (arguments, variables, helper functions; not the entry point) renamed in the order
    the tree is walked; a 16-hex-digit digest of it (a Summary crosses ranks). So two samples that are one
    program written with other names, spacing or comments get one vote; a solution that is not Python (or too
    deep a tree to write out) votes on its text with spaces collapsed. None (no answer): no vote.
    Not its behaviour on the tests' inputs, which would group more programs (x * 2 and x + x): the grade runs
    those inputs, but what they printed is not kept where eval reads it (the grade returns a reward and a
    verdict), and running them again here (vote() runs right after grade(), on the grader's threads) would
    double the sandbox's work. The gold never enters: the tree is of the solution alone."""
    if not pred:
        return None
    try:
        tree = ast.parse(pred)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # not Python, or nested past the parser
        return " ".join(pred.split())
    # docstrings out: a string statement at the head of a body says nothing the program does
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and len(body) > 1 and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:]
    # the names the solution binds, in walk order; the entry point keeps its name (the tests call it)
    bound = [node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)]
    bound += [node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)]
    bound += [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    renamed = {name: f"v{i}" for i, name in enumerate(dict.fromkeys(bound)) if name != row["entry"]}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.arg = renamed.get(node.arg, node.arg)
        elif isinstance(node, ast.Name):
            node.id = renamed.get(node.id, node.id)
        elif isinstance(node, ast.FunctionDef):
            node.name = renamed.get(node.name, node.name)
    try:
        dumped = ast.dump(tree)
    except RecursionError:  # parsed, but deeper than ast.dump recurses (a sum of ~1,000 terms and more)
        return " ".join(pred.split())
    return hashlib.sha256(dumped.encode()).hexdigest()[:16]

"""
A second tool next to Python (`task = "tasks/calculator.py"`, configs/tiny_calc.py): the math task with a
`calculate` tool that evaluates an arithmetic expression. The same problems, answers and 0/1 reward as
tasks/math.py; the prompt lists both tools, the model may call either, and every call's record carries its
tool's name, so metrics and p_err see both.

The tool runs here, in the trainer, not in the sandbox: it parses the expression (Python's ast) and
evaluates integers with + - * // % and parentheses only, up to MAX_CHARS characters (nothing else
runs, so it cannot hang or reach anything). It answers like every tool, with an agent.ToolResult: "ok" and
the value as stdout, or "error" and the reason as stderr (which counts as a failed call in p_err).

Teaching the tiny model to call it: `python data.py traces --task=tasks/calculator.py` writes SFT traces from
trace() below, with the real answers of the tools; the README's "Fork it" has the commands.
"""
import ast
import concurrent.futures
import operator

import agent
from tasks.math import COLUMNS, grade, predict  # noqa: F401  (the same rows, answers and reward)

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression of integers with + - * // % and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 482 * 907 - 66"}},
            "required": ["expression"],
        },
    },
}
MAX_CHARS = 200
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
             ast.Mod: operator.mod}


def evaluate(node):
    """The value of a parsed expression made of integers, + - * // %, unary minus and parentheses only."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError(f"only integers, + - * // % and parentheses are allowed, not {type(getattr(node, 'op', node)).__name__}")


def run_calculator(args, sandbox):
    # arguments that are not an object, or lack "expression", raise: the model is answered with the error
    expression = args["expression"]
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, not {type(expression).__name__}")
    try:
        if len(expression) > MAX_CHARS:
            raise ValueError(f"the expression is longer than {MAX_CHARS} characters")
        result = agent.ToolResult("ok", f"{evaluate(ast.parse(expression.strip(), mode='eval').body)}\n")
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        result = agent.ToolResult("error", "", f"{type(e).__name__}: {e}\n")
    done = concurrent.futures.Future()  # answered at once: a Future like every tool's
    done.set_result(result)
    return done


TOOLS = {**agent.PYTHON_TOOLS, "calculate": agent.Tool(CALCULATOR_SCHEMA, run_calculator)}


def prompt(row):
    return agent.prompt_text(row["question"], tools=TOOLS)


def trace(row, rng):
    """SFT messages that solve a tiny-task row ("What is <expr>?") with the calculator; a quarter of them
    first make a malformed call and then fix it. Tool messages are left None: data.py fills them in with
    the tools' real answers."""
    expr = row["question"].removeprefix("What is ").removesuffix("?")

    def call(reason, expression):
        fn = {"name": "calculate", "arguments": {"expression": expression}}
        return {"role": "assistant", "content": f"<reason>{reason}</reason>", "tool_calls": [{"type": "function", "function": fn}]}
    messages = [{"role": "user", "content": row["question"]}]
    if rng.random() < 0.25:
        messages += [call("I will compute this with the calculator.", rng.choice([f"({expr}", f"{expr} =", f"{expr})"])),
                     {"role": "tool", "content": None}, call("The expression was malformed. I will fix it.", expr)]
    else:
        messages.append(call("I will compute this with the calculator.", expr))
    messages += [{"role": "tool", "content": None},
                 {"role": "assistant", "content": f"<reason>The tool gave the result.</reason>\n<answer>\\boxed{{{row['answer']}}}</answer>"}]
    return messages

"""
How big the core is, counted the way the README states it.

    python tests/codelines.py        # per module, then the totals and the budgets

Core = the run-time import closure of train_sft.py, train_rl.py and eval.py over the repository's
top-level modules (an import inside a function counts: it runs), plus the default task file they load
(tasks/math.py; the other task files are examples, outside the core like the tools). A code line is a line that holds a
token other than a comment or a docstring: blank lines, comments and docstrings are free, so
explaining costs nothing. The tools (bench, demo, data, simulate, view) are outside the core, and
tests/test_codelines.py keeps them there.
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
BUDGET, SANDBOX_BUDGET = 3400, 800  # ceilings (DESIGN.md), not goals


def code_lines(path):
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
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in free:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


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


if __name__ == "__main__":
    counts = {m: code_lines(os.path.join(ROOT, m + ".py")) for m in core() + [DEFAULT_TASK]}
    for m, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {m}.py")
    total, box = sum(counts.values()), sum(counts.get(m, 0) for m in SANDBOX)
    ok = total <= BUDGET and box <= SANDBOX_BUDGET
    print(f"core {total} code lines (budget {BUDGET}), sandbox pair {box} (budget {SANDBOX_BUDGET}): "
          f"{'within budget' if ok else 'over budget'}")
    sys.exit(0)

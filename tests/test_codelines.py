"""The core's size is counted the way the README states it (tests/codelines.py: code tokens, a ceiling),
and no core module imports a tool (bench, demo, data, simulate, view): a tool is free to grow, the core
is not."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import codelines  # noqa: E402


def test_no_core_module_imports_a_tool():
    core = codelines.core()
    assert {"train_sft", "train_rl", "eval", "rollout", "sandbox", "agent"} <= set(core), core
    assert not set(core) & set(codelines.TOOLS), set(core) & set(codelines.TOOLS)


def test_code_lines_leave_comments_docstrings_and_blank_lines_free(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""module\ndocstring"""\n# a comment\n\nimport os  # trailing comment\n\n\n'
                   'def f(x):\n    """its docstring,\n    two lines"""\n    # why\n    return (x +\n            1)\n'
                   'S = """a string\nthat is code"""\n')
    # import os / def f / return ( / 1) / S = """ / that is code"""
    assert codelines.code_lines(str(src)) == 6


def test_reading_path_resolves_and_is_counted():
    # every name on the path is a function or method that still exists, with code lines of its own
    lines, files, stops = codelines.reading_path()
    assert len(lines) == len(codelines.READING_PATH) and all(n > 0 for n in lines), lines
    assert files == len({a.partition(":")[0] for a in codelines.READING_PATH}) and stops == files - 1
    for bad in ("rollout.py:Engine.no_such_method", "nowhere.py:run", "agent.py:NoSuchName"):
        with pytest.raises(LookupError, match=bad.split(":")[0]):
            codelines.resolve(bad)


def test_readme_map_anchors_resolve():
    # the README's "Where is it in the code": every `file.py` or `file.py:name` in it names what exists
    readme = open(os.path.join(codelines.ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("\n## Where is it in the code\n", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"`([\w/]+\.py(?::[\w.]+)?)`", section)
    assert len(anchors) >= 40, anchors
    for anchor in anchors:
        codelines.resolve(anchor)


def test_readme_map_each_question_needs_at_most_two_stops():
    # a newcomer's question is answered by opening at most two files (the sandbox pair and a task file with
    # grading.py count as one stop each, codelines.ONE_STOP); the README says how many each row needs
    readme = open(os.path.join(codelines.ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("\n## Where is it in the code\n", 1)[1].split("\n## ", 1)[0]
    questions = section.split("| Question | Where |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in questions.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 13, rows
    for row in rows:
        files = set(re.findall(r"`([\w/]+\.py)(?::[\w.]+)?`", row))
        assert codelines.stops(files) <= 2, (row, files)


def test_core_within_its_ceilings_and_the_readme_quotes_the_count():
    # the ceilings are on code tokens (joining lines saves nothing) and the sandbox pair's code lines; the README
    # quotes the summary lines of `python tests/codelines.py` as they are on this commit
    sizes, summary = codelines.report()
    assert sum(s[0] for s in sizes.values()) <= codelines.TOKEN_BUDGET, summary
    assert sum(sizes[m][1] for m in codelines.SANDBOX) <= codelines.SANDBOX_BUDGET, summary
    # at most 6.5% of the code lines over LONG_LINE characters (DESIGN.md; the anchors: nanochat 6.5%)
    assert sum(s[2] for s in sizes.values()) <= 0.065 * sum(s[1] for s in sizes.values()), summary
    readme = open(os.path.join(codelines.ROOT, "README.md"), encoding="utf-8").read()
    for line in summary:
        assert line in readme, f"README.md does not quote `{line}` (run python tests/codelines.py)"


def test_code_tokens_count_what_a_reader_reads(tmp_path):
    # comments and docstrings are free; joining two statements into one line saves no token
    src = tmp_path / "m.py"
    src.write_text('"""doc"""\n# c\nx = 1\ny = 2\n')
    joined = tmp_path / "j.py"
    joined.write_text('"""doc"""\nx, y = 1, 2\n')
    assert len(codelines.code_tokens(str(src))) == 6  # x = 1 / y = 2
    assert len(codelines.code_tokens(str(joined))) == 7  # x , y = 1 , 2
    assert codelines.size(str(src)) == (6, 2, 0)

"""The core's size is counted the way the README states it (tests/codelines.py), and no core module imports a
tool (bench, demo, data, simulate, view): a tool is free to grow, the core is not."""
import os
import sys

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

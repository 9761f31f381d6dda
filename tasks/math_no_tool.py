"""
The same math problems without any tool (`task = "tasks/math_no_tool.py"`): the rStar2 prompt with no tools
block, the same answer and 0/1 reward (tasks/math.py's). Run eval.py with each task on one model to put the
tool-using and the plain score side by side. A <tool_call> the model writes anyway is answered with the
release's error for an unknown tool, and counts as a failed call.
"""
import agent
from tasks.math import COLUMNS, grade, predict  # noqa: F401  (the same rows, answers and reward)

TOOLS = {}


def prompt(row):
    return agent.prompt_text(row["question"], tools=TOOLS)

"""
The rStar2-Agent math task, the default (`task = "tasks/math.py"`): the released prompt with its one Python
tool, and the 0/1 math-verify reward of the paper. Token for token what the release's model sees.

A task is one file like this one, named by the `task` key of train_rl.py and eval.py. It defines:

    COLUMNS        the JSONL columns every row must have (a missing one stops the run, naming file and line)
    TOOLS          its tool table, name -> agent.Tool (schema + run); {} offers no tool
    prompt(row)    the whole prompt text of a data row (agent.prompt_text renders the protocol's)
    answer(turns)  the prediction read from the sampled turns (maj@k votes on it; None: no answer)
    grade(row, pred, turns, grader, trajectory) -> (reward in [0, 1], correct): reward is what training uses,
                   correct what avg@k / pass@k / maj@k and the metrics count. It runs on grading.Grader's threads,
                   under its bounds; grader.reward(turns, gold) is the math-verify rule, grader.sandbox the sandbox
                   pool; trajectory.tool_calls the call records (tool, arguments, status, output) and
                   trajectory.environment the environment's final state.
and may define
    environment(row)  one new object per trajectory, the state its tools share (a game, a session): the tools
                   marked agent.Tool(stateful=True) run on it, grade() reads it, its close() runs when the
                   trajectory ends however it ends (tasks/gridworld.py is the worked example)

`row` is the whole JSONL row: every column reaches prompt() and grade().
"""
import agent

COLUMNS = ("question", "answer")
TOOLS = agent.PYTHON_TOOLS


def prompt(row):
    return agent.prompt_text(row["question"], tools=TOOLS)


def answer(turns):
    return agent.extract_answer(turns)


def grade(row, pred, turns, grader, trajectory):
    reward = grader.reward(turns, row["answer"])  # 1.0 or 0.0: grading.Grader.reward has the rule
    return reward, reward == 1.0

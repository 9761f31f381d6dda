"""
A stateful, multi-turn environment (`task = "tasks/gridworld.py"`, configs/tiny_grid.py): the model walks through
a small grid with a `move` tool, one step a call, and is rewarded for reaching the goal in few moves. What each
call answers depends on the calls before it (where the walker stands now), so the state lives in one object per
trajectory, the task's environment(row), never in this module:

    environment(row)   a new GridWorld for one trajectory (rollout.Engine makes it when the row is claimed; the
                       samples of one prompt each get their own, and a preempted row keeps its own)
    TOOLS["move"]      agent.Tool(stateful=True): the engine calls run_move(arguments, that trajectory's GridWorld)
    grade(...)         reads the GridWorld's final state (where the walk ended, how many moves it took), not the
                       text: reward = shortest path / moves taken when the goal was reached, else 0; correct =
                       the goal was reached (a row whose start is its goal: 1.0, reached in no moves)
    GridWorld.close()  runs when the trajectory ends, however it ends (an answer, the budget, the turn limit, an
                       exception in the step): no move is accepted after it

A row: {"question": "...", "size": 4, "start": [0, 0], "goal": [2, 3], "walls": [[1, 1], [2, 2]]}; the question
says all of it (`python data.py grid-set` writes a tiny set). Positions are (x, y): "right" adds 1 to x, "up"
adds 1 to y. A move into a wall or off the grid leaves the walker where it is, and is answered so ("blocked");
the move count counts it. A move with an unknown direction, or after the goal was reached, is a failed call
(status "error": p_err and tool/err count it). A row that cannot be walked (its goal walled off, the start a
wall, a position off the grid or not [x, y]) is refused with its question (check()) before a run or trace starts.

SFT traces from the real environment: `python data.py traces --task=tasks/gridworld.py` runs trace()'s moves
through a GridWorld of each row, so every tool message is what the environment answered.
"""
import collections
import concurrent.futures
import itertools
import random

import agent

COLUMNS = {"question": str, "size": int, "start": list, "goal": list, "walls": list}
DIRECTIONS = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}
MOVE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move one step in the grid and see where you are.",
        "parameters": {
            "type": "object",
            "properties": {"direction": {"type": "string", "description": "up, down, left or right"}},
            "required": ["direction"],
        },
    },
}


class GridWorld:
    """One trajectory's walk: where it is, how many moves it made, whether it reached the goal."""

    def __init__(self, row):
        self.size, self.goal = row["size"], tuple(row["goal"])
        self.walls = {tuple(wall) for wall in row["walls"]}
        self.position = tuple(row["start"])
        self.moves = 0
        self.shortest = len(shortest_path(row))  # the fewest moves that reach the goal (the reward's yardstick)
        self.closed = False

    def move(self, direction):
        """One step: the observation the model reads, as an agent.ToolResult (ok, or error for a failed call)."""
        if self.closed:
            raise RuntimeError("the trajectory is over: its environment is closed")
        if direction not in DIRECTIONS:
            return agent.ToolResult("error", "", f"unknown direction {direction!r}: up, down, left or right\n")
        if self.position == self.goal:
            return agent.ToolResult("error", "", "the goal is reached already: answer now\n")
        self.moves += 1
        dx, dy = DIRECTIONS[direction]
        target = (self.position[0] + dx, self.position[1] + dy)
        if target in self.walls or not all(0 <= c < self.size for c in target):
            return agent.ToolResult("ok", f"blocked, still at {fmt(self.position)}\n")
        self.position = target
        if self.position == self.goal:
            return agent.ToolResult("ok", f"at {fmt(self.position)}: the goal, after {self.moves} moves\n")
        return agent.ToolResult("ok", f"at {fmt(self.position)}\n")

    def close(self):
        self.closed = True


def fmt(position):
    return f"({position[0]}, {position[1]})"


def run_move(arguments, world):
    # arguments that are not an object, or lack "direction", raise: the model is answered with the error
    done = concurrent.futures.Future()  # a move is answered at once; a Future like every tool's
    done.set_result(world.move(arguments["direction"]))
    return done


TOOLS = {"move": agent.Tool(MOVE_SCHEMA, run_move, stateful=True)}


def environment(row):
    return GridWorld(row)


def check(row):
    """A ValueError naming the row when it cannot be walked: start, goal and walls each [x, y], two integers; start
    and goal inside the grid, the start off the walls, the goal reachable from it (the reward's yardstick is the
    shortest walk). prompt() and trace() check: train_rl.py and eval.py make every prompt before their first step
    (a row that failed only when its trajectory began ended the run there), `data.py traces` traces every row."""
    where = f"grid row {row['question']!r:.80}"
    cells = [row["start"], row["goal"], *row["walls"]]
    two_ints = [isinstance(cell, list) and len(cell) == 2 and all(type(c) is int for c in cell)
                for cell in cells]
    if not all(two_ints):
        raise ValueError(f"{where}: start, goal and each wall must be [x, y], two integers")
    size = row["size"]
    if not all(0 <= c < size for c in row["start"] + row["goal"]):
        raise ValueError(f"{where}: start {row['start']} and goal {row['goal']} must be inside the "
                         f"{size} x {size} grid")
    if row["start"] in row["walls"]:
        raise ValueError(f"{where}: the start {row['start']} is a wall")
    if shortest_path(row) is None:
        raise ValueError(f"{where}: no walk reaches the goal {row['goal']} from the start "
                         f"{row['start']}")


def prompt(row):
    check(row)
    return agent.prompt_text(row["question"], tools=TOOLS)


def predict(turns):
    return agent.extract_answer(turns)


def grade(row, pred, turns, grader, trajectory):
    world = trajectory.environment
    if world.position != world.goal:
        return 0.0, False
    # a row whose start is its goal is reached in no moves, as few as it can be (its shortest walk is 0 moves)
    if world.moves == 0:
        return 1.0, True
    return world.shortest / world.moves, True


# -----------------------------------------------------------------------------
# rows and SFT traces (data.py grid-set, data.py traces)

def shortest_path(row):
    """The directions of a shortest walk from start to goal around the walls (breadth-first search); None when
    the walls cut the goal off."""
    start, goal = tuple(row["start"]), tuple(row["goal"])
    walls, size = {tuple(wall) for wall in row["walls"]}, row["size"]
    came_from, frontier = {start: None}, collections.deque([start])
    while frontier:
        here = frontier.popleft()
        for direction, (dx, dy) in DIRECTIONS.items():
            there = (here[0] + dx, here[1] + dy)
            if there not in came_from and there not in walls and all(0 <= c < size for c in there):
                came_from[there] = (here, direction)
                frontier.append(there)
    if goal not in came_from:
        return None
    path, here = [], goal
    while came_from[here] is not None:
        here, direction = came_from[here]
        path.append(direction)
    return path[::-1]


def problems(n, seed, size=4, n_walls=2):
    """n distinct rows: a size x size grid, a start, a goal and n_walls walls that leave the goal reachable, drawn
    from every such layout (a 4 x 4 grid with 2 walls has about 21K); ValueError when there are fewer than n."""
    cells = [(x, y) for x in range(size) for y in range(size)]
    layouts = [(start, goal, walls) for start in cells for goal in cells if goal != start
               for walls in itertools.combinations([c for c in cells if c not in (start, goal)], n_walls)]
    random.Random(seed).shuffle(layouts)
    rows = []
    for start, goal, walls in layouts:
        row = {"size": size, "start": list(start), "goal": list(goal), "walls": [list(wall) for wall in walls]}
        if len(rows) == n:
            return rows
        if shortest_path(row) is None:
            continue
        walls_text = ", ".join(fmt(wall) for wall in walls)
        row["question"] = (f"You are at {fmt(start)} in a {size} x {size} grid. Reach the goal at {fmt(goal)} "
                           f"with the move tool in as few moves as you can. Walls: {walls_text}.")
        rows.append(row)
    if len(rows) < n:
        raise ValueError(f"a {size} x {size} grid with {n_walls} walls has only {len(rows)} layouts, not {n}")
    return rows


def trace(row, rng):
    """SFT messages that walk a shortest path, one move a turn; a quarter of them first step the wrong way and
    then go on from where that move left them (so a move is chosen from the last observation). Tool messages are
    left None: data.py fills them in with the environment's real answers."""
    check(row)
    def call(direction):
        fn = {"name": "move", "arguments": {"direction": direction}}
        return [{"role": "assistant", "content": f"<reason>I move {direction}.</reason>",
                 "tool_calls": [{"type": "function", "function": fn}]}, {"role": "tool", "content": None}]
    messages, start = [{"role": "user", "content": row["question"]}], row["start"]
    # a detour: one step that is not on a shortest path, then the shortest from there (none at the goal already)
    if rng.random() < 0.25 and row["start"] != row["goal"]:
        detour = rng.choice([d for d in DIRECTIONS if d not in shortest_path(row)[:1]])
        world = GridWorld(row)
        world.move(detour)
        messages += call(detour)
        start = list(world.position)
    for direction in shortest_path(dict(row, start=start)):
        messages += call(direction)
    answer_text = f"<reason>I reached the goal.</reason>\n<answer>\\boxed{{{fmt(row['goal'])}}}</answer>"
    return messages + [{"role": "assistant", "content": answer_text}]

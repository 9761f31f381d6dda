"""Per-trajectory environments through the real engine (rollout.Engine) with a scripted policy: tasks/gridworld.py's
GridWorld, one per trajectory, driven by several samples of one prompt side by side, with rows preempted in the
middle of their walks and a tool that never answers; the reward read from each environment's final state."""
import concurrent.futures
import functools
import json
import os
import random
import re
import threading
import time
import types

import pytest
import torch
import transformers

import agent
import data
import grading
import train_sft
import view
import zygote
from common import write_jsonl
from model import load_model
from rollout import Engine, Request, iter_claim
from sandbox import SandboxPool

GRID = grading.load_task("tasks/gridworld.py")
MATH = grading.load_task("tasks/math.py")
ROW = {"question": "You are at (0, 0) in a 4 x 4 grid. Reach the goal at (2, 0) with the move tool in as few moves "
                   "as you can. Walls: (1, 0).", "size": 4, "start": [0, 0], "goal": [2, 0], "walls": [[1, 0]]}
HANG_SCHEMA = {"type": "function", "function": {"name": "wait", "description": "never answers", "parameters": {}}}
# the grid's move tool, and one of the same environment whose Future never completes
TOOLS = {**GRID.TOOLS, "wait": agent.Tool(HANG_SCHEMA, lambda args, world: concurrent.futures.Future(), stateful=True)}


def call(name, **arguments):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"I act.</reason>\n<tool_call>\n{body}\n</tool_call><|im_end|>"


def moves(*directions):
    return [call("move", direction=d) for d in directions]


NO_SANDBOX = types.SimpleNamespace()  # the grid needs no sandbox pool (a Python call would fail loudly)
DONE = "I am done.</reason>\n<answer>\\boxed{(2, 0)}</answer><|im_end|>"
# the assistant turns of each sample of the one prompt (after the forced <reason>), and where its walk ends
SCRIPTS = {
    0: moves("up", "right", "right", "down") + [DONE],  # the shortest walk: 4 moves
    1: moves("right", "up", "right", "right", "down") + [DONE],  # into the wall first: 5 moves
    2: moves("up", "up") + [call("move", direction="north"), DONE],  # lost, and an unknown direction
    3: moves("up") + [call("wait")] + moves("right", "right", "down") + [DONE],  # a call that never answers
}
WANT = {0: ((2, 0), 4, 1.0), 1: ((2, 0), 5, 0.8), 2: ((0, 2), 2, 0.0), 3: ((2, 0), 4, 1.0)}


class Counting(GRID.GridWorld):
    """A GridWorld that remembers every move it was asked for and whether it was closed."""
    made = []  # every instance, in the order they were made

    def __init__(self, row):
        super().__init__(row)
        self.asked = []
        Counting.made.append(self)

    def move(self, direction):
        self.asked.append(direction)
        return super().move(direction)


class Scripted(Engine):
    """The engine with a scripted policy: each sample's turns (SCRIPTS, by sample index) are forced token by token
    from the trajectory's own state, so a row prefilled again after preemption goes on exactly where it was."""

    scripts = None  # {key: turns}; None: SCRIPTS by sample index

    def sample(self, rows, temperature):
        toks, lps = super().sample(rows, temperature)
        for i, row in enumerate(rows):
            turns = SCRIPTS[row.req.key[2]] if self.scripts is None else self.scripts[row.req.key]
            turn = self.tok.encode(turns[row.traj.turns], add_special_tokens=False)
            toks[i] = turn[len(row.traj.response_ids) - row.turn_start]
        return toks, lps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tokenizer that knows the grid's prompt and turns, and a random tiny Qwen3 over it."""
    d = tmp_path_factory.mktemp("grid")
    texts = [agent.prompt_text(ROW["question"], tools=TOOLS)] + [t for s in SCRIPTS.values() for t in s]
    tok = data.train_tokenizer(texts + ["<tool_response>\nTool call success\nstdout: at (0, 1)\n"], vocab_size=700)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return load_model(str(d)), tok


def walk(tiny, kv_capacity, reserve):
    model, tok = tiny
    prompt = tok.encode(agent.prompt_text(ROW["question"], tools=TOOLS), add_special_tokens=False)
    Counting.made = []
    reqs = [Request(prompt, key=(0, 0, s), meta={"problem": 0}, tools=TOOLS,
                    environment=functools.partial(Counting, ROW)) for s in SCRIPTS]
    engine = Scripted(model, tok, kv_capacity=kv_capacity, max_len=len(prompt) + 340, temperature=1.0,
                      sandbox=NO_SANDBOX, reserve=reserve, max_rows=len(reqs), page_size=4, call_timeout=0.5)
    trajs = {t.key[2]: t for t in engine.run(iter_claim(reqs), 340)}
    return engine, trajs, len(prompt)


def test_each_sample_walks_its_own_grid_through_preemption_and_a_hung_call(tiny):
    engine, roomy, n_prompt = walk(tiny, kv_capacity=4 * 2000, reserve=1.0)
    assert engine.stats["preemptions"] == 0
    engine, trajs, _ = walk(tiny, kv_capacity=2 * n_prompt + 200, reserve=0.0)
    # rows left the KV mid-walk: more was recomputed than their prompts
    preempted = engine.stats["preemptions"]
    assert preempted >= 2 and engine.stats["recomputed_tokens"] > preempted * n_prompt
    worlds = {t.key[2]: t.environment for t in trajs.values()}
    assert len(Counting.made) == 4 and len({id(w) for w in worlds.values()}) == 4  # one environment each
    for sample, traj in trajs.items():
        world, script = worlds[sample], SCRIPTS[sample]
        position, n_moves, _ = WANT[sample]
        # each sample's state is its own: its walk, and every move asked of it exactly once, preemption or not
        assert (world.position, world.moves) == (position, n_moves) and world.closed
        assert world.asked == [json.loads(t.split("\n")[2])["arguments"]["direction"] for t in script if "move" in t]
        assert traj.finish == "stop" and traj.turns == len(script)
        # the same records and tokens as the engine that never preempted
        assert [(c.tool, c.arguments, c.status, c.output) for c in traj.tool_calls] == \
            [(c.tool, c.arguments, c.status, c.output) for c in roomy[sample].tool_calls]
        assert traj.response_ids == roomy[sample].response_ids
    # what the environment answered is what the model read, after its own earlier moves
    outputs = [c.output for c in trajs[1].tool_calls]
    assert outputs[0].startswith("Tool call success\nstdout: blocked, still at (0, 0)")
    assert outputs[-1].startswith("Tool call success\nstdout: at (2, 0): the goal, after 5 moves")
    assert trajs[2].tool_calls[-1].status == "error"  # "north": a failed call
    # the call that never answered: "timeout" after call_timeout, a failed call; the walk went on after it
    hung = trajs[3].tool_calls[1]
    assert (hung.tool, hung.status) == ("wait", "timeout") and "worker_timeout" in hung.output
    assert agent.n_failed([c.status for c in trajs[3].tool_calls]) == 1
    # the reward reads each environment's final state (and the call records), through the grader's thread pool
    grader = grading.Grader(engine.tok, task=GRID, rows=[ROW])
    for traj in trajs.values():
        grader(traj)
    grades = grader.results()
    grader.close()
    for sample, (_, _, reward) in WANT.items():
        assert grades[(0, 0, sample)].reward == pytest.approx(reward)
        assert grades[(0, 0, sample)].correct == (reward > 0)


def test_environments_close_when_the_step_raises(tiny):
    # an exception in the middle of the step (here: the model's forward) still closes every trajectory's environment
    model, tok = tiny
    prompt = tok.encode(agent.prompt_text(ROW["question"], tools=TOOLS), add_special_tokens=False)
    Counting.made = []
    forwards = []

    def failing(*args, **kw):
        forwards.append(1)
        if len(forwards) > 40:
            raise RuntimeError("the accelerator fell over")
        return type(model).forward_cached(model, *args, **kw)
    model.forward_cached = failing
    try:
        engine = Scripted(model, tok, kv_capacity=4 * 2000, max_len=len(prompt) + 340, sandbox=NO_SANDBOX, call_timeout=0.5)
        reqs = [Request(prompt, key=(0, 0, s), meta={"problem": 0}, tools=TOOLS,
                        environment=functools.partial(Counting, ROW)) for s in SCRIPTS]
        with pytest.raises(RuntimeError, match="fell over"):
            engine.run(iter_claim(reqs), 340)
    finally:
        del model.forward_cached
    assert len(Counting.made) == 4 and all(w.closed for w in Counting.made)
    assert any(w.asked for w in Counting.made)  # they were mid-walk


def test_one_eval_mixes_tasks_and_reports_each(tiny):
    # a grid row that names its task beside a math row of the default task: each prompted, offered tools, given an
    # environment (or none) and graded by its own task; the summary has the totals and each task's numbers
    import eval as ev
    model, tok = tiny
    problems = [dict(ROW, task="tasks/gridworld.py"), {"question": "What is 6 * 7?", "answer": "42"}]
    prompt_ids = [tok.encode(grading.row_task(p, MATH).prompt(p), add_special_tokens=False) for p in problems]
    assert grading.row_task(problems[0], MATH) is GRID and grading.row_task(problems[1], MATH) is MATH
    assert '"name": "move"' in tok.decode(prompt_ids[0]) and agent.TOOL_NAME in tok.decode(prompt_ids[1])
    math_turn = "I know it.</reason>\n<answer>\\boxed{%d}</answer><|im_end|>"
    engine = Scripted(model, tok, kv_capacity=8000, max_len=max(map(len, prompt_ids)) + 340, sandbox=NO_SANDBOX,
                      call_timeout=0.5)
    engine.scripts = {(0, 0, 0): SCRIPTS[0], (0, 0, 1): SCRIPTS[1], (0, 1, 0): [math_turn % 42],
                      (0, 1, 1): [math_turn % 41]}
    seen = {}
    summary, per_problem = ev.evaluate(engine, tok, problems, 2, 340, prompt_ids=prompt_ids, task=MATH,
                                       on_graded=lambda traj, s: seen.update({traj.key: traj}))
    assert isinstance(seen[(0, 0, 1)].environment, GRID.GridWorld) and seen[(0, 1, 0)].environment is None
    assert [p["correct"] for p in per_problem] == [2, 1]
    assert summary["avg@k"] == pytest.approx(0.75) and summary["reward"] == pytest.approx((1 + 0.8 + 1 + 0) / 4)
    grid, math = summary["tasks"]["gridworld"], summary["tasks"]["math"]
    assert (grid["avg@k"], grid["reward"], grid["tool/calls"]) == (1.0, pytest.approx(0.9), 4.5)
    assert (math["avg@k"], math["reward"], math["tool/calls"]) == (0.5, 0.5, 0.0)


def test_stateless_tools_see_the_sandbox_and_no_environment():
    # the Python tool's run still gets the sandbox pool, whether or not the trajectory has an environment
    seen = []
    tool = agent.Tool(agent.TOOL_SCHEMA, lambda args, sandbox: seen.append(sandbox) or concurrent.futures.Future())
    world = GRID.environment(ROW)
    agent.start_call(agent.ToolCall(agent.TOOL_NAME, {"code": "1", "input": ""}), {agent.TOOL_NAME: tool}, "pool", world)
    rec, future = agent.start_call(agent.ToolCall("move", {"direction": "up"}), GRID.TOOLS, "pool", world)
    assert seen == ["pool"] and future.result().stdout == "at (0, 1)\n" and world.position == (0, 1)
    rec, future = agent.start_call(agent.ToolCall("move", "up"), GRID.TOOLS, "pool", world)  # not an object
    assert future is None and rec.status == "invalid" and world.moves == 1


def test_grid_traces_come_from_the_real_environment():
    rows = GRID.problems(16, seed=0)
    traces = data.task_traces(GRID, rows, random.Random(1), sandbox=None)
    for row, trace in zip(rows, traces):
        outputs = [m["content"] for m in trace["messages"] if m["role"] == "tool"]
        assert outputs[-1].startswith("Tool call success\nstdout: at " + GRID.fmt(row["goal"]) + ": the goal")
        assert trace["tools"] == [GRID.MOVE_SCHEMA]
        assert len(agent.render_conversation(types.SimpleNamespace(encode=lambda t, **k: list(t)), trace["messages"],
                                             GRID.TOOLS)[0]) > 0
    # some walks first step off the search's path, and then go on from where that step left them
    first = [t["messages"][1]["tool_calls"][0]["function"]["arguments"]["direction"] for t in traces]
    assert any(step != GRID.shortest_path(row)[0] for step, row in zip(first, rows))


def test_a_row_that_starts_at_its_goal_is_reached_in_no_moves():
    # a user's row whose start is its goal: the walk is over before it starts, as short as a walk can be
    row = dict(ROW, start=[2, 0])
    world = GRID.environment(row)
    assert world.move("up").status == "error" and world.moves == 0
    assert GRID.grade(row, "(2, 0)", [], None, types.SimpleNamespace(environment=world)) == (1.0, True)
    # its traces answer at once: no detour into a call the environment refuses
    traces = data.task_traces(GRID, [row] * 8, random.Random(0), sandbox=None)
    assert all([m["role"] for m in t["messages"]] == ["user", "assistant"] for t in traces)


@pytest.mark.parametrize("change, words", [
    ({"walls": [[1, 0], [0, 1]]}, "no walk reaches the goal [2, 0]"),  # walled in at the start
    ({"goal": [4, 0]}, "must be inside the 4 x 4 grid"),
    ({"start": [1, 0]}, "the start [1, 0] is a wall"),
    ({"walls": [[1]]}, "each wall must be [x, y], two integers"),
])
def test_a_grid_row_that_cannot_be_walked_is_refused(change, words):
    # a walled-off goal made GridWorld raise TypeError when a trajectory began, in the middle of a run; now its
    # prompt (made for every row before the first step) and its traces refuse it, naming its question
    row = dict(ROW, **change)
    for make in (GRID.prompt, lambda row: GRID.trace(row, random.Random(0))):
        with pytest.raises(ValueError, match=f"grid row 'You are at .*: .*{re.escape(words)}"):
            make(row)


def test_more_grid_rows_than_layouts_is_a_line_not_a_traceback(tmp_path):
    # a 4 x 4 grid with 2 walls has ~21K layouts: data.py grid-set asked for more raised problems()'s
    # ValueError as a traceback; now it is a usage error that names the options, and writes nothing
    p = zygote.run(("data.py", "grid-set", f"--data_dir={tmp_path}", "--n_train=30000"), timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--n_train + --n_heldout: a 4 x 4 grid with 2 walls has only 21736 layouts" in p.stderr
    assert "Traceback" not in p.stderr and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- the worked example, end to end

def script(*args):
    p = zygote.run(args, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def grid_eval(tmp_path, model, out):
    """Success on the 6 grid rows, 32 samples each, on the same random numbers for every model."""
    script("eval.py", "configs/tiny_eval.py", "--task=tasks/gridworld.py",
           f"--data_path={tmp_path}/grid.jsonl", f"--model_path={model}", f"--out_dir={out}",
           "--samples=32", "--max_prompt_tokens=200", "--max_response_tokens=384",
           "--max_turns=10", "--tool_workers=1", "--deterministic=true")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)["avg@k"]


@pytest.mark.slow
def test_the_grid_world_trains_from_traces_of_the_real_environment(tmp_path):
    # the tiny base (tokenizer + random model), SFT on traces the GridWorld answered, then RL with configs/tiny_grid.py
    with SandboxPool(workers=1) as pool:
        data.prepare(str(tmp_path / "base"), 0, pool.map, data_dir=str(tmp_path / "data"), n_train=8, n_heldout=4,
                     n_sft=12, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    rows = GRID.problems(6, seed=0)
    write_jsonl(str(tmp_path / "grid.jsonl"), rows)
    write_jsonl(str(tmp_path / "sft_grid.jsonl"), data.task_traces(GRID, rows * 4, random.Random(0), sandbox=None))
    script("train_sft.py", "configs/tiny_sft.py", f"--model_path={tmp_path}/base", f"--out_dir={tmp_path}/sft",
           f"--data_mix=[('{tmp_path}/sft_grid.jsonl', 'rstar2', 1.0)]", "--max_seq_len=704", "--epochs=40",
           "--batch_size=12", "--lr=1e-2", "--log_every=1000")
    # the SFT model's success on the 6 rows: it walks some grids, and its sampled calls often break
    before = grid_eval(tmp_path, tmp_path / "sft", tmp_path / "eval_sft")
    # 30 RL steps on the same rows: plain GRPO, every sample kept (RoC keeping 4 of 8 at lr 1e-3
    # swung with the seed: 42% -> 20%..59%); only step 1's rollouts are dumped (~50 s in all)
    script("train_rl.py", "configs/tiny_rl.py", "configs/tiny_grid.py", f"--model_path={tmp_path}/sft",
           f"--data_path={tmp_path}/grid.jsonl", f"--run_dir={tmp_path}/rl",
           "--prompts_per_step=6", "--samples_per_prompt=8", "--keep_per_prompt=8", "--roc=false",
           "--lr=5e-4", "--warmup_steps=3", "--tool_workers=1", "--steps=30", "--save_every=30",
           "--dump_every=1000", "--deterministic=true")
    # RL learns: measured 42.2% -> 60.4% (with --seed=1..3: 55.2%, 55.7%, 56.8%; the training
    # reward of steps 1-5 0.462, of steps 26-30 0.575); --lr=0 leaves it at 42.2% and fails here
    after = grid_eval(tmp_path, tmp_path / "rl", tmp_path / "eval_rl")
    assert after >= before + 0.08, (before, after)
    # the first step's rollouts (the SFT model's): each reward is what the environment says
    records = view.read_records(str(tmp_path / "rl" / "rollouts" / "step_000001.jsonl.gz"))
    assert len(records) == 6 * 8
    moves = [c for r in records for c in r["tool_calls"] if c["tool"] == "move"]
    assert len(moves) > len(records)  # it walks: more than one move a trajectory
    for record in records:
        # the reward is the environment's verdict, replayed here from the walk the records show
        row = next(r for r in rows if r["question"] == record["question"])
        world = GRID.GridWorld(row)
        for call in record["tool_calls"]:
            if call["tool"] == "move" and isinstance(call["arguments"], dict):
                world.move(call["arguments"].get("direction"))
        reached = world.position == world.goal and record["finish"] != "length"
        assert record["reward"] == pytest.approx(world.shortest / world.moves if reached else 0.0)
    assert any(r["reward"] > 0 for r in records)
    # one run mixes tasks: math rows (the config's task) beside grid rows that name theirs, metrics per task
    math_rows = [{"question": r["question"], "answer": r["answer"]} for r in rows_of(tmp_path / "data" / "train.jsonl")]
    write_jsonl(str(tmp_path / "mixed.jsonl"), math_rows[:2] + [dict(r, task="tasks/gridworld.py") for r in rows[:2]])
    script("train_rl.py", "configs/tiny_rl.py", f"--model_path={tmp_path}/sft", f"--data_path={tmp_path}/mixed.jsonl",
           f"--run_dir={tmp_path}/mixed", "--prompts_per_step=4", "--samples_per_prompt=4", "--keep_per_prompt=2",
           "--max_prompt_tokens=200", "--max_response_tokens=384", "--max_turns=10", "--tool_workers=1", "--steps=1",
           "--dump_every=1")
    metrics = json.loads(open(tmp_path / "mixed" / "metrics.jsonl").readline())
    records = view.read_records(str(tmp_path / "mixed" / "rollouts" / "step_000001.jsonl.gz"))
    math_records = [r for r in records if r["question"].startswith("What is")]
    grid_records = [r for r in records if r not in math_records]
    assert len(math_records) == len(grid_records) == 8
    for name, mine in (("math", math_records), ("gridworld", grid_records)):
        assert metrics[f"task/{name}/reward"] == pytest.approx(sum(r["reward"] for r in mine) / 8)
    # a math row is offered the Python tool only: a move there is an unknown tool, a failed call
    assert all(c["status"] == "invalid" for r in math_records for c in r["tool_calls"] if "move" in json.dumps(c))
    assert metrics["tool/calls/move"] > 0 and "task/gridworld/tool_err" in metrics


# ----------------------------------------------------------------------------- an environment that answers turns

GUESS = grading.load_task("tasks/guess.py")
GUESS_ROW = {"question": "Guess my number from 1 to 16: one guess a turn, in <answer>\\boxed{}</answer>.",
             "secret": 11, "high": 16}


def guess(n):
    return f"I guess.</reason>\n<answer>\\boxed{{{n}}}</answer><|im_end|>"


def referee_run(tiny, scripts, budget=300, max_turns=4, kv_capacity=4 * 2000, reserve=0.5):
    """Each sample's turns (scripts: sample index -> turns) through the real engine, one Referee each."""
    model, tok = tiny
    prompt = tok.encode(GUESS.prompt(GUESS_ROW), add_special_tokens=False)
    reqs = [Request(prompt, key=(0, 0, s), meta={"problem": 0}, **grading.rollout_seam(GUESS_ROW, GUESS))
            for s in scripts]
    engine = Scripted(model, tok, kv_capacity=kv_capacity, max_len=len(prompt) + budget, sandbox=NO_SANDBOX,
                      max_turns=max_turns, call_timeout=0.5, reserve=reserve, max_rows=len(reqs), page_size=4)
    engine.scripts = {(0, 0, s): turns for s, turns in scripts.items()}
    return engine, {t.key[2]: t for t in engine.run(iter_claim(reqs), budget)}


def test_a_referee_answers_turns_without_calls_and_ends_the_episode(tiny):
    scripts = {0: [guess(8), guess(12), guess(10), guess(11)],  # binary search: found in 4
               1: ["I am not sure.</reason>\nmaybe eleven<|im_end|>", guess(11)],  # no integer, then found
               2: [guess(1), guess(2), guess(3), guess(4), guess(5)]}  # the turn limit (4) ends it
    engine, trajs = referee_run(tiny, scripts)
    tok = engine.tok
    referees = {s: t.environment for s, t in trajs.items()}
    assert len({id(r) for r in referees.values()}) == 3 and all(r.closed for r in referees.values())
    assert referees[0].guesses == [8, 12, 10, 11] and referees[1].guesses == [None, 11]
    # the turn at the limit is shown to the referee, its answer is not appended
    assert referees[2].guesses == [1, 2, 3, 4]
    assert [trajs[s].finish for s in (0, 1, 2)] == ["stop", "stop", "max_turns"]
    assert [trajs[s].turns for s in (0, 1, 2)] == [4, 2, 4] and all(not t.tool_calls for t in trajs.values())
    # the referee's words are user turns in the chat template's format, mask 0; every sampled token is mask 1
    runs = agent.mask_runs(tok, trajs[0].response_ids, trajs[0].mask)
    user = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<reason>"
    assert [text for text, m in runs if not m] == [user.format(w) for w in ("higher", "lower", "higher")]
    assert [text for text, m in runs if m] == scripts[0]
    assert user.format("Answer with one integer from 1 to 16 in <answer>\\boxed{}</answer>.") in tok.decode(
        trajs[1].response_ids)
    assert all(lp == 0.0 for t in trajs.values() for lp, m in zip(t.logprobs, t.mask) if not m)
    # the reward reads the referee: 5 guesses always suffice for 1..16; 4 and 2 earn the whole reward
    grader = grading.Grader(tok, task=GUESS, rows=[GUESS_ROW])
    for traj in trajs.values():
        grader(traj)
    grades = grader.results()
    grader.close()
    assert [grades[(0, 0, s)].reward for s in (0, 1, 2)] == [1.0, 1.0, 0.0]
    assert GUESS.grade(GUESS_ROW, "11", [], None, types.SimpleNamespace(environment=types.SimpleNamespace(
        secret=11, high=16, guesses=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]))) == (5 / 11, True)


def test_a_referees_answers_count_against_the_budget(tiny):
    # the same game with a budget that ends 2 tokens into the third reply: that reply does not fit, and ends the
    # trajectory ("length") after the third guess, as a tool answer that does not fit does
    scripts = {0: [guess(8), guess(12), guess(10), guess(11)]}
    _, full = referee_run(tiny, scripts)
    third = [i for i in range(1, len(full[0].mask)) if full[0].mask[i - 1] and not full[0].mask[i]][2]
    _, trajs = referee_run(tiny, scripts, budget=third + 2, max_turns=10)
    assert (trajs[0].finish, trajs[0].response_ids) == ("length", full[0].response_ids[:third])
    assert trajs[0].environment.guesses == [8, 12, 10] and trajs[0].environment.closed


def test_without_respond_a_turn_without_a_call_ends_the_episode(tiny):
    # a task whose environment has no respond(): the first turn without a call stops, as the math task's does
    class Silent:
        def __init__(self, row):
            self.closed = False

        def close(self):
            self.closed = True
    model, tok = tiny
    prompt = tok.encode(GUESS.prompt(GUESS_ROW), add_special_tokens=False)
    engine = Scripted(model, tok, kv_capacity=4000, max_len=len(prompt) + 200, sandbox=NO_SANDBOX, call_timeout=0.5)
    engine.scripts = {(0, 0, 0): [guess(8), guess(11)]}
    [traj] = engine.run(iter_claim([Request(prompt, key=(0, 0, 0), meta={"problem": 0}, tools={},
                                            environment=functools.partial(Silent, GUESS_ROW))]), 200)
    assert (traj.finish, traj.turns, sum(traj.mask) == len(traj.response_ids)) == ("stop", 1, True)


def test_a_reply_that_takes_time_is_bounded_like_a_call(tiny):
    # respond() may return a Future (it is called on the decode loop, like a tool's run()): one answered later
    # from another thread is appended as any reply; one that never completes ends its episode at the row's
    # deadline (call_timeout), while the other row goes on
    class Slow(GUESS.Referee):
        def __init__(self, row, hang):
            super().__init__(row)
            self.hang = hang

        def respond(self, turn_text):
            reply = super().respond(turn_text)
            future = concurrent.futures.Future()
            if not self.hang:
                threading.Timer(0.05, future.set_result, [reply]).start()
            return future
    model, tok = tiny
    prompt = tok.encode(GUESS.prompt(GUESS_ROW), add_special_tokens=False)
    scripts = {0: [guess(8), guess(12), guess(10), guess(11)], 1: [guess(8), guess(12)]}
    reqs = [Request(prompt, key=(0, 0, s), meta={"problem": 0}, tools={},
                    environment=functools.partial(Slow, GUESS_ROW, hang=s == 1)) for s in scripts]
    engine = Scripted(model, tok, kv_capacity=4000, max_len=len(prompt) + 300, sandbox=NO_SANDBOX, max_turns=6,
                      call_timeout=0.5, max_rows=2, page_size=4)
    engine.scripts = {(0, 0, s): turns for s, turns in scripts.items()}
    start = time.monotonic()
    trajs = {t.key[2]: t for t in engine.run(iter_claim(reqs), 300)}
    assert time.monotonic() - start < 10
    assert [trajs[s].environment.guesses for s in (0, 1)] == [[8, 12, 10, 11], [8]]
    assert [(trajs[s].finish, trajs[s].turns) for s in (0, 1)] == [("stop", 4), ("stop", 1)]
    # the late replies are appended exactly as the same referee's immediate ones are
    _, immediate = referee_run(tiny, {0: scripts[0]}, max_turns=6)
    assert (trajs[0].response_ids, trajs[0].mask) == (immediate[0].response_ids, immediate[0].mask)


def test_a_guess_past_the_digits_int_reads_is_asked_again():
    # int() refuses a string of more than 4,300 digits: the referee raised, and the whole step with it
    referee = GUESS.environment(GUESS_ROW)
    assert referee.respond(guess("9" * 5000)).startswith("Answer with one integer from 1 to 16")
    assert referee.respond(guess(20)) == "lower" and referee.guesses == [None, 20]


def test_a_guess_row_whose_secret_is_out_of_its_range_is_refused():
    # no guess from 1 to 16 finds 20, and the traces' binary search looped forever on it (the prompt is made,
    # and so checked, first: train_rl.py and eval.py make every prompt before their first step)
    for secret in (20, 0, -3):
        row = dict(GUESS_ROW, secret=secret)
        for make in (GUESS.prompt, lambda row: GUESS.trace(row, random.Random(0))):
            with pytest.raises(ValueError, match=f"its secret {secret} is not in 1..16"):
                make(row)


def test_referee_rows_preempted_mid_game_ask_each_turn_once(tiny):
    # a KV too small for the three games at once: rows leave it mid-game (parked on a reply or decoding) and are
    # prefilled again; each referee still sees each turn once, and the tokens are those of the roomy run
    scripts = {0: [guess(8), guess(12), guess(10), guess(11)], 1: [guess(4), guess(6), guess(11)],
               2: [guess(16), guess(11)]}
    _, roomy = referee_run(tiny, scripts)
    model, tok = tiny
    n_prompt = len(tok.encode(GUESS.prompt(GUESS_ROW), add_special_tokens=False))
    engine, trajs = referee_run(tiny, scripts, kv_capacity=2 * n_prompt + 120, reserve=0.0)
    assert engine.stats["preemptions"] >= 1
    for sample, traj in trajs.items():
        assert traj.response_ids == roomy[sample].response_ids and traj.mask == roomy[sample].mask
        assert traj.environment.guesses == [int(t.split("{")[1].split("}")[0]) for t in scripts[sample]]
        assert traj.finish == "stop"


def test_referee_traces_hold_the_replies_the_engine_appends(tiny, tmp_path):
    # python data.py guess-set, then traces --task=tasks/guess.py: each user turn after the question is the
    # Referee's real reply to the turn before it
    for args in (["guess-set", "--n_train=8", "--n_heldout=2"],
                 ["traces", "--task=tasks/guess.py", f"--problems={tmp_path}/guess_train.jsonl", "--n_sft=8"]):
        script("data.py", *args, f"--data_dir={tmp_path}")
    traces = rows_of(tmp_path / "sft_guess.jsonl")
    # train_sft.py's "rstar2" format takes them: every line passes its checks
    assert len(traces) == len(train_sft.index_file(str(tmp_path / "sft_guess.jsonl"), "rstar2")) == 8
    for trace in traces:
        replies = [m["content"] for m in trace["messages"][1:] if m["role"] == "user"]
        guesses = [int(m["content"].split("{")[1].split("}")[0]) for m in trace["messages"] if m["role"] == "assistant"]
        want = ["higher" if g < trace["secret"] else "lower" for g in guesses[:-1]]
        assert replies == want and guesses[-1] == trace["secret"]
    # SFT renders a trace exactly as the engine appends the same turns against the same row's Referee
    [trace] = data.task_traces(GUESS, [GUESS_ROW], random.Random(1), sandbox=None)
    turns = [m["content"].removeprefix("<reason>") + agent.END for m in trace["messages"] if m["role"] == "assistant"]
    assert len(turns) > 2
    engine, trajs = referee_run(tiny, {0: turns}, max_turns=10)
    ids, mask = agent.render_conversation(engine.tok, trace["messages"], GUESS.TOOLS)
    n_prompt = len(engine.tok.encode(GUESS.prompt(GUESS_ROW), add_special_tokens=False))
    assert (ids[n_prompt:], mask[n_prompt:]) == (trajs[0].response_ids, trajs[0].mask)
    assert trajs[0].finish == "stop"
    # a trace that goes on after the referee ended the game (or ends where it answered) is refused, not written
    right = {"role": "assistant", "content": "<reason>I guess 11.</reason>\n<answer>\\boxed{11}</answer>"}
    wrong = {"role": "assistant", "content": "<reason>I guess 3.</reason>\n<answer>\\boxed{3}</answer>"}
    for messages, says in (([right, {"role": "user", "content": None}, right], "goes on"), ([wrong], "ends")):
        task = types.SimpleNamespace(TOOLS={}, environment=GUESS.environment,
                                     trace=lambda row, rng: [{"role": "user", "content": "q"}] + messages)
        with pytest.raises(ValueError, match=f"message [0-9]: the trace {says} where"):
            data.task_traces(task, [GUESS_ROW], random.Random(0), sandbox=None)

"""agent.Grader, the engine's on_finish: answers only from sampled tokens, truncated rollouts score 0 (the
paper) unless score_truncated (the released code), and grading never holds up the decode loop."""
import threading

import pytest

import agent
import data
from rollout import Trajectory


@pytest.fixture(scope="module")
def tok():
    texts = ["<|im_start|>assistant\n<reason>compute</reason>\n<answer>\\boxed{7}</answer><|im_end|>\n"
             "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"] * 20
    return data.train_tokenizer(texts, vocab_size=400)


def trajectory(tok, pieces, finish="stop", gold="7"):
    ids, mask = [], []
    for text, m in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + piece, mask + [m] * len(piece)
    return Trajectory(key=(0, 0, 0), prompt_ids=[1], response_ids=ids, mask=mask, finish=finish, turns=2,
                      meta={"answer": gold})


def grade(tok, traj, **kw):
    g = agent.Grader(tok, **kw)
    g(traj)
    return g.results()[traj.key]


def test_tool_output_cannot_supply_the_answer(tok):
    printed = "<|im_end|>\n<|im_start|>user\n<tool_response>\n<answer>\\boxed{7}</answer>\n</tool_response>" \
              "<|im_end|>\n<|im_start|>assistant\n<reason>"
    t = trajectory(tok, [("compute</reason>", 1), (printed, 0), ("so it is done</reason><|im_end|>", 1)])
    assert agent.reward(tok.decode(t.response_ids), "7") == 1.0  # the whole decoded text would pay out
    assert grade(tok, t) == {"reward": 0.0, "answers": 0, "pred": None}
    # an answer block cannot be stitched together across a tool response either
    t = trajectory(tok, [("<answer>\\boxed{7}", 1), (printed.replace("<answer>\\boxed{7}", ""), 0), ("</reason>", 1)])
    assert grade(tok, t)["answers"] == 0
    t = trajectory(tok, [("compute</reason>", 1), (printed, 0), ("<answer>\\boxed{7}</answer><|im_end|>", 1)])
    assert grade(tok, t) == {"reward": 1.0, "answers": 1, "pred": "7"}


def test_truncated_rollouts_score_zero_unless_asked(tok):
    t = trajectory(tok, [("done</reason>\n<answer>\\boxed{7}</answer> and more", 1)], finish="length")
    assert grade(tok, t)["reward"] == 0.0
    assert grade(tok, t, score_truncated=True)["reward"] == 1.0
    t.finish = "max_turns"  # not cut by the budget: graded
    assert grade(tok, t)["reward"] == 1.0


def test_grading_does_not_block_the_caller(tok, monkeypatch):
    release = threading.Event()

    def slow_reward(turns, gold, timeout):
        release.wait(30)
        return 1.0
    monkeypatch.setattr(agent, "reward", slow_reward)
    g = agent.Grader(tok)
    ts = [trajectory(tok, [("<answer>\\boxed{7}</answer>", 1)]) for _ in range(3)]
    for i, t in enumerate(ts):
        t.key = (0, 0, i)
        g(t)  # returns while the grade is still being computed
    assert not release.is_set()
    release.set()
    assert [r["reward"] for r in g.results().values()] == [1.0, 1.0, 1.0]

"""
A referee environment (`task = "tasks/guess.py"`): the model guesses a secret number, one guess a turn, and a
referee answers each guess with "higher" or "lower" as the next user turn, until the guess is right. No tool: the
environment answers turns that made no tool call, which is the second half of the environment seam:

    environment(row)          a new Referee for one trajectory (rollout.Engine makes it when the row is claimed)
    Referee.respond(text)     called by the engine when an assistant turn ends without a tool call; `text` is the
                              turn as sampled (after the forced <reason>, up to its <|im_end|>). It returns the next
                              observation, which the engine appends as a user turn in the chat template's format
                              (`<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n<reason>`, mask
                              0, counted against the response budget like a tool answer), or None to end the
                              episode (finish "stop"). A turn at the turn limit is still shown to it (its guess
                              counts); its observation is then not appended (finish "max_turns"). A turn cut by the
                              budget is never shown to it. An environment without respond() ends the episode on
                              a turn without a call, as the math task does.
    grade(...)                reads the Referee: reward = the fewest guesses that always find the number (binary
                              search: ceil(log2(high + 1))) / guesses made, at most 1, when the last guess was
                              right, else 0; correct = the number was found

A row: {"question": "...", "secret": 11, "high": 16}; the question says the range and how to answer. A row whose
secret is not in 1..high is refused with its question (check()) before a run or trace starts.
"""
import math
import random

import agent
import grading

COLUMNS = {"question": str, "secret": int, "high": int}
TOOLS = {}


class Referee:
    """One trajectory's game: its secret and the guesses made so far."""

    def __init__(self, row):
        self.secret = row["secret"]
        self.high = row["high"]
        self.guesses = []  # each turn's guess (None: the turn had no integer answer)
        self.closed = False

    def respond(self, turn_text):
        if self.closed:
            raise RuntimeError("the trajectory is over: its environment is closed")
        answer = agent.extract_answer(turn_text)
        digits = grading.plain_int(answer) if answer else None
        try:
            guess = None if digits is None else int(digits)
        except ValueError:  # more digits than int() reads (4,300): no integer from 1 to high either
            guess = None
        self.guesses.append(guess)
        if guess is None:
            return f"Answer with one integer from 1 to {self.high} in <answer>\\boxed{{}}</answer>."
        # right: the episode ends (None); else the next user turn says which way to go
        if guess == self.secret:
            return None
        return "higher" if guess < self.secret else "lower"

    def close(self):
        self.closed = True


def environment(row):
    return Referee(row)


def check(row):
    """A ValueError naming the row when its secret is not in the range its question gives (1..high): no guess by
    the rules finds it, and trace()'s search would never end. prompt() and trace() check: train_rl.py and eval.py
    make every prompt before their first step, `data.py traces` traces every row."""
    if not 1 <= row["secret"] <= row["high"]:
        raise ValueError(f"guess row {row['question']!r:.80}: its secret {row['secret']} is not in "
                         f"1..{row['high']}")


def prompt(row):
    check(row)
    return agent.prompt_text(row["question"], tools=TOOLS)


def predict(turns):
    return agent.extract_answer(turns)


def trace(row, rng):
    """SFT messages that play the game by binary search, one guess a turn; user messages after the first are
    left None: data.py fills them in with the Referee's real replies (python data.py traces
    --task=tasks/guess.py). A quarter of them open with a random guess instead of the middle."""
    check(row)
    low, high = 1, row["high"]
    guess = rng.randint(low, high) if rng.random() < 0.25 else (low + high) // 2
    messages = [{"role": "user", "content": row["question"]}]
    while True:
        messages.append({"role": "assistant",
                         "content": f"<reason>I guess {guess}.</reason>\n<answer>\\boxed{{{guess}}}</answer>"})
        if guess == row["secret"]:
            return messages
        messages.append({"role": "user", "content": None})
        # the referee's reply, known here from the secret, narrows the range
        low, high = (guess + 1, high) if guess < row["secret"] else (low, guess - 1)
        guess = (low + high) // 2


def problems(n, seed, high=16):
    """n rows {"question", "secret", "high"}, the secret drawn from 1..high (the same secret may repeat)."""
    rng = random.Random(seed)
    question = (f"Guess my number from 1 to {high}: one guess a turn, in <answer>\\boxed{{}}</answer>. I answer "
                "higher or lower.")
    return [{"question": question, "secret": rng.randint(1, high), "high": high} for _ in range(n)]


def grade(row, pred, turns, grader, trajectory):
    referee = trajectory.environment
    if not referee.guesses or referee.guesses[-1] != referee.secret:
        return 0.0, False
    fewest = math.ceil(math.log2(referee.high + 1))
    return min(1.0, fewest / len(referee.guesses)), True

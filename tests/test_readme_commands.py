"""Every command the README's "Fork it" section and the data pages show runs here, as written, at
toy sizes (issue #41 item 8), so that a command the text shows cannot break unnoticed.

Which commands (read from the pages each time: a command added or changed in the text is the one
that runs):
- every command line of the bash blocks of the README's "Fork it" section and of docs/data.md;
- every `python data.py ...` any page shows, in a bash block or inline (REFERENCES lists the inline
  ones that name a subcommand in a sentence).
How each one runs:
- as written, with its kind's size overrides from TOY appended (the last --key=value wins), in the
  pages' order, in a scratch checkout (a symlink to each file of this one, its own out/ and data/):
  a command reads what the commands before it wrote, at the paths the text gives;
- `torchrun ... script.py args` as `python script.py args` (the launcher's process count is a size
  too), and a Hub model the text names (MODELS) as the toy model: no downloads in tests;
- from what `bash run.sh` leaves in out/ (the demo's data.py prepare and RL run at toy size, its SFT
  models stood in for by the base model) and the files the data pages say you download yourself
  (DOWNLOADS: tests/fixtures/rl's rows, in each source's layout).
A command fails the test naming its page and line: when it exits non-zero, when a file its
trailing comment names (`# out/data/sft_calculator.jsonl`) is not there after it, and when its kind
has no TOY entry (so a new kind of command in the text makes this file say how to shrink it).

Cheap (~20 commands, ~30 s of CPU): one "zygote" process (tests/zygote.py) imports torch, transformers and this
project's modules once, then forks a child per command, with its own process, argv, cwd and output
as `python script.py` gives them, but without the ~3 s of CPU the imports cost a script on a 2-core
box. A child that runs past TIMEOUT is killed with every process it started.
"""
import glob
import json
import os
import re
import shlex
import shutil
import signal
import time

import pytest

from zygote import Zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DATA_PAGE = os.path.join(ROOT, "docs", "data.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "rl")
TIMEOUT = 120  # seconds a command may take here; each takes 0.1-6 s on a busy 2-core box

# one RL step on 2 prompts x 4 samples, 32-token responses: the run's whole path (rollouts, grades,
# RoC, the update, a checkpoint) at the least work (RoC keeps G = 2 of 2G: a baseline needs two)
RL_STEP = ["--steps=1", "--prompts_per_step=2", "--samples_per_prompt=4", "--keep_per_prompt=2",
           "--max_response_tokens=32", "--tool_workers=1"]
# each kind of command (its script, and data.py's subcommand) and the overrides that shrink it
TOY = {
    "data.py code-set": ["--n_train=4", "--n_heldout=2"],
    "data.py grid-set": ["--n_train=4", "--n_heldout=2"],
    "data.py guess-set": ["--n_train=4", "--n_heldout=2"],
    "data.py traces": ["--n_sft=3"],
    "data.py convert": [],  # its inputs are the toy DOWNLOADS
    "data.py rl-set": [],  # likewise
    "train_sft.py": ["--epochs=1", "--batch_size=4"],
    "train_rl.py": RL_STEP,
    "eval.py": ["--limit=2", "--samples=2", "--max_response_tokens=32", "--tool_workers=1"],
    # docs/data.md's time and memory at the paper's size, at 1% (its files under out/, not /tmp)
    "tests/rl_set_scale.py": ["--scale=0.01", "--dir=out/rl_set_scale"],
}
# the models the text names by their Hub id, and the toy model that stands in for each here
MODELS = {"Qwen/Qwen3-32B": "out/tiny-sft"}
# inline code that names a subcommand in a sentence: not a command to run
REFERENCES = {
    "python data.py traces --task=...",  # README's "Fork it" table; the bash block below runs it
    "python data.py convert",  # docs/files.md's data.py line
    "python data.py rl-set",  # likewise
}
# what `bash run.sh` leaves in out/ that the commands start from, made by the demo's own commands
# (demo.py) at toy size: the tokenizer, the random base model and the task's data; its RL run
DEMO_DATA = ["data.py", "prepare", "--out=out/tiny-base", "--n_train=8", "--n_heldout=4",
             "--n_sft=12"]
DEMO_RL = ["train_rl.py", "configs/tiny_rl.py", *RL_STEP]  # out/tiny-rl
# the SFT model the commands start from, the base model copied: the commands are checked to run,
# not to learn. out/tiny-sft is the demo's SFT (its command runs in tests/test_train.py)
STAND_INS = {"out/tiny-sft": "out/tiny-base"}
# the files the data pages say to download, made from the fixture rows in each source's layout:
# path -> (fixture file, {its column: the source's} kept and renamed, or None: all, as they are)
AIME_2025 = {"problem": "question", "answer": "answer"}  # opencompass/AIME2025
DOWNLOADS = {
    "aime_2024/train-00000-of-00001.parquet": ("bench_aime.jsonl", None),  # HuggingFaceH4
    "aime2025-I.jsonl": ("bench_aime.jsonl", AIME_2025),
    "aime2025-II.jsonl": ("bench_aime.jsonl", AIME_2025),
    "MATH-500/test.jsonl": ("bench_math500.jsonl", None),
    "dapo-math-17k.parquet": ("dapo_math_17k.jsonl", None),
    "OpenMathReasoning/data/tir-00000-of-00001.parquet": ("openmathreasoning.jsonl", None),
    "euler.parquet": ("project_euler.jsonl", None),
}


# ------------------------------------------------------------------ the commands the pages show

def blank_code_blocks(text):
    """The page with its fenced blocks' lines blanked (the line count kept: offsets give lines)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)


def section_lines(text, heading):
    """The first and last line numbers of a `## heading` section."""
    lines = text.splitlines()
    first = lines.index(f"## {heading}") + 1
    rest = [i for i, line in enumerate(lines[first:], first + 1) if line.startswith("## ")]
    return first, rest[0] - 1 if rest else len(lines)


def block_commands(text):
    """(line, command, comment) of every command line of the page's bash blocks: continuation lines
    joined, the trailing `# comment` split off, whitespace collapsed."""
    in_bash = False
    start = None
    pending = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_bash = line == "```bash" and not in_bash
            continue
        if not in_bash or line.lstrip().startswith("#") and not pending:
            continue
        start = start if pending else number
        # a line ending in `\` goes on on the next
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        command, _, comment = pending.partition(" #")
        if command.strip():
            yield start, " ".join(command.split()), comment.strip()
        pending = ""


def inline_commands(text):
    """(line, command) of every `python ...` / `torchrun ...` in the page's inline code, which may
    wrap onto the next line."""
    prose = blank_code_blocks(text)
    for m in re.finditer(r"`((?:python|torchrun) [^`]*)`", prose):
        yield prose[:m.start()].count("\n") + 1, " ".join(m[1].split())


def shown_commands():
    """{command: (where, comment)} of every command this file runs, in reading order (README first);
    a command shown twice runs once, where it is first shown."""
    shown = {}
    for page in PAGES:
        text = open(page, encoding="utf-8").read()
        name = os.path.relpath(page, ROOT)
        fork_it = section_lines(text, "Fork it") if page == README else (0, -1)
        found = list(block_commands(text))
        found += [(line, command, "") for line, command in inline_commands(text)]
        for line, command, comment in sorted(found):
            # the whole of the "Fork it" section and of the data page; elsewhere data.py only
            everything = page == DATA_PAGE or fork_it[0] <= line <= fork_it[1]
            wanted = everything or command.startswith("python data.py")
            if wanted and command not in REFERENCES:
                shown.setdefault(command, (f"{name}:{line}", comment))
    return shown


def kind(command):
    """The TOY key of a command: its script, and data.py's subcommand; None for a command that runs
    no script with `python` or `torchrun`."""
    words = shlex.split(command)
    scripts = [i for i, word in enumerate(words) if word.endswith(".py")]
    if words[0] not in ("python", "torchrun") or not scripts:
        return None
    script = words[scripts[0]]
    if script == "data.py":
        return f"data.py {words[scripts[0] + 1]}"
    return script


def toy_argv(command, cwd):
    """The argv that runs a shown command in the directory cwd: from its script on (the launcher
    dropped), each shell glob expanded as bash does (sorted; a word without a match stays as it is),
    then a --model_path for each Hub model MODELS replaces, and the kind's TOY overrides."""
    words = shlex.split(command)
    words = words[next(i for i, word in enumerate(words) if word.endswith(".py")):]
    argv = [match for word in words for match in sorted(glob.glob(word, root_dir=cwd)) or [word]]
    models = [MODELS[word.split("=", 1)[1]] for word in words
              if word.startswith("--model_path=") and word.split("=", 1)[1] in MODELS]
    return argv + [f"--model_path={model}" for model in models] + TOY[kind(command)]


SHOWN = shown_commands()


def test_every_shown_command_has_a_toy_size():
    # the worked examples, the data page's block and results.md's grid set, at least
    assert len(SHOWN) >= 15, SHOWN
    for command, (where, _) in SHOWN.items():
        assert kind(command) in TOY, \
            f"{where}: `{command}`: no TOY entry for {kind(command)!r}: say how to shrink it"
    # every entry is used: one for a kind the pages no longer show goes
    shown_kinds = {kind(command) for command in SHOWN}
    assert set(TOY) == shown_kinds, set(TOY) - shown_kinds
    shown_values = {word.split("=", 1)[1] for c in SHOWN for word in shlex.split(c) if "=" in word}
    assert set(MODELS) <= shown_values, set(MODELS) - shown_values


def test_the_parser_finds_blocks_continuations_and_wrapped_inline_code():
    page = ("text `python data.py convert a.parquet\nb.jsonl` and `ls`\n```bash\n# a comment\n"
            "python train_rl.py c.py \\\n    --steps=2   # out/x\n```\n")
    assert list(block_commands(page)) == [(5, "python train_rl.py c.py --steps=2", "out/x")]
    assert list(inline_commands(page)) == [(1, "python data.py convert a.parquet b.jsonl")]
    assert kind("torchrun --nproc_per_node 8 eval.py c.py") == "eval.py"
    assert kind("python data.py rl-set o.jsonl") == "data.py rl-set"
    command = "torchrun --nproc_per_node 8 eval.py configs/tiny_*.py --model_path=Qwen/Qwen3-32B"
    argv = toy_argv(command, ROOT)
    assert argv[:3] == ["eval.py", "configs/tiny_calc.py", "configs/tiny_code.py"], argv
    assert argv[-len(TOY["eval.py"]) - 1:] == ["--model_path=out/tiny-sft", *TOY["eval.py"]], argv


# ------------------------------------------------------------------ the zygote

class Checkout:
    """The scratch checkout and its zygote (tests/zygote.py): run(argv) runs one script there and returns
    its exit code and output, kept in command_NN.log."""

    def __init__(self, path):
        self.path = path
        self.count = 0
        self.zygote = Zygote(cwd=path, env={"HF_HUB_OFFLINE": "1"})

    def run(self, argv, timeout=TIMEOUT):
        self.count += 1
        log = os.path.join(self.path, f"command_{self.count:02d}.log")
        p = self.zygote.run(argv, timeout=timeout, log=log)
        return p.returncode, p.stdout

    def run_demo(self, argv):
        rc, output = self.run(argv)
        assert rc == 0, f"the demo's `python {' '.join(argv)}` failed (exit {rc}):\n" \
                        f"{output[-3000:]}"

    def close(self):
        self.zygote.close()


def write_download(path, fixture, columns):
    """One DOWNLOADS file: the fixture's rows (their columns kept and renamed per `columns`), as
    parquet or JSONL by the name's extension."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in open(os.path.join(FIXTURES, fixture), encoding="utf-8")]
    if columns:
        rows = [{new: row[old] for old, new in columns.items()} for row in rows]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path.endswith(".parquet"):
        # a parquet column holds one type: a column the fixture mixes (Euler's answers 41584 and
        # "0.4167") is written as text
        mixed = {key for key in rows[0] if len({type(row.get(key)) for row in rows}) > 1}
        rows = [{key: str(value) if key in mixed else value for key, value in row.items()}
                for row in rows]
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """The scratch checkout, as a user's after `bash run.sh` and the downloads, with its zygote."""
    path = str(tmp_path_factory.mktemp("checkout"))
    # every file of this checkout but git's, the venv's and what runs make (out/, data/: made here)
    for name in os.listdir(ROOT):
        if not name.startswith(".") and name not in ("out", "data"):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    for download, (fixture, columns) in DOWNLOADS.items():
        write_download(os.path.join(path, download), fixture, columns)
    here = Checkout(path)
    # the demo's data and base model, the SFT models copied from it, then the demo's RL run
    here.run_demo(DEMO_DATA)
    for model, base in STAND_INS.items():
        shutil.copytree(os.path.join(path, base), os.path.join(path, model))
    here.run_demo(DEMO_RL)
    yield here
    here.close()


@pytest.mark.parametrize("command", list(SHOWN), ids=[where for where, _ in SHOWN.values()])
def test_the_command_runs_at_toy_size(command, checkout):
    where, comment = SHOWN[command]
    assert kind(command) in TOY, f"{where}: `{command}`: no TOY entry (see the test above)"
    argv = toy_argv(command, checkout.path)
    rc, output = checkout.run(argv)
    assert rc == 0, f"{where}: `{command}` failed (exit {rc}), run here as " \
                    f"`python {' '.join(argv)}`:\n{output[-3000:]}"
    # the files its comment says it writes are there
    for path in re.findall(r"\bout/[\w./-]*\w", comment):
        assert os.path.exists(os.path.join(checkout.path, path)), f"{where}: no {path} after it"


def test_a_failing_command_fails_with_its_exit_code_and_words(checkout):
    # what the test above reads when a command breaks: a config error's exit 2 and line,
    # sys.exit("...")'s exit 1 and message, an uncaught exception's exit 1 and traceback, a hung
    # command's SIGKILL at its timeout, with the process it started
    rc, output = checkout.run(["train_rl.py", "configs/tiny_rl.py", "--stepz=1"])
    assert rc == 2 and "unknown key 'stepz' (did you mean 'steps'?)" in output, (rc, output)
    rc, output = checkout.run(["data.py", "convert", "nowhere.jsonl", "out/x.jsonl"])
    assert rc == 1 and "convert error" in output and "nowhere.jsonl" in output, (rc, output)
    with open(os.path.join(checkout.path, "out", "raises.py"), "w") as f:
        f.write("import sys\nprint('before')\nraise ValueError(sys.argv[1])\n")
    rc, output = checkout.run(["out/raises.py", "boom"])
    assert rc == 1 and output.startswith("before\nTraceback"), (rc, output)
    assert "ValueError: boom" in output, output
    with open(os.path.join(checkout.path, "out", "hangs.py"), "w") as f:
        f.write("import subprocess, time\n"
                "child = subprocess.Popen(['sleep', '60'])\n"
                "print(child.pid, flush=True)\n"
                "time.sleep(60)\n")
    started = time.time()
    rc, output = checkout.run(["out/hangs.py"], timeout=1)
    assert rc == -signal.SIGKILL and time.time() - started < 30, (rc, output)
    # its `sleep` went with it: no such process, or a zombie that init has yet to reap
    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.time() + 10
    while alive(int(output)) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(int(output)), output


"""The README and docs/*.md hold together: every relative link reaches a file and every #anchor a heading (GitHub's
slug rules), the README stays a front door (a size ceiling, every docs page listed, a true file tree), every
section of the README as it was before the docs/ split has a home, and every train_rl / train_sft / eval command
in the pages names config files and --keys that exist. Reads text only: well under a second."""
import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
# the README is what a newcomer reads top to bottom: measurements and methods go to docs/
README_CEILING = 20_000

# where each heading of the README before the split (1c65858: 971 lines, 87K characters) went: (file, heading);
# the paragraphs without a heading got one of their own
MOVED = {
    "nano-rStar2": [("README.md", "nano-rStar2")],
    "Two commands": [("README.md", "Two commands"),
                     ("docs/running.md", "What the two commands install, and how long they take"),
                     ("docs/running.md", "The tiny run's options (`demo.py`)")],
    "At scale (the paper's recipe, Qwen3-14B-Base)": [("README.md", "At scale (the paper's recipe, Qwen3-14B-Base)")],
    "SFT data": [("docs/data.md", "SFT data")],
    "RL data": [("docs/data.md", "RL data")],
    "(Any config key can be overridden...)": [("docs/running.md", "Config overrides and resume")],
    "(train_rl.py writes one row per step...)": [("docs/running.md", "What a run logs (`metrics.jsonl`)")],
    "(Evaluation data: ...)": [("docs/data.md", "Evaluation data")],
    "(The prompt, tool name ... are the released rStar2-Agent-14B's)": [
        ("docs/fidelity.md", "Fidelity: where we follow the paper, where the release, and why")],
    "Fidelity: where we follow the paper, where the release, and why": [
        ("docs/fidelity.md", "Fidelity: where we follow the paper, where the release, and why")],
    "Reading rollouts (`python view.py`)": [("docs/running.md", "Reading rollouts (`python view.py`)")],
    "Fork it": [("README.md", "Fork it")],
    "Where is it in the code": [("README.md", "Where is it in the code")],
    "Files": [("README.md", "Files"), ("docs/files.md", "Files: what each one holds")],
    "Results": [("docs/results.md", "Results: what the tiny run, the seed studies and the engine-vs-trainer gap show"),
                ("docs/speed.md", "Speed: how fast each part is, and against what")],
    "On a GPU (`python bench.py gpu`)": [("docs/speed.md", "On a GPU (`python bench.py gpu`)")],
    "The tiny run (`bash run.sh`)": [("docs/results.md", "The tiny run (`bash run.sh`)")],
    "Trusting the update: the engine's log-probs vs the trainer's": [
        ("docs/results.md", "Trusting the update: the engine's log-probs vs the trainer's"),
        ("docs/speed.md", "The update: only the work the loss needs (`python bench.py u`)"),
        ("docs/results.md", "What repeats exactly")],
    "Sandbox (`python bench.py sandbox`)": [("docs/speed.md", "Sandbox (`python bench.py sandbox`)")],
    "Rollout engine vs transformers (`python bench.py`)": [
        ("docs/speed.md", "Rollout engine vs transformers (`python bench.py`)")],
    "Paged KV cache: over-commit and preemption (`python bench.py k`)": [
        ("docs/speed.md", "Paged KV cache: over-commit and preemption (`python bench.py k`)")],
    "Rollout scheduling at 64-GPU scale (`python simulate.py`, ~40 s)": [
        ("docs/speed.md", "Rollout scheduling at 64-GPU scale (`python simulate.py`, ~40 s)")],
    "At 64 GPUs: what each rank holds (Qwen3-14B, 64 ranks, 8 per node)": [
        ("docs/scale.md", "At 64 GPUs: what each rank holds (Qwen3-14B, 64 ranks, 8 per node)")],
    "GPU memory of one rank during `train_rl.py configs/stage1.py`": [
        ("docs/scale.md", "GPU memory of one rank during `train_rl.py configs/stage1.py`")],
    "What crosses ranks after a rollout phase (`python bench.py scale`, ~5 min)": [
        ("docs/scale.md", "What crosses ranks after a rollout phase (`python bench.py scale`, ~5 min)")],
    "The stage-3 filter (`eval.py` on 42K problems × 8 samples)": [
        ("docs/scale.md", "The stage-3 filter (`eval.py` on 42K problems × 8 samples)")],
    "Sandbox processes per node": [("docs/scale.md", "Sandbox processes per node")],
    "Checkpoints": [("docs/scale.md", "Checkpoints")],
    "Waits": [("docs/scale.md", "Waits")],
    "What is not here": [("docs/limitations.md", "What is not here"),
                         ("docs/sandbox.md", "What does not hold")],
}


def read(path):
    return open(path, encoding="utf-8").read()


def prose(text):
    """The text outside fenced code blocks (a `# comment` in a bash block is not a heading)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def headings(text):
    return [m[1].strip() for m in re.finditer(r"^#{1,6} (.+)$", prose(text), flags=re.M)]


def slug(heading):
    """GitHub's anchor for a heading: the rendered text (no backticks, a link's text only), lower case, every
    character that is not a letter, digit, `_`, `-` or space dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text):
    """Every anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    for heading in headings(text):
        base = slug(heading)
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def links(text):
    """(target, anchor) of every relative link and image outside code: `[x](path#anchor)`, `![x](path)`."""
    text = re.sub(r"`[^`\n]*`", "", prose(text))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        yield path, anchor


def test_slug_follows_githubs_rules():
    assert slug("Reading rollouts (`python view.py`)") == "reading-rollouts-python-viewpy"
    assert slug("The stage-3 filter (`eval.py` on 42K problems × 8 samples)") == \
        "the-stage-3-filter-evalpy-on-42k-problems--8-samples"
    assert slug("Trusting the update: the engine's log-probs vs the trainer's") == \
        "trusting-the-update-the-engines-log-probs-vs-the-trainers"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


@pytest.mark.parametrize("page", [README] + PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    text = read(page)
    for path, anchor in links(text):
        target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(target), f"{os.path.relpath(page, ROOT)}: link to {path!r}, no such file"
        if anchor:
            assert target.endswith(".md"), f"{os.path.relpath(page, ROOT)}: #{anchor} on a file that is not a page"
            assert anchor in anchors(read(target)), \
                f"{os.path.relpath(page, ROOT)}: #{anchor} is no heading of {os.path.relpath(target, ROOT)}"


def test_the_link_check_catches_a_dead_link_and_anchor():
    bad = "see [x](docs/nowhere.md), [y](docs/results.md#no-such-heading), `[z](in/code.md)`"
    found = list(links(bad))
    assert found == [("docs/nowhere.md", ""), ("docs/results.md", "no-such-heading")]
    assert not os.path.exists(os.path.join(ROOT, found[0][0]))
    assert found[1][1] not in anchors(read(os.path.join(ROOT, found[1][0])))


def test_readme_is_a_front_door():
    text = read(README)
    assert len(text) <= README_CEILING, f"README.md has {len(text):,} characters (ceiling {README_CEILING:,}): " \
                                        "move measurements and methods to a docs/ page"
    # the order a newcomer reads in: the two commands, the recipe at scale, the seams, the code map, files, docs
    order = ["Two commands", "At scale (the paper's recipe, Qwen3-14B-Base)", "Fork it", "Where is it in the code",
             "Files", "Docs"]
    found = headings(text)
    assert [h for h in found if h in order] == order, found
    # every docs page is listed with the question it answers, and none is listed that does not exist
    listed = set(re.findall(r"^- \[[\w.-]+\]\(docs/([\w.-]+\.md)\):", text, flags=re.M))
    assert listed == {os.path.basename(p) for p in PAGES}, listed


def test_readme_file_tree_is_true():
    text = read(README)
    section = text.split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    tree = section.split("```", 2)[1]
    entries = re.findall(r"^(\S+)", tree, flags=re.M)
    for entry in entries:
        assert os.path.exists(os.path.join(ROOT, entry)), f"README's file tree lists {entry}, which does not exist"
    # every script at the root and every folder of code or pages is in the tree (not the folders that runs and
    # data commands make: out/, data/, .venv/ hold no .py or .md of their own)
    def is_source_folder(name):
        path = os.path.join(ROOT, name)
        return os.path.isdir(path) and any(f.endswith((".py", ".md")) for f in os.listdir(path))
    root = {name + ("/" if os.path.isdir(os.path.join(ROOT, name)) else "") for name in os.listdir(ROOT)
            if not name.startswith(".") and (name.endswith((".py", ".sh")) or is_source_folder(name))}
    assert root <= set(entries), f"missing from README's file tree: {sorted(root - set(entries))}"
    # the docs/ line names every page
    docs_line = tree.split("docs/", 1)[1].split("\n```", 1)[0]
    for page in PAGES:
        name = os.path.basename(page)[:-3]
        assert re.search(rf"\b{name}\b", docs_line), f"README's file tree does not name docs/{name}.md"


def test_every_old_section_has_a_home():
    for old, homes in MOVED.items():
        for path, heading in homes:
            assert heading in headings(read(os.path.join(ROOT, path))), f"{old!r} -> {path}: no heading {heading!r}"


def script_keys(script):
    """The config keys of an entry script: the names it assigns before `cfg = configure(globals())` in the same
    block (the module, or its `if __name__ == "__main__":`)."""
    for block in ast.walk(ast.parse(read(os.path.join(ROOT, script)))):
        body = getattr(block, "body", None)
        if not isinstance(body, list):
            continue
        keys = set()
        for node in body:
            if isinstance(node, ast.Assign) and "configure(" in ast.unparse(node.value):
                return keys
            if isinstance(node, ast.Assign):
                keys |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    raise LookupError(f"{script} calls no configure()")


def commands(text):
    """Every `python|torchrun ... (train_rl|train_sft|eval).py args` of a page's code blocks (continuation lines
    joined) and inline code, as (script, [args])."""
    spans = re.findall(r"`((?:python|torchrun) [^`\n]*)`", prose(text))
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M) + spans:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0]
            m = re.search(r"(?:python|torchrun [^#]*?)\s(train_rl\.py|train_sft\.py|eval\.py)\s(.*)", line)
            if m and not line.lstrip().startswith("#"):
                yield m[1], re.findall(r"(?:\"[^\"]*\"|'[^']*'|\S)+", m[2])


def test_commands_name_config_files_and_keys_that_exist():
    seen = 0
    for page in [README] + PAGES:
        for script, args in commands(read(page)):
            keys = script_keys(script)
            assert len(keys) > 10, (script, keys)
            for arg in args:
                where = f"{os.path.relpath(page, ROOT)}: {script} {arg}"
                if arg.startswith("--"):
                    assert arg[2:].split("=", 1)[0] in keys, f"{where}: no such key"
                else:
                    assert os.path.isfile(os.path.join(ROOT, arg)), f"{where}: no such config file"
                    config = ast.parse(read(os.path.join(ROOT, arg)))
                    assigned = {t.id for n in config.body if isinstance(n, ast.Assign) for t in n.targets
                                if isinstance(t, ast.Name)}
                    assert assigned <= keys, f"{where}: sets keys {script} lacks: {assigned - keys}"
            seen += 1
    # the recipe at scale (SFT, three RL stages, the stage-3 filter, eval), the label check, the worked examples
    assert seen >= 10, seen


def test_readme_demo_table_is_the_results_table():
    # the expected output the README shows is the results page's measured table, digit for digit
    def rows(text):
        table = text.split("| model | held-out avg@4 |", 1)[1].split("\n\n", 1)[0]
        return [line.split("|")[2:] for line in table.splitlines()[2:]]
    results = read(os.path.join(ROOT, "docs", "results.md")).split("\n## The tiny run (`bash run.sh`)\n", 1)[1]
    assert rows(read(README)) == rows(results)

"""
`python data.py rl-set` at the paper's size, on synthetic data: time and peak memory (docs/data.md, "RL data").

    python tests/rl_set_scale.py [--scale=1.0] [--dir=/tmp/rl_set_scale] [--seed=0]

Writes, in the sources' layouts, the paper's candidate mix (§4.2): 17,000 DAPO-Math-17k rows (parquet, the
question inside DAPO's instruction wrapper), 93,000 OpenMathReasoning rows (parquet, with a generated_solution
column the command does not read) and 937 Project Euler rows (JSONL): 110,937 candidates; and benchmark files
of AIME 2024's, AIME 2025's and MATH-500's sizes (30 + 30 + 500 problems, their layouts). Problems are random
words (30 to 120 each) from a 20,000-word vocabulary, so no two share an 8-gram by chance. Planted, and counted
as planted: non-integer labels, integer labels in every accepted spelling, exact and whitespace-changed copies
of earlier problems (OpenMathReasoning has one row per solution), problems holding one 8-word run of a benchmark
problem (dropped) and problems holding a 7-word run (kept). Then it runs the command in a child process and
prints its output, its wall time and its peak RSS (getrusage of the child), and checks each printed count
against what was planted. --scale shrinks everything (tests/test_rl_set.py runs it at 1%).
"""
import argparse
import json
import os
import random
import string
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402

WRAP = data.DAPO_PREFIX + "{}" + data.DAPO_SUFFIX
SPELLINGS = ["{}", "{:,}", "\\boxed{{{}}}", "${}$", "{}.0", "00{}"]  # integer labels as sources write them
NOT_INTEGERS = ["\\frac{{{}}}{{7}}", "{}.5", "2\\sqrt{{{}}}", "{}, 3", "x = {}"]


def make(out_dir, scale=1.0, seed=0):
    """Write the candidate and benchmark files; return (candidate paths, benchmark paths, planted counts)."""
    rng = random.Random(seed)
    vocab = sorted({"".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(20000)})
    text = lambda: " ".join(rng.choices(vocab, k=rng.randint(30, 120))) + "?"  # noqa: E731
    size = lambda n: max(1, round(n * scale))  # noqa: E731
    os.makedirs(out_dir, exist_ok=True)
    # 1. the benchmarks, in their layouts: AIME 2024 (parquet-like columns, JSONL here), AIME 2025, MATH-500
    bench = {"aime24.jsonl": [{"id": i, "problem": text(), "solution": "...", "answer": str(i)} for i in range(size(30))],
             "aime25.jsonl": [{"question": text(), "answer": str(i)} for i in range(size(30))],
             "math500.jsonl": [{"problem": text(), "solution": "...", "answer": "\\frac{1}{2}", "level": 3,
                                "unique_id": f"test/{i}.json"} for i in range(size(500))]}
    bench_texts = [row.get("problem", row.get("question")).split() for rows in bench.values() for row in rows]
    for name, rows in bench.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    planted = {"not an integer answer": 0, "exact duplicate": 0, "duplicate up to whitespace": 0,
               "shares an 8-gram with a benchmark": 0}

    def label():  # an integer in one of the accepted spellings, or (1 in 4) a label that is not an integer
        value = rng.randint(1, 10 ** rng.randint(1, 6))
        return rng.choice(NOT_INTEGERS if rng.random() < 0.25 else SPELLINGS).format(value)

    # 2. DAPO-Math-17k: every 50th problem holds 8 words of a benchmark problem, every 50th + 25 holds 7;
    #    "x0" around the run (a word no text has) keeps it exactly 8 or 7 words long
    dapo = []
    for i in range(size(17000)):
        question = text()
        if i % 25 == 0:
            run = 8 if i % 50 == 0 else 7
            words = rng.choice(bench_texts)
            start = rng.randrange(len(words) - run)
            question = question.replace(" ", " x0 " + " ".join(words[start:start + run]) + " x0 ", 1)
            planted["shares an 8-gram with a benchmark"] += run == 8
        dapo.append({"data_source": "math_dapo", "prompt": [{"content": WRAP.format(question), "role": "user"}],
                     "ability": "MATH", "reward_model": {"ground_truth": str(rng.randint(1, 999)), "style": "rule"},
                     "extra_info": {"index": str(i)}})
    pq.write_table(pa.Table.from_pylist(dapo), os.path.join(out_dir, "dapo-math-17k.parquet"))
    # 3. OpenMathReasoning: one row per solution, so problems repeat (exactly, or with other whitespace)
    omr, originals = [], []
    for i in range(size(93000)):
        kind = rng.random()
        if originals and kind < 0.15:  # another solution of an earlier problem
            question, answer = rng.choice(originals)
            reason = "exact duplicate"
        elif originals and kind < 0.20:  # an earlier problem, its first space doubled, its last a newline
            question, answer = rng.choice(originals)
            head, tail = question.rsplit(" ", 1)
            question = head.replace(" ", "  ", 1) + "\n" + tail
            reason = "duplicate up to whitespace"
        else:
            question, answer = text(), label()
            originals.append((question, answer))
            reason = None
        # a copy of a problem whose label is not an integer goes for that first, as the original does
        if data.integer_answer(answer) is None:
            planted["not an integer answer"] += 1
        elif reason:
            planted[reason] += 1
        omr.append({"expected_answer": answer, "problem_type": "has_answer_extracted",
                    "problem_source": "aops_c6_high_school_olympiads", "generation_model": "DeepSeek-R1",
                    "problem": question, "generated_solution": " ".join(rng.choices(vocab, k=100)),
                    "inference_mode": "cot"})
    pq.write_table(pa.Table.from_pylist(omr), os.path.join(out_dir, "omr.parquet"))
    # 4. Project Euler: integer answers up to 20 digits, 1 in 20 a decimal
    n_euler = size(937)
    with open(os.path.join(out_dir, "euler.jsonl"), "w") as f:
        for i in range(n_euler):
            answer = f"{rng.random():.8f}" if i % 20 == 0 else str(rng.randint(1, 10 ** 20))
            planted["not an integer answer"] += i % 20 == 0
            f.write(json.dumps({"id": i + 1, "title": "t", "problem": text(), "numerical_answer": answer}) + "\n")
    sources = [os.path.join(out_dir, name) for name in ("dapo-math-17k.parquet", "omr.parquet", "euler.jsonl")]
    n = len(dapo) + len(omr) + n_euler
    return sources, [os.path.join(out_dir, name) for name in bench], {"read": n, **planted, "kept": n - sum(planted.values())}


def printed_counts(stdout):
    """{filter: count} from the command's printed table."""
    counts = {}
    for line in stdout.splitlines():
        if line.startswith(("  - ", "  = ")):
            parts = line[4:].split("->")[0].split()
            counts[" ".join(parts[:-1])] = int(parts[-1])
    return counts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--dir", default="/tmp/rl_set_scale")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.time()
    sources, benchmarks, planted = make(args.dir, args.scale, args.seed)
    print(f"made {planted['read']} candidates and {len(benchmarks)} benchmark files in {time.time() - t0:.0f} s: "
          + ", ".join(f"{os.path.basename(p)} {os.path.getsize(p) / 2 ** 20:.0f} MiB" for p in sources))
    command = [sys.executable, os.path.join(ROOT, "data.py"), "rl-set", os.path.join(args.dir, "rl.jsonl"),
               "--from", *sources, "--decontaminate", *benchmarks]
    # Linux counts a forked child's peak RSS from its parent's (this process holds the made rows): a small
    # python in between starts the command and reports its children's peak, which is the command's alone
    measure = "import resource, subprocess, sys, time; t0 = time.time(); p = subprocess.run(sys.argv[1:]); " \
              "print(f'wall {time.time() - t0:.1f} s, peak RSS ' " \
              "f'{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB'); sys.exit(p.returncode)"
    p = subprocess.run([sys.executable, "-c", measure, *command], capture_output=True, text=True)
    baseline = subprocess.run([sys.executable, "-c", measure, sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import data"],
                              capture_output=True, text=True)
    print(p.stdout + p.stderr, end="")
    print(f"(python and `import data` alone: {baseline.stdout.strip()})")
    got = {key: printed_counts(p.stdout).get(key) for key in planted if key != "read"}
    want = {key: value for key, value in planted.items() if key != "read"}
    print("counts as planted" if got == want else f"counts NOT as planted: printed {got}, planted {want}")
    sys.exit(0 if p.returncode == 0 and got == want else 1)

"""
avg@k evaluation with the same agent loop as RL: k sampled multi-turn, tool-using answers per problem.

The paper's protocol (§5): 16 samples per problem, temperature 0.6 (top-p not stated: 1.0), up to 30K response tokens
(model + tool tokens, one budget) and 30 turns; it reports avg@16 (mean accuracy over the 16 samples)
and the mean response length in tokens. configs/eval_aime.py carries exactly that.

CPU (tiny model):    python eval.py configs/tiny_eval.py --model_path=out/tiny-sft
one GPU:             python eval.py configs/eval_aime.py --model_path=DIR --data_path=aime24.jsonl
8 GPUs:              torchrun --nproc_per_node 8 eval.py configs/eval_aime.py --model_path=DIR --data_path=aime24.jsonl

--model_path is an HF directory (weights + tokenizer; the released rStar2-Agent-14B loads unchanged) or a run
directory, whose latest step_*/ checkpoint with HF weights is used. --data_path is JSONL, one problem per line,
with the columns of the task (--task; the default math task's: {"question": "<bare problem text>",
"answer": "<gold answer as a string>"}; every field reaches the task's prompt and grade). Under torchrun the problems are shared across ranks by scheduler.py (claim by free KV
capacity). A rank's memory does not grow with the data file: each prompt is tokenized once, a request is
made when a rank claims it, and a trajectory is let go once graded (written down first by the rank that
made it, if asked); only per-trajectory summaries cross ranks, and rank 0 writes the results.

Benchmark files (AIME, MATH-500, the release's parquet) become that JSONL with `python data.py convert`.

Metrics (summary.json, summary.md, printed):
  correct        what the task's grade says (tasks/math.py: reward 1); the reward (in [0, 1]) is training's, and a
                 partial reward is not "correct" unless the task says so
  avg@k          mean over problems of the fraction of its k samples that are correct (= pass@1);
                 avg@k_se is the standard error of that mean over problems (sample std / sqrt(P))
  pass@j         the unbiased estimator 1 - C(n-c, j) / C(n, j) (Chen et al. 2021), mean over problems,
                 for j = 1, 2, 4, ... and j = k
  maj@k          majority vote over the k extracted answers: answers are normalised by removing all
                 whitespace (and leading zeros / '+' of plain integers), then the most frequent wins;
                 a tie goes to the answer sampled first among the tied ones; samples without a
                 (non-empty) answer do not vote, nor do those cut by the budget (they score 0; with
                 --score_truncated they are graded and vote). The vote is correct if the first sample with the
                 winning answer is correct. The answers are the task's predictions (task.predict), or what
                 the row's task's vote(row, pred, trajectory) returns when it has one (a hashable key;
                 None: no vote; it runs with the grade, under its bounds): tasks/code.py votes on
                 the program's syntax tree, not its text. For the math task it is a plain string vote:
                 answers that math-verify finds equal but that are written differently ("1/2", "0.5")
                 are counted apart.
  rollout/       mean / median response tokens (response_len: everything after the prompt, tool responses
                 included) and sampled ones (sampled_len, mask 1); turns per answer; the shares of answers cut by
                 the budget (truncated_frac), by the turn limit (max_turns_frac) and without an answer
  tool/          calls per answer, the share that failed (err: status invalid / error / timeout / memory / crash;
                 err_pos: in correct answers), did not parse (unparsed), named no tool (unknown_tool), or repeated
                 the call before (repeat). rollout/ and tool/ keys are those train_rl.py logs each step
  grade/         the grades scored 0 without a verdict, on all ranks (summary.json; train_rl.py logs them too):
                 verification too slow (timed_out), an answer too long or deep to parse (refused), no
                 math-verify helper to be had or the task's grade raised (failed)
Outputs in out_dir: summary.json, summary.md (the table + one row per problem), per_problem.jsonl,
trajectories.jsonl (every trajectory decoded, in train_rl.py's dump record: view.py shows them; in the
order the ranks finished them, so sort by (group, sample); --save_trajectories=false skips it for huge runs).
Each file is whole or absent (written aside, then renamed), and no summary stands beside another
run's files: an earlier run's summaries and dump are removed before this run's files are written,
and summary.json, the last one, marks a finished eval (a run stopped before it leaves no summary).
--keep_unsolved=FILE writes the problems whose pass rate is < 1 (the paper's stage-3 filter: 8 samples,
drop what the policy always solves). --keep_solved=FILE writes those that at least --keep_min_correct of the k
samples got right (the paper's label check, §4.2: Qwen3-32B, 16 samples, at least 2 match the label): one
rule (keep_by_correct), two thresholds. Prompts longer than max_prompt_tokens are then skipped, not an
error: train_rl.py skips them too, so the filter and training agree on which problems exist.

Sampling is reproducible: every trajectory samples from its own generator seeded from
(seed, 0, problem index, sample index), so a CPU run with the same seed gives the same numbers, and two
checkpoints are compared on the same random numbers. evaluate() can be imported by another script; importing
this file runs nothing. Grading follows the training rule: answers are read from what the
policy sampled only, and a trajectory cut by the budget scores 0 (--score_truncated=true: grade it anyway,
as the released code does).
"""
import itertools
import json
import math
import os
import statistics
import time

import torch.distributed as dist
from tqdm import tqdm

import agent
import grading
from rollout import Request
from scheduler import (Lazy, dump_line, gather, gather_summaries, generate, join_parts, rollout_metrics,
                       summarize)

# evaluate()'s calls in this process: each claims from a counter of its own in the ranks' shared
# store (a second call on the first's counter found it used up and generated nothing)
calls = itertools.count()


# -----------------------------------------------------------------------------
# metrics

def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers; comb is 0 when n - c < k


def normalize_answer(answer):
    """The string maj@k votes on: no whitespace; plain integers without leading zeros or '+'."""
    s = "".join(answer.split())
    return grading.plain_int(s) or s


def majority_vote(answers):
    """Index of the sample whose answer wins the vote (the first sample with it), or None when no sample
    has an answer. Ties go to the answer sampled first among the tied. An answer is a string
    (normalised) or any other hashable key (a task's vote(): tasks/code.py's); one that is empty or None
    does not vote."""
    keys = [normalize_answer(answer) if isinstance(answer, str) else answer for answer in answers]
    # each sample's answer's votes
    votes = [keys.count(key) if key else 0 for key in keys]
    return votes.index(max(votes)) if any(votes) else None  # index(): the first of the most voted


def metrics(groups):
    """groups: one list of scheduler.Summary per problem, in sample order. Returns (summary, per_problem)."""
    sizes = {len(group) for group in groups}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"need the same non-zero number of samples for every problem, "
                         f"got {[len(group) for group in groups]}")
    k = len(groups[0])
    summaries = [summary for group in groups for summary in group]
    per_problem = []
    for index, group in enumerate(groups):
        # how many of the problem's k samples are right
        correct = sum(summary.correct for summary in group)
        # the index of the vote's winner, None: no sample answered
        winner = majority_vote([summary.vote for summary in group])
        # the problem's row: its counts, its vote, its lengths, its tool calls and endings
        per_problem.append({
            "index": index,
            "samples": k,
            "correct": correct,
            "accuracy": correct / k,
            "maj_answer": None if winner is None else group[winner].pred,
            "maj_correct": 0.0 if winner is None else float(group[winner].correct),
            "preds": [summary.pred for summary in group],
            "response_len": statistics.fmean(summary.n_response for summary in group),
            "tool_calls": sum(len(summary.call_statuses) for summary in group),
            "tool_errors": sum(agent.n_failed(summary.call_statuses) for summary in group),
            "truncated": sum(summary.finish == "length" for summary in group),
        })
    accuracies = [row["accuracy"] for row in per_problem]
    # pass@j for j = 1, 2, 4, ... below k (the powers of two up to k - 1), and k itself
    passes = {f"pass@{attempts}": statistics.fmean(pass_at_k(k, row["correct"], attempts)
                                                   for row in per_problem)
              for attempts in [2 ** power for power in range((k - 1).bit_length())] + [k]}
    summary = {
        "problems": len(groups),
        "samples": k,
        "avg@k": statistics.fmean(accuracies),
        # the mean reward: partial rewards count, not only 1s
        "reward": statistics.fmean(summary.reward for summary in summaries),
        "avg@k_se": statistics.stdev(accuracies) / math.sqrt(len(accuracies))
                    if len(accuracies) > 1 else 0.0,
        **passes,
        # pass@k under its own name too (the same number as pass@<k>)
        "pass@k": passes[f"pass@{k}"],
        "maj@k": statistics.fmean(row["maj_correct"] for row in per_problem),
        # rollout/ and tool/: training's metrics of the same name (length, endings, turns, tool calls and failures)
        **rollout_metrics(summaries),
        "rollout/response_len_median": statistics.median(summary.n_response
                                                         for summary in summaries),
        "rollout/sampled_len": statistics.fmean(summary.n_sampled for summary in summaries),
        "rollout/sampled_len_median": statistics.median(summary.n_sampled for summary in summaries),
        "rollout/max_turns_frac": statistics.fmean(summary.finish == "max_turns"
                                                   for summary in summaries),
        "rollout/no_answer_frac": statistics.fmean(not summary.pred for summary in summaries),
    }
    return summary, per_problem


def evaluate(engine, tokenizer, problems, samples, budget, mode="dynamic", score_truncated=False, *,
             prompt_ids, task, on_graded=None):
    """
    Sample `samples` trajectories for every problem (the rows of the task module `task`; prompt_ids: their
    rendered prompts, tokenized) with the engine's own sampling settings and tools, `budget` response tokens
    each, graded by the task's grade(); under torchrun the work is shared across ranks. Memory does not grow
    with the number of problems: requests are made as a rank claims them, and a trajectory is let go once graded
    (on_graded(trajectory, summary) sees it first, on the rank that made it: e.g. to write it down); what is
    kept of it is its Summary.
    Returns (summary, per_problem) on every rank.
    """
    # samples < 1: metrics() raises the ValueError (no samples to count)
    # each request with its row's tools, and the maker of its own environment when the row's task keeps state
    requests = Lazy(len(problems) * samples, lambda index: Request(
        list(map(int, prompt_ids[index // samples])),
        key=(0, index // samples, index % samples),
        meta={"problem": index // samples},
        **grading.rollout_seam(problems[index // samples], task)))
    # rank 0's bar; under torchrun it counts this rank's trajectories only, so it has no total
    distributed = dist.is_initialized()
    bar = tqdm(total=None if distributed else len(requests), disable=distributed and dist.get_rank() > 0,
               desc="eval", unit="traj", dynamic_ncols=True)
    # grades off the decode loop, by the task's rule, on its rows
    grader = grading.Grader(tokenizer, score_truncated,
                            task=task, rows=problems, sandbox=engine.sandbox)
    # (trajectory, its grade's future) of the trajectories not yet graded
    waiting = []
    # what is kept of the graded ones (this rank's summaries)
    mine = []

    def let_go(final=None):
        """The graded trajectories: summarised, handed to on_graded, dropped. final (the grader's
        results(), at the end): every trajectory still waiting takes its grade from there."""
        for trajectory, future in list(waiting):
            # a grade still running waits for a later call
            if final is not None or future.done():
                # what is kept of it: its summary, with the grade's result
                mine.append(summarize(trajectory, future.result() if final is None
                                      else final[trajectory.key]))
                # handed over before it is let go (e.g. written down)
                if on_graded:
                    on_graded(trajectory, mine[-1])
                # let go: no longer waiting
                waiting.remove((trajectory, future))
                # the grader keeps every grade's future until results() (~1.9 KB each, with its lock and
                # deque): a grade read here is dropped there too, so memory stays flat over 42K × 8 samples
                grader.pending.pop(trajectory.key, None)

    def on_finish(trajectory):
        waiting.append((trajectory, grader(trajectory)))
        bar.update(1)
        let_go()

    generate(engine, requests, budget, mode, on_finish, counter=f"eval/{next(calls)}", keep=False)
    bar.close()
    let_go(final=grader.results())  # every grade within its bound (a stuck one scores 0)
    summaries = gather_summaries(mine)
    # each problem's summaries, in sample order (a sample lost or repeated: metrics() names the
    # counts)
    groups = [[] for _ in problems]
    for graded in summaries:
        groups[graded.problem].append(graded)
    summary, per_problem = metrics(groups)
    # the grades scored 0 without a verdict, on all ranks (grading.Grader.results: too slow, refused,
    # failed): a math-verify helper that never started zeroed every answer it had to check, unseen
    for key in ("timed_out", "refused", "failed"):
        summary[f"grade/{key}"] = sum(gather(grader.stats[key]))
    # rows that name their own tasks: the same metrics per task too, under summary["tasks"][name]
    names = [grading.row_task(problem, task).__name__ for problem in problems]
    if len(set(names)) > 1:
        summary["tasks"] = {name: metrics([group for group, group_name in zip(groups, names)
                                           if group_name == name])[0]
                            for name in sorted(set(names))}
    # each problem's row also holds the data row's own columns (its id, question, answer...: a key above wins)
    per_problem = [{**problem, **row} for row, problem in zip(per_problem, problems)]
    return summary, per_problem


def keep_by_correct(problems, per_problem, fewest, most):
    """The problems that fewest..most of their samples got right (stage 3: 0..k-1; the label check: N..k)."""
    return [problems[row["index"]] for row in per_problem if fewest <= row["correct"] <= most]



# -----------------------------------------------------------------------------
# the script

if __name__ == "__main__":
    import contextlib

    import torch
    from transformers import AutoTokenizer

    from checkpoint import latest_checkpoint
    from common import barrier, compute_cleanup, compute_init, print0, resolve_model, write_jsonl
    from configurator import configure, require
    from model import load_model
    from rollout import Engine, kv_rows
    from sandbox import SandboxPool

    # defaults: the paper's protocol (configs/eval_aime.py spells it out; configs/tiny_eval.py is the CPU run)
    # HF directory (weights + tokenizer) or a run directory (its latest step_*/ with weights)
    model_path = ""
    data_path = ""  # JSONL with the task's columns (the math task: "question" and "answer")
    # the task file: prompt, tools, grade (tasks/math_no_tool.py: the same without the tool)
    task = "tasks/math.py"
    out_dir = "out/eval"  # summary.json, summary.md, per_problem.jsonl, trajectories.jsonl go here
    samples = 16  # k samples per problem
    temperature = 0.6  # the paper's evaluation temperature
    top_p = 1.0  # nucleus sampling; 1.0 = off (the paper does not state it)
    # decode steps: "eager", or at static shapes (model.Qwen.static_step) "static", "compile"
    #               (inductor) or "graphs" (inductor's CUDA graphs on a GPU: not yet run on one)
    decode_mode = "eager"
    max_response_tokens = 30720  # one budget for model + tool tokens of a trajectory
    # a longer prompt is an error (the denominator must not change silently); with
    # keep_unsolved it is skipped, as train_rl.py skips it
    max_prompt_tokens = 2048
    max_turns = 30  # assistant turns per answer (the paper: 30)
    # tool calls run per assistant turn; surplus ones are dropped (the release runs one)
    max_calls_per_turn = 1
    # seconds a call may take before it is answered "timeout" (and an environment's reply before the episode
    # ends); 0: the sandbox's bound + 30 s
    tool_call_timeout = 0.0
    # chars per tool response, middle cut (the release: verl's max_tool_response_length)
    tool_max_chars = 256
    # KV-cache tokens per rank; 0 = 90% of free accelerator memory / up to 256 rows on CPU
    kv_capacity = 0
    rollout_split = "dynamic"  # "dynamic" (claim by free KV) or "static" (fixed split)
    # True: the same numbers on a busy machine too (tool answers awaited; static split)
    deterministic = False
    tool_workers = 0  # sandbox workers per rank; 0 = the node's cores shared by its ranks
    tool_timeout = 4.0  # seconds per tool call
    # bytes of address space per tool call (code-judge's MAX_MEMORY default)
    tool_memory = 256 << 20
    # "auto" (bubblewrap) or "none": no sandbox at all, for trusted code only
    tool_isolation = "auto"
    seed = 0  # every trajectory's generator derives from (seed, problem, sample)
    limit = 0  # evaluate the first N problems only; 0 = all
    keep_unsolved = ""  # write the problems with pass rate < 1 to this JSONL (stage-3 filter)
    # write the problems >= keep_min_correct of whose samples are right (label check, §4.2)
    keep_solved = ""
    keep_min_correct = 2  # with keep_solved: the fewest right samples a kept problem has (paper: 2)
    # trajectories.jsonl; false for huge runs (42K problems × 8 × 12K tokens)
    save_trajectories = True
    # True: grade trajectories cut by the budget (released code); paper: they score 0
    score_truncated = False
    dtype = "bfloat16"  # "float32" on CPU
    # a collective waiting longer raises (a rank died or hangs); see common.compute_init
    dist_timeout_s = 1800
    cfg = configure(globals())
    # the two paths must be given; the ranges of the settings
    require(globals(), "model_path and data_path", "samples >= 1", "limit >= 0",
            "not keep_solved or 0 <= keep_min_correct <= samples",
            "max_response_tokens >= 1", "max_turns >= 1", "max_calls_per_turn >= 1", "tool_max_chars >= 2",
            "temperature >= 0", "0 < top_p <= 1")

    rank, world, device = compute_init(seed, dist_timeout_s)
    model_path = resolve_model(model_path)
    # a run directory: its newest weights
    if not os.path.isfile(f"{model_path}/config.json"):
        model_path = latest_checkpoint(model_path, weights=True) or model_path
    if not os.path.isfile(f"{model_path}/config.json"):
        raise SystemExit(f"eval error: {model_path} is no model directory (config.json) and no run directory (step_*/)")
    try:
        task_module = grading.load_task(task)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"config error: {e}")
    problems = grading.read_problems(data_path, task_module)

    # the first limit problems; limit 0: all of them
    problems = problems[:limit or None]
    if not problems:
        raise SystemExit(f"eval error: {data_path} has no problems")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # each prompt tokenized once, then shared by its samples
    prompt_ids = grading.tokenize_prompts(problems, task_module, tokenizer)
    # which prompts fit in max_prompt_tokens, and how many do not
    fits = [len(ids) <= max_prompt_tokens for ids in prompt_ids]
    too_long = fits.count(False)
    if too_long and not (keep_unsolved or keep_solved):
        raise SystemExit(f"eval error: {too_long} prompt(s) longer than max_prompt_tokens="
                         f"{max_prompt_tokens} (first: problem {fits.index(False)} of "
                         f"{data_path}); raise --max_prompt_tokens")
    # the stage-3 filter: training skips these prompts, so they are not part of the hard subset
    if too_long:
        problems = list(itertools.compress(problems, fits))
        prompt_ids = list(itertools.compress(prompt_ids, fits))
        print0(f"{too_long} prompt(s) longer than max_prompt_tokens={max_prompt_tokens} "
               "skipped, as train_rl.py skips them")
    # (no dropout in the model: nothing to switch to eval mode)
    model = load_model(model_path, device=device, dtype=getattr(torch, dtype))
    model.decode_mode = decode_mode
    max_len = max_prompt_tokens + max_response_tokens
    # this rank's share of the rollouts: the most rows its engine holds at once (as in train_rl.py:
    # with reserve="auto" an engine holding more takes rollouts from the ranks that would run them
    # sooner; the first rank to claim took up to ~4x its share, leaving others idle), and the most
    # rows of KV it needs
    share = -(-len(problems) * samples // world)
    rows = kv_rows(model, max_len, kv_capacity, limit=share)
    print0(f"eval: {len(problems)} problems × {samples} samples from {data_path} "
           f"| model {model_path} | T {temperature} top-p {top_p} | budget {max_response_tokens} "
           f"| turns {max_turns} | {world} rank(s) × {rows} rows")
    os.makedirs(out_dir, exist_ok=True)
    # each rank's part of the dump, joined into trajectories.jsonl at the end
    dump = open(f"{out_dir}/trajectories.jsonl.tmp.{rank}", "w") if save_trajectories else None

    # train_rl.py's dump record, written by the rank that made the trajectory
    def write(trajectory, summary):
        dump.write(dump_line(trajectory, summary, tokenizer, problems[summary.problem],
                             tokenizer.decode(trajectory.prompt_ids)))

    # the peak reported below is the evaluation's own: the load's (torch, the weights) is forgotten here
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.time()
    with SandboxPool(workers=tool_workers or None, timeout=tool_timeout, memory=tool_memory,
                     isolation=tool_isolation) as sandbox:
        engine = Engine(model, tokenizer, kv_capacity=rows * max_len, max_len=max_len,
                        temperature=temperature, top_p=top_p, seed=seed,
                        sandbox=sandbox, max_turns=max_turns, max_calls_per_turn=max_calls_per_turn,
                        tool_max_chars=tool_max_chars, deterministic=deterministic,
                        tools=task_module.TOOLS, call_timeout=tool_call_timeout or None,
                        # the promise per row follows what the finished rows used (docs/speed.md)
                        reserve="auto", max_rows=share)
        summary, per_problem = evaluate(engine, tokenizer, problems, samples, max_response_tokens,
                                        rollout_split, score_truncated=score_truncated,
                                        prompt_ids=prompt_ids,
                                        on_graded=write if save_trajectories else None,
                                        task=task_module)
    # rank 0's peak RSS since the load: VmHWM is this process's own (ru_maxrss also counts the memory its parent
    # had when it forked this process, e.g. a test runner's)
    with open("/proc/self/status") as f:
        peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    summary.update(model=model_path, temperature=temperature, wall_s=time.time() - t0, config=cfg,
                   peak_rss_mib=peak_kib / 1024)
    if dump:
        dump.close()
    barrier()
    if rank == 0:
        k = samples
        table = [f"# eval of {model_path} on {data_path}", "",
                 f"{len(problems)} problems × {k} samples, temperature {temperature}, "
                 f"top-p {top_p}, {max_response_tokens} tokens, {max_turns} turns, seed {seed}", "",
                 "| metric | value |", "|---|---|",
                 f"| avg@{k} | {100 * summary['avg@k']:.2f}% ± {100 * summary['avg@k_se']:.2f} |",
                 f"| mean reward | {summary['reward']:.3f} |"]
        table += [f"| {key} | {100 * summary[key]:.2f}% |" for key in summary
                  if key.startswith("pass@") and key != "pass@k"]
        table += [f"| maj@{k} | {100 * summary['maj@k']:.2f}% |",
                  f"| mean / median length (tokens, all) | {summary['rollout/response_len']:.1f} / {summary['rollout/response_len_median']:.1f} |",
                  f"| mean / median length (model tokens) | {summary['rollout/sampled_len']:.1f} / {summary['rollout/sampled_len_median']:.1f} |",
                  f"| turns per answer | {summary['rollout/turns']:.2f} |",
                  f"| tool calls per answer | {summary['tool/calls']:.2f} |",
                  f"| tool error ratio | {summary['tool/err']:.3f} |",
                  f"| truncation ratio (length) | {summary['rollout/truncated_frac']:.3f} |",
                  f"| max-turns ratio | {summary['rollout/max_turns_frac']:.3f} |",
                  f"| no-answer ratio | {summary['rollout/no_answer_frac']:.3f} |",
                  f"| wall time | {summary['wall_s']:.1f} s |"]
        # a mixed set: each task's own avg@k, mean reward and tool error ratio
        table += [f"| {name}: avg@{k} / mean reward / tool errors | "
                  f"{100 * task_summary['avg@k']:.2f}% / {task_summary['reward']:.3f} / {task_summary['tool/err']:.3f} |"

                  for name, task_summary in summary.get("tasks", {}).items()]
        per = ["",
               "| # | id | gold | correct | maj answer | mean length | tool calls (errors) | truncated |",
               "|---|---|---|---|---|---|---|---|"]
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")[:40]
        per += [f"| {row['index']} | {cell(row.get('id', ''))} | {cell(row.get('answer', ''))} | "
                f"{row['correct']}/{k} | {cell(row['maj_answer'])} | {row['response_len']:.0f} | "
                f"{row['tool_calls']} ({row['tool_errors']}) | {row['truncated']} |"
                for row in per_problem]
        print("\n".join(table[4:]))
        # an earlier run's summaries and dump go first (its dump would read as this run's, view.py
        # shows it beside this summary), and this run's summaries are written last: a run stopped
        # before its end leaves no summary beside files of two runs (demo.py takes summary.json for
        # a finished eval)
        for name in ("summary.json", "summary.md", "trajectories.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{out_dir}/{name}")
        # the ranks' parts, one after the other, renamed once whole: sort by (group, sample) to
        # read in order
        if save_trajectories:
            join_parts(f"{out_dir}/trajectories.jsonl.tmp", world)
            os.replace(f"{out_dir}/trajectories.jsonl.tmp", f"{out_dir}/trajectories.jsonl")
        write_jsonl(f"{out_dir}/per_problem.jsonl", per_problem)
        # the two keep rules: which rows, from how many right samples to how many, the rule in words
        for path, fewest, most, rule in [(keep_unsolved, 0, k - 1, "pass rate < 1"),
                                         (keep_solved, keep_min_correct, k,
                                          f">= {keep_min_correct} of {k} right")]:
            # a rule whose file is not asked for writes nothing
            if path:

                kept = keep_by_correct(problems, per_problem, fewest, most)
                write_jsonl(path, kept)
                print(f"kept {len(kept)} of {len(problems)} problems ({rule}) in {path}")
        # each summary whole or absent: written aside, then renamed; summary.json the last file
        for name, text in [("summary.md", "\n".join(table + per) + "\n"),
                           ("summary.json", json.dumps(summary, indent=2))]:
            with open(f"{out_dir}/{name}.tmp", "w") as f:
                f.write(text)
            os.replace(f"{out_dir}/{name}.tmp", f"{out_dir}/{name}")
        print(f"wrote {out_dir}/summary.md, summary.json, per_problem.jsonl and "
              "trajectories.jsonl (unless --save_trajectories=false)")
    compute_cleanup()

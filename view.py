"""
A static HTML viewer of rollouts: what the model wrote, which code it ran, what the tool answered,
which groups were dropped and which samples Resample-on-Correct kept. One self-contained page that a
browser opens from disk: no server, no network, no external script or font.

  python view.py out/tiny-rl                     a run dir: rollouts/step_*.jsonl.gz + metrics.jsonl
  python view.py out/tiny-rl/rollouts/step_000010.jsonl.gz -o step10.html     one dumped step
  python view.py out/eval_tiny                   an eval out_dir (its trajectories.jsonl)

The page goes next to its input (RUN_DIR/view.html, or the dump's name with .html) unless -o says.
A run dir puts every dumped step in one page: at 14B scale (16,384 rollouts of ~4K tokens a step) open
one dump file at a time.
train_rl.py writes one record per trajectory every `dump_every` steps, eval.py one per trajectory it grades
(both with scheduler.dump_line); eval's have no step and group_kind, and RoC's penalty, kept and advantage unset.

On the page: a chart of reward, tool-error ratio and length over steps (metrics.jsonl, else the dumps);
per step, each prompt with its samples side by side. Sampled tokens (mask 1, in the loss) are plain
text; tool responses and forced glue (mask 0) are shaded, and a strip over each sample draws the mask
to scale in tokens. Filters (correct, wrong, truncated, tool error, kept, dropped) combine with AND;
correct/wrong and kept/dropped each switch the other off.

How it stays fast at 512 prompts x 32 samples a step: the records ride in the page as one JSON blob
(token ids dropped, text kept), and a group's samples become DOM only when the group nears the
viewport. All model text and tool output reaches the page through textContent, never as markup; the
JSON blob has every "<" written as \\u003c, so no "</script>" inside it can end the script element.
"""
import argparse
import glob
import gzip
import html
import itertools
import json
import os
import re
import sys

from agent import TOOL_ERRORS  # the statuses that count as a failed tool call


def read_records(path):
    """The records of one .jsonl or .jsonl.gz file. A file cut short (a step's dump still being written, or a
    run killed while writing it) gives its complete records, and a note says so; a bad line is named."""
    records = []
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except ValueError as e:
                    # a last line without its newline: where the writer was when the file was read
                    if not line.endswith("\n"):
                        raise EOFError from None
                    raise SystemExit(f"view error: {path}:{line_number}: not valid JSON ({e})") from None
    except EOFError:
        print(f"view: {path} is cut short (still being written, or its writer was stopped): "
              f"its first {len(records)} records", file=sys.stderr)
    return records


def load(path):
    """(records, metrics rows) from a run dir, an eval out_dir, or one dump / trajectories file."""
    if os.path.isdir(path):
        # the joined dumps only: not the ranks' parts (step_*.jsonl.gz.0, ...) of a dump being written
        files = sorted(f for f in glob.glob(os.path.join(path, "rollouts", "step_*.jsonl*"))
                       if f.endswith((".jsonl", ".jsonl.gz")))
        evals = [os.path.join(path, "trajectories.jsonl" + gz) for gz in ("", ".gz")]
        files = files or [f for f in evals if os.path.isfile(f)]
        run_dir = path
    else:
        files = [path]
        parent = os.path.dirname(os.path.abspath(path))  # a dump sits in RUN_DIR/rollouts/
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == "rollouts" else None
    if not files:
        raise SystemExit(f"view error: no rollouts/step_*.jsonl.gz or trajectories.jsonl in {path}")
    records = [r for f in files for r in read_records(f)]
    if not records:  # (the page would have no step to show)
        raise SystemExit(f"view error: no trajectories in {', '.join(files)}")
    metrics_path = os.path.join(run_dir, "metrics.jsonl") if run_dir else ""
    metrics = []
    if os.path.isfile(metrics_path) and any(r.get("step") is not None for r in records):
        # a run being trained appends a row a step: its last line may be half written
        metrics = read_records(metrics_path)
    return records, metrics


def call_view(call):
    """What the page shows of one tool-call record: status, duration, tool, and the Python tool's code and stdin
    (another tool's arguments as JSON in their place)."""
    args = call.get("arguments")
    python = isinstance(args, dict) and set(args) <= {"code", "input"}
    code = args.get("code") if python else json.dumps(args, ensure_ascii=False) if args is not None else call.get("code")
    return {"status": call.get("status"), "duration": call.get("duration"), "tool": call.get("tool", ""),
            "code": code, "stdin": args.get("input") if python else call.get("stdin")}


def page_data(records):
    """Groups of samples in (step, group, sample) order, with only what the page shows."""
    groups = {}
    for r in sorted(records, key=lambda r: (r.get("step") or 0, r["group"], r["sample"])):
        g = groups.setdefault((r.get("step"), r["group"]), {
            "step": r.get("step"), "group": r["group"],
            "question": r.get("question"), "answer": r.get("answer"),
            "prompt": r.get("prompt", ""), "kind": r.get("group_kind"), "samples": []})
        mask = r.get("mask") or []
        runs = [len(list(run)) for _, run in itertools.groupby(mask)]  # tokens in each segment
        if len(runs) != len(r["segments"]):
            runs = [None] * len(r["segments"])
        g["samples"].append({
            "sample": r["sample"], "reward": r["reward"], "finish": r["finish"], "turns": r["turns"],
            # the task's verdict (dumps before it had one: math's 0/1 reward)
            "correct": bool(r.get("correct", r["reward"] >= 1)),
            "kept": r.get("kept"), "penalty": r.get("penalty"), "advantage": r.get("advantage"),
            "tokens": len(mask), "model_tokens": sum(mask),
            "segments": [[text, m, n] for (text, m), n in zip(r["segments"], runs)],
            # the tool output is already in the text (a mask-0 segment); the code is shown unescaped
            "calls": [call_view(c) for c in r["tool_calls"]]})
    return list(groups.values())


def step_series(records, metrics):
    """(step, reward, tool error ratio, mean length) per step: metrics.jsonl's rows, else the dumps'."""
    if metrics and "rollout/reward" in metrics[0]:  # a run from before the namespaces: from its dumps
        return [(m["step"], m["rollout/reward"], m["tool/err"], m["rollout/response_len"]) for m in metrics]
    rows = []
    for step, rs in itertools.groupby(sorted((r for r in records if r.get("step") is not None),
                                             key=lambda r: r["step"]), key=lambda r: r["step"]):
        rs = list(rs)
        calls = [c["status"] for r in rs for c in r["tool_calls"]]
        rows.append((step, sum(r["reward"] for r in rs) / len(rs),
                     sum(s in TOOL_ERRORS for s in calls) / max(1, len(calls)),
                     sum(len(r["response_ids"]) for r in rs) / len(rs)))
    return rows


def chart(series, dumped, w=260, h=96):
    """Three small inline-SVG line charts over steps: reward, tool-error ratio, response length; a dot on
    each step the page holds."""
    if not series:
        return ""
    steps = [s[0] for s in series]
    x0, x1 = min(steps), max(steps)
    panels = []
    kinds = [("reward", "#2a7"), ("tool error ratio", "#c33"), ("response length", "#36c")]
    for k, (title, color) in enumerate(kinds):
        ys = [s[k + 1] for s in series]
        y0, y1 = min(ys), max(ys)
        sx = lambda x: 40 + (x - x0) / ((x1 - x0) or 1) * (w - 50)
        sy = lambda y: h - 18 - (y - y0) / ((y1 - y0) or 1) * (h - 38)
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(steps, ys))
        panels.append(
            f'<svg class="chart" width="{w}" height="{h}"><text x="40" y="12">{title}</text>'
            f'<text x="36" y="{sy(y1) + 4:.0f}" text-anchor="end">{y1:.3g}</text>'
            f'<text x="36" y="{sy(y0) + 4:.0f}" text-anchor="end">{y0:.3g}</text>'
            f'<text x="40" y="{h - 3}">step {x0}</text>'
            f'<text x="{w - 10}" y="{h - 3}" text-anchor="end">{x1}</text>'
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>'
            + "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"><title>step {x}: '
                      f'{y:.3g}</title></circle>' for x, y in zip(steps, ys) if x in dumped)
            + "</svg>")
    return "".join(panels)


def render(records, metrics, title):
    """The page: one string, the data embedded as JSON that the script parses once."""
    data = {"groups": page_data(records), "errors": sorted(TOOL_ERRORS), "rl": any(r.get("step") is not None for r in records)}
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # ascii; no "</script>" possible
    dumped = {r.get("step") for r in records}
    parts = {"TITLE": html.escape(title), "CHART": chart(step_series(records, metrics), dumped), "DATA": blob}
    return re.sub("__(TITLE|CHART|DATA)__", lambda m: parts[m.group(1)], TEMPLATE)  # one pass: no re-scan


TEMPLATE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 0; color: #222; background: #f6f6f4; }
header { padding: 8px 14px; background: #fff; border-bottom: 1px solid #ddd; }
h1 { font-size: 16px; margin: 2px 0 6px; }
.chart { background: #fafafa; border: 1px solid #e4e4e4; margin-right: 8px; }
.chart text { font-size: 10px; fill: #555; }
#bar { position: sticky; top: 0; z-index: 2; background: #fff; padding: 6px 14px; border-bottom: 1px solid #ddd; }
#bar button { margin: 0 2px; padding: 2px 8px; border: 1px solid #bbb; border-radius: 10px; background: #fff; }
#bar button.on { background: #234; color: #fff; border-color: #234; }
#count { margin-left: 10px; font-weight: 600; }
#stats { color: #555; margin-top: 4px; }
.m1 { background: #fff; }
.m0 { background: #ffe9b8; color: #6a4d00; }
.g { margin: 10px 14px; background: #fff; border: 1px solid #ddd; border-radius: 4px; }
.gh { padding: 6px 10px; cursor: pointer; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.gh:hover { background: #f3f6fa; }
.g.closed .gb { display: none; }
.gb:empty { height: 420px; }
.kind { padding: 0 6px; border-radius: 8px; font-size: 11px; }
.kind.mixed { background: #dde9ff; }
.kind.all_correct { background: #d7f2df; }
.kind.all_wrong { background: #f8dcdc; }
.prompt { margin: 0 10px 6px; color: #666; }
.row { display: flex; gap: 8px; overflow-x: auto; padding: 0 10px 10px; }
.s { flex: 0 0 340px; border: 1px solid #ddd; border-top: 4px solid #c33; border-radius: 3px; }
.s.ok { border-top-color: #2a7; }
.s.dropped { opacity: .55; }
.sh { padding: 3px 6px; background: #fafafa; font-size: 12px; }
.mask { display: flex; height: 5px; }
.mask i { display: block; min-width: 1px; }
.mask i.b1 { background: #36c; } .mask i.b0 { background: #f0b030; }
.calls { padding: 2px 6px; }
.calls details { display: inline-block; margin-right: 4px; }
.calls summary { cursor: pointer; font-size: 11px; padding: 0 5px; border-radius: 8px; background: #d7f2df; }
.calls summary.err { background: #f8dcdc; }
pre { white-space: pre-wrap; word-break: break-word; font: 11.5px/1.35 ui-monospace, monospace; margin: 0; }
.txt { padding: 4px 6px; max-height: 360px; overflow-y: auto; }
.calls pre { background: #f4f4f4; padding: 4px; max-width: 320px; }
</style></head><body>
<header><h1>__TITLE__</h1><div>__CHART__</div></header>
<div id="bar"><select id="step"></select> <span id="filters"></span><span id="count"></span>
<div id="stats"></div><div>legend: <span class="m1">sampled by the policy (mask 1, in the loss)</span>
<span class="m0">tool response / forced glue (mask 0)</span></div></div>
<main id="groups"></main>
<script type="application/json" id="data">__DATA__</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const ERR = new Set(D.errors);
const TEST = {  // the filters; a sample shows when it passes every active one
  correct: s => s.correct, wrong: s => !s.correct, truncated: s => s.finish === 'length',
  'tool error': s => s.calls.some(c => ERR.has(c.status)),
  kept: s => s.kept === true, dropped: s => s.kept === false};
const OTHER = {correct: 'wrong', wrong: 'correct', kept: 'dropped', dropped: 'kept'};  // exclusive pairs
const active = new Set();
const steps = [...new Set(D.groups.map(g => g.step))];
let step = steps[steps.length - 1];
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;  // text only: model output never becomes markup
  return e;
};
const fmt = x => x === null || x === undefined ? '-' : (+x).toFixed(2);
const pass = s => [...active].every(f => TEST[f](s));

function sampleView(g, s) {
  const ok = s.correct;
  const box = el('div', 's' + (ok ? ' ok' : '') + (s.kept === false ? ' dropped' : ''));
  // the reward beside the verdict: a partial reward (0.8) must not look like a 0
  let head = `#${s.sample} ${ok ? '✓' : '✗'} reward ${fmt(s.reward)} · ${s.finish} · ${s.turns} turns · ` +
    `${s.tokens} tok (${s.model_tokens} sampled)`;
  if (s.kept !== undefined && s.kept !== null)
    head += g.kind === 'mixed' ? ` · ${s.kept ? 'kept' : 'dropped'} p=${fmt(s.penalty)}` +
      (s.kept ? ` A=${fmt(s.advantage)}` : '') : ' · group dropped';
  box.appendChild(el('div', 'sh', head));
  const bar = el('div', 'mask');
  for (const [, m, n] of s.segments) {
    if (!n) continue;
    const b = el('i', 'b' + m);
    b.style.flexGrow = n;
    b.title = `${n} tokens, mask ${m}`;
    bar.appendChild(b);
  }
  box.appendChild(bar);
  if (s.calls.length) {
    const calls = el('div', 'calls');
    s.calls.forEach((c, i) => {
      const d = el('details');
      d.append(el('summary', ERR.has(c.status) ? 'err' : '', `call ${i + 1}${c.tool ? ' (' + c.tool + ')' : ''}: ${c.status} ${fmt(c.duration)}s`),
               el('pre', '', c.code || '(no code)'));
      if (c.stdin) d.appendChild(el('pre', '', 'stdin: ' + c.stdin));
      calls.appendChild(d);
    });
    box.appendChild(calls);
  }
  const txt = el('pre', 'txt');
  for (const [text, m] of s.segments) txt.appendChild(el('span', 'm' + m, text));
  box.appendChild(txt);
  return box;
}

function fill(sec) {  // build a group's samples: once, when it comes near the viewport or is opened
  if (sec.built) return;
  sec.built = true;
  const g = sec.group, body = sec.querySelector('.gb');
  const p = el('details', 'prompt');
  p.append(el('summary', '', 'prompt'), el('pre', '', g.prompt));
  const row = el('div', 'row');
  for (const s of g.samples) if (pass(s)) row.appendChild(sampleView(g, s));
  body.append(p, row);
}
const seen = new IntersectionObserver(es => es.forEach(e => {
  if (e.isIntersecting) { fill(e.target); seen.unobserve(e.target); }
}), {rootMargin: '600px 0px'});

function render() {
  const list = document.getElementById('groups');
  seen.disconnect();
  list.textContent = '';
  const mine = D.groups.filter(g => g.step === step), all = mine.flatMap(g => g.samples);
  let shown = 0, groups = 0;
  for (const g of mine) {
    const n = g.samples.filter(pass).length, right = g.samples.filter(TEST.correct).length;
    if (!n) continue;
    shown += n; groups += 1;
    const sec = el('section', 'g'), head = el('div', 'gh');
    sec.group = g;
    head.append(`group ${g.group} `);
    if (g.kind) head.append(el('span', 'kind ' + g.kind, g.kind.replace('_', ' ')), ' ');
    const kept = g.kind === 'mixed' ? ` · ${g.samples.filter(TEST.kept).length} kept` : '';
    // a task whose rows have no "answer" column (code, grid, guess) shows no gold: not "gold null"
    const gold = g.answer === null || g.answer === undefined ? '' : `gold ${g.answer} · `;
    head.append(`${right}/${g.samples.length} correct${kept} · ${gold}`, el('b', '', g.question));
    head.onclick = () => { sec.classList.toggle('closed'); fill(sec); };
    sec.append(head, el('div', 'gb'));
    list.appendChild(sec);
    seen.observe(sec);
  }
  document.getElementById('count').textContent = `${shown} of ${all.length} trajectories · ${groups} groups`;
  const kinds = k => mine.filter(g => g.kind === k).length;
  document.getElementById('stats').textContent = (step === null ? 'eval · ' : `step ${step} · `) +
    `${mine.length} prompts × ${mine[0].samples.length} samples` + (!D.rl ? '' : ` · groups: ` +
    `${kinds('mixed')} mixed, ${kinds('all_correct')} all correct, ${kinds('all_wrong')} all wrong ` +
    '(uniform groups are dropped before RoC)');
  for (const b of document.querySelectorAll('#filters button')) {  // each filter's count in this step
    b.textContent = `${b.dataset.f} ${all.filter(TEST[b.dataset.f]).length}`;
    b.classList.toggle('on', active.has(b.dataset.f));
  }
}

const sel = document.getElementById('step');
for (const s of steps) {
  const o = el('option', '', s === null ? 'eval' : `step ${s}`);
  o.value = String(s);
  sel.appendChild(o);
}
sel.value = String(step);
sel.onchange = () => { step = steps.find(s => String(s) === sel.value); render(); };
for (const f of Object.keys(TEST)) {
  if (!D.rl && (f === 'kept' || f === 'dropped')) continue;
  const b = el('button');
  b.dataset.f = f;
  b.onclick = () => { active.has(f) ? active.delete(f) : (active.add(f), active.delete(OTHER[f])); render(); };
  document.getElementById('filters').appendChild(b);
}
render();
// load-to-first-render, for the browser test and the benchmark: after the frame that shows the page
requestAnimationFrame(() => setTimeout(() => { window.firstRender = performance.now(); }));
</script></body></html>
"""

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Write one self-contained HTML page of dumped rollouts.")
    ap.add_argument("path", help="run dir, eval out_dir, or one .jsonl / .jsonl.gz file")
    ap.add_argument("-o", "--out", help="output .html (default: next to the input)")
    args = ap.parse_args()
    if not os.path.exists(args.path):
        sys.exit(f"view error: {args.path} does not exist")
    records, metrics = load(args.path)
    out = args.out or (os.path.join(args.path, "view.html") if os.path.isdir(args.path)
                       else args.path.split(".jsonl")[0] + ".html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(render(records, metrics, f"rollouts · {args.path}"))
    groups = len({(r.get("step"), r["group"]) for r in records})
    print(f"wrote {out}: {len(records)} trajectories, {groups} groups")

"""view.py in a real browser: headless Chromium (Debian's package; `bash run.sh` installs it as root) driven
over the DevTools protocol on a pipe, standard library only. A 2-step tiny RL run dumps its rollouts; the
page shows their counts, a filter click leaves what it should, model text cannot become markup, and a
step of 512 x 32 rollouts renders lazily (its load-to-first-render time is printed: run with -s)."""
import base64
import fcntl
import gzip
import json
import os
import random
import shutil
import subprocess
import time

import pytest

import agent
import view
from test_train import rl, run, sft  # noqa: F401  (sft: the tiny SFT model fixture, reused)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"step", "group", "sample", "question", "answer", "prompt", "segments", "response_ids", "mask", "reward",
        "correct", "pred", "finish", "turns", "tool_calls", "group_kind", "penalty", "kept", "advantage"}


class Browser:
    """Headless Chromium over the DevTools protocol with --remote-debugging-pipe: it reads commands on its
    fd 3 and writes answers and events on its fd 4, each message one JSON object followed by a NUL byte."""

    def __init__(self, tmp):
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:  # a failure, not a skip: the viewer is untested without a browser
            pytest.fail("no chromium on PATH: `apt-get update && apt-get install -y chromium` "
                        "(bash run.sh does it when run as root)")
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()

        def to_fds_3_and_4():  # in the child: dup above 10 first, so dup2 cannot clobber a source fd
            a, b = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, out_w))
            os.dup2(a, 3), os.dup2(b, 4)  # dup2 makes them inheritable; everything else is close-on-exec

        self.proc = subprocess.Popen(
            [exe, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--disable-extensions", f"--user-data-dir={tmp}", "about:blank"],
            preexec_fn=to_fds_3_and_4, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r), os.close(out_w)
        self.buf, self.events, self.last_id, self.session = b"", [], 0, None
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.send(domain + ".enable")
        self.send("Emulation.setDeviceMetricsOverride", width=1500, height=1000, deviceScaleFactor=1,
                  mobile=False)

    def read(self, timeout=60):
        deadline = time.time() + timeout
        while b"\0" not in self.buf:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium stopped answering")
            chunk = os.read(self.out_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, **params):
        self.last_id += 1
        msg = {"id": self.last_id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self.read()
            if m.get("id") == self.last_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self.events.append(m)

    def wait_event(self, method):
        while True:
            for i, m in enumerate(self.events):
                if m.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self.read())

    def open(self, path):
        """Load a file and wait for its first render (window.firstRender); returns wall seconds."""
        self.events.clear()
        t0 = time.perf_counter()
        self.send("Page.navigate", url="file://" + os.path.abspath(path))
        self.wait_event("Page.loadEventFired")
        while self.js("window.firstRender === undefined"):
            time.sleep(0.01)
        return time.perf_counter() - t0

    def js(self, expression):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def text(self, selector):
        return self.js(f"document.querySelector({json.dumps(selector)}).textContent")

    def click(self, selector):
        """A real mouse click at the middle of the element (not element.click())."""
        x, y = self.js(f"(r => [r.x + r.width / 2, r.y + r.height / 2])"
                       f"(document.querySelector({json.dumps(selector)}).getBoundingClientRect())")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path):
        png = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        with open(path, "wb") as f:
            f.write(png)
        return png

    def close(self):
        self.proc.kill()
        self.proc.wait()
        os.close(self.cmd_w), os.close(self.out_r)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()


@pytest.fixture(scope="module")
def tiny_run(sft, tmp_path_factory):  # noqa: F811
    """Two RL steps of the tiny SFT model with every step dumped."""
    d = tmp_path_factory.mktemp("rl") / "run"
    rl(sft, d, "--steps=2", "--dump_every=1")
    return d


def make_page(path, *args):
    out = run("view.py", str(path), *args)
    return out.stdout


def test_dump_is_the_record_of_the_step(tiny_run):
    metrics = [json.loads(line) for line in open(tiny_run / "metrics.jsonl")]
    assert sorted(os.listdir(tiny_run / "rollouts")) == ["step_000001.jsonl.gz", "step_000002.jsonl.gz"]
    kinds = set()
    for m in metrics:
        recs = view.read_records(str(tiny_run / "rollouts" / f"step_{m['step']:06d}.jsonl.gz"))
        assert all(set(r) == KEYS for r in recs) and len(recs) == 4 * 8  # every trajectory, kept or not
        order = [(r["step"], r["group"], r["sample"]) for r in recs]
        assert order == [(m["step"], g, s) for g in range(4) for s in range(8)]
        # the dump agrees with what train_rl.py logged for the step
        assert sum(r["reward"] for r in recs) / len(recs) == pytest.approx(m["rollout/reward"])
        assert sum(len(r["response_ids"]) for r in recs) / len(recs) == pytest.approx(m["rollout/response_len"])
        for g in range(4):
            grp = recs[g * 8:(g + 1) * 8]
            right = sum(r["correct"] for r in grp)
            assert all(r["correct"] == (r["reward"] == 1.0) for r in grp)  # the math task: correct is reward 1
            kind = grp[0]["group_kind"]
            kinds.add(kind)
            assert kind == ("all_correct" if right == 8 else "all_wrong" if right == 0 else "mixed")
            if kind == "mixed":  # RoC keeps G = 4 of the 2G = 8, with group-normalised advantages
                kept = [r for r in grp if r["kept"]]
                assert len(kept) == 4 and all(r["penalty"] is not None for r in grp)
                assert sum(r["advantage"] for r in kept) == pytest.approx(0, abs=1e-5)
                assert all(r["advantage"] is None for r in grp if not r["kept"])
            else:
                assert all(not r["kept"] and r["penalty"] is None and r["advantage"] is None for r in grp)
        for r in recs:  # segments are the response in runs of one mask value, in order
            runs = [seg[1] for seg in r["segments"]]
            assert all(a != b for a, b in zip(runs, runs[1:])) and runs[0] == 1
            assert sum(len(seg[0]) > 0 for seg in r["segments"]) == len(runs)
            assert len(r["mask"]) == len(r["response_ids"]) and r["mask"][0] == 1
            assert (len(runs) > 1) == any(m == 0 for m in r["mask"])
    assert "mixed" in kinds  # otherwise RoC's fields went untested


def test_page_counts_filter_and_screenshot(tiny_run, browser, tmp_path):
    out = make_page(tiny_run, "-o", str(tmp_path / "page.html"))
    assert "wrote" in out and "64 trajectories" in out
    browser.open(tmp_path / "page.html")
    recs = view.read_records(str(tiny_run / "rollouts" / "step_000002.jsonl.gz"))
    n_right = sum(r["reward"] > 0 for r in recs)
    n_err = sum(any(c["status"] in agent.TOOL_ERRORS for c in r["tool_calls"]) for r in recs)
    assert browser.js("document.getElementById('step').value") == "2"  # the last step first
    assert browser.text("#count") == "32 of 32 trajectories · 4 groups"
    buttons = browser.js("[...document.querySelectorAll('#filters button')].map(b => b.textContent)")
    assert f"correct {n_right}" in buttons and f"wrong {32 - n_right}" in buttons
    assert f"tool error {n_err}" in buttons and f"kept {sum(r['kept'] for r in recs)}" in buttons
    # the first groups are built: samples with both kinds of segment, the loss mask drawn
    assert browser.js("document.querySelectorAll('.s').length") > 0
    assert browser.js("document.querySelectorAll('.txt .m0').length") > 0
    assert browser.js("document.querySelectorAll('.mask i.b0').length") > 0
    browser.click("#filters button[data-f=correct]")
    groups = len({r["group"] for r in recs if r["reward"] > 0})
    assert browser.text("#count") == f"{n_right} of 32 trajectories · {groups} groups"
    assert browser.js("[...document.querySelectorAll('.s')].every(s => s.classList.contains('ok'))")
    browser.click("#filters button[data-f=wrong]")  # exclusive with correct: one replaces the other
    assert browser.text("#count").startswith(f"{32 - n_right} of 32")
    browser.click("#filters button[data-f=wrong]")
    png = browser.screenshot(tmp_path / "page.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    # the other step from the selector, and the page asked for nothing but itself
    browser.js("(s => { s.value = '1'; s.onchange(); })(document.getElementById('step'))")
    recs1 = view.read_records(str(tiny_run / "rollouts" / "step_000001.jsonl.gz"))
    assert browser.text("#stats").startswith("step 1 · 4 prompts × 8 samples")
    assert browser.text("#count") == "32 of 32 trajectories · 4 groups"
    assert f"correct {sum(r['reward'] > 0 for r in recs1)}" in browser.js(
        "[...document.querySelectorAll('#filters button')].map(b => b.textContent)")
    urls = [e["params"]["request"]["url"] for e in browser.events
            if e.get("method") == "Network.requestWillBeSent"]
    assert urls == ["file://" + str(tmp_path / "page.html")]
    assert browser.js("document.querySelectorAll('svg.chart polyline').length") == 3  # metrics.jsonl's chart


def synthetic(path, groups, samples, tokens=300, evil=None, seed=0):
    """A dump of one step shaped like train_rl.py's, with realistic text: ~4 chars per token, tool calls."""
    rng = random.Random(seed)
    words = "the of we compute sum = + * ( ) 42 print result x y so mod 1000 check answer".split()
    chunks = [" ".join(rng.choice(words) for _ in range(tokens)) for _ in range(64)]  # sliced per segment
    recs = []
    for g in range(groups):
        question = f"What is {rng.randint(100, 999)} * {rng.randint(100, 999)} mod {rng.randint(7, 97)}?"
        right = [rng.random() < 0.4 for _ in range(samples)]
        kind = "mixed" if 0 < sum(right) < samples else "all_correct" if right[0] else "all_wrong"
        for s in range(samples):
            n_calls, segments, calls, mask = rng.randint(0, 3), [], [], []
            for c in range(n_calls + 1):
                n = tokens // (n_calls + 1) - (40 if c < n_calls else 0)
                segments.append([rng.choice(chunks)[:4 * n], 1])
                mask += [1] * n
                if c < n_calls:
                    status = rng.choice(["ok", "ok", "ok", "error"])
                    output = evil or f"{rng.randint(0, 10**6)}"
                    calls.append({"code": "print(1)", "stdin": "", "status": status, "output": output,
                                  "duration": 0.02})
                    segments.append([f"\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response>", 0])
                    mask += [0] * 40
            recs.append({"step": 7, "group": g, "sample": s, "question": evil or question, "answer": "42",
                         "prompt": "<|im_start|>system\n...", "segments": segments,
                         "response_ids": [5] * len(mask), "mask": mask, "reward": float(right[s]),
                         "finish": rng.choice(["stop"] * 9 + ["length"]),
                         "turns": n_calls + 1, "tool_calls": calls, "group_kind": kind,
                         "penalty": 0.5 if kind == "mixed" else None, "kept": kind == "mixed" and s % 2 == 0,
                         "advantage": 0.1 if kind == "mixed" and s % 2 == 0 else None})
    with gzip.open(path, "wt", compresslevel=1) as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


def test_model_text_and_tool_output_stay_text(browser, tmp_path):
    evil = "</script><script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'> a < b && c > d"
    synthetic(tmp_path / "step_000007.jsonl.gz", 2, 4, tokens=60, evil=evil)
    make_page(tmp_path / "step_000007.jsonl.gz")
    page = open(tmp_path / "step_000007.html").read()
    assert "</script><script>window.pwned" not in page and page.count("</script>") == 2  # the page's own two
    browser.open(tmp_path / "step_000007.html")
    assert browser.js("window.pwned") is None and browser.js("document.querySelectorAll('img').length") == 0
    shown = browser.js("[...document.querySelectorAll('.txt .m0')].map(e => e.textContent).join('')")
    assert evil in shown  # shown as the characters it is made of
    assert evil in browser.text(".gh b")


def test_big_step_renders_lazily(browser, tmp_path):
    # the paper's step: 512 prompts x 32 samples of ~300 tokens; only what is near the viewport is built
    t0 = time.perf_counter()
    recs = synthetic(tmp_path / "big.jsonl.gz", 512, 32)
    t_dump = time.perf_counter() - t0
    make_page(tmp_path / "big.jsonl.gz", "-o", str(tmp_path / "big.html"))
    t_page = time.perf_counter() - t0 - t_dump
    walls, firsts = [], []
    for _ in range(3):  # a shared machine: three loads
        walls.append(browser.open(tmp_path / "big.html"))
        firsts.append(browser.js("window.firstRender"))
    mb = os.path.getsize(tmp_path / "big.html") / 1e6
    print(f"\n16,384 rollouts: dump {t_dump:.1f}s, view.py {t_page:.1f}s, page {mb:.1f} MB; "
          f"load-to-first-render (navigation start -> first frame) {', '.join(f'{f:.0f}' for f in firsts)} ms; "
          f"wall {', '.join(f'{w:.2f}' for w in walls)} s")
    assert browser.text("#count") == "16384 of 16384 trajectories · 512 groups"
    built = browser.js("document.querySelectorAll('.s').length")
    assert 0 < built <= 32 * 8  # a few groups, not 512
    browser.js("window.scrollTo(0, document.body.scrollHeight)")
    for _ in range(100):  # the observer builds the last group once it is in view
        if browser.js("document.querySelector('section.g:last-child').built"):
            break
        time.sleep(0.05)
    assert browser.js("document.querySelector('section.g:last-child .s')") is not None
    n_right = sum(r["reward"] > 0 for r in recs)
    browser.click("#filters button[data-f=correct]")
    assert browser.text("#count").startswith(f"{n_right} of 16384")


def test_eval_page(sft, tmp_path, browser):  # noqa: F811
    run("eval.py", "configs/tiny_eval.py", f"--model_path={sft}/sft", f"--data_path={sft}/data/rl.jsonl",
        f"--out_dir={tmp_path}/ev", "--samples=2", "--limit=3", "--max_response_tokens=96", "--tool_workers=1")
    recs = view.read_records(str(tmp_path / "ev" / "trajectories.jsonl"))  # in the order they finished
    assert sorted((r["group"], r["sample"]) for r in recs) == [(g, s) for g in range(3) for s in range(2)]
    assert all(set(r) == KEYS - {"step", "group_kind"} for r in recs)
    make_page(tmp_path / "ev")
    browser.open(tmp_path / "ev" / "view.html")
    assert browser.text("#count") == "6 of 6 trajectories · 3 groups"
    assert browser.text("#stats") == "eval · 3 prompts × 2 samples"
    assert browser.js("document.querySelector('#filters button[data-f=kept]')") is None  # no RoC in an eval
    assert browser.js("document.querySelectorAll('svg.chart').length") == 0


def test_a_partial_reward_is_shown_beside_the_verdict(browser, tmp_path):
    # a 0.8 (a grid walk with one move too many, 4 of 5 hidden tests) must not look like a 0
    path = tmp_path / "step_000007.jsonl.gz"
    recs = synthetic(path, 1, 2, tokens=60)
    recs[0].update(reward=0.8, correct=False)
    recs[1].update(reward=1.0, correct=True)
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    make_page(path)
    browser.open(tmp_path / "step_000007.html")
    heads = browser.js("[...document.querySelectorAll('.sh')].map(e => e.textContent)")
    assert heads[0].startswith("#0 ✗ reward 0.80 · ") and heads[1].startswith("#1 ✓ reward 1.00 · ")


def test_a_task_without_an_answer_column_shows_no_gold(browser, tmp_path):
    # the grid, guess and code rows have no "answer": their headers read "gold null"
    path = tmp_path / "step_000007.jsonl.gz"
    recs = synthetic(path, 1, 2, tokens=60)
    for r in recs:
        del r["answer"]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    make_page(path)
    browser.open(tmp_path / "step_000007.html")
    header = browser.text(".gh")
    assert "gold" not in header and header.endswith(f" · {recs[0]['question']}"), header


def test_a_run_read_while_its_dump_is_written(tmp_path, capsys):
    # train_rl writes a step's dump as one part a rank (step_*.jsonl.gz.0, ...), then joins them: a run viewed
    # meanwhile, or killed then, holds a part and a cut-short dump; the page shows the complete records
    rollouts = tmp_path / "run" / "rollouts"
    rollouts.mkdir(parents=True)
    recs = synthetic(rollouts / "step_000007.jsonl.gz", 2, 4, tokens=60)
    whole = (rollouts / "step_000007.jsonl.gz").read_bytes()
    (rollouts / "step_000008.jsonl.gz.0").write_bytes(whole[:len(whole) // 2])
    (rollouts / "step_000009.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    records, _ = view.load(str(tmp_path / "run"))
    assert records[:len(recs)] == recs and 0 < len(records) - len(recs) < len(recs)
    assert "step_000009.jsonl.gz is cut short" in capsys.readouterr().err
    # metrics.jsonl of a run still training, read while a row is written: its complete rows
    row = {"step": 7, "rollout/reward": 0.5, "tool/err": 0.0, "rollout/response_len": 60.0}
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row)[:30])
    assert view.load(str(tmp_path / "run"))[1] == [row]
    # a line that is not JSON is named by file and line
    with gzip.open(rollouts / "step_000009.jsonl.gz", "wt") as f:
        f.write(json.dumps(recs[0]) + "\n{not json\n")
    with pytest.raises(SystemExit, match="step_000009.jsonl.gz:2: not valid JSON"):
        view.load(str(tmp_path / "run"))
    # a dump cut before its first record, alone: nothing to show, said so (not a page without a step)
    (rollouts / "step_000009.jsonl.gz").write_bytes(whole[:20])
    with pytest.raises(SystemExit, match="no trajectories in"):
        view.load(str(rollouts / "step_000009.jsonl.gz"))

"""Static-shape decode steps (model.Qwen.static_step, issue 45 item 1) against the eager path: the same tokens,
greedy and sampled, through the whole engine (tool turns, preemption, rows joining and leaving), run eagerly at
fixed shapes ("static") and through inductor ("compile"); the logits of padded buckets against forward_cached's."""
import contextlib
import math

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import data
from model import KVCache, load_model
from rollout import Engine, Request, iter_claim
from test_rollout import QUESTIONS, ForcedTurns, SlowTools, tiny  # noqa: F401 (tiny: the fixture)


def rollouts(path, tok, mode, temperature):
    """12 samples of 6 prompts with two tool turns each, in a pool small enough that rows are preempted: the
    row set changes between decode steps, and tool answers are prefilled into rows that hold tokens"""
    model = load_model(path)
    model.decode_mode = mode
    prompts = [data.render_prompt(tok, q) for q in QUESTIONS[:6]]
    reqs = [Request(prompts[i // 2], key=(1, i // 2, i % 2)) for i in range(12)]
    tools = SlowTools({"print(%d)" % v: 0.0 for v in range(20)})
    engine = Engine(ForcedTurns(model, tok), tok, kv_capacity=640, max_len=320, temperature=temperature, seed=5,
                    sandbox=tools, reserve=0.0, max_rows=12, page_size=4, deterministic=True)
    trajs = {t.key: t for t in engine.run(iter_claim(reqs), 280)}
    assert len(trajs) == 12 and engine.stats["preemptions"] > 0
    return {k: (t.response_ids, t.mask, t.finish, t.turns) for k, t in trajs.items()}, engine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_steps_give_the_eager_tokens(tiny, temperature):
    path, tok, _ = tiny
    eager, _ = rollouts(path, tok, "eager", temperature)
    static, engine = rollouts(path, tok, "static", temperature)
    assert static == eager
    assert all(t == 3 for _, _, _, t in eager.values())  # every row made both tool calls
    # a mode model.py does not know is an error that names it
    with pytest.raises(ValueError, match="decode_mode 'cudagraphs': eager, static, compile or graphs"):
        engine.model.model.decode_mode = "cudagraphs"
        engine.generate([[1, 2, 3]], 2)


def test_graphs_compile_the_step_for_cuda_graphs_with_the_pools_in_place(tiny, monkeypatch):
    """decode_mode "graphs": the static step through torch.compile's CUDA graphs (mode "reduce-overhead", whole:
    fullgraph), every KV pool marked as a static address (a graph writes into it in place). A CPU makes no CUDA
    graphs, so torch.compile is stood in for here by the step itself, run eagerly (bench.py gpu section 3b runs
    the real thing on a device): the arguments it got, the pools' marks, and the eager tokens."""
    path, tok, _ = tiny
    calls = []

    def spy(fn, **kwargs):
        calls.append(kwargs)
        return fn
    monkeypatch.setattr(torch, "compile", spy)
    eager, _ = rollouts(path, tok, "eager", 1.0)
    graphs, engine = rollouts(path, tok, "graphs", 1.0)
    assert graphs == eager
    # made once, on the first static step, for the engine's model
    assert calls == [dict(fullgraph=True, mode="reduce-overhead")]
    pools = [pool for layer in engine.cache.layers for pool in layer]
    assert all(getattr(pool, "_dynamo_static_input_type", None) for pool in pools)
    # each mode its own compiled step, made once: the same model switched to "compile", back, and again
    for mode in ("compile", "graphs", "compile"):
        engine.model.model.decode_mode = mode
        engine.generate([[1, 2, 3]], 2)
    assert calls == [dict(fullgraph=True, mode="reduce-overhead"), dict(fullgraph=True, mode=None)]


@pytest.mark.slow
def test_compiled_steps_give_the_eager_tokens(tiny):
    """inductor on the CPU: the same trajectories, sampled, as the eager path (the compile takes a minute)"""
    path, tok, _ = tiny
    assert rollouts(path, tok, "compile", 1.0)[0] == rollouts(path, tok, "eager", 1.0)[0]


def test_padded_buckets_match_forward_cached(tiny):
    """3 and 5 rows of different lengths (padded to 4 and 8 rows, their pages to a power of two): the logits of
    forward_cached's eager path, the padding rows' tokens only in the spare page, and an eager forward after
    static steps (its rows in the kept gather are stale, gathered again) still right"""
    path, _, _ = tiny
    model = load_model(path)
    g = torch.Generator().manual_seed(0)
    caches = [KVCache(model.cfg, 6, 64, "cpu", torch.float32, page_size=4) for _ in range(2)]
    for cache in caches:
        for r, n in enumerate((5, 17, 9, 30, 2, 12)):
            cache.grow(r, 64)
    seqs = [torch.randint(0, 100, (n,), generator=g) for n in (5, 17, 9, 30, 2, 12)]
    for cache in caches:
        for r, s in enumerate(seqs):
            model.forward_cached(s[None], cache, [r])
    for rows in ([4, 1, 3], [0, 2, 5, 3, 1], [4, 1, 3]):
        ids = torch.randint(0, 100, (len(rows), 1), generator=g)
        out = []
        for mode, cache in zip(("eager", "static"), caches):
            model.decode_mode = mode
            out.append(model.forward_cached(ids, cache, torch.tensor(rows)))
        assert out[0].shape == out[1].shape == (len(rows), 1, model.cfg.vocab_size)
        assert torch.allclose(out[0], out[1], atol=1e-5, rtol=1e-5)
        # an eager forward (two tokens: no static step) reads the same keys in both caches
        model.decode_mode = "eager"
        two = torch.randint(0, 100, (len(rows), 2), generator=g)
        a, b = (model.forward_cached(two, cache, torch.tensor(rows)) for cache in caches)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    # only the padding rows wrote into the spare page (the pool's last); the rows' own pages are alike
    keys = [torch.stack([k for k, _ in cache.layers]) for cache in caches]  # (L, Hkv, pages, ps, hd) each
    assert keys[0][:, :, -1].abs().sum() == 0 < keys[1][:, :, -1].abs().sum()
    assert torch.allclose(keys[0][:, :, :-1], keys[1][:, :, :-1], atol=1e-5)


def test_a_prefill_runs_the_layers_on_its_real_tokens_alone(tiny):
    """issue 45 item 3: rows of different lengths prefilled together (tool answers into rows that hold tokens,
    and prompts) go through the layers packed, (1, N) real tokens with no padding, and each row's logits are those
    of prefilling it alone; the decode step after it reads what the prefill wrote"""
    path, _, _ = tiny
    model = load_model(path)
    g = torch.Generator().manual_seed(1)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    for held in ((0, 0, 0), (9, 3, 14)):  # prompts, then tool answers into rows that hold tokens
        caches = [KVCache(model.cfg, 3, 64, "cpu", torch.float32, page_size=4) for _ in range(2)]
        for cache in caches:
            for r, n in enumerate(held):
                cache.grow(r, 64)
                if n:
                    model.forward_cached(torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(r)),
                                         cache, [r])
        new = [7, 2, 5]
        ids = torch.randint(0, 100, (3, 7), generator=g)
        seen.clear()
        together = model.forward_cached(ids, caches[0], [2, 0, 1], last_only=True,
                                        n_new=[new[r] for r in (2, 0, 1)])
        assert seen == [(1, 14, model.cfg.hidden_size)]  # 5 + 7 + 2 real tokens, no padding
        alone = [model.forward_cached(ids[b:b + 1, :new[r]], caches[1], [r], last_only=True)
                 for b, r in enumerate((2, 0, 1))]
        assert torch.allclose(together, torch.cat(alone), atol=1e-5, rtol=1e-5)
        assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [n + k for n, k in zip(held, new)]
        step = torch.randint(0, 100, (3, 1), generator=g)
        a, b = (model.forward_cached(step, cache, [0, 1, 2]) for cache in caches)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_the_gpu_bench_graphs_section_dry_runs(tmp_path):
    """bench.py gpu's section 3b (eager vs CUDA-graph decode steps) at toy sizes on the CPU, where the static
    steps run eagerly: both sides at each batch, the same tokens, and the first (capturing) run timed apart"""
    import bench
    bench.random_qwen3(str(tmp_path), dry=True)
    rows = bench.gpu_graphs(str(tmp_path), "cpu", True, (1, 3), 8, 6, None, lambda: None)
    assert [(r["batch"], r["side"]) for r in rows] == [(1, "eager"), (1, "static"), (3, "eager"), (3, "static")]
    assert all(r["same_tokens"] == r["rows"] == r["batch"] for r in rows)
    assert all(r["common_prefix"] == 6 for r in rows)  # every row's 6 tokens
    assert [r["first_run_s"] is not None for r in rows] == [False, True, False, True]


class RecordedGraph:
    """A CPU stand-in for torch.cuda.CUDAGraph: the capture records the aten ops a step runs,
    and a replay runs them again on the same tensors, as a graph replays its kernels on the same
    memory. So what a replay does not copy into the graph's own inputs, or a Python decision on
    a value, replays as it was at the capture."""

    def __init__(self):
        self.ops = []  # (op, args, kwargs, outputs) in the order they ran
        self.replays = 0

    def pool(self):
        return None

    def replay(self):
        self.replays += 1
        for op, args, kwargs, out in self.ops:
            again = op(*args, **kwargs)
            for old, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(again)):
                # a view of the memory it wrote is already up to date
                if not torch.is_tensor(old):
                    continue
                if old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                    old.copy_(new)


class Capture(TorchDispatchMode):
    """records each op into a RecordedGraph; an op that waits on the host (.item(), bool of a
    tensor, nonzero, a mask's indexing) or draws random numbers fails, as it would in a CUDA
    graph's capture"""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host = op in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)
        # (SDPA's ops are tagged as seeded, for their dropout: the names say which ops draw)
        random_ops = ("rand", "bernoulli", "multinomial", "normal", "uniform")
        draws = any(word in str(op) for word in random_ops)
        assert not (host or draws), f"{op} in a CUDA graph's capture"
        out = op(*args, **kwargs)
        self.graph.ops.append((op, args, kwargs, out))
        return out


def test_graphed_steps_replay_the_eager_tokens(tmp_path, monkeypatch):
    """bench.py's GraphedSteps (CUDA graphs captured by hand, run only on a GPU) on a CPU
    stand-in for CUDA graphs (RecordedGraph): the same greedy tokens as eager steps, a graph per
    shape (bucket of rows and pages) replayed at every step, no host sync or random draw in a
    capture, and each graph warmed up on the stream that captures it (a lazy initialisation made
    once a stream, as cuBLAS's workspace, must not happen in the capture)"""
    import bench

    class Stream:
        def wait_stream(self, other):
            pass

    default = Stream()
    streams = [default]  # the current stream last
    runs = []  # the stream each of the model's runs (its layers' forwards) ran on
    graphs = []

    @contextlib.contextmanager
    def on_stream(stream):
        streams.append(stream)
        yield
        streams.pop()

    @contextlib.contextmanager
    def capture(graph, pool=None, stream=None):
        assert stream is streams[-1] is not default
        graphs.append(graph)
        with Capture(graph):
            yield
    for name, fake in (("CUDAGraph", RecordedGraph), ("graph", capture), ("Stream", Stream),
                       ("stream", on_stream), ("current_stream", lambda: streams[-1])):
        monkeypatch.setattr(torch.cuda, name, fake)
    bench.random_qwen3(str(tmp_path), dry=True)
    model = load_model(str(tmp_path)).eval()
    run = model.run
    monkeypatch.setattr(model, "run", lambda *a, **kw: runs.append(streams[-1]) or run(*a, **kw))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (8,), generator=g).tolist() for _ in range(3)]
    # pages of 4 tokens: a row's pages cross a power of two (4 to 6, its whole row) while it
    # decodes
    engine = Engine(model, bench.NoStops(), kv_capacity=3 * 21, max_len=21, max_rows=3,
                    page_size=4)
    eager = engine.generate(prompts, 12)
    runs.clear()
    model.decode_mode = "static"
    model.static_step = bench.GraphedSteps(model)
    assert engine.generate(prompts, 12) == eager
    # 3 rows padded to 4, with 4 pages and then 6: two graphs, each replayed at every step of its
    # shape
    assert [graph for graph, _, _ in model.static_step.graphs.values()] == graphs
    assert len(graphs) == 2
    assert sum(graph.replays for graph in graphs) == 11
    # the prompts' prefill on the default stream; each graph's warm-up run, then its capture, on
    # one side stream
    assert runs[0] is default and len(runs) == 5 and default not in runs[1:]
    assert runs[1] is runs[2] and runs[3] is runs[4]


def test_the_gpu_bench_graphs_section_keeps_its_time_budget_and_saves_each_batch(tmp_path):
    """section 3b past its deadline begins no compiled side, each skipped a row that says so (a
    compile a shape and batch can outlast a lent GPU's command), while the sides without a compile
    still run, and it hands its rows so far to save after each batch (the JSON report), so a run
    killed in its last batch keeps the others"""
    import bench
    bench.random_qwen3(str(tmp_path), dry=True)
    saved = []
    rows = bench.gpu_graphs(str(tmp_path), "cpu", True, (1, 2), 8, 4, None, lambda: None,
                            deadline=-math.inf, save=lambda rows: saved.append(list(rows)),
                            others=("static", "compile"))
    assert [(r["batch"], r["side"], "skipped" in r) for r in rows] == [
        (1, "compile", True), (1, "eager", False), (1, "static", False),
        (2, "compile", True), (2, "eager", False), (2, "static", False)]
    assert saved == [rows[:3], rows]


def test_the_memory_bench_runs_at_14b_shapes():
    """bench.py mem: a 14B decoder layer and the chunked output layer under FakeTensorMode (shapes, no data); it
    passed False for chunk_logprobs' entropy list and crashed in the output layer's part."""
    import bench
    peaks = bench.mem_bench(tokens=2048)
    assert peaks["output layer, 1,024-token chunks"]["temp"] > 0
    assert peaks["decoder layer, recomputed in its backward"]["act"] > 0

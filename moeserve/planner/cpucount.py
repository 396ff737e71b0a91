"""What one compiled decode step of the CPU engine runs, counted by class (planner/cpucheck.py prices them).

A dispatch mode cannot run inside compiled graphs, so the count comes from torch.profiler's event tree of
one real compiled step, plus the inductor kernels and the graphs' C++ helpers (neither of which the profiler
sees on CPU) counted by wrapping the loaded graphs' module globals for that step. Classes, each with its own
per-call cost:
- lookup: dynamo's cache lookups in the step (guard evaluation over every weight a graph reads, timed per
  lookup on the engine's own layers: lookup_seconds). The engine's decode graphs skip it once warm
  (engine/compiled_decode.DirectGraphs calls the entry dynamo picked directly), so a steady step has none;
- graph: graph runs (the entry's code past the lookup: DirectGraphs' dispatch, dynamo's transformed
  bytecode, AOT's wrappers, the graph's call());
- kernel: inductor's fused C++ kernels inside the graphs;
- helper: the graphs' calls of dynamo's C++ helpers (GRAPH_HELPERS: size / stride asserts, allocations,
  reinterpreted views; a MoE layer's graph runs ~60, the profiler shows none);
- opaque: calls of our custom ops from a graph (layers/opaque.py, the packed linear's op);
- gemm: GEMM calls (extern GEMMs in the graphs, those inside opaque ops and around the forward), also
  counted by kernel class (KERNELS: the Linears' op, the fused MoE, the per-head batched GEMM), each of which
  cpucheck prices at its own measured streaming rate and fixed cost;
- attention: decode attention kernel calls (MLA's SDPA flash call: its FLOPs are in the cost model's
  roofline at the measured kernel rate, each call's fixed cost here);
- view: metadata-only ops (views, allocations): ~1 us, not the cost of an op that computes;
- op: every other outermost aten op (inside opaque ops, extern ops in graphs).
The compiled step is counted inside the model forward (FORWARD); what the step runs around it is priced whole,
per step (planner/cpucheck.measure_host_rows).
"""
from __future__ import annotations

import re
import time
from collections import Counter

CLASSES = ("lookup", "graph", "kernel", "helper", "opaque", "gemm", "attention", "view", "op")

GEMM_OPS = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "_int_mm", "_grouped_mm",
            "qlinear_pointwise", "_linear_pointwise",  # linear stays whole under inference_mode
            "zentorch_linear_unary", "zentorch_fused_moe",  # AMD CPUs with zentorch (layers/moe/zen.py)
            "cpu_fused_moe", "fused_experts_cpu",  # vLLM's AMX fused MoE (layers/moe/amx.py)
            "int8_scaled_mm_with_quant",  # vLLM's AMX INT8 GEMM (layers/amx_linear.py)
            "onednn_mm", "bmm_cpu")  # vLLM's BF16 GEMMs (layers/onednn_linear.py, attention/mla_bmm.py)

# The GEMM kernel classes a step's GEMM calls fall in, each streaming weights at a rate of its own (planner/cpucheck.py
# measures one per class, on the op the engine runs for it): routed experts' fused MoE calls, per-head batched
# products (MLA's absorbed W_UK / W_UV: vLLM's `bmm_cpu`, else aten's bmm), and every other GEMM op ("linear":
# the Linears' kernel op, the LM head, aten mm's)
MOE_OPS = ("zentorch_fused_moe", "cpu_fused_moe", "fused_experts_cpu")
BMM_OPS = ("bmm_cpu", "bmm", "baddbmm")
KERNELS = ("linear", "moe", "bmm")


def gemm_kernel_class(op: str) -> str:
    """The kernel class (KERNELS) of a GEMM op counted in the gemm class (GEMM_OPS), by its name."""
    return "moe" if op in MOE_OPS else "bmm" if op in BMM_OPS else "linear"


# The decode attention kernel (layers/attention/mla.py _decode); eager dispatch sees the flash op SDPA picks;
# BF16 decode over the paged cache runs vLLM's kernel (layers/attention/mla_kernel.py)
ATTENTION_OPS = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "decode_attention_cpu")

# No data touched: tensor metadata or an allocation (profile: planner/cpuprofile.measure_view_cost)
VIEW_OPS = frozenset((
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "as_strided_", "slice", "select",
    "narrow", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "split", "split_with_sizes",
    "unbind", "chunk", "alias", "detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view_as", "contiguous", "resize_",
    "result_type"))

_OP = re.compile(r"^(\w+)::(\w+)")
GRAPH_LOOKUP = "TorchDynamo Cache Lookup"  # one per call through dynamo; DirectGraphs' direct calls have none
GRAPH_RUN = "## Call CompiledFxGraph"  # one per graph run, through dynamo or called directly


def classify(events) -> Counter:
    """Counts per class over profiler events (objects with .name, .cpu_parent, .cpu_children). An op is
    counted when no enclosing event is an op, or the nearest enclosing op is ours (moeserve::, an opaque op
    whose insides run eagerly); ops an op issues internally (aten::linear's mm) belong to it. `to` is a view
    when it converts nothing; one that copies shows an aten::_to_copy child."""
    counts = Counter({c: 0 for c in CLASSES})
    for e in events:
        c = event_class(e)
        if c:
            counts[c] += 1
    return counts


def gemm_kernels(events) -> tuple[Counter, dict]:
    """The GEMM calls classify counts, split by kernel class (gemm_kernel_class): (calls per class, their
    profiled ms per class, a diagnostic), every class in KERNELS present (0 where the step runs none)."""
    counts, ms = Counter({k: 0 for k in KERNELS}), dict.fromkeys(KERNELS, 0.0)
    for e in events:
        if event_class(e) == "gemm":
            k = gemm_kernel_class(_OP.match(e.name).group(2))
            counts[k] += 1
            ms[k] += e.cpu_time_total / 1e3
    return counts, ms


def event_class(e) -> str | None:
    """The class an event is counted in (classify), None when it is not counted on its own."""
    if e.name.startswith(GRAPH_RUN):
        return "graph"
    if e.name == GRAPH_LOOKUP:
        return "lookup"
    m = _OP.match(e.name)
    if not m:
        return None
    ns, op = m.groups()
    if ns == "moeserve":
        return "opaque"
    outer = _enclosing_op(e)
    if outer is not None and not outer.name.startswith("moeserve::"):
        return None
    if op == "to":
        return "op" if any(c.name == "aten::_to_copy" for c in e.cpu_children) else "view"
    return ("gemm" if op in GEMM_OPS else "attention" if op in ATTENTION_OPS else "view" if op in VIEW_OPS
            else "op")


def profiled_ms(events) -> dict:
    """Where the profiled step's time went, per class (a diagnostic beside the prediction, never an input to
    it; the profiler adds ~1 us per event): counted ops their whole time; `lookup` dynamo's cache lookups;
    `graph` whatever of the graph runs and their wrappers (dynamo's region, or a direct call's pre-graph
    bytecode and AOT prologue) is not a counted op (wrappers, fused kernels); `opaque` what our ops spend
    outside the ops they issue (their Python); `python` the step's time outside every event (engine Python)."""
    out = dict.fromkeys([c for c in CLASSES if c not in ("kernel", "helper")] + ["python"], 0.0)
    roots = []
    for e in events:
        # the forward's range is no work of its own: its children are roots
        if e.name != FORWARD and (e.cpu_parent is None or e.cpu_parent.name == FORWARD):
            roots.append(e)
        c = event_class(e)
        if c in ("lookup", "gemm", "attention", "view", "op"):
            out[c] += e.cpu_time_total
        elif c in ("graph", "opaque"):
            out[c] += e.cpu_time_total - _counted_inside(e)
        elif e.name.startswith(GRAPH_WRAPPERS) and not _inside_graph(e):
            out["graph"] += e.cpu_time_total - _counted_inside(e)
    if roots:
        span = max(e.time_range.end for e in roots) - min(e.time_range.start for e in roots)
        out["python"] = span - sum(e.cpu_time_total for e in roots)
    return {c: v / 1e3 for c, v in out.items()}


# A graph run's wrapper events: dynamo's region around its run, or, on a direct call, the entry's pre-graph
# bytecode and AOT's prologue beside the graph's call
GRAPH_WRAPPERS = ("Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher")


def _inside_graph(e) -> bool:
    """Whether a graph run or a wrapper of one encloses e (its time is then in that one's)."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(GRAPH_RUN) or p.name.startswith(GRAPH_WRAPPERS):
            return True
        p = p.cpu_parent
    return False


def _counted_inside(e) -> float:
    """Time of the counted events (opaque ones whole) directly or indirectly inside e."""
    total = 0.0
    for c in e.cpu_children:
        total += c.cpu_time_total if event_class(c) else _counted_inside(c)
    return total


def _enclosing_op(e):
    parent = e.cpu_parent
    while parent is not None and not _OP.match(parent.name):
        parent = parent.cpu_parent
    return parent


# The range count_compiled_step marks around the model forward (engine/model_runner.ModelRunner.forward): the
# step's ops are counted inside it; what the step runs outside it (scheduler, input preparation, the LM head and
# sampler, outputs) is priced whole, per step (planner/cpucheck.measure_host_rows)
FORWARD = "moeserve.cpucheck.forward"


def inside_forward(events) -> list:
    """The events inside the FORWARD range (the range itself left out)."""
    def inside(e):
        p = e.cpu_parent
        while p is not None:
            if p.name == FORWARD:
                return True
            p = p.cpu_parent
        return False
    return [e for e in events if inside(e)]


class wrapping_forward:
    """Runs engine.runner.forward inside `around()` (a context manager made per call: a profiler range, a timer)
    while active (an instance attribute, removed on exit)."""

    def __init__(self, runner, around) -> None:
        self.runner, self.around = runner, around

    def __enter__(self) -> None:
        forward = self.runner.forward

        def wrapped(*args, **kwargs):
            with self.around():
                return forward(*args, **kwargs)
        self.runner.forward = wrapped

    def __exit__(self, *exc) -> None:
        del self.runner.forward


def count_compiled_step(engine) -> tuple[Counter, dict, Counter, dict]:
    """(counts per class, profiled ms per class, GEMM calls per kernel class, their profiled ms per kernel
    class) of one engine step (runs the step), which must be a decode step through the graphs. Counts and
    kernel classes cover the model forward only (the step's host work outside it is priced per step: the LM
    head's bytes stay in the cost model's roofline); the profiled ms (a diagnostic) the whole step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    graphs = engine.runner.decode_graphs
    assert graphs is not None, "the engine runs its decode eagerly"
    before = graphs.steps
    with capturing_kernels() as kernels, capturing_helpers() as helpers, wrapping_forward(engine.runner, lambda: record_function(FORWARD)), \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    assert graphs.steps == before + 1, "the step did not go through the decode graphs"
    events = prof.events()
    forward = inside_forward(events)
    counts = classify(forward)
    counts["kernel"] = len(kernels)
    counts["helper"] = len(helpers)
    return (counts, profiled_ms(events)) + gemm_kernels(forward)


class capturing_kernels:
    """Records (kernel, args) for every call of the fused C++ kernels of every loaded inductor graph while
    active (a graph's call() looks its kernels up as module globals, so a wrapper there sees each call)."""

    def _wanted(self, name: str) -> bool:
        return name.startswith("cpp_fused_")

    def __enter__(self) -> list:
        from torch._inductor.codecache import PyCodeCache

        self.calls, self.saved = [], []
        for mod in PyCodeCache.modules:
            for name, fn in list(vars(mod).items()):
                if self._wanted(name) and callable(fn):
                    self.saved.append((mod, name, fn))
                    setattr(mod, name, self._wrap(fn))
        return self.calls

    def _wrap(self, fn):
        def recorded(*args):
            self.calls.append((fn, args))
            return fn(*args)
        return recorded

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self.saved):
            setattr(mod, name, fn)


# Dynamo's C++ helpers a generated graph's call() runs beside its kernels and ops, bound as module globals
# (torch._C._dynamo.guards): no dispatcher, no profiler event. ~0.4-0.5 us a call on this CPU.
GRAPH_HELPERS = ("assert_size_stride", "assert_alignment", "empty_strided_cpu", "reinterpret_tensor")


class capturing_helpers(capturing_kernels):
    """Records (helper, args) for every call of GRAPH_HELPERS by every loaded inductor graph while active."""

    def _wanted(self, name: str) -> bool:
        return name in GRAPH_HELPERS


def without_lookup(fn, args: tuple):
    """The code dynamo runs for fn(*args) once its cache lookup has picked a compiled entry (the entry's
    transformed bytecode, which calls the graph), as a plain function: timing it against fn itself gives
    the lookup's cost (guard evaluation, torch.compile's wrapper) on a real call."""
    from moeserve.engine.compiled_decode import compiled_entry

    entry = compiled_entry(fn, args)
    if entry is None:
        raise RuntimeError(f"no compiled entry of {fn.__name__} takes these arguments")
    return entry[0]


def lookup_seconds(engine, rows: int, repeats: int = 20) -> float:
    """Seconds one dynamo cache lookup takes before a decode layer's graph runs (guard evaluation over every
    weight the layer's graph reads, torch.compile's wrapper), at `rows` decode rows: the mean over the
    engine's layers of the best call through dynamo (the layer function torch.compile'd, as DirectGraphs
    calls it on a key's first call) minus the best call of the same graph without the lookup
    (without_lookup), on the engine's own layers over padding rows (as its warm-up runs them: no metadata
    rows, nothing written). The price of each lookup a step counts (a warm step through DirectGraphs has
    none: what they save)."""
    import torch

    from moeserve.engine import compiled_decode
    from moeserve.layers.attention.metadata import AttentionMetadata, attention_context

    graphs = engine.runner.decode_graphs
    through_dynamo = getattr(graphs._layer, "compiled", graphs._layer)  # DirectGraphs' torch.compile'd function
    body = graphs.model.model  # the decoder stack: embedding, then the layers the graphs run
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), [], None, engine.runner.kv_caches)
    total = 0.0
    with torch.inference_mode(), attention_context(meta):  # the engine's mode: guards check inference tensors
        pos = torch.zeros(graphs.bucket(rows), dtype=torch.long)
        x = body.embed_tokens(pos)  # the layers' input: [bucket, hidden] in the model dtype
        for layer in body.layers:
            args = (layer, x, pos)
            direct = without_lookup(compiled_decode._run_layer, args)
            best = [float("inf"), float("inf")]
            for _ in range(5):  # more rounds while a loaded machine hides the lookup in the calls' noise
                for _ in range(repeats):  # interleaved, so both see the same machine
                    for i, fn in enumerate((through_dynamo, direct)):
                        t = time.perf_counter()
                        fn(*args)
                        best[i] = min(best[i], time.perf_counter() - t)
                if best[0] > best[1]:
                    break
            total += max(0.0, best[0] - best[1])
    return total / len(body.layers)

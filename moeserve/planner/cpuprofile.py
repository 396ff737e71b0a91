"""The CPU check's profile of this machine (planner/cpucheck.py predicts the engine's decode step from it).

Measured here with torch, one thread by default: read bandwidth (float32 sum over 256 MB, best of 5, reported),
the bandwidth and fixed cost of weight streaming through BF16 GEMMs (one row through the kernel op of the
engine's own Linear, packed for the kernel the engine runs, over a pool of distinct weight matrices larger than
the caches, at 0.5 MB and 8 MB per matrix: t = fixed + bytes / bw, best of 5; StreamingProbe keeps the pools
to time them again between the engine's measured steps), the same two terms for each
other GEMM kernel class the engine's step runs (cpucount.KERNELS: the routed experts' fused MoE where one runs
here, zentorch's or vLLM's AMX one, one row through 1 and 8 cold experts a call; MLA's absorbed products,
vLLM's bmm_cpu or aten's bmm, one row through cold [16 and 64 heads, C, dn] matrices), the BF16 GEMM rate
(1024^3, reported) and at a decode shape (64 x 1024 x 1024, used), the cost of one small eager op (Python +
dispatcher, over a mix of tiny linear/softmax/topk/index/cat ops), of a view, of a trivial compiled graph's
run and kernel, of the graphs' helpers and of a trivial custom op, and decode MLA attention as the engine runs
it (its FLOP rate, the cost model's mla_tflops, and its fixed cost a call). profile() returns them all.
"""
from __future__ import annotations

import time

import torch

from moeserve.perf.models import load_model
from moeserve.planner import cpucount


def measure_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Bytes/s read by a float32 sum (memory-bound; a BF16 sum would be convert-bound)."""
    x = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32)
    best = min(timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best


def measure_gemm(n: int = 1024, dtype=torch.bfloat16, repeats: int = 3) -> float:
    """FLOP/s of an n^3 matmul."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up: kernel selection, page faults
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best


def linear_pools(pool_mb: int = 256) -> tuple[list[list], tuple[float, float]]:
    """Two pools of one-row BF16 GEMM calls over cold weights (decode's weight reads) and the bytes a call reads:
    0.5 and 8 MB matrices, distinct ones totalling `pool_mb`, so the weights come from DRAM as in a decode step (a
    repeated single matrix would be served from cache); two sizes separate the fixed per-call cost (kernel setup,
    packing) from the streaming rate (StreamingProbe fits t = fixed + bytes / bw). The weights are the engine's
    own BF16 Linear's, packed for the kernel it runs (oneDNN or zentorch), and the call is that kernel's op alone
    (gemm_kernel): what a step's profile counts as one GEMM call (the module's own Python, ~5 us a call here, is
    not in that op: the step counts and prices it as views and opaque calls). The two sizes are made interleaved (16 small matrices, one large, ...), so both lie in the same stretches of memory:
    made one pool after the other, each took memory of its own, whose rate here differed by up to 30% between
    the two (0.5 MB matrices alone 14.8-21.2 GB/s over four pools in one process, 8 MB 18.6-22.1), and the fit's
    fixed cost moved with it (14.6-29.1 us; interleaved, 17.7-20.5)."""
    from moeserve.layers.linear import Linear

    def kernel(rows: int, cols: int):
        layer = Linear(cols, rows).to(torch.bfloat16)
        with torch.no_grad():
            layer.weight.normal_()
        layer.process_weights_after_loading()
        return gemm_kernel(layer)

    small, large = (256, 1024), (4096, 1024)
    per = large[0] // small[0]  # small matrices a large one's bytes
    x = torch.randn(1, small[1]).to(torch.bfloat16)
    pools = [[], []]
    for _ in range(max(4, pool_mb * (1 << 20) // (large[0] * large[1] * 2))):
        pools[0] += [kernel(*small) for _ in range(per)]
        pools[1].append(kernel(*large))
    pools = [[lambda w=w: w(x) for w in ws] for ws in pools]
    return pools, (2 * small[0] * small[1], 2 * large[0] * large[1])


def _sweep(pools: list[list]) -> list[float]:
    """Mean seconds a call in each pool, one pass over each, the pools one after the other."""
    return [timed(lambda: [f() for f in calls]) / len(calls) for calls in pools]


def _fit(times: list[float], nbytes: tuple[float, float]) -> tuple[float, float]:
    """t = fixed + bytes / bw through two (bytes, seconds a call) points: (bw, fixed)."""
    (t_small, t_large), (b_small, b_large) = times, nbytes
    bw = (b_large - b_small) / max(t_large - t_small, 1e-9)
    return bw, max(0.0, t_small - b_small / bw)


def moe_pools(pool_mb: int = 192, ks: tuple[int, int] = (1, 8)) -> tuple[list[list], tuple, list] | None:
    """Two pools of calls of the routed experts' fused MoE kernel as the engine runs it (one call per MoE layer:
    zentorch's `zentorch_fused_moe` on AMD CPUs with zentorch, vLLM's `cpu_fused_moe` on Intel CPUs with AMX and
    the library; layers/moe/experts.FusedExperts picks, as for the engine's layers), the bytes a call reads and
    the expert layers behind them (free them with free_moe_pools); None where no fused kernel runs here (the
    experts' GEMMs are then Linear-class calls). One row through `ks[0]` and `ks[1]` distinct experts a call, the
    bench model's expert shapes, over layers of experts totalling `pool_mb` (larger than the caches; each call
    reads experts no other call of its sweep reads), fitted as the Linear's (linear_pools)."""
    from moeserve.layers.moe.experts import FusedExperts

    m = load_model("moeserve-bench")
    h, inter, e = m.hidden_size, m.moe_intermediate_size, m.n_routed_experts
    expert_bytes = 3 * h * inter * 2
    layers = []
    for _ in range(max(2, pool_mb * (1 << 20) // (e * expert_bytes))):
        experts = FusedExperts(e, h, inter).to(torch.bfloat16)
        with torch.no_grad():
            experts.w13.normal_(std=0.02)
            experts.w2.normal_(std=0.02)
        experts.process_weights_after_loading()
        if not experts.fused:
            return None
        layers.append(experts)
    x = torch.randn(1, h).to(torch.bfloat16)

    def pool(k: int) -> list:
        weights = torch.full((1, k), 1.0 / k)
        return [moe_kernel(experts, x, torch.arange(start, start + k, dtype=torch.int32)[None], weights)
                for experts in layers for start in range(0, e - k + 1, k)]

    return [pool(k) for k in ks], tuple(k * expert_bytes for k in ks), layers


def free_moe_pools(built: tuple) -> None:
    """Free moe_pools' experts now: a zentorch layer's finalizer flushes every reordered weight
    (zen.flush_cache), which must not land in the engine's measured steps later (each of its experts
    reordered again)."""
    import gc

    built[0].clear()
    built[2].clear()
    gc.collect()


def moe_kernel(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """() -> the fused MoE op the engine's FusedExperts issues for these rows (its `fused` kernel: layers/moe/
    zen.py or amx.py), called on arguments made beforehand, without the wrapper's conversions and output
    allocation (the step counts those as views and ops): what a step's profile counts as one GEMM call."""
    out = torch.empty_like(x)
    if experts.fused == "amx":
        w13, w2 = experts.fused_weights
        return lambda: (torch.ops._C.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, False, "silu", "amx"),
                        out)[1]
    return lambda: (torch.ops.zentorch.zentorch_fused_moe(out, x, experts.w13, experts.w2, None, None, weights, ids,
                                                          False, "silu"), out)[1]


def bmm_pools(pool_mb: int = 256) -> tuple[list[list], tuple[float, float]]:
    """Two pools of calls of MLA decode's per-head products with the absorbed matrices as the engine runs them
    (layers/attention/mla.py absorb_query: vLLM's `bmm_cpu` on the packed matrix where mla_bmm applies, else
    aten's weight-first bmm), one row, over distinct matrices larger than the caches: the bench model's W_UK
    shape [H, C, dn] and one with 4x the heads; and the bytes a call reads."""
    from moeserve.layers.attention import mla_bmm

    m = load_model("moeserve-bench")
    c, dn = m.kv_lora_rank, m.qk_nope_head_dim

    sizes = (m.num_attention_heads, 4 * m.num_attention_heads)
    qs = [torch.randn(1, heads, dn).to(torch.bfloat16) for heads in sizes]

    def call(i: int):
        w = (torch.randn(sizes[i], c, dn) * 0.02).to(torch.bfloat16)
        return bmm_kernel(w, mla_bmm.pack(w), qs[i])

    pools = [[], []]  # made interleaved (4 small, one large, ...): both in the same memory (linear_pools)
    for _ in range(max(4, pool_mb * (1 << 20) // (sizes[1] * c * dn * 2))):
        pools[0] += [call(0) for _ in range(sizes[1] // sizes[0])]
        pools[1].append(call(1))
    return pools, tuple(2.0 * hd * c * dn for hd in sizes)


class StreamingProbe:
    """The GEMM kernel classes' weight-streaming pools (linear_pools, moe_pools where a fused MoE runs here,
    bmm_pools), kept to be swept again between the engine's measured steps (cpucheck.run_check; one sweep
    before each timed step), so that a batch is priced at the rates of the sweeps timed between its own steps,
    as many as its steps, in the same minutes. The Linear's and the bmm's pools are made `instances` times,
    each a third of the size, and a kernel's rate is that of its median instance: on this VM a pool's rate is
    a property of the memory it was given (four pools made one after another in one process: 20.6 / 24.5 /
    24.4 / 24.7 GB/s). A sweep passes once over every pool, each kernel's two sizes one after the other;
    rates(tag) fits each instance through the best mean call time of each of its two pools over the sweeps
    recorded under `tag`."""

    KEYS = {"linear": ("gemm_stream_gbs", "gemm_call_us"), "moe": ("moe_stream_gbs", "moe_call_us"),
            "bmm": ("bmm_stream_gbs", "bmm_call_us")}

    def __init__(self, instances: int = 3) -> None:
        self.pools = {"linear": [], "bmm": []}  # kernel class -> [(two pools of calls, bytes a call reads)]
        for _ in range(instances):  # the two classes' instances made alternately: spread over more memory
            self.pools["linear"].append(linear_pools(256 // instances))
            self.pools["bmm"].append(bmm_pools(256 // instances))
        self._moe = moe_pools()
        if self._moe is not None:
            self.pools["moe"] = [self._moe[:2]]
        self.sweeps: dict = {}
        self.sweep(None)  # each call once: kernels that reorder a weight on its first call have done so

    def sweep(self, tag=None) -> None:
        """One pass over every pool, recorded under `tag` (None: not recorded, a warm-up: the first pass after
        the engine loads its weights, which flushes zentorch's cache, reorders the pool's experts again)."""
        with torch.inference_mode():
            times = {k: [_sweep(pools) for pools, _ in inst] for k, inst in self.pools.items()}
        if tag is not None:
            self.sweeps.setdefault(tag, []).append(times)

    def fits(self, tag) -> dict:
        """{kernel class: [(bytes/s, seconds a call) per instance]} from the sweeps under `tag`."""
        sweeps = self.sweeps[tag]
        return {k: [_fit([min(s[k][j][i] for s in sweeps) for i in range(2)], nbytes)
                    for j, (_, nbytes) in enumerate(inst)] for k, inst in self.pools.items()}

    def rates(self, tag) -> dict:
        """The profile's streaming keys (GB/s, us per call per kernel class: its median instance by rate) from
        the sweeps under `tag`, and "stream_sweeps": how many."""
        out = {"stream_sweeps": len(self.sweeps[tag])}
        for k, fits in self.fits(tag).items():
            bw, fixed = sorted(fits)[len(fits) // 2]
            out.update({self.KEYS[k][0]: bw / 1e9, self.KEYS[k][1]: fixed * 1e6})
        return out

    def close(self) -> None:
        """Free the pools (the MoE's through free_moe_pools)."""
        if self._moe is not None:
            free_moe_pools(self._moe)
            self._moe = None
        self.pools.clear()


def bmm_kernel(w: torch.Tensor, packed: torch.Tensor | None, q: torch.Tensor):
    """() -> the GEMM op MLA's absorb_query issues for q [B, H, dn] and W_UK w [H, C, dn]: vLLM's bmm_cpu on
    the packed matrix (its output [B, H, C] made beforehand, returned), or aten's bmm ([H, C, B])."""
    if packed is None:
        qt = q.permute(1, 2, 0)
        return lambda: torch.bmm(w, qt)
    out = q.new_empty(q.shape[0], q.shape[1], w.shape[1])
    ot, qt = out.transpose(0, 1), q.transpose(0, 1)
    return lambda: (torch.ops._C.bmm_cpu(ot, qt, packed, True, None), out)[1]


def gemm_kernel(layer):
    """x -> the GEMM op the engine's BF16 Linear issues for its packed weight, called without the module's
    Python (its getattr's, reshape and view): vLLM's library's oneDNN matmul where it is installed
    (layers/onednn_linear.py), zentorch's on AMD CPUs with zentorch, PyTorch's oneDNN packed linear, else
    F.linear."""
    handle = getattr(layer, "weight_onednn", None)
    if handle is not None:  # the op writes into an output made beforehand (the step counts that as a view)
        outputs = {}

        def onednn(x):
            out = outputs.get(x.shape[0])
            if out is None:
                out = outputs[x.shape[0]] = x.new_empty(x.shape[0], layer.out_features)
            torch.ops._C.onednn_mm(out, x, None, handle)
            return out
        return onednn
    packed = getattr(layer, "weight_packed", None)
    if packed is not None:
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    packed = getattr(layer, "weight_zen", None)
    if packed is not None:
        return lambda x: torch.ops.zentorch.zentorch_linear_unary(x, packed, None, is_weight_prepacked=True)
    return lambda x: torch.nn.functional.linear(x, layer.weight)


def measure_decode_gemm(m: int = 64, k: int = 1024, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of F.linear at a decode-sized shape (small M: packing and threading dominate on CPU)."""
    x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
    torch.nn.functional.linear(x, w)
    best = min(timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(repeats))
    return 2 * m * k * n / best


# The decode context the check runs at (measure_engine: a 128-token prompt, then ~11 tokens in over 16 steps)
CHECK_CONTEXT = 139


def measure_mla_decode(context: int = CHECK_CONTEXT, rows: tuple[int, int] = (1, 16),
                       repeats: int = 5, reps: int = 20) -> tuple[float, float]:
    """(FLOP/s, seconds per call) of decode MLA attention as the engine runs it (layers/attention/mla.py
    _decode: SDPA's flash kernel, each row's heads the queries of one KV head over its latent context under
    a boolean mask), on the bench model's dims at `context` tokens: two row counts, timed interleaved, give
    the rate (FLOPs counted as the cost model counts them: perf/cost.mla_decode) and the fixed cost a call
    (t = fixed + flops / rate)."""
    import torch.nn.functional as F

    m = load_model("moeserve-bench")
    heads, width = m.num_attention_heads, m.kv_lora_rank + m.qk_rope_head_dim
    calls, flops = [], []
    for b in rows:
        q = torch.randn(b, 1, heads, width).to(torch.bfloat16)
        kv = torch.randn(b, 1, context, width).to(torch.bfloat16)
        mask = torch.ones(b, 1, 1, context, dtype=torch.bool)
        calls.append(lambda q=q, kv=kv, mask=mask: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask,
                                                                                   scale=0.1))
        flops.append(2.0 * b * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * context)
    best = [float("inf")] * len(rows)
    with torch.inference_mode():
        for f in calls:
            f()
        for _ in range(repeats):  # interleaved, so both see the same machine
            for i, f in enumerate(calls):
                best[i] = min(best[i], timed(lambda: [f() for _ in range(reps)]) / reps)
    rate = (flops[1] - flops[0]) / max(best[1] - best[0], 1e-9)
    return rate, max(0.0, best[0] - flops[0] / rate)


def measure_op_cost(reps: int = 200) -> float:
    """Seconds per small eager op, over the mix a decode step issues on tiny tensors
    (linear, softmax, topk, index, cat, elementwise): launch/dispatch cost, not data."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(64, 64).to(torch.bfloat16)
    idx = torch.tensor([1, 0])

    def mix():  # 8 ops
        y = torch.nn.functional.linear(x, w)
        p = torch.softmax(y.float(), -1)
        v, i = torch.topk(p, 2)
        z = y.index_select(0, idx)
        return torch.cat([z, y]).mul_(2).add_(1)

    mix()
    return min(timed(lambda: [mix() for _ in range(reps)]) for _ in range(3)) / (8 * reps)


def measure_view_cost(reps: int = 200) -> float:
    """Seconds per metadata-only op (views, an allocation): the compiled step's cheapest ops, ~1 us where a
    computing op costs several."""
    x = torch.randn(4, 64).to(torch.bfloat16)

    def mix():  # 8 ops
        y = x.view(2, 2, 64).permute(1, 0, 2).reshape(4, 64)
        return y[1:], y.select(0, 0).unsqueeze(0), y.transpose(0, 1), torch.empty(4, 64)

    with torch.inference_mode():
        mix()
        return min(timed(lambda: [mix() for _ in range(reps)]) for _ in range(3)) / (8 * reps)


def _trivial_layer(module, t):
    return module(t) * 2 + 1


def measure_graph_costs(reps: int = 200) -> tuple[float, float]:
    """(seconds per run of a compiled graph past its lookup, seconds per fused kernel call in it), on a
    trivial graph compiled and called as the engine compiles and calls its decode layers
    (engine/compiled_decode.DirectGraphs: inductor, fullgraph, static shapes, inference mode; after the first
    call the entry dynamo picked is called directly, without the lookup) that runs one elementwise kernel,
    and the kernel itself directly with the arguments the graph gave it. The run's price leaves out its
    kernel and its C++ helper calls (counted and priced on their own: measure_helper_cost). Dynamo's lookup,
    where a step still pays one, is priced on the engine's own layers (cpucount.lookup_seconds)."""
    import torch._dynamo

    from moeserve.engine.compiled_decode import DirectGraphs

    x = torch.randn(4, 64).to(torch.bfloat16)
    module = torch.nn.Identity()
    graph = DirectGraphs(_trivial_layer)
    torch._dynamo.config.recompile_limit += 1  # room for it beside the engine's graphs
    with torch.inference_mode():
        graph(module, x)  # through dynamo: compiles, and keeps the entry for direct calls
        with cpucount.capturing_kernels() as calls, cpucount.capturing_helpers() as helpers:
            graph(module, x)
        if graph.direct_calls != 1:
            raise RuntimeError("the trivial graph was not called directly (DirectGraphs found no entry)")
        assert len(calls) == 1, f"expected one fused kernel, the graph ran {len(calls)}"
        fn, args = calls[0]
        t_run = min(timed(lambda: [graph(module, x) for _ in range(reps)]) for _ in range(3)) / reps
        t_kernel = min(timed(lambda: [fn(*args) for _ in range(reps)]) for _ in range(3)) / reps
    return max(0.0, t_run - t_kernel - len(helpers) * measure_helper_cost()), t_kernel


def measure_helper_cost(reps: int = 200) -> float:
    """Seconds per call of the C++ helpers a generated graph's call() runs (cpucount.GRAPH_HELPERS), over a
    mix in a MoE layer graph's proportions (35 size / stride asserts, 10 allocations, 14 reinterpreted views
    there): 7 asserts, 2 allocations, 3 reinterprets."""
    g = torch._C._dynamo.guards
    x = torch.randn(16, 1024).to(torch.bfloat16)
    assert_size_stride, empty, reinterpret = g.assert_size_stride, g._empty_strided_cpu, g._reinterpret_tensor

    def mix():  # 12 calls
        for _ in range(7):
            assert_size_stride(x, (16, 1024), (1024, 1), "input")
        for _ in range(2):
            empty((16, 1024), (1024, 1), torch.bfloat16)
        for _ in range(3):
            reinterpret(x, (16, 64, 16), (1024, 16, 1), 0)

    with torch.inference_mode():
        mix()
        return min(timed(lambda: [mix() for _ in range(reps)]) for _ in range(3)) / (12 * reps)


_PROBE = None


def measure_opaque_cost(reps: int = 200) -> float:
    """Seconds a graph's call of one of our ops (layers/opaque.py define_op, as the packed linear's) adds to the
    work inside it: such an op around torch.empty_like against torch.empty_like itself."""
    global _PROBE
    if _PROBE is None:
        from moeserve.layers.opaque import define_op

        @define_op("cpucheck_probe", "(Tensor t) -> Tensor", lambda t: torch.empty_like(t))
        def _probe(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(t)
        _PROBE = _probe
    x = torch.randn(4, 64).to(torch.bfloat16)
    op = torch.ops.moeserve.cpucheck_probe
    with torch.inference_mode():
        op(x)
        t_op = min(timed(lambda: [op(x) for _ in range(reps)]) for _ in range(3)) / reps
        t_in = min(timed(lambda: [torch.empty_like(x) for _ in range(reps)]) for _ in range(3)) / reps
    return max(0.0, t_op - t_in)


def timed(fn) -> float:
    """Seconds one call of fn takes (wall clock)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def profile(threads: int | None = None, probe: StreamingProbe | None = None, repeats: int = 5) -> dict:
    """This machine's profile. The GEMM kernels' streaming terms are the best of `repeats` sweeps of `probe`
    (recorded under "profile"; a probe made and freed here when none is given)."""
    if threads is not None:
        torch.set_num_threads(threads)
    own = probe is None
    probe = probe or StreamingProbe()
    try:
        for _ in range(repeats):
            probe.sweep("profile")
        stream = probe.rates("profile")  # no moe keys where no fused MoE kernel runs here: no such class
    finally:
        if own:
            probe.close()
    entry, kernel = measure_graph_costs()
    mla_rate, mla_call = measure_mla_decode()
    return {"threads": torch.get_num_threads(), "mem_bw_gbs": measure_bandwidth() / 1e9, **stream,
            "gemm_bf16_gflops": measure_gemm() / 1e9, "gemm_decode_gflops": measure_decode_gemm() / 1e9,
            "op_cost_us": measure_op_cost() * 1e6, "view_us": measure_view_cost() * 1e6,
            "graph_entry_us": entry * 1e6, "kernel_us": kernel * 1e6,
            "graph_helper_us": measure_helper_cost() * 1e6, "opaque_call_us": measure_opaque_cost() * 1e6,
            "mla_decode_gflops": mla_rate / 1e9, "mla_call_us": mla_call * 1e6}

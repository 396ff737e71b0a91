"""The CPU check: the planner's cost model on a device built from a CPU profile, plus what one decode step
runs (counted by class: planner/cpucount.py) at measured per-call costs."""
from types import SimpleNamespace

import pytest

from moeserve.planner import cpucheck, cpucount, cpuprofile

PROF = {"threads": 1, "mem_bw_gbs": 12.0, "gemm_stream_gbs": 10.0, "gemm_call_us": 30.0,
        "gemm_bf16_gflops": 1000.0, "gemm_decode_gflops": 500.0, "op_cost_us": 10.0, "view_us": 1.0,
        "graph_entry_us": 20.0, "kernel_us": 1.0, "graph_helper_us": 0.5, "opaque_call_us": 3.0,
        "mla_call_us": 8.0}


def test_eager_prediction_is_roofline_plus_gemm_calls_and_ops():
    p = cpucheck.predict(PROF, batch=1, context=128, counts={"gemm": 100, "op": 900})
    assert p["overhead_ms"] == pytest.approx(100 * 0.030 + 900 * 0.010)  # GEMM calls x 30 us + 900 ops x 10 us
    assert p["step_ms"] == pytest.approx(p["roofline_ms"] + p["overhead_ms"])
    # batch 1 is weight-streaming bound: ~active BF16 weights / 10 GB/s (bench model ~190M active+head)
    assert 20 < p["roofline_ms"] < 80
    # weights stream at the GEMM rate, not the plain read rate
    faster_read = cpucheck.predict({**PROF, "mem_bw_gbs": 50.0}, 1, 128, {"gemm": 100, "op": 900})
    assert faster_read["roofline_ms"] == pytest.approx(p["roofline_ms"])


def test_compiled_prediction_prices_each_class_and_the_lookups():
    counts = {"lookup": 4, "graph": 8, "kernel": 100, "helper": 400, "opaque": 24, "gemm": 110, "view": 500,
              "op": 300}
    p = cpucheck.predict(PROF, batch=1, context=128, counts=counts, lookup_us=150.0)
    # 4 x 150 + 8 x 20 + 100 x 1 + 400 x 0.5 + 24 x 3 + 110 x 30 + 500 x 1 + 300 x 10 us
    assert p["by_class_ms"] == pytest.approx({"lookup": 0.6, "graph": 0.16, "kernel": 0.1, "helper": 0.2,
                                              "opaque": 0.072, "gemm": 3.3, "view": 0.5, "op": 3.0})
    assert p["overhead_ms"] == pytest.approx(7.932)
    assert p["step_ms"] == pytest.approx(p["roofline_ms"] + 7.932)
    assert p["roofline_ms"] == pytest.approx(cpucheck.predict(PROF, 1, 128)["roofline_ms"])


def test_a_step_without_lookups_pays_none():
    """The engine's DirectGraphs call a layer's entry directly once dynamo picked it: a warm step has no
    lookup event, and the lookup's measured price (what a call through dynamo would cost) adds nothing.
    Before, the lookup was timed on the layers and added per step whatever the step ran."""
    counts = {"lookup": 0, "graph": 8, "kernel": 100, "opaque": 24, "gemm": 110, "view": 500, "op": 300}
    p = cpucheck.predict(PROF, batch=1, context=128, counts=counts, lookup_us=150.0)
    assert p["by_class_ms"]["lookup"] == 0 and p["overhead_ms"] == pytest.approx(7.132)


class Ev:
    """A profiler event as classify and profiled_ms read it (times in us)."""

    def __init__(self, name, *children, total=0.0, start=0.0):
        self.name, self.cpu_parent, self.cpu_children = name, None, list(children)
        self.cpu_time_total = total
        self.time_range = SimpleNamespace(start=start, end=start + total)
        for c in children:
            c.cpu_parent = self

    def walk(self):
        yield self
        for c in self.cpu_children:
            yield from c.walk()


def test_classify_counts_outermost_ops_and_the_insides_of_ours():  # a step through dynamo's lookup
    roots = [
        Ev("TorchDynamo Cache Lookup"),
        Ev("Torch-Compiled Region: 0/1", Ev("## Call CompiledFxGraph f0 ##",
           Ev("moeserve::packed_linear", Ev("mkldnn::_linear_pointwise")),  # opaque + its GEMM
           Ev("moeserve::mla_attention",
              Ev("aten::view"),
              Ev("aten::bmm", Ev("aten::empty")),  # the bmm's own allocation belongs to it
              Ev("aten::to", Ev("aten::_to_copy", Ev("aten::copy_"))),  # a conversion: one op
              Ev("aten::to"),  # converts nothing: a view
              Ev("aten::scaled_dot_product_attention", Ev("aten::_scaled_dot_product_flash_attention_for_cpu"))),
           Ev("aten::mm"),  # an extern GEMM in the graph
           Ev("aten::topk"))),
        Ev("aten::index", Ev("aten::reshape", Ev("aten::view"))),  # around the forward
        Ev("aten::linear", Ev("aten::t"), Ev("aten::mm")),
        Ev("aten::empty"),
    ]
    events = [e for r in roots for e in r.walk()]
    counts = cpucount.classify(events)
    assert counts == {"lookup": 1, "graph": 1, "kernel": 0, "helper": 0, "opaque": 2, "gemm": 4, "attention": 1,
                      "view": 3, "op": 3}


def direct_layer_call(graph="f0"):
    """A layer's graph as DirectGraphs runs it once warm (torch 2.x profile): no lookup or compiled region,
    the entry's pre-graph bytecode and AOT's prologue beside the graph's call."""
    return [Ev("Pregraph bytecode", total=5), Ev("AOTDispatcher Runtime Wrapper Prologue", total=3),
            Ev(f"## Call CompiledFxGraph {graph} ##", Ev("moeserve::packed_linear", Ev("mkldnn::_linear_pointwise",
               total=40), total=45), Ev("aten::empty", total=1), total=60)]


def test_direct_graph_calls_count_runs_and_no_lookups():
    roots = direct_layer_call("f0") + direct_layer_call("f1") + [Ev("aten::argmax", total=10)]
    counts = cpucount.classify([e for r in roots for e in r.walk()])
    assert counts == {"lookup": 0, "graph": 2, "kernel": 0, "helper": 0, "opaque": 2, "gemm": 2, "attention": 0,
                      "view": 2, "op": 1}
    got = cpucount.profiled_ms([e for r in roots for e in r.walk()])
    # graph: the wrappers beside each call (5 + 3 us) + the call less its counted events (60 - 45 - 1)
    assert got["graph"] == pytest.approx(2 * (8 + 14) / 1e3) and got["lookup"] == 0
    assert got["opaque"] == pytest.approx(2 * 5 / 1e3)


def test_profiled_breakdown_splits_the_step_by_class():
    roots = [
        Ev("TorchDynamo Cache Lookup", total=100, start=0),
        Ev("Torch-Compiled Region: 0/1", Ev("## Call CompiledFxGraph f0 ##",
           Ev("moeserve::mla_attention", Ev("aten::bmm", total=150), Ev("aten::view", total=1), total=400),
           Ev("aten::mm", total=50), total=950), total=1000, start=100),
        Ev("aten::argmax", total=80, start=1200),  # 100 us of Python before it, outside every event
    ]
    got = cpucount.profiled_ms([e for r in roots for e in r.walk()])
    assert got.pop("attention") == 0
    # graph: the region less the counted ops in it (our op whole, the mm); our op: less its ops
    assert got == pytest.approx({"lookup": 0.1, "graph": (1000 - 400 - 50) / 1e3, "opaque": (400 - 150 - 1) / 1e3,
                                 "gemm": 0.2, "view": 0.001, "op": 0.08, "python": 0.1})


def test_host_work_is_priced_per_step_and_the_graphs_python_per_graph_run():
    """Issue 41: what the step does outside the model forward (whose ops the counts leave out) is added once a
    step, the forward's Python beyond its counted calls per graph run; both only with counts."""
    counts = {"lookup": 4, "graph": 8, "kernel": 100, "helper": 400, "opaque": 24, "gemm": 110, "view": 500,
              "op": 300}
    p = cpucheck.predict(PROF, batch=1, context=128, counts=counts, lookup_us=150.0, host_us=900.0,
                         graph_python_us=400.0)
    assert p["by_class_ms"]["host"] == pytest.approx(0.9)
    assert p["by_class_ms"]["graph_python"] == pytest.approx(8 * 0.4)
    assert p["overhead_ms"] == pytest.approx(7.932 + 0.9 + 3.2)  # the classes as before, + 0.9 + 8 x 0.4
    bare = cpucheck.predict(PROF, 1, 128, host_us=900.0, graph_python_us=400.0)  # nothing counted
    assert "host" not in bare["by_class_ms"] and bare["overhead_ms"] == pytest.approx(0)


def test_host_prices_from_the_host_models_rows():
    """host_us: the host model's best step less its forward, less its LM head's weights at the Linear's rate;
    graph_python_us: its forward less its own counted calls at the profile's prices, per graph run."""
    counts = {"lookup": 0, "graph": 8, "kernel": 100, "helper": 400, "opaque": 24, "gemm": 110, "view": 500,
              "op": 300}
    priced = 7.332  # 8 x 20 + 100 x 1 + 400 x 0.5 + 24 x 3 + 110 x 30 + 500 x 1 + 300 x 10 us (test above)
    row = {"batch": 1, "context": 128, "counts": counts, "lookup_us": 150.0, "gemm_kernels": None,
           "forward_ms": priced + 3.2, "host_ms": 1.5}
    got = cpucheck.host_prices(PROF, [row])
    head_us = 2 * 32000 * cpucheck.HOST_CONFIG["hidden_size"] / (PROF["gemm_stream_gbs"] * 1e3)  # 409.6
    assert got == {1: pytest.approx({"host_us": 1500 - head_us, "graph_python_us": 400.0})}
    # its decode attention's FLOPs at the profile's MLA rate come out too: 2 x 1 row x 16 heads x (2 x 32 + 32)
    # x 128 tokens x 8 layers = 3.15 MFLOP at 10 GFLOP/s = 0.315 ms, 39.3 us a graph run
    mla = cpucheck.host_prices({**PROF, "mla_decode_gflops": 10.0}, [row])[1]["graph_python_us"]
    assert mla == pytest.approx(400.0 - 2 * 16 * 96 * 128 * 8 / 10e9 * 1e6 / 8)
    # a forward no slower than its counted calls leaves nothing to price
    assert cpucheck.host_prices(PROF, [{**row, "forward_ms": 7.0}])[1]["graph_python_us"] == 0


def test_a_failing_host_model_leaves_its_terms_out(monkeypatch):
    """Where the host model's engine cannot run (a kernel library refusing its widths), the check goes on
    without the two terms: the prediction as before them."""
    def fail(*args, **kwargs):
        raise RuntimeError("no kernel for these widths")
    monkeypatch.setattr(cpucheck, "measure_engine", fail)
    monkeypatch.setattr(cpucheck, "host_checkpoint", lambda: "unused")
    with pytest.warns(UserWarning, match="host model"):
        assert cpucheck.measure_host_rows([1]) == []


def test_the_step_is_counted_inside_the_forward():
    """The step's ops outside the model forward (sampler, inputs) are not counted (host_us prices them); the
    forward's range itself is no work of the profiled breakdown's (its Python outside events stays python)."""
    roots = [
        Ev("aten::tensor", total=10, start=0),  # the runner's inputs
        Ev(cpucount.FORWARD, *direct_layer_call("f0"), total=100, start=20),
        Ev("aten::linear", Ev("aten::mm"), total=30, start=130),  # the LM head
        Ev("aten::argmax", total=10, start=170),
    ]
    events = [e for r in roots for e in r.walk()]
    counts = cpucount.classify(cpucount.inside_forward(events))
    assert counts == {"lookup": 0, "graph": 1, "kernel": 0, "helper": 0, "opaque": 1, "gemm": 1, "attention": 0,
                      "view": 1, "op": 0}
    assert cpucount.gemm_kernels(cpucount.inside_forward(events))[0] == {"linear": 1, "moe": 0, "bmm": 0}
    whole = cpucount.profiled_ms(events)
    # span 180 us: 10 + 30 + 10 outside the forward, the layer's events inside it (direct_layer_call)
    inside = sum(e.cpu_time_total for e in direct_layer_call("f0"))
    assert whole["python"] == pytest.approx((180 - 50 - inside) / 1e3)


def test_decode_attention_at_its_measured_rate_and_call_cost():
    """Decode MLA runs at the attention kernel's measured rate (the cost model's mla_tflops), not the GEMM
    rate, and each kernel call at its measured fixed cost: a slow kernel predicts a slower step, by about its
    FLOPs at that rate at batch 16 (16 rows x 16 heads of scores), by little at batch 1."""
    counts = {"gemm": 100, "attention": 8, "op": 300}
    slow = {**PROF, "mla_decode_gflops": 50.0}
    p16, base16 = (cpucheck.predict(p, 16, 139, counts) for p in (slow, PROF))
    p1, base1 = (cpucheck.predict(p, 1, 139, counts) for p in (slow, PROF))
    assert p16["by_class_ms"]["attention"] == pytest.approx(8 * PROF["mla_call_us"] * 1e-3)
    # bench model: 8 layers x 2 x 16 rows x 16 heads x (2 x 256 + 64) x 139 FLOPs = 5.2 ms at 50 GFLOP/s;
    # at the GEMM rate (500) the same attention took at most its KV read (~0.26 ms a layer at 10 GB/s)
    mla_ms = 1e3 * 8 * 2 * 16 * 16 * 576 * 139 / 50e9
    assert mla_ms - 8 * 0.3 < p16["roofline_ms"] - base16["roofline_ms"] <= mla_ms
    assert 0 < p1["roofline_ms"] - base1["roofline_ms"] < 0.35


def test_streaming_probe_fits_each_kernel_through_the_best_sweep_of_each_pool():
    """t = fixed + bytes / bw through each pool's best mean call time over the sweeps of one tag (another tag's
    sweeps, e.g. the profile's, do not count), per pool instance; a kernel's rate is its median instance's:
    hand-computed."""
    probe = object.__new__(cpuprofile.StreamingProbe)
    probe.pools = {"linear": [(None, (1e6, 9e6))] * 3, "bmm": [(None, (2e6, 4e6))]}
    # linear instances: best 60 / 460 us -> 8 MB in 400 us = 20 GB/s, 60 - 1 MB / 20 GB/s = 10 us (the median);
    # 8 MB in 200 us = 40 GB/s + 55 us; 8 MB in 800 us = 10 GB/s + 0 us. bmm: best 30 / 50 us -> 2 MB in
    # 20 us = 100 GB/s, 30 - 20 = 10 us
    probe.sweeps = {4: [{"linear": [[70e-6, 460e-6], [80e-6, 280e-6], [100e-6, 900e-6]], "bmm": [[30e-6, 55e-6]]},
                        {"linear": [[60e-6, 500e-6], [85e-6, 300e-6], [110e-6, 900e-6]], "bmm": [[35e-6, 50e-6]]}],
                    "profile": [{"linear": [[1e-6, 2e-6]] * 3, "bmm": [[1e-6, 2e-6]]}]}
    got = probe.rates(4)
    assert got == pytest.approx({"stream_sweeps": 2, "gemm_stream_gbs": 20.0, "gemm_call_us": 10.0,
                                 "bmm_stream_gbs": 100.0, "bmm_call_us": 10.0})
    assert [bw / 1e9 for bw, _ in probe.fits(4)["linear"]] == pytest.approx([20.0, 40.0, 10.0])
    assert "moe_stream_gbs" not in got  # no fused MoE pool here: no such class


def test_each_batch_is_priced_at_the_sweeps_between_its_own_steps(monkeypatch):
    """Measuring, run_check times the GEMM kernels' streaming again before each timed step and prices each batch
    at the rates of its own sweeps; the prediction at the profile's rates (timed before the steps) stays as a
    diagnostic."""
    rates = {1: 20.0, 4: 5.0}

    class Probe:
        def __init__(self):
            self.tags = []

        def sweep(self, tag=None):
            self.tags.append(tag)

        def rates(self, tag):
            return {"gemm_stream_gbs": rates[tag], "stream_sweeps": self.tags.count(tag)}

        def fits(self, tag):
            return {"linear": [(rates[tag] * 1e9, 0.0)]}

        def close(self):
            pass

    def measure(batches, eager=False, probe=None):
        rows = []
        for b in batches:
            probe.sweep(None)
            for _ in range(3):
                probe.sweep(b)
            rows.append({"batch": b, "context": 128.0, "counts": None, "lookup_us": 0.0, "gemm_kernels": None,
                         "ops_per_step": 0, "gemms_per_step": 0, "measured_ms": 50.0})
        return rows

    monkeypatch.setattr(cpuprofile, "StreamingProbe", Probe)
    monkeypatch.setattr(cpucheck, "profile", lambda threads, probe: dict(PROF))
    monkeypatch.setattr(cpucheck, "measure_engine", measure)
    monkeypatch.setattr(cpucheck, "measure_host_rows", lambda batches: [])
    res = cpucheck.run_check([1, 4], measure=True)
    for r in res["rows"]:
        b = r["batch"]
        assert r["stream_sweeps"] == 3 and r["kernel_rates"]["linear"][0] == rates[b]
        assert r["stream_instances_gbs"] == {"linear": [rates[b]]}
        assert r["predicted_ms"] == pytest.approx(cpucheck.predict({**PROF, "gemm_stream_gbs": rates[b]}, b,
                                                                   128.0)["step_ms"], abs=1e-3)
        assert r["predicted_profile_rates_ms"] == pytest.approx(cpucheck.predict(PROF, b, 128.0)["step_ms"],
                                                                abs=1e-3)
    assert res["profile"]["gemm_stream_gbs"] == PROF["gemm_stream_gbs"]


def test_faster_profile_predicts_faster():
    slow = cpucheck.predict(PROF, 4, 128, {"gemm": 50, "op": 450})["step_ms"]
    fast = cpucheck.predict({**PROF, "gemm_stream_gbs": 20.0, "op_cost_us": 5.0}, 4, 128,
                            {"gemm": 50, "op": 450})["step_ms"]
    assert fast < slow


def test_profile_measures_positive_rates():
    prof = cpuprofile.profile()
    assert prof["mem_bw_gbs"] > 0.1 and prof["gemm_bf16_gflops"] > 1 and prof["op_cost_us"] > 0
    assert prof["gemm_stream_gbs"] > 0.1 and prof["gemm_call_us"] >= 0
    assert prof["view_us"] > 0 and prof["graph_entry_us"] >= 0 and prof["kernel_us"] > 0
    assert prof["opaque_call_us"] >= 0 and prof["graph_helper_us"] > 0
    assert prof["mla_decode_gflops"] > 0.1 and prof["mla_call_us"] >= 0
    # a rate per GEMM kernel class present here: the absorbed products' always (bmm_cpu or aten's bmm), the
    # fused MoE's where a fused kernel runs (zentorch's, vLLM's AMX one)
    from moeserve.layers.moe import amx, zen
    assert prof["bmm_stream_gbs"] > 0.1 and prof["bmm_call_us"] >= 0
    assert ("moe_stream_gbs" in prof) == (zen.available() or amx.available())
    if "moe_stream_gbs" in prof:
        assert prof["moe_stream_gbs"] > 0.1 and prof["moe_call_us"] >= 0


def test_graph_helpers_are_counted_where_the_profiler_sees_none():
    """A generated graph's call() checks sizes and strides, allocates and reinterprets buffers through
    dynamo's C++ helpers, which emit no profiler event: capturing_helpers counts each call (a MoE layer's
    graph runs ~60), and the trivial graph's run price leaves its own helpers out (priced per call)."""
    import torch

    def f(t):
        return (t * 2 + 1).sum(0)

    x = torch.randn(4, 64)
    g = torch.compile(f, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        g(x)
        with cpucount.capturing_helpers() as helpers, torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            g(x)
        g(x)  # the graph's own helpers again after the wrappers are gone
    names = {fn.__name__ for fn, _ in helpers}
    assert names and names <= {"assert_size_stride", "assert_alignment", "_empty_strided_cpu", "_reinterpret_tensor"}
    assert not any("assert_size_stride" in e.name or "empty_strided" in e.name for e in prof.events())


def test_the_measured_side_runs_outside_the_repo(tmp_path):
    """Issue 32: the check imported benchmarks.common from the working directory, which the wheel does not
    ship, so `profile-cpu --measure` failed anywhere but in a checkout. Here from an empty directory with no
    benchmarks/ importable, on a small bench-style model."""
    import json
    import os
    import subprocess
    import sys

    script = f"""
import importlib.util, json
assert importlib.util.find_spec("benchmarks") is None, "benchmarks/ is importable: not a test of the wheel"
from moeserve.bench_model import BENCH_CONFIG, bench_checkpoint
from moeserve.planner.cpucheck import measure_engine
small = {{**BENCH_CONFIG, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}}
path = bench_checkpoint({str(tmp_path / "bench")!r}, small)
class Probe:  # as cpuprofile.StreamingProbe: swept before each timed step
    tags = []
    def sweep(self, tag=None):
        self.tags.append(tag)
probe = Probe()
rows = measure_engine([2], prompt_len=8, steps=2, checkpoint=path, probe=probe)  # compiled: the default
assert probe.tags == [None, 2, 2], probe.tags  # a warm-up, then one before each timed step
rows += measure_engine([2], prompt_len=8, steps=2, checkpoint=path, eager=True)
from moeserve.planner.cpucheck import host_prices
cold = measure_engine([2], prompt_len=8, steps=2, checkpoint=path, flush_mb=4)  # as measure_host_rows runs it
prof = {{"gemm_stream_gbs": 10.0, "gemm_call_us": 30.0, "op_cost_us": 10.0, "view_us": 1.0, "graph_entry_us": 20.0,
        "kernel_us": 1.0, "graph_helper_us": 0.5, "opaque_call_us": 3.0, "mla_call_us": 8.0,
        "mem_bw_gbs": 12.0, "gemm_bf16_gflops": 1000.0, "gemm_decode_gflops": 500.0, "threads": 1}}
rows += [cold[0], host_prices(prof, cold)[2]]
print(json.dumps(rows))
"""
    # without the suite's MOESERVE_ENFORCE_EAGER, as a user runs it: the engine compiles its decode graphs,
    # under which the eager op counter failed ("found no compiled frames"); the compiled step is counted from
    # a profile of one real step
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOESERVE_ENFORCE_EAGER")}
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    compiled, eager, cold, host = json.loads(r.stdout.strip().splitlines()[-1])
    # each timed step split at the model forward, the host model's on cold caches (measure_host_rows), and the
    # prices it gives: the step's work outside the forward, the forward's Python per graph run
    for row in compiled, cold:
        assert 0 < row["forward_ms"] < row["measured_ms"] and row["host_ms"] > 0
    assert set(host) == {"host_us", "graph_python_us"} and host["host_us"] > 0 and host["graph_python_us"] >= 0
    for row in compiled, eager:
        assert row["batch"] == 2 and row["measured_ms"] > 0 and row["gemms_per_step"] > 0
        # the GEMM calls split by kernel class, every call in one
        assert set(row["gemm_kernels"]) == {"linear", "moe", "bmm"}
        assert sum(row["gemm_kernels"].values()) == row["gemms_per_step"]
    c = compiled["counts"]
    # one graph run per decoder layer, called directly (DirectGraphs): no dynamo lookup in a warm step, though
    # one is priced (timed on the layers); fused kernels, our ops
    assert c["graph"] == 2 and c["lookup"] == 0 and compiled["lookup_us"] > 0
    assert c["kernel"] > 0 and c["helper"] > c["graph"] and c["opaque"] >= 2
    assert set(eager["counts"]) == {"gemm", "attention", "op"} and eager["lookup_us"] == 0
    # one MLA decode kernel (SDPA) per layer, either way
    assert c["attention"] == 2 and eager["counts"]["attention"] == 2
    # the graphs take most of the eager step's small ops
    assert c["op"] + c["view"] < eager["counts"]["op"]


def test_gemm_price_times_the_linears_own_kernel_op():
    """The profile prices a GEMM call by the op a step's profile counts as one (a oneDNN matmul here),
    not the Linear module around it (its Python is counted and priced as views / opaque calls): the op
    gemm_kernel calls computes what the engine's Linear computes, and is the GEMM class's op."""
    import torch

    from moeserve.layers.linear import Linear

    layer = Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
    layer.process_weights_after_loading()
    x = torch.randn(3, 64).to(torch.bfloat16)
    kernel = cpuprofile.gemm_kernel(layer)
    with torch.inference_mode():
        assert torch.equal(kernel(x), layer(x))  # (vLLM's library's matmul: its output made on this first call)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            kernel(x)
    counts = cpucount.classify(prof.events())
    assert counts["gemm"] == 1 and counts["view"] + counts["op"] == 0


# Issue 41 on AMD Zen 4: a streaming rate per GEMM kernel class (the Linears' op, the fused MoE, MLA's absorbed bmm)
KERNEL_PROF = {**PROF, "moe_stream_gbs": 5.0, "moe_call_us": 10.0, "bmm_stream_gbs": 20.0, "bmm_call_us": 4.0}


def test_each_gemm_kernel_streams_its_bytes_at_its_own_rate():
    """Hand-computed, batch 1 of the bench model (weight-streaming bound: every GEMM's FLOPs at 500 GFLOP/s are far
    under its bytes' time): the routed experts' bytes (7 MoE layers x the cost model's expected distinct experts
    of 6 draws from 64, 64 (1 - (63/64)^6) = 5.77, x 3 x 1024 x 256 BF16 weights = 63.36 MB) move from the
    Linear's 10 GB/s to the fused MoE's 5, MLA's absorbed matrices (8 layers x 16 heads x 256 x (128 + 128)
    BF16 = 16,777,216 B) to the bmm's 20; each class's calls pay its own fixed cost."""
    counts = {"gemm": 83, "op": 100}
    kernels = {"linear": 60, "moe": 7, "bmm": 16}
    p = cpucheck.predict(KERNEL_PROF, 1, 139, counts, kernels=kernels)
    base = cpucheck.predict(KERNEL_PROF, 1, 139, counts)  # uncounted kernels: every GEMM at the Linear's rate
    assert p["by_class_ms"]["gemm"] == pytest.approx((60 * 30 + 7 * 10 + 16 * 4) * 1e-3)  # 1.934 ms
    assert base["by_class_ms"]["gemm"] == pytest.approx(83 * 30 * 1e-3)
    routed, absorbed = 7 * 64 * (1 - (63 / 64) ** 6) * 3 * 1024 * 256 * 2, 16_777_216
    assert p["gemm_mb"]["moe"] == pytest.approx(routed / 1e6, rel=0.01)  # + the rows' activations
    assert p["gemm_mb"]["bmm"] == pytest.approx(absorbed / 1e6, rel=0.01)
    expected = 1e3 * (routed * (1 / 5e9 - 1 / 10e9) + absorbed * (1 / 20e9 - 1 / 10e9))  # 6.336 - 0.839 ms
    assert p["roofline_ms"] - base["roofline_ms"] == pytest.approx(expected, rel=0.01)
    assert p["step_ms"] == pytest.approx(p["roofline_ms"] + p["overhead_ms"])
    assert sum(p["gemm_mb"].values()) == pytest.approx(sum(base["gemm_mb"].values()))  # the same bytes, split


def test_a_kernel_class_the_step_or_the_profile_lacks_takes_the_linears_rate():
    """Intel / oneDNN machines: no fused MoE measured (the experts' GEMMs are Linear-class calls), or a step that
    runs no call of a class: that class's bytes and calls are priced as the Linear's, which is the prediction
    without kernel classes; and at equal rates the per-kernel pricing is the cost model's own."""
    counts = {"gemm": 83, "op": 100}
    base = cpucheck.predict(PROF, 4, 139, counts)
    no_moe = {k: v for k, v in KERNEL_PROF.items() if not k.startswith("moe_")}
    p = cpucheck.predict({**no_moe, "bmm_stream_gbs": 10.0, "bmm_call_us": 30.0}, 4, 139, counts,
                         kernels={"linear": 67, "moe": 0, "bmm": 16})
    assert p["step_ms"] == pytest.approx(base["step_ms"])
    p = cpucheck.predict(KERNEL_PROF, 4, 139, counts, kernels={"linear": 83, "moe": 0, "bmm": 0})
    assert p["step_ms"] == pytest.approx(base["step_ms"])
    assert cpucheck.kernel_rates(no_moe, {"moe": 7, "bmm": 16}) == {
        "linear": (10.0, 30.0), "moe": (10.0, 30.0), "bmm": (20.0, 4.0)}


def test_gemm_calls_are_split_by_kernel_class():
    roots = [Ev("## Call CompiledFxGraph f0 ##",
                Ev("moeserve::fused_experts", Ev("zentorch::zentorch_fused_moe", total=300)),
                Ev("moeserve::mla_attention", Ev("_C::bmm_cpu", total=20), Ev("aten::bmm", total=30)),
                Ev("zentorch::zentorch_linear_unary", total=100), Ev("_C::onednn_mm", total=50), total=600),
             Ev("aten::linear", Ev("aten::mm"), total=40), Ev("_C::cpu_fused_moe", total=200)]
    events = [e for r in roots for e in r.walk()]
    calls, ms = cpucount.gemm_kernels(events)
    assert calls == {"linear": 3, "moe": 2, "bmm": 2} and sum(calls.values()) == cpucount.classify(events)["gemm"]
    assert ms == pytest.approx({"linear": 0.19, "moe": 0.5, "bmm": 0.05})


def test_each_kernel_rate_is_timed_on_the_op_the_step_counts_in_its_class():
    """The profile's calls for the fused MoE and the absorbed products issue one GEMM op each, of the class the
    step's profile counts it in, and compute what the engine's layers compute."""
    import torch

    from moeserve.layers.attention import mla_bmm
    from moeserve.layers.moe.experts import FusedExperts

    def kernel_of(call):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        calls, _ = cpucount.gemm_kernels(prof.events())
        return {k: n for k, n in calls.items() if n}

    w = (torch.randn(2, 64, 32) * 0.1).to(torch.bfloat16)
    q = torch.randn(3, 2, 32).to(torch.bfloat16)
    packed = mla_bmm.pack(w)
    call = cpuprofile.bmm_kernel(w, packed, q)
    with torch.inference_mode():
        got = call()
        assert kernel_of(call) == {"bmm": 1}
    if packed is None:
        got = got.permute(2, 0, 1)  # aten's weight-first bmm: [H, C, B]; bmm_cpu writes [B, H, C]
    want = torch.bmm(w.float(), q.permute(1, 2, 0).float()).permute(2, 0, 1)  # [B, H, C]: q[b, h] W[h]^T
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)

    experts = FusedExperts(8, 64, 32).to(torch.bfloat16)
    with torch.no_grad():
        experts.w13.normal_(std=0.1)
        experts.w2.normal_(std=0.1)
    experts.process_weights_after_loading()
    if not experts.fused:
        assert cpuprofile.moe_pools() is None  # no fused kernel here: no MoE class in the profile
        return
    x, ids, weights = torch.randn(1, 64).to(torch.bfloat16), torch.tensor([[1, 5]], dtype=torch.int32), \
        torch.tensor([[0.25, 0.75]])
    call = cpuprofile.moe_kernel(experts, x, ids, weights)
    with torch.inference_mode():
        got = call()
        assert kernel_of(call) == {"moe": 1}
        assert torch.allclose(got.float(), experts.fused_forward(x, ids, weights).float(), atol=1e-2, rtol=1e-2)

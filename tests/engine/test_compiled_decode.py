"""The compiled decode graphs (engine/compiled_decode.py) give the eager path's greedy tokens.

Every bucket is compiled at start-up with fullgraph=True, where a graph break is an error: an engine that
starts has traced all of them. The prompts' lengths differ so that the running batch shrinks step by step
and lands on padded buckets; the 41-token prompt is prefilled in chunks (max_num_batched_tokens=32).
"""
import json

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.engine_args import EngineArgs

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 61)), [7, 8, 9, 10, 11], [42]]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 14, 9, 5, 3)]
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture(autouse=True)
def compile_allowed(monkeypatch):
    monkeypatch.delenv("MOESERVE_ENFORCE_EAGER", raising=False)  # tests/conftest.py makes engines eager
    # every call that skips dynamo's lookup (DirectGraphs) evaluates its entry's guards and raises on a miss
    monkeypatch.setenv("MOESERVE_CHECK_GRAPH_GUARDS", "1")


def generate(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def eager_and_compiled(path: str, **kw) -> tuple[list[list[int]], list[list[int]], LLM]:
    want = generate(LLM(path, enforce_eager=True, **ENGINE, **kw))
    llm = LLM(path, **ENGINE, **kw)
    return want, generate(llm), llm


def assert_graphs_ran(llm: LLM, buckets: list[int]) -> None:
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None, "the engine chose the eager path"
    assert graphs.buckets == buckets and graphs.compiled == set(buckets)
    assert graphs.steps > 0, "no decode step went through a graph"
    assert graphs._layer.direct_calls > 0, "every layer call went through dynamo's lookup"
    assert llm.engine.stats().num_graph_steps == graphs.steps


def routed_op_calls(llm: LLM, batch: int) -> int:
    """How many times the routed experts' opaque op ran while `batch` prompts decoded 4 tokens."""
    from torch.profiler import profile
    with profile() as prof:
        generate(llm, [[5, 6, 7]] * batch, [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * batch)
    return sum(e.count for e in prof.key_averages() if e.key == "moeserve::moe_routed")


@pytest.mark.parametrize("variant,dtype,quant,fused", [
    ("v3", "float32", None, ""), ("v2_lite", "float32", None, ""), ("v3", "bfloat16", None, ""),
    ("v3", "bfloat16", None, "zentorch"), ("v3", "bfloat16", None, "amx"), ("v3", "float32", "a8w8", ""),
], ids=["v3", "v2-lite", "v3-bf16", "v3-bf16-zentorch", "v3-bf16-amx", "v3-a8w8"])
def test_compiled_decode_gives_eager_tokens(ckpt_dir, variant, dtype, quant, fused, monkeypatch):
    from moeserve.layers.moe import amx, zen
    from moeserve.layers.moe.experts import FusedExperts
    kernels = {"zentorch": zen, "amx": amx}
    if fused and not kernels[fused].available():
        pytest.skip(f"the {fused} fused MoE is not available here ({kernels[fused].__name__})")
    for name, module in kernels.items():  # BF16: the one kernel asked for, else the oneDNN-packed experts
        if name != fused:
            monkeypatch.setattr(module, "available", lambda: False)
    # BF16: buckets 4 and 8 (8 and 16 rows over 8 experts) go through the oneDNN-packed experts' opaque op
    monkeypatch.setattr(FusedExperts, "GATHER_ROWS_PER_SLOT", 0.5)
    # A8W8: buckets 1 and 2 (2 and 4 pairs over 8 experts) trace the INT8 experts into the graph, 4 and 8 keep
    # the per-expert GEMMs in an opaque op
    from moeserve.layers.quant import Int8FusedExperts
    monkeypatch.setattr(Int8FusedExperts, "GATHER_PAIRS_PER_SLOT", 0.5)
    want, got, llm = eager_and_compiled(ckpt_dir(variant), dtype=dtype, quantization=quant)
    assert got == want
    assert_graphs_ran(llm, [1, 2, 4, 8])
    if quant == "a8w8":
        assert routed_op_calls(llm, 2) == 0, "a batch of 2 ran the INT8 experts outside the graph"
        assert routed_op_calls(llm, 3) > 0  # bucket 4
    experts = [m for m in llm.engine.runner.model.modules() if type(m) is FusedExperts]
    if dtype == "bfloat16":  # every bucket through one opaque op per layer: the fused kernel's, or the packed experts'
        assert all(m.fused == fused for m in experts) and all(bool(m.packed) != bool(fused) for m in experts)


def test_compiled_decode_with_packed_int8_gives_eager_tokens(ckpt_dir, monkeypatch):
    """A8W8 with every INT8 weight packed for oneDNN (the tiny model's weights are below the packing size on a
    VNNI CPU; lowered here): the packed GEMM runs inside the graphs as an opaque op from 2 rows, torch._int_mm
    at 1 row, and the tokens are the eager engine's."""
    from moeserve.layers import quant

    monkeypatch.setattr(quant, "_VNNI_PACK_MIN_ELEMENTS", 0)
    if quant.Int8Packed.of(quant.quantize_per_channel(torch.ones(8, 16))[0], torch.ones(8, 1)) is None:
        pytest.skip("oneDNN's packed INT8 GEMM does not run here")
    want, got, llm = eager_and_compiled(ckpt_dir("v3"), dtype="float32", quantization="a8w8")
    assert got == want
    assert_graphs_ran(llm, [1, 2, 4, 8])
    model = llm.engine.runner.model
    assert model.lm_head.weight_packed is not None and model.model.layers[0].self_attn.o_proj.weight_packed is not None


def test_compiled_decode_with_mtp(mtp_ckpt_dir):
    """MTP k=1: verification steps have 2 rows per sequence, so the buckets go to 2 * max_num_seqs."""
    path = mtp_ckpt_dir("v3")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    plain = generate(LLM(path, dtype="float32", enforce_eager=True, **ENGINE))
    want, got, llm = eager_and_compiled(path, dtype="float32", speculative_config=spec)
    assert got == want == plain
    assert_graphs_ran(llm, [1, 2, 4, 8, 16])
    assert llm.engine.runner.decode_graphs.mtp_steps > 0, "no MTP pass went through a graph"
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0


def test_compiled_decode_with_prefix_cache_and_preemption(ckpt_dir):
    """A pool too small for the batch (preemption, recompute) and shared prefixes (cache hits)."""
    shared = list(range(100, 116))  # two full blocks
    prompts = [shared + [5, 6], shared + [7], shared + [8, 9, 10], [300, 12]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4  # ~6 blocks each, 8 in all
    kw = dict(dtype="float32", num_kv_blocks=8, block_size=8, enable_prefix_caching=True)
    want = generate(LLM(ckpt_dir("v3"), enforce_eager=True, **ENGINE, **kw), prompts, params)
    llm = LLM(ckpt_dir("v3"), **ENGINE, **kw)
    assert generate(llm, prompts, params) == want
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_graphs_ran(llm, [1, 2, 4, 8])


def test_compiled_decode_under_dp2_ep(ckpt_dir):
    """DP=2 with EP (rank processes over gloo): the routed experts are an opaque op in each rank's graph."""
    want = generate(LLM(ckpt_dir("v3"), dtype="float32", enforce_eager=True, **ENGINE))
    llm = LLM(ckpt_dir("v3"), dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout=60, **ENGINE)
    try:
        assert generate(llm) == want
        assert llm.engine.stats().num_graph_steps > 0, "the ranks decoded eagerly"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "dp2-tp2-ep"])
def test_compiled_decode_under_tensor_parallelism(ckpt_dir, layout):
    """TP=2 (rank processes over gloo): attention's all-reduce and the MoE block (row shares, the TP gather)
    are opaque ops in each rank's graph; the tokens are the same layout's eager ones."""
    def run(**kw):
        llm = LLM(ckpt_dir("v3"), dtype="float32", distributed_timeout=60, **layout, **ENGINE, **kw)
        try:
            return generate(llm), llm.engine.stats().num_graph_steps
        finally:
            llm.shutdown()

    want, eager_steps = run(enforce_eager=True)
    got, graph_steps = run()
    assert got == want
    assert eager_steps == 0 and graph_steps > 0


def test_compiled_decode_records_the_eager_expert_loads(ckpt_dir, tmp_path):
    """--expert-load-stats: the graphs keep the routed part opaque and its op records the step's real rows
    (not the bucket's padding): the counts and the tokens are the eager engine's."""
    files = {}
    for name, kw in (("eager", dict(enforce_eager=True)), ("compiled", {})):
        files[name] = tmp_path / f"{name}.json"
        llm = LLM(ckpt_dir("v3"), dtype="float32", expert_load_stats=str(files[name]), **ENGINE, **kw)
        files[name + "_tokens"] = generate(llm)
        llm.engine.runner.load_recorder.write()
        if name == "compiled":
            assert_graphs_ran(llm, [1, 2, 4, 8])
    assert files["compiled_tokens"] == files["eager_tokens"]
    eager, compiled = (json.loads(files[n].read_text()) for n in ("eager", "compiled"))
    assert compiled["layers"] == eager["layers"] and sum(map(sum, eager["layers"].values())) > 0


def test_compiled_decode_under_tp2_records_the_eager_expert_loads(ckpt_dir, tmp_path):
    """TP=2: each rank records its share of the rows inside the MoE block's op, the bucket's padding left out
    of the shares: the rank files add up to the eager engine's."""
    from moeserve.layers.moe.load_stats import read_loads

    loads, tokens = {}, {}
    for name, kw in (("eager", dict(enforce_eager=True)), ("compiled", {})):
        path = tmp_path / f"{name}.json"
        llm = LLM(ckpt_dir("v3"), dtype="float32", tensor_parallel_size=2, expert_load_stats=str(path),
                  distributed_timeout=60, **ENGINE, **kw)
        try:
            tokens[name] = generate(llm)
            steps = llm.engine.stats().num_graph_steps
        finally:
            llm.shutdown()  # ranks write their final counts on the way out
        assert (steps > 0) == (name == "compiled")
        loads[name] = read_loads([f"{path}.rank0", f"{path}.rank1"])
    assert tokens["compiled"] == tokens["eager"] and loads["compiled"] == loads["eager"]


def test_compiled_decode_with_online_eplb(ckpt_dir):
    """--enable-eplb with DP=2 x EP (rank processes over gloo), rebalancing every 2 steps: experts move while
    the ranks decode through their graphs (the op maps to slots with the current map), the tokens are the
    eager engine's."""
    base = dict(dtype="float32", data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2,
                enable_eplb=True, eplb_step_interval=2, distributed_timeout=60, **ENGINE)

    def run(**kw):
        llm = LLM(ckpt_dir("v3"), **base, **kw)
        try:
            return generate(llm), llm.engine.stats()
        finally:
            llm.shutdown()

    want, eager = run(enforce_eager=True)
    got, compiled = run()
    assert got == want
    assert compiled.eplb_experts_moved > 0 and compiled.num_graph_steps > 0 and eager.num_graph_steps == 0


def test_eager_reasons(ckpt_dir):
    """--enforce-eager, -O 0 and the layouts whose collectives are not in the graph say why they run eagerly."""
    import torch

    from moeserve.engine.compiled_decode import why_eager

    cpu = torch.device("cpu")

    def reason(**kw):
        return why_eager(EngineArgs(model=ckpt_dir("v3"), **kw).create_config(4096), None, cpu)

    assert reason() is None
    assert reason(enforce_eager=True) == "--enforce-eager"
    assert reason(compilation_config="0") == "--enforce-eager"
    assert reason(tensor_parallel_size=2) is None  # its collectives are opaque ops in the graphs
    assert reason(enable_dbo=True, data_parallel_size=2, enable_expert_parallel=True) == "--enable-dbo"
    assert reason(expert_load_stats="/tmp/x.json") is None  # recorded inside the graphs' routed op
    assert why_eager(EngineArgs(model=ckpt_dir("v3")).create_config(4096), None, torch.device("meta"))
    assert LLM(ckpt_dir("v3"), dtype="float32", enforce_eager=True).engine.runner.decode_graphs is None


def test_buckets():
    from moeserve.engine.compiled_decode import buckets_for

    assert buckets_for(1) == [1] and buckets_for(6) == [1, 2, 4, 6] and buckets_for(512) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(512, (1, 3, 128)) == [1, 3, 128] and buckets_for(8, (1, 3, 128)) == [1, 3]


@pytest.mark.parametrize("value,eager,sizes", [
    (None, False, None),
    ('{"cudagraph_capture_sizes": [4, 1, 2, 4]}', False, (1, 2, 4)),
    ({"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 4}, False, (1,)),
    ('{"max_cudagraph_capture_size": 6}', False, (1, 2, 4, 6)),
    ("3", False, None), (0, True, None), ('{"level": 0}', True, None), ('{"mode": 3}', False, None),
    ('{"cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"]}', False, None),
])
def test_compilation_config(ckpt_dir, value, eager, sizes):
    """vLLM's --compilation-config: the keys that apply set the decode graphs, vLLM-internal ones are accepted."""
    model = EngineArgs(model=ckpt_dir("v3"), compilation_config=value).create_config(4096).model
    assert (model.enforce_eager, model.decode_graph_sizes) == (eager, sizes)


@pytest.mark.parametrize("value,words", [
    ('{"cudagraph_capture_size": [1]}', "unknown key(s) cudagraph_capture_size"),
    ('{"cudagraph_capture_sizes": []}', "non-empty list of positive integers"),
    ('{"cudagraph_capture_sizes": [0, 2]}', "non-empty list of positive integers"),
    ('{"mode": 7}', "mode must be 0-3"),
    ("{not json", "--compilation-config"),
])
def test_compilation_config_errors(ckpt_dir, value, words):
    with pytest.raises(ConfigError) as e:
        EngineArgs(model=ckpt_dir("v3"), compilation_config=value).create_config(4096)
    assert words in str(e.value)


def test_compilation_config_flag_and_sizes(ckpt_dir):
    """`-O` / --compilation-config on the command line; the chosen sizes are the graphs the engine compiles."""
    from moeserve.cli import build_parser

    ns = build_parser().parse_args(["serve", ckpt_dir("v3"), "-O", '{"cudagraph_capture_sizes": [1, 3]}'])
    assert ns.compilation_config == '{"cudagraph_capture_sizes": [1, 3]}'
    want = generate(LLM(ckpt_dir("v3"), dtype="float32", enforce_eager=True, **ENGINE))
    llm = LLM(ckpt_dir("v3"), dtype="float32", compilation_config={"cudagraph_capture_sizes": [1, 3]}, **ENGINE)
    assert generate(llm) == want
    assert_graphs_ran(llm, [1, 3])


def test_generate_command_compiles_only_when_asked(ckpt_dir):
    """`moeserve generate` runs eagerly by default (one short run does not pay for compiling); -O 3 compiles
    the graphs its prompts can use, an explicit config is taken as given."""
    from moeserve.cli import build_parser
    from moeserve.entrypoints.generate_cli import engine_args_for

    def model_config(*flags, prompts=2):
        args = build_parser().parse_args(["generate", "--model", ckpt_dir("v3"), *flags])
        return engine_args_for(args, prompts).create_config(4096).model

    assert model_config().enforce_eager
    got = model_config("-O", "3", prompts=3)
    assert not got.enforce_eager and got.decode_graph_sizes == (1, 2, 3)
    got = model_config("-O3", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}')
    assert got.decode_graph_sizes == (1, 2, 4)
    assert model_config("--compilation-config", '{"cudagraph_capture_sizes": [8]}').decode_graph_sizes == (8,)


CACHE_PROBE = r"""
import json, sys
import torch
torch.set_num_threads(1)
from torch._dynamo.utils import counters
from moeserve import LLM
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=1, max_model_len=64)
assert llm.engine.runner.decode_graphs.compiled == {1}
print("COUNTERS " + json.dumps(dict(counters["inductor"])))
"""


def test_a_second_process_reuses_the_compile_cache(ckpt_dir, tmp_path):
    """The first engine fills the on-disk inductor cache; a second process with the same model and layout
    compiles nothing: every graph is a cache hit."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("MOESERVE_ENFORCE_EAGER", None)

    def counters() -> dict:
        proc = subprocess.run([sys.executable, "-c", CACHE_PROBE, ckpt_dir("v3")], env=env, capture_output=True,
                              text=True, timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("COUNTERS ")), None)
        assert line is not None, proc.stderr[-3000:]
        return json.loads(line[len("COUNTERS "):])

    first = counters()
    assert first.get("fxgraph_cache_miss", 0) > 0
    second = counters()
    assert second.get("fxgraph_cache_miss", 0) == 0, second
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"], (first, second)


def _scaled(layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return layer(x) + positions[:, None]


def test_direct_graph_calls_follow_dynamo(monkeypatch):
    """DirectGraphs calls the entry dynamo picked for a (module, rows) key without dynamo's lookup; the guard
    check mode catches a module changed in place behind its back, and forget() goes back to dynamo, which
    compiles for the new module and gives its result."""
    from moeserve.engine.compiled_decode import DirectGraphs

    monkeypatch.setenv("MOESERVE_CHECK_GRAPH_GUARDS", "1")
    graphs = DirectGraphs(_scaled)
    lin = torch.nn.Linear(4, 3)
    x, pos = torch.randn(2, 4), torch.arange(2)
    with torch.inference_mode():
        want = lin(x) + pos[:, None]
        assert torch.allclose(graphs(lin, x, pos), want) and graphs.direct_calls == 0
        assert torch.allclose(graphs(lin, x, pos), want) and graphs.direct_calls == 1
        assert torch.allclose(graphs(lin, x[:1], pos[:1]), want[:1]) and graphs.direct_calls == 1  # new key
        lin.weight = torch.nn.Parameter(torch.randn(5, 4))  # the same module, a graph input of another shape
        lin.bias = torch.nn.Parameter(torch.randn(5))
        with pytest.raises(RuntimeError, match="no longer passes its guards"):
            graphs(lin, x, pos)
        graphs.forget()
        assert torch.allclose(graphs(lin, x, pos), lin(x) + pos[:, None])
        assert torch.allclose(graphs(lin, x, pos), lin(x) + pos[:, None]) and graphs.direct_calls == 2

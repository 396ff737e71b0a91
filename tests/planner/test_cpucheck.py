"""The CPU check's prediction side: the planner's cost model on a device built from a CPU profile."""
import pytest

from moeserve.planner import cpucheck

PROF = {"threads": 1, "mem_bw_gbs": 12.0, "gemm_stream_gbs": 10.0, "gemm_call_us": 30.0,
        "gemm_bf16_gflops": 1000.0, "gemm_decode_gflops": 500.0, "op_cost_us": 10.0}


def test_prediction_is_roofline_plus_gemm_calls_and_ops():
    p = cpucheck.predict(PROF, batch=1, context=128, ops_per_step=1000, gemms_per_step=100)
    assert p["overhead_ms"] == pytest.approx(100 * 0.030 + 900 * 0.010)  # GEMM calls x 30 us + 900 ops x 10 us
    assert p["step_ms"] == pytest.approx(p["roofline_ms"] + p["overhead_ms"])
    # batch 1 is weight-streaming bound: ~active BF16 weights / 10 GB/s (bench model ~190M active+head)
    assert 20 < p["roofline_ms"] < 80
    # weights stream at the GEMM rate, not the plain read rate
    faster_read = cpucheck.predict({**PROF, "mem_bw_gbs": 50.0}, 1, 128, 1000, 100)
    assert faster_read["roofline_ms"] == pytest.approx(p["roofline_ms"])


def test_faster_profile_predicts_faster():
    slow = cpucheck.predict(PROF, 4, 128, 500, 50)["step_ms"]
    fast = cpucheck.predict({**PROF, "gemm_stream_gbs": 20.0, "op_cost_us": 5.0}, 4, 128, 500, 50)["step_ms"]
    assert fast < slow


def test_profile_measures_positive_rates():
    prof = cpucheck.profile()
    assert prof["mem_bw_gbs"] > 0.1 and prof["gemm_bf16_gflops"] > 1 and prof["op_cost_us"] > 0
    assert prof["gemm_stream_gbs"] > 0.1 and prof["gemm_call_us"] >= 0


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
print(json.dumps(measure_engine([2], prompt_len=8, steps=2, checkpoint=path)))
"""
    # without the suite's MOESERVE_ENFORCE_EAGER, as a user runs it: the engine would compile its decode graphs,
    # under which the op counter failed ("found no compiled frames")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOESERVE_ENFORCE_EAGER")}
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["batch"] == 2 and row["measured_ms"] > 0 and row["gemms_per_step"] > 0

"""The operator-level terms (docs/planner.md "Calibration"), each against a hand-computed case or the
measurement it comes from, and the properties they must keep."""
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from moeserve.perf import comm, cost, moe
from moeserve.planner.analysis import decode_memory, decode_point
from moeserve.planner.calibrate import leave_one_out, load_cases, validate
from moeserve.planner.cli import main
from moeserve.perf.deploy import Instance, Workload
from moeserve.planner.explain import with_terms
from moeserve.perf.hardware import TERMS, load_hardware
from moeserve.planner.layers import layer_breakdown
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step, prefill_step

V3 = load_model("deepseek-v3")
# kernels.md: DeepEP low-latency on H800 + CX7 and CANN on the 910C die, 128 tokens per rank x top-8.
DEEPEP = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}
CANN = {8: (116, 118), 16: (131, 132), 32: (133, 146), 64: (141, 150), 128: (152, 150), 256: (152, 149)}
FP8_COPY = 7168 * (1 + 4 / 128)   # FP8 + a fp32 scale per 128 elements
INT8_COPY = 7168 + 4              # INT8 + a fp32 per-token scale


def test_floor_hand_case():
    """Floor = measured time - its own payload on the measuring links (155 GB/s NVLink, 47.5 GB/s CX7)."""
    t = load_hardware("h800").collective
    floors = {ep: (d, c) for ep, d, c in comm.table_floors(t)}
    vol_d, vol_c = 1024 * FP8_COPY, 1024 * 7168 * 2
    assert floors[8][0] == pytest.approx(77 - vol_d * 7 / 8 / 155e3)          # all inside the node
    assert floors[16][1] == pytest.approx(195 - vol_c * 8 / 16 / 47.5e3)      # half leaves over CX7
    assert floors[8][0] == pytest.approx(34.27, abs=0.01) and floors[16][1] == pytest.approx(40.47, abs=0.01)


@pytest.mark.parametrize("name, table, copy", [("h800", DEEPEP, FP8_COPY), ("cloudmatrix-384-die", CANN, INT8_COPY)])
def test_dispatch_combine_reproduce_their_tables(name, table, copy):
    """On the links they were measured on, 128 tokens x top-8 cost the measured times; where a smaller EP
    had the higher floor, at least that (the floor never falls with EP)."""
    hw = load_hardware(name)
    for ep, (d, c) in table.items():
        got_d = comm.alltoall(hw, ep, 1024, copy, "dispatch") * 1e6
        got_c = comm.alltoall(hw, ep, 1024, 7168 * 2, "combine") * 1e6
        assert got_d >= d * 0.995 and got_c >= c * 0.995, ep
        assert got_d == pytest.approx(d, rel=0.06) and got_c == pytest.approx(c, rel=0.06), ep


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 2048), st.integers(2, 2048), st.sampled_from(["dispatch", "combine"]),
       st.sampled_from(["h800", "910c-die", "atlas-800i-a2"]))
def test_larger_ep_never_lowers_the_floor(a, b, kind, name):
    hw = load_hardware(name)
    lo, hi = sorted((a, b))
    assert comm.floor_us(hw, hi, kind) >= comm.floor_us(hw, lo, kind)
    measured = {ep: (d, c) for ep, d, c in comm.table_floors(hw.collective)}
    for ep, floors in measured.items():  # never below the table's own floor at any smaller EP
        if ep <= hi:
            assert comm.floor_us(hw, hi, kind) >= floors[0 if kind == "dispatch" else 1] - 1e-9


def test_kernel_profile_drops_floors_and_latencies():
    hw = load_hardware("h800", profile="kernel")
    assert comm.alltoall(hw, 64, 1024, FP8_COPY) == pytest.approx(1024 * FP8_COPY * 56 / 64 / 47.5e9, rel=1e-3)
    assert comm.hop_latency(hw, 7, 3) == 0.0


@pytest.mark.parametrize("m_rows, lo, hi", [(64, 206, 336), (128, 352, 645), (4096, 775, 1520)])
def test_gemm_efficiency_by_m_against_deepgemm(m_rows, lo, hi):
    """kernels.md DeepGEMM FP8 on H800, shapes N x K below: the roofline with the measured weight-streaming
    and compute fractions lands in the measured TFLOPS range at each M (memory-bound at small M)."""
    hw = load_hardware("h800")
    shapes = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
    got = [cost.gemm_efficiency(hw, "fp8", m_rows, n, k) * 1979 for n, k in shapes]
    assert lo * 0.99 <= min(got) and max(got) <= hi * 1.01, got


def test_gemm_efficiency_hand_case_and_growth_with_m():
    hw = load_hardware("h800")
    # M = 64, N = 4096, K = 7168: bytes 29.36M + 0.46M + 0.52M; at 3350 GB/s x 0.616 -> 14.7 us; FLOPs
    # 3.76 GFLOP -> 256 TFLOPS = 0.129 of 1979 (memory-bound: compute alone would take 3.0 us)
    nbytes = 4096 * 7168 + 64 * 7168 + 64 * 4096 * 2
    t = nbytes / (3350e9 * 0.616)
    assert cost.gemm_efficiency(hw, "fp8", 64, 4096, 7168) == pytest.approx(2 * 64 * 4096 * 7168 / t / 1979e12)
    effs = [cost.gemm_efficiency(hw, "fp8", m, 4096, 7168) for m in (1, 8, 64, 256, 1024, 8192)]
    assert effs == sorted(effs) and effs[-1] == pytest.approx(0.623, rel=1e-3)  # the compute roof


def test_mla_decode_regimes_on_h800():
    """FlashMLA: memory-bound at 3000 GB/s, compute-bound at 660 TFLOPS 'once heads x q_len >= 128': the two
    measured rates cross at heads x q_len = 220 flop/B x 1152 B / 2176 flop = 116 rows."""
    hw = load_hardware("h800")
    kv = 1152.0  # bytes per token and layer (576 BF16)

    def t(heads_q):
        inst = Instance(cards=128 // heads_q if heads_q <= 128 else 1, tp=128 // heads_q if heads_q <= 128 else 1)
        q = max(1, heads_q // 128)
        return cost.mla_decode(V3, hw, inst, 1, q, 4096).seconds

    mem = 4096 * kv / (3350e9 * 0.896)
    assert t(64) == pytest.approx(mem, rel=1e-6)            # memory-bound
    assert t(256) == pytest.approx(2 * 256 * 1088 * 4096 / (989e12 * 0.667), rel=1e-6)  # compute-bound
    assert t(128) > mem                                     # just past the ridge


def test_mla_tile_explains_h20_16_heads():
    """kernels.md FlashMLA on H20 with 16 heads: ~1012 GB/s = 25% of 4.0 TB/s. Padded to 64-row tiles the
    model streams ~20%; without the tile term ~82%."""
    hw = load_hardware("h20")
    inst = Instance(cards=8, tp=8)  # 16 heads per card
    op = cost.mla_decode(V3, hw, inst, 64, 1, 4096)
    frac = op.nbytes / op.seconds / hw.hbm_bw
    assert frac == pytest.approx(0.20, abs=0.01)
    off = cost.mla_decode(V3, with_terms(hw, [t for t in TERMS if t != "mla_tile"]), inst, 64, 1, 4096)
    assert off.nbytes / off.seconds / hw.hbm_bw == pytest.approx(0.82, abs=0.01)
    assert cost.mla_rows(hw, 16) == 64 and cost.mla_rows(hw, 128) == 128 and cost.mla_rows(hw, 130) == 192


def test_framework_and_load_noise_terms():
    hw = load_hardware("atlas-800i-a2")
    inst = Instance(cards=32, moe_comm="allgather", mtp_drafts=1)
    full = decode_step(V3, hw, inst, 60, 3072)
    no_fw = decode_step(V3, with_terms(hw, [t for t in TERMS if t != "framework"]), inst, 60, 3072)
    assert full.total - no_fw.total == pytest.approx(1e-3)  # FusionSpec ~1 ms per step
    # load noise: 32 x 60 x 2 tokens x 8 copies / 32 ranks = 960 copies, + sqrt(2 ln 32 / 960) = 8.5%, x the
    # residual skew under EPLB published for DeepSeek-R1 (1.027, data/models.yaml)
    copies, _ = moe.routed_load(V3, inst, 3840)
    assert copies == pytest.approx(960 * (1 + (2 * 3.4657 / 960) ** 0.5) * 1.027, rel=1e-4)
    assert moe.routed_load(V3, inst, 3840, noise=False)[0] == 960


def test_sequence_parallel_attention_hand_case():
    """A2 prefill TP16 over two nodes (hardware.md): latent allgather, in-node all-to-all of the heads'
    outputs, reduce-scatter of o_proj partial sums across the nodes."""
    hw = load_hardware("atlas-800i-a2")
    inst = Instance(cards=16, tp=16, dense_tp=8, flashcomm="int8", moe_comm="allgather")
    q = 16384
    ops = {o.name: o.seconds for o in cost.attn_comm(V3, hw, inst, q)}
    up, out = 196e9 * 0.837, 25e9 * 0.95
    gather = q * (1536 + 4 + 576 * 2)
    assert ops["tp_allgather"] == pytest.approx(comm.allgather(hw, 16, gather))
    assert ops["tp_alltoall"] == pytest.approx(q * 8 * 128 * 2 * 7 / 8 / up + 0.5e-6)
    assert ops["tp_reduce_scatter"] == pytest.approx(q / 8 * 7168 * 2 / 2 / out + 1.5e-6)
    # q_a / kv_a run on the card's 1/16 of the tokens
    sp = cost.attn_proj(V3, hw, inst, q).flops
    assert sp == pytest.approx(2 * q / 16 * (V3.q_a_params + V3.kv_a_params) + 2 * q * V3.attn_split_params / 16)
    assert cost.dense_mlp(V3, hw, inst, q).flops == pytest.approx(2 * q / 2 * V3.dense_mlp_params / 8)
    router = moe.moe_compute(V3, hw, inst, q, q)[0]  # the gate routes the card's own 1/16 of the tokens
    assert router.name == "router" and router.flops == pytest.approx(2 * q / 16 * V3.gate_params)


def test_max_num_seqs_caps_the_batch():
    hw, wl = load_hardware("atlas-800i-a2"), Workload(2048, 2048)
    free = Instance(cards=32, moe_comm="allgather", mtp_drafts=1)
    assert decode_memory(V3, hw, free, wl).max_batch > 60
    assert decode_memory(V3, hw, replace(free, max_num_seqs=60), wl).max_batch == 60


hardware = st.sampled_from(["hgx-h800", "hgx-h100", "atlas-800i-a2", "cloudmatrix-384-die", "gb200-nvl72", "mi300x-8"])
layouts = st.builds(Instance, cards=st.sampled_from([16, 32, 64]), tp=st.sampled_from([1, 2, 16]),
                    moe_comm=st.sampled_from(["alltoall", "allgather"]), micro_batch_overlap=st.booleans(),
                    mtp_drafts=st.sampled_from([0, 1]), flashcomm=st.sampled_from(["off", "int8"]))


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(128, 8192), hardware,
       st.sampled_from(["scale_up_gbps", "scale_out_gbps", "hbm_tbps", "link_latency_us", "out_latency_us",
                        "step_overhead_ms"]))
def test_more_bandwidth_or_less_latency_is_never_slower(inst, batch, ctx, name, knob):
    hw = load_hardware(name)
    if hw.fp8_tflops is None and inst.quantization == "fp8":
        return
    better = {"scale_up_gbps": ("scale_up_gbps", 2.0), "scale_out_gbps": ("scale_out_gbps", 2.0),
              "hbm_tbps": ("hbm_tbps", 2.0), "link_latency_us": ("link_latency_us", 0.5),
              "out_latency_us": ("out_latency_us", 0.5), "step_overhead_ms": ("step_overhead_ms", 0.5)}[knob]
    field, f = better
    if field in ("link_latency_us", "out_latency_us", "step_overhead_ms"):
        fast = replace(hw, eff=replace(hw.eff, **{field: getattr(hw.eff, "latency_out_us" if field ==
                                                                 "out_latency_us" else field) * f}))
    else:
        fast = replace(hw, **{field: getattr(hw, field) * f})
    for run in (lambda h: decode_step(V3, h, inst, batch, ctx).total,
                lambda h: prefill_step(V3, h, inst, 1, ctx).total):
        assert run(fast) <= run(hw) * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(layouts, st.integers(1, 256), st.integers(128, 8192), hardware)
def test_every_term_only_adds_time(inst, batch, ctx, name):
    hw = load_hardware(name)
    for i in range(len(TERMS)):
        fewer = with_terms(hw, TERMS[:i])
        more = with_terms(hw, TERMS[: i + 1])
        assert decode_step(V3, more, inst, batch, ctx).total >= decode_step(V3, fewer, inst, batch, ctx).total * (1 - 1e-9)


def test_validate_explains_the_gap_term_by_term():
    res = validate()
    for r in res["rows"] + res["unlisted"]:
        steps = r["terms"]
        assert steps[0]["term"] == "kernels" and steps[0]["value"] == pytest.approx(r["predicted_kernel"], abs=0.1)
        assert steps[-1]["value"] == pytest.approx(r["predicted"], abs=0.1)
        assert [s["term"] for s in steps[1:]] == list(TERMS)


def test_prefill_rows_show_both_boundaries():
    rows = {r["id"]: r for r in validate()["rows"]}
    h = rows["a2-prefill-ttft"]["handoff"]
    assert h["forward_ms"] == pytest.approx(rows["a2-prefill-ttft"]["predicted"], abs=0.1)
    assert h["with_handoff_ms"] == pytest.approx(h["forward_ms"] + h["kv_pull_ms"] + h["first_decode_step_ms"], abs=0.2)
    assert h["with_handoff_tok_s_card"] == pytest.approx(16384 / 16 / (h["with_handoff_ms"] * 1e-3), rel=1e-3)
    # the pull crosses RoCE (48 cards > one node): 2048 x 70272 x 62/61 B at 25 GB/s x 0.95 + 1.5 us
    assert h["kv_pull_ms"] == pytest.approx(2048 * 70272 * 62 / 61 / (25e9 * 0.95) * 1e3 + 0.0015, abs=0.01)


def test_per_layer_checks_use_the_case_layout():
    res = validate()
    rows = {p["id"]: p for p in res["per_layer"]}
    assert rows["cloudmatrix-layer-no-mtp"]["published_us"] == 874
    assert rows["cloudmatrix-layer-mtp"]["published_us"] == 1260
    case = next(c for c in load_cases()["cases"] if c["id"] == "cloudmatrix384-decode")
    inst = Instance(**case["instance"], redundant_experts=0)
    # the paper's batch 96 per NPU (910C chip) = 48 per die, the case's rank (docs/planner.md "The CloudMatrix unit")
    direct = layer_breakdown(V3, load_hardware(case["hardware"]), replace(inst, mtp_drafts=0), 48, 4096)
    assert rows["cloudmatrix-layer-no-mtp"]["per_layer_us"] == direct["per_layer_us"]
    assert direct["moe_layer_total_us"] == pytest.approx(sum(direct["moe_layer_us"].values()), abs=0.5)
    assert direct["per_layer_us"] == pytest.approx(direct["step_ms"] * 1e3 / 61, abs=0.1)


def test_leave_one_out_moves_nothing():
    res = leave_one_out()
    assert [r["id"] for r in res["rows"]] == [c["id"] for c in load_cases()["cases"]]
    assert res["max_changed_pct"] == 0.0
    for r in res["rows"]:
        assert r["predicted"] == r["alone"] == r["others_doubled"] == r["others_halved"]


def test_cli_layers_and_leave_one_out(capsys):
    assert main(["plan", "layers", "--json", "--hardware", "cloudmatrix-384-die", "--cards", "144",
                 "--shared-expert-ranks", "16", "--batch", "96", "--context", "4096"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["batch_per_dp"] == 96 and "mla_decode" in obj["moe_layer_us"]
    assert main(["plan", "validate", "--leave-one-out", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["leave_one_out"]["max_changed_pct"] == 0.0
    assert main(["plan", "validate", "--leave-one-out"]) == 0
    out = capsys.readouterr().out
    assert "term by term" in out and "leave-one-out" in out and "per-layer" in out


def test_decode_point_tpot_rises_with_framework_time():
    hw = load_hardware("atlas-800i-a2")
    inst = Instance(cards=32, moe_comm="allgather", mtp_drafts=1, max_num_seqs=60)
    slow = replace(hw, eff=replace(hw.eff, step_overhead_ms=5.0))
    assert decode_point(V3, slow, inst, Workload(), 60).tpot_ms > decode_point(V3, hw, inst, Workload(), 60).tpot_ms


def test_bad_new_inputs_are_refused_naming_the_field(tmp_path, capsys):
    a2 = ["--hardware", "atlas-800i-a2", "--cards", "32", "--moe-comm", "allgather", "--mtp-drafts", "1"]
    assert main(["plan", "estimate", *a2, "--max-num-seqs", "60", "--batch", "61"]) == 2
    assert "--max-num-seqs 60" in capsys.readouterr().err
    assert main(["plan", "decode", *a2, "--dense-tp", "5"]) == 2
    assert "dense_tp 5" in capsys.readouterr().err
    bad = {
        "terms: [fast]": ("efficiency:\n  profiles:\n    end_to_end: {terms: [fast]}\n", "unknown term 'fast'"),
        "missing table": ("devices:\n  x: {bf16_tflops: 1, int8_tops: 1, hbm_gib: 1, hbm_tbps: 1, scale_up_gbps: 1, "
                          "scale_out_gbps: 1, collectives: nope}\n", "collectives 'nope' is not in"),
        "bad points": ("collectives:\n  t: {tokens: 128, hidden: 7168, topk: 8, dispatch_bytes: 1, combine_bytes: 2, "
                       "up_gbps: 100, out_gbps: 50, domain: 8, points: {8: [0, 10]}}\n"
                       "devices:\n  x: {bf16_tflops: 1, int8_tops: 1, hbm_gib: 1, hbm_tbps: 1, scale_up_gbps: 1, "
                       "scale_out_gbps: 1, collectives: t}\n", "points must be EP >= 2"),
        "table field": ("collectives:\n  t: {tokenz: 128}\n", "unknown field 'tokenz'"),
    }
    for name, (text, needle) in bad.items():
        path = tmp_path / f"{name.replace(' ', '_').replace(':', '')}.yaml"
        path.write_text(text)
        assert main(["plan", "hardware", "--hardware-file", str(path)]) == 2, name
        assert needle in capsys.readouterr().err, name


def test_a_users_collective_table_is_used(tmp_path):
    """A file's own dispatch/combine table sets the floors of the device that names it."""
    path = tmp_path / "hw.yaml"
    path.write_text("collectives:\n  slow: {tokens: 128, hidden: 7168, topk: 8, dispatch_bytes: 1, combine_bytes: 2, "
                    "up_gbps: 1000, out_gbps: 1000, domain: 8, points: {8: [500, 600]}}\n"
                    "systems:\n  slow-h800: {device: h800, collectives: slow}\n")
    from moeserve.perf.hardware import HardwareDB
    hw = HardwareDB(str(path)).get("slow-h800")
    floor_d = 500 - 1024 * 7168 * 7 / 8 / 1000e3
    assert comm.floor_us(hw, 8, "dispatch") == pytest.approx(floor_d)
    assert comm.floor_us(hw, 64, "dispatch") == pytest.approx(floor_d)  # beyond the table: its largest EP's


def test_amla_rate_on_the_910c_die():
    """AMLA (arXiv 2509.25224): up to 614 TFLOPS per CloudMatrix384 NPU = 910C package, 86.8% of a 707
    TFLOPS maximum (two dies at 353.9), so 307 per die, the rank a CloudMatrix card is read as (issue 41:
    die and package apart). At batch 96 / 4K KV the die's 128 query rows compute 357 us against a 337 us
    KV read, and MTP's 256 rows double the compute."""
    hw = load_hardware("cloudmatrix-384-die")
    assert hw.eff.mla_tflops == 307 and load_hardware("cloudmatrix-384").eff.mla_tflops == 614
    assert 614 / 0.868 == pytest.approx(2 * 353.9, rel=1e-3)   # the paper's maximum: two dies, not one
    mem = 96 * 4096 * 1152 / (1.6e12 * 0.841)
    comp = 2 * 96 * 128 * 1088 * 4096 / 307e12
    assert mem < comp and cost.mla_decode(V3, hw, Instance(cards=1), 96, 1, 4096).seconds == pytest.approx(comp)
    comp2 = 2 * 96 * 256 * 1088 * 4096 / 307e12
    assert cost.mla_decode(V3, hw, Instance(cards=1), 96, 2, 4096).seconds == pytest.approx(comp2)
    pkg = load_hardware("cloudmatrix-384")   # one package: twice the die's rate and bandwidth
    assert cost.mla_decode(V3, pkg, Instance(cards=1), 192, 2, 4096).seconds == pytest.approx(comp2)
    assert load_hardware("atlas-800i-a2").eff.mla_tflops is None  # no 910B measurement: CANN's 65.4%


def test_overlap_bound_caps_two_batch_overlap_at_its_measured_gain():
    """Two-batch overlap gains no more than measured on the family at this many tokens per card (Hopper:
    SGLang on H100, 0 at 64 tokens, +35% at 256; data/hardware.yaml tbo_gain). The unbounded model hides
    more (H800 EP144 at 184 sequences: +41%); at 184 tokens the bound is 0.35 x 120 / 192 = +21.9%."""
    hw = load_hardware("hgx-h800")
    inst = Instance(cards=144, redundant_experts=32, quantization="fp8", micro_batch_overlap=True)
    fw = 1e-3
    serial = decode_step(V3, hw, replace(inst, micro_batch_overlap=False), 184, 3072).total - fw
    tbo = decode_step(V3, hw, inst, 184, 3072).total - fw
    free = decode_step(V3, with_terms(hw, [t for t in TERMS if t != "overlap_bound"]), inst, 184, 3072).total - fw
    gain = 0.35 * (184 - 64) / (256 - 64)
    assert free < serial / (1 + gain) and tbo == pytest.approx(serial / (1 + gain))
    # 256 tokens and beyond: the +35% cap
    serial = decode_step(V3, hw, replace(inst, micro_batch_overlap=False), 300, 3072).total - fw
    assert decode_step(V3, hw, inst, 300, 3072).total - fw == pytest.approx(serial / 1.35)


def test_search_tries_the_published_a2_prefill_layout():
    """TP over two nodes with sequence parallelism and the dense MLP inside a node (hardware.md's A2 prefill)."""
    from moeserve.planner import search as srch
    from moeserve.planner.analysis import prefill_point
    hw, wl = load_hardware("atlas-800i-a2"), Workload(2048, 2048)
    pres = srch.best_prefill(V3, hw, 16, Instance(cards=16, mtp_drafts=1), wl, top=None)
    wide = [c for c in pres if c.inst.tp == 16]
    assert wide and all(c.inst.flashcomm == "int8" and c.inst.dense_tp == 8 for c in wide)
    c = wide[0]
    assert c.tok_s_card == pytest.approx(prefill_point(V3, hw, c.inst, c.batch * c.inst.dp, 2048).tok_s_card)

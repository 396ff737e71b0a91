"""Rack-scale Blackwell (GB200 / GB300 NVL72), AMD Instinct (MI300X / MI355X) and FP4 weights (issue 41):
one decode-step term per new device family against a hand computation, FP4 refused where the device has no
FP4 tensor path, and the CLI on the new systems."""
import json
import math

import pytest

from moeserve.perf import comm
from moeserve.perf.deploy import Instance
from moeserve.perf.hardware import load_hardware
from moeserve.perf.models import load_model
from moeserve.perf.step import decode_step
from moeserve.planner.cli import main

V3 = load_model("deepseek-v3")
H, I, EXPERT = 7168, 2048, 3 * 7168 * 2048   # DeepSeek-V3 hidden, expert intermediate, params per expert


def test_gb200_nvl72_nvfp4_routed_experts_and_dispatch_by_hand():
    """72 GB200s, one NVL72 rack, NVFP4 experts (0.5 + 1/16 bytes per weight), batch 64 per GPU."""
    hw = load_hardware("gb200-nvl72")
    assert (hw.fp4_tflops, hw.hbm_tbps, hw.scale_up_gbps, hw.scale_up_domain) == (10000, 8.0, 900, 72)
    step = decode_step(V3, hw, Instance(cards=72, quantization="nvfp4", redundant_experts=32), 64, 4096)
    n, k, ep = 64 * 72, 8, 72
    mean = n * k / ep                                       # 512 copies per rank
    copies = mean * (1 + math.sqrt(2 * math.log(ep) / mean)) * 1.027  # Poisson noise on the busiest rank x
                                                                     # V3's residual under EPLB (models.yaml)
    active = 4 * (1 - math.exp(-n * k / 288))               # 288 slots, 4 per rank, all busy
    w = 0.5625
    act = copies * (H * w + 2 * I * 2 + 2 * I * 2 + I * (2 + w) + H * 2)
    t_flops = 2 * copies * EXPERT / (10000e12 * 0.623)      # FP4 peak x Hopper's DeepGEMM fraction
    t_mem = (active * EXPERT * w + act) / (8e12 * 0.616)    # small-M GEMM weight streaming
    assert step.by_name()["routed_experts"] == pytest.approx(58 * max(t_flops, t_mem), rel=1e-9)
    # Dispatch: every destination inside the 72-GPU NVLink domain (71 of 72 remote), FP8 + 1x128 scales.
    # NVLinkOneSided at EP64 (the largest measured; EP 72 takes it): 41.6 us at 128 BF16 tokens less their
    # payload at the measuring rate, 128 x 8 x 14336 B x 63/64 / 700 GB/s
    floor = 41.6 - 128 * 8 * 7168 * 2 * 63 / 64 / 700e3
    assert {e: d for e, d, _ in comm.table_floors(hw.collective)}[64] == pytest.approx(floor)
    pay = copies * (H + 4 * 56) * 71 / 72 / (900e9 * 0.778)
    assert step.by_name()["dispatch"] == pytest.approx(58 * (pay + floor * 1e-6), rel=1e-9)


def test_nvl72_beyond_one_rack_sends_the_rest_over_the_nic():
    """144 GB200s = two racks: half the destinations leave the NVLink domain over the 50 GB/s NIC."""
    hw = load_hardware("gb200-nvl72")
    assert comm.domain_fractions(hw, 144) == (71 / 144, 0.5)
    assert comm.domain_fractions(hw, 72) == (71 / 72, 0.0)
    inside = comm.alltoall(hw, 72, 1000, 7392)
    two_racks = comm.alltoall(hw, 144, 1000, 7392)
    assert two_racks > inside


def test_mi300x_mla_decode_by_hand():
    """128 heads x 1 query on one MI300X (TP1): the latent's 1088 FLOPs per byte pair put it above the ridge,
    so it is compute-bound at BF16 peak x the default attention fraction (no AMD figure: docs/planner.md)."""
    hw = load_hardware("mi300x-8")
    step = decode_step(V3, hw, Instance(cards=8, quantization="fp8"), 32, 4096)
    ctx = 4096 + 1
    flops = 2 * 32 * 128 * (2 * 512 + 64) * ctx
    t_flops = flops / (1307e12 * 0.654)
    t_mem = 32 * ctx * 576 * 2 / (5.3e12 * 0.841)
    assert t_flops > t_mem
    assert step.by_name()["mla_decode"] == pytest.approx(61 * t_flops, rel=1e-9)


@pytest.mark.parametrize("name", ["mi300x-8", "hgx-h800", "atlas-800i-a2"])
def test_fp4_refused_without_an_fp4_tensor_path(name, capsys):
    code = main(["plan", "estimate", "--hardware", name, "--cards", "16", "--quantization", "nvfp4",
                 "--batch", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "no FP4 tensor path" in err and "--quantization" in err


@pytest.mark.parametrize("name, quant, cards", [("gb200-nvl72", "nvfp4", 72), ("gb300-nvl72", "nvfp4", 72),
                                                ("mi355x-8", "mxfp4", 8), ("mi300x-8", "fp8", 8)])
def test_plan_accepts_the_new_devices(name, quant, cards, capsys):
    code = main(["plan", "decode", "--hardware", name, "--cards", str(cards), "--quantization", quant,
                 "--tpot-ms", "50", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and "error" not in out


def test_fp4_weights_take_less_memory_than_fp8():
    from moeserve.planner.analysis import decode_memory
    from moeserve.perf.deploy import Workload
    hw = load_hardware("gb200-nvl72")
    wl = Workload(2048, 2048)
    fp8 = decode_memory(V3, hw, Instance(cards=72, quantization="fp8", redundant_experts=32), wl)
    fp4 = decode_memory(V3, hw, Instance(cards=72, quantization="nvfp4", redundant_experts=32), wl)
    assert fp4.max_batch > fp8.max_batch

"""`moeserve plan ...`: the deployment planner's command line. Every subcommand takes --json."""
from __future__ import annotations

import argparse
import json
import sys

from moeserve.planner.cli_args import at_most, fraction, hit_rate, imbalance, nonneg_int, positive_float, positive_int
from moeserve.perf.deploy import (FLASHCOMM, QUANT, KV_BYTES, MAX_CARDS, MOE_COMM, DoesNotFit, Instance,
                                     Workload, fewest_redundant_slots)

# --cards, --prefill-cards
cards = at_most(MAX_CARDS, "the planner's limit on cards in a deployment")
from moeserve.perf.hardware import PROFILES


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", default="deepseek-v3", help="preset or path to a config.json / checkpoint")
    g.add_argument("--hardware", default="hgx-h800", help="device or system name (plan hardware lists)")
    g.add_argument("--hardware-file", help="YAML/JSON with extra devices/systems/efficiency")
    g.add_argument("--efficiency-profile", choices=PROFILES, default=None,
                   help="end_to_end (default): a serving step; kernel: kernel-level factors only")
    g.add_argument("--scale-up-domain", type=positive_int, help="cards per scale-up domain (override)")
    g.add_argument("--scale-up-gbps", type=positive_float, help="scale-up GB/s per card, one direction")
    g.add_argument("--scale-out-gbps", type=positive_float, help="scale-out GB/s per card, one direction")
    d = p.add_argument_group("deployment instance")
    d.add_argument("--cards", type=cards, default=32, help="cards in the instance (= DP x TP)")
    d.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=positive_int, default=1, help="attention TP")
    d.add_argument("--shared-expert-ranks", type=nonneg_int, default=0)
    d.add_argument("--redundant-experts", type=nonneg_int, default=None,
                   help="extra routed-expert slots (default: fewest making slots divisible)")
    d.add_argument("--quantization", choices=sorted(QUANT), default="a8w8")
    d.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", choices=sorted(KV_BYTES),
                   default="bf16")
    d.add_argument("--num-speculative-tokens", "--mtp-drafts", dest="mtp_drafts", type=nonneg_int, default=0)
    d.add_argument("--mtp-acceptance", type=fraction, default=0.7)
    d.add_argument("--moe-comm", choices=MOE_COMM, default="alltoall")
    d.add_argument("--micro-batch-overlap", action=argparse.BooleanOptionalAction, default=False)
    d.add_argument("--attention-dtype", choices=["bf16", "fp8"], default="bf16",
                   help="decode MLA math: fp8 = FP8 Q/KV on the FP8 tensor path (FlashMLA-FP8; needs "
                        "--kv-cache-dtype fp8)")
    d.add_argument("--overlap-shared", action=argparse.BooleanOptionalAction, default=True,
                   help="shared experts (and the gate, with allgather) run during the first MoE collective")
    d.add_argument("--flashcomm", choices=FLASHCOMM, default="off",
                   help="with attention TP: ReduceScatter + BF16 ('on') or INT8 AllGather instead of AllReduce")
    d.add_argument("--weight-prefetch", action=argparse.BooleanOptionalAction, default=False,
                   help="prefetch attention weights while collectives run (capped at the published +10%%)")
    d.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="sequences a DP rank may run at once (the engine's --max-num-seqs; caps the decode batch)")
    d.add_argument("--dense-tp", type=positive_int, default=None,
                   help="TP of the dense layers' MLP when it differs from attention TP (A2 prefill: 8)")
    skew = d.add_mutually_exclusive_group()
    skew.add_argument("--imbalance", type=imbalance, default=None, help="residual expert-load max/mean (>=1)")
    skew.add_argument("--eplb-stats", nargs="+", metavar="FILE",
                   help="expert loads (moeserve --expert-load-stats files, or JSON per-expert / [layer][expert] "
                        "lists) -> imbalance under the balanced placement of this layout's redundant slots")
    d.add_argument("--eplb-placement", choices=("balanced", "contiguous"), default="balanced",
                   help="placement --eplb-stats is scored under: EPLB's (balanced) or experts in rank blocks")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=positive_int, default=2048)
    w.add_argument("--output-len", type=positive_int, default=2048)
    w.add_argument("--prefix-cache-hit-rate", type=hit_rate, default=0.0,
                   help="share of each prompt's tokens the prefill finds in the prefix cache (shared system "
                        "prompt, earlier turns): attended to, not computed")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _ctx(args):
    """(model, hardware, instance, workload) from parsed args. Also sets args.load_skew: the --eplb-stats
    loads (or None), which give every other layout a command tries its own imbalance factor."""
    from moeserve.planner.eplb_stats import LoadSkew
    from moeserve.perf.hardware import HardwareDB
    from moeserve.planner.memory import check_tp
    from moeserve.perf.models import load_model
    m = load_model(args.model)
    hw = HardwareDB(args.hardware_file, args.efficiency_profile).get(args.hardware).with_overrides(
        scale_up_domain=args.scale_up_domain, scale_up_gbps=args.scale_up_gbps,
        scale_out_gbps=args.scale_out_gbps)
    _check_lengths(m, args)
    check_tp(m, args.tp)
    if args.shared_expert_ranks >= args.cards:  # checked here: the default below divides by the routed ranks
        raise ValueError(f"--shared-expert-ranks {args.shared_expert_ranks} must be below --cards {args.cards}: "
                         "at least one card has to hold the routed experts")
    red = args.redundant_experts
    if red is None:
        red = fewest_redundant_slots(m.n_routed_experts, args.cards - args.shared_expert_ranks)
    inst = Instance(cards=args.cards, tp=args.tp, shared_expert_ranks=args.shared_expert_ranks,
                    redundant_experts=red, quantization=args.quantization, kv_dtype=args.kv_dtype,
                    mtp_drafts=args.mtp_drafts, mtp_acceptance=args.mtp_acceptance, moe_comm=args.moe_comm,
                    micro_batch_overlap=args.micro_batch_overlap,
                    imbalance=args.imbalance,  # None: the model's published residual (perf/moe.py)
                    overlap_shared=args.overlap_shared, flashcomm=args.flashcomm,
                    weight_prefetch=args.weight_prefetch, max_num_seqs=args.max_num_seqs,
                    dense_tp=args.dense_tp, attention_dtype=args.attention_dtype)
    hw.peak_flops(inst.compute_dtype)  # a format the device has no tensor path for: refused naming --quantization
    if inst.attention_dtype == "fp8" and not hw.fp8_tflops:
        raise ValueError(f"{hw.name} has no FP8 tensor path for --attention-dtype fp8; use bf16")
    args.load_skew = None
    if args.eplb_stats and m.n_routed_experts:
        args.load_skew = LoadSkew.from_files(args.eplb_stats, m.n_routed_experts,
                                             balanced=args.eplb_placement == "balanced")
        inst = args.load_skew.apply(inst)
    return m, hw, inst, Workload(args.input_len, args.output_len, args.prefix_cache_hit_rate)


def _check_lengths(m, args) -> None:
    """Prompt + output must fit the model's context window (prefill: the prompt alone)."""
    from moeserve.perf.models import check_context
    prefill = getattr(args, "plan_command", None) == "prefill"
    check_context(m, args.input_len, None if prefill else args.output_len, ("--input-len", "--output-len"))


def _emit(args, obj: dict, text: str) -> int:
    print(json.dumps(obj, indent=2) if args.json else text)
    return 0


# Exit codes (docs/planner.md): 0 answered; 1 refused (the layout does not fit in memory, search found no
# plan); 2 bad input (a flag value, a file, a layout that cannot exist).
EXIT_REFUSED, EXIT_BAD_INPUT = 1, 2


class _PlanParser(argparse.ArgumentParser):
    """A subcommand's parser: with --json, a refused flag value is also one JSON object on stdout."""

    def parse_known_args(self, args=None, namespace=None):
        self._json = "--json" in (sys.argv[1:] if args is None else args)
        ns, extra = super().parse_known_args(args, namespace)
        if extra:  # the subcommand takes the rest of the line: report leftovers here, where --json is known
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra

    def error(self, message):
        if getattr(self, "_json", False):
            print(json.dumps({"error": message}))
        # One line, not argparse's usage block (30 lines for estimate) in front of it.
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (--help lists the flags)\n")


def _run(func, args) -> int:
    """One error line on stderr (and {"error": ...} on stdout with --json) instead of a traceback."""
    try:
        return func(args) or 0
    except ValueError as e:
        print(f"moeserve plan {args.plan_command}: error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(e)}))
        return EXIT_REFUSED if isinstance(e, DoesNotFit) else EXIT_BAD_INPUT


def register(subparsers) -> None:
    from moeserve.planner import cli_cmds as c
    plan = subparsers.add_parser("plan", help="deployment planner: cost model, search, simulation",
                                 description=__doc__)
    sub = plan.add_subparsers(dest="plan_command", required=True, metavar="PLAN_COMMAND",
                              parser_class=_PlanParser)
    specs = [
        ("estimate", "per-operator decode step breakdown at one batch, memory, prefill point", c.cmd_estimate),
        ("decode", "decode throughput vs batch/TPOT, best throughput under a TPOT SLO, PNG plot", c.cmd_decode),
        ("prefill", "prefill TTFT and throughput for N prompts of a given length", c.cmd_prefill),
        ("memory", "memory per card (weights, KV, activations); refuses layouts that do not fit", c.cmd_memory),
        ("search", "enumerate layouts and prefill:decode splits, rank by goodput per card", c.cmd_search),
        ("simulate", "request stream through the real engine Scheduler with cost-model step times",
         c.cmd_simulate),
        ("layers", "one decoder layer's operators at a batch and KV length (vs published per-layer times)",
         c.cmd_layers),
        ("validate", "predicted vs published results (+-15%%)", c.cmd_validate),
        ("hardware", "list the hardware database", c.cmd_hardware),
        ("profile-cpu", "measure this CPU and predict moeserve's own CPU decode step times", c.cmd_profile_cpu),
    ]
    for name, help_, func in specs:
        p = sub.add_parser(name, help=help_, description=help_.replace("%%", "%"))
        getattr(c, "args_" + name.replace("-", "_"), _add_common)(p)
        p.set_defaults(func=lambda a, f=func: _run(f, a))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moeserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())

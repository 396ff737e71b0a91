"""MoE communication of data-parallel attention + expert parallelism: alltoall vs allgather, D = 2 and 4.

Usage: python benchmarks/dp_ep.py [--layouts 1 2 4] [--batch 8] [--prompt-len 32] [--new-tokens 32] [--dbo]
                                 [--shared-expert-ranks N] [--two-stage L] [--pipeline-chunks K ...]
(--dbo: each D > 1 layout also runs with --enable-dbo, two micro-batches per step; --shared-expert-ranks N:
each D > N + 1 layout also runs with the shared expert on N ranks of its own; --two-stage L: each allgather
layout with D > L also runs with --moe-comm-hierarchy two-stage over simulated nodes of L ranks. Those rows'
ratio column compares with the same layout without the option; the inter-node column is the bytes per token
per MoE layer that crossed (simulated) nodes of L ranks. --pipeline-chunks K ...: each D > 1 layout also runs
with --moe-pipeline-chunks K for each K > 1 given; the overlap column is the share of the MoE communication
and expert time (dispatch + experts + combine phases) spent on a chunk while another chunk's transfer was
still in flight.)
For each layout it runs the same greedy batch through LLM(...) and prints
  - decode tokens/s and its ratio to the single-process engine measured in the same run;
  - bytes sent per token per MoE layer by the MoE collectives, next to the formula:
      alltoall:  tokens x top-k x hidden x bytes x 2 (dispatch + combine) x (W-1)/W (rows to other ranks);
                 with shared-expert ranks top-k + 1 rows per token (the shared row travels too)
      allgather: tokens x hidden x bytes x (W-1) (gather) + the same for the reduce-scatter, plus the
                 routing weights/ids; independent of top-k, padded to the busiest rank;
  - the share of MoE/attention time per phase (attention, router, dispatch, experts, combine, shared).
The model is the core engine's bench config shrunk to fit a small CPU (BF16).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import BENCH_CONFIG, bench_checkpoint  # noqa: E402

SHRUNK = {**BENCH_CONFIG, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 128,
          "num_hidden_layers": 4, "n_routed_experts": 32, "num_experts_per_tok": 6, "n_group": 4, "topk_group": 2,
          "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8000, "kv_lora_rank": 128,
          "q_lora_rank": 192, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
MOE_KINDS = ("alltoall", "allgather", "reduce_scatter")  # the token payload collectives of the MoE layers
PHASES = ("attention", "router", "dispatch", "experts", "combine", "shared_experts")


def run(path: str, d: int, comm: str, batch: int, prompt_len: int, new_tokens: int, dbo: bool = False,
        shared: int = 0, node: int | None = None, two_stage: bool = False, chunks: int = 1) -> dict:
    from moeserve import LLM

    kw = dict(data_parallel_size=d, enable_expert_parallel=True, moe_comm=comm, enable_dbo=dbo) if d > 1 else {}
    if chunks > 1:
        kw.update(moe_pipeline_chunks=chunks)
    if node and d > 1:  # the node size counts bytes by link class; two-stage also changes the schedule
        kw.update(moe_node_size=node, moe_comm_hierarchy="two-stage" if two_stage else "flat")
    if shared:  # routed experts over the other D - shared ranks, with the fewest replicas that make them divide
        kw.update(shared_expert_ranks=shared, num_redundant_experts=-SHRUNK["n_routed_experts"] % (d - shared))
    llm = LLM(path, dtype="bfloat16", max_num_seqs=batch, enable_prefix_caching=False, **kw)  # the same prompts run again: measure compute, not the prefix cache
    prompts = [[(7 * i + j) % (SHRUNK["vocab_size"] - 2) + 2 for j in range(prompt_len)] for i in range(batch)]
    drive(llm.engine, prompts, 2, "warm")  # warm-up
    before = _stats(llm)
    tokens, decode_s = drive(llm.engine, prompts, new_tokens, "run")
    after = _stats(llm)
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    processed = batch * (prompt_len + new_tokens - 1)  # every token the model processed in the measured run
    moe_layers = SHRUNK["num_hidden_layers"] - SHRUNK["first_k_dense_replace"]
    bytes_ = {k: after["bytes"].get(k, 0) - before["bytes"].get(k, 0) for k in after["bytes"]}
    secs = {k: after["seconds"].get(k, 0.0) - before["seconds"].get(k, 0.0) for k in PHASES}
    overlap = after["seconds"].get("moe_overlap", 0.0) - before["seconds"].get("moe_overlap", 0.0)
    return dict(layout=f"D={d} {comm}" + (" dbo" if dbo else "") + (f" shared{shared}" if shared else "")
                + (" two-stage" if two_stage else "") + (f" K={chunks}" if chunks > 1 else ""), d=d, comm=comm,
                dbo=dbo, shared=shared, two_stage=two_stage, chunks=chunks,
                overlap_share=overlap / moe_s if (moe_s := secs["dispatch"] + secs["experts"] + secs["combine"]) else 0.0,
                decode_tps=batch * (new_tokens - 1) / decode_s,
                inter_node_per_token_layer=bytes_.get("moe_inter_node", 0) / (processed * moe_layers),
                bytes_per_token_layer=sum(bytes_.get(k, 0) for k in MOE_KINDS) / (processed * moe_layers),
                formula=formula(comm, d, shared), seconds=secs, bytes=bytes_, tokens=tokens)


def drive(engine, prompts, new_tokens: int, tag: str) -> tuple[list[list[int]], float]:
    """Run the batch through the engine interface; decode time = first token of all -> last token."""
    from moeserve import SamplingParams
    from moeserve.protocol import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    got: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"{tag}{i}", p, params, [1]))
    t0 = None
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        if t0 is None and all(got.values()):
            t0 = time.perf_counter()  # every prefill is done: decode starts
    return list(got.values()), time.perf_counter() - t0


def _stats(llm) -> dict:
    if not hasattr(llm.engine, "rank_stats"):  # single process: this process's own counters
        from moeserve.distributed.comm import STATS
        return {"bytes": dict(STATS.bytes), "seconds": dict(STATS.seconds)}
    # Let the ranks' last reports arrive, then read the summed counters.
    time.sleep(0.3)
    llm.engine.step(poll_s=0.05)
    s = llm.engine.stats()
    return {"bytes": dict(s.comm_bytes), "seconds": dict(s.phase_seconds)}


def formula(comm: str, w: int, shared: int = 0) -> float:
    """Expected bytes per token per MoE layer (uniform routing, BF16 rows, int32 slot ids not counted). With
    shared-expert ranks each token has one more pair; its fraction sent to other ranks is still (W-1)/W."""
    h, k, b = SHRUNK["hidden_size"], SHRUNK["num_experts_per_tok"] + (1 if shared else 0), 2
    if w == 1:
        return 0.0
    if comm == "alltoall":
        return k * h * b * 2 * (w - 1) / w
    return h * b * (w - 1) + h * b * (w - 1) + k * (4 + 8) * (w - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dbo", action="store_true", help="also run each D > 1 layout with --enable-dbo")
    ap.add_argument("--shared-expert-ranks", type=int, default=0,
                    help="also run each D > N + 1 layout with --shared-expert-ranks N")
    ap.add_argument("--pipeline-chunks", type=int, nargs="+", default=[], metavar="K",
                    help="also run each D > 1 layout with --moe-pipeline-chunks K")
    ap.add_argument("--two-stage", type=int, default=None, metavar="L",
                    help="simulated nodes of L ranks: also run each allgather layout with D > L two-stage")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the single-process engine (ranks get cpu_count / ranks each)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(config=SHRUNK)
    results = []
    for d in args.layouts:
        for comm in (("local",) if d == 1 else ("alltoall", "allgather")):
            node = args.two_stage if args.two_stage and d > args.two_stage else None
            for dbo in ((False, True) if args.dbo and d > 1 else (False,)):
                results.append(run(path, d, comm, args.batch, args.prompt_len, args.new_tokens, dbo, node=node))
                print(f"done {results[-1]['layout']}", file=sys.stderr)
            if node and comm == "allgather":
                results.append(run(path, d, comm, args.batch, args.prompt_len, args.new_tokens, node=node,
                                   two_stage=True))
                print(f"done {results[-1]['layout']}", file=sys.stderr)
            for k in (k for k in args.pipeline_chunks if k > 1 and d > 1):
                results.append(run(path, d, comm, args.batch, args.prompt_len, args.new_tokens, chunks=k))
                print(f"done {results[-1]['layout']}", file=sys.stderr)
            n = args.shared_expert_ranks
            if n and d > n + 1:
                results.append(run(path, d, comm, args.batch, args.prompt_len, args.new_tokens, shared=n))
                print(f"done {results[-1]['layout']}", file=sys.stderr)
    base = next((r for r in results if r["d"] == 1), None)
    print(f"{'layout':<28}{'decode tok/s':>13}{'vs D=1':>8}{'B/token/layer':>15}{'formula':>10}{'inter-node':>11}"
          f"{'overlap':>8}  phase share "
          "(attention router dispatch experts combine shared)")
    for r in results:
        ref = base
        if r["dbo"] or r["shared"] or r["two_stage"] or r["chunks"] > 1:  # against the layout without the option
            ref = next(x for x in results if x["d"] == r["d"] and x["comm"] == r["comm"] and not x["dbo"]
                       and not x["shared"] and not x["two_stage"] and x["chunks"] == 1)
        ratio = r["decode_tps"] / ref["decode_tps"] if ref else float("nan")
        tot = sum(r["seconds"].values()) or 1.0
        share = " ".join(f"{100 * r['seconds'][p] / tot:4.0f}%" for p in PHASES)
        same = "" if base is None or r["tokens"] == base["tokens"] else "  (tokens differ from D=1)"
        print(f"{r['layout']:<28}{r['decode_tps']:>13.1f}{ratio:>8.2f}{r['bytes_per_token_layer']:>15.0f}"
              f"{r['formula']:>10.0f}{r['inter_node_per_token_layer']:>11.0f}{100 * r['overlap_share']:>7.0f}%"
              f"  {share}{same}")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results], indent=1))


if __name__ == "__main__":
    main()

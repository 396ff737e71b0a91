"""PD disaggregation: the KV pull over NIXL/UCX against the prefill it saves, on the bench model.

Two engines in this process (a prefill and a decode instance, each with its own NIXL agent; UCX picks
shared memory between them here, RDMA across nodes). Per prompt length: the prefill step's time, the pull
(from the decode engine taking the request to its KV being in place), the bytes moved, and the pull as a
fraction of the prefill. Prints figures, never passes or fails.

Usage: python benchmarks/pd_kv_pull.py [--lens 128,512,1024] [--repeats 3] [--threads 1] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from benchmarks.common import bench_checkpoint
    from moeserve import LLM, SamplingParams
    from moeserve.disagg import trust
    from moeserve.protocol import EngineCoreRequest

    SECRET = secrets.token_hex(16)  # the deployment secret both engines share (disagg/trust.py)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lens", default="128,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lens = [int(x) for x in a.lens.split(",")]
    kw = dict(dtype="bfloat16", max_model_len=max(lens) + 64, max_num_seqs=4, max_num_batched_tokens=max(lens),
              kv_transfer_config={"kv_connector": "nixl", "kv_secret": SECRET}, enable_prefix_caching=False)  # the same prompts run again: measure compute, not the prefix cache
    prefill, decode = LLM(bench_checkpoint(), **kw).engine, LLM(bench_checkpoint(), **kw).engine
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for n in lens:
        best_pre = best_pull = float("inf")
        for r in range(a.repeats + 1):  # the first round warms up (and loads the remote agent's metadata)
            ids = [(13 * j + r) % 31000 + 2 for j in range(n)]
            rid = f"n{n}-r{r}"
            prefill.add_request(EngineCoreRequest(rid, ids, one, [], kv_transfer_params=trust.ticket(SECRET)))
            t = time.perf_counter()
            outs = prefill.step()
            t_pre = time.perf_counter() - t
            params = next(o.kv_transfer_params for o in outs if o.request_id == rid)
            decode.add_request(EngineCoreRequest(rid, ids, one, [], kv_transfer_params=params))
            t = time.perf_counter()
            while decode.kv_transfer.pulls:
                for req in decode.kv_transfer.poll()[0]:
                    decode.scheduler.add_request(req)
            t_pull = time.perf_counter() - t
            while decode.has_unfinished():
                decode.step()
            while prefill.kv_transfer.num_held:
                prefill.kv_transfer.poll()
            if r:
                best_pre, best_pull = min(best_pre, t_pre), min(best_pull, t_pull)
        blocks = decode.kv.blocks_needed(n - 1)
        nbytes = blocks * len(decode.runner.kv_tensors()) * decode.kv_transfer.connector.block_bytes
        rows.append({"prompt_tokens": n, "prefill_ms": round(best_pre * 1e3, 2), "pull_ms": round(best_pull * 1e3, 3),
                     "pull_mb": round(nbytes / 1e6, 3), "pull_gbs": round(nbytes / best_pull / 1e9, 2),
                     "pull_over_prefill": round(best_pull / best_pre, 4)})
    if a.json:
        print(json.dumps({"threads": a.threads, "rows": rows}, indent=2))
        return
    print(f"bench model, BF16, {a.threads} thread(s), best of {a.repeats}")
    print(f"{'prompt':>7} {'prefill ms':>11} {'pull ms':>9} {'pull MB':>8} {'GB/s':>6} {'pull/prefill':>13}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['prefill_ms']:>11.2f} {r['pull_ms']:>9.3f} {r['pull_mb']:>8.3f} "
              f"{r['pull_gbs']:>6.2f} {r['pull_over_prefill']:>13.4f}")


if __name__ == "__main__":
    main()

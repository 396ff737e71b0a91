"""`vllm bench serve`'s flags and result-file keys for `moeserve bench serve`, so sweep scripts written for
vLLM run unchanged (docs/from-vllm.md).

Spellings that name a moeserve option store into it (--dataset-name -> --dataset, --random-input-len ->
--input-len, --disable-tqdm -> --no-progress, ...); the others (--save-result, --result-dir,
--result-filename, --label, --percentile-metrics, --goodput, --backend, --host/--port, --burstiness,
sampling flags, --extra-body, --header, --metadata, --num-warmups, --save-detailed) are read here.
The result file holds vLLM's keys (date, backend, model_id, duration, completed, request_throughput,
mean_ttft_ms, p99_itl_ms, max_output_tokens_per_s, max_concurrent_requests, ...) beside moeserve's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from datetime import datetime

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def add_vllm_flags(p, given_action) -> None:
    S = argparse.SUPPRESS
    g = p.add_argument_group("vLLM's `vllm bench serve` spellings")
    g.add_argument("--dataset-name", dest="dataset", choices=["random", "sharegpt"], default=S, help="= --dataset")
    g.add_argument("--random-input-len", dest="input_len", type=int, default=S, help="= --input-len")
    g.add_argument("--random-output-len", dest="output_len", type=int, default=S, action=given_action,
                   help="= --output-len")
    g.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=S, help="= --range-ratio")
    g.add_argument("--disable-tqdm", dest="no_progress", action="store_true", default=S, help="= --no-progress")
    g.add_argument("--backend", choices=sorted(BACKENDS), default="openai",
                   help="openai/vllm: /v1/completions, openai-chat: /v1/chat/completions (unless --endpoint)")
    g.add_argument("--host", default=None, help="server host (with --port: the base URL)")
    g.add_argument("--port", type=int, default=None, help="server port (with --host: the base URL)")
    g.add_argument("--served-model-name", default=None, help="model name sent in requests (default: --model)")
    g.add_argument("--label", default=None, help="result file prefix and 'label' key (default: the backend)")
    g.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's file name)")
    g.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: also per-request lists (input_lens, ttfts, itls, ...)")
    g.add_argument("--append-result", action="store_true", help="append the result as one JSON line")
    g.add_argument("--result-dir", default=None, help="folder of the result JSON")
    g.add_argument("--result-filename", default=None, help="file name of the result JSON")
    g.add_argument("--percentile-metrics", default=None,
                   help="metrics reported with percentiles, of ttft,tpot,itl,e2el (default: all four)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 (= --ttft-slo-ms ...)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="arrival burstiness: gamma-distributed gaps with this shape (1 = Poisson)")
    for name in SAMPLING:
        g.add_argument("--" + name.replace("_", "-"), type=int if name == "top_k" else float, default=None,
                       help=f"send {name} (default: the request's own, temperature 0)")
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    g.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE", help="extra HTTP headers")
    g.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE", help="stored in the result JSON")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not measured) before the run")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="wait this long for the server to answer /v1/models before starting")


def _pairs(items: list[str] | None, sep: str, flag: str) -> dict[str, str]:
    out = {}
    for item in items or ():
        if sep not in item:
            raise ValueError(f"{flag} takes KEY{sep}VALUE items, got {item!r}")
        k, v = item.split(sep, 1)
        out[k] = v
    return out


def normalise(args) -> None:
    """Fold vLLM's spellings into moeserve's options (in place); refuse what cannot be honoured."""
    if args.host is not None or args.port is not None:
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    if not args.endpoint_given:
        args.endpoint = BACKENDS[args.backend]
    for key, value in _pairs(args.goodput, ":", "--goodput").items():
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput keys are ttft, tpot, e2el; got {key!r}")
        try:
            setattr(args, f"{key}_slo_ms", float(value))
        except ValueError:
            raise ValueError(f"--goodput {key}:{value}: the value is milliseconds") from None
    metrics = (args.percentile_metrics or ",".join(PERCENTILE_METRICS)).split(",")
    bad = [m for m in metrics if m not in PERCENTILE_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics takes {','.join(PERCENTILE_METRICS)}; got {bad[0]!r}")
    args.selected_metrics = metrics
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    args.headers = _pairs(args.header, "=", "--header")
    args.metadata_dict = _pairs(args.metadata, "=", "--metadata")


def request_extra(args) -> dict:
    extra = {k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None}
    return {**extra, **(args.extra_body or {})}


def result_doc(args, m: dict, results, started_at: datetime) -> dict:
    """vLLM's result keys (and moeserve's beside them)."""
    ok = [r for r in results if r.success]
    label = args.label or args.backend
    doc = {"date": started_at.strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend, "backend": args.backend,
           "label": label, "model_id": args.model, "tokenizer_id": args.tokenizer or args.model,
           "num_prompts": args.num_prompts,
           "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **args.metadata_dict,
           "duration": m["duration_s"], "completed": m["completed"], "failed": m["failed"],
           "total_input_tokens": m["total_input_tokens"], "total_output_tokens": m["total_output_tokens"],
           "request_throughput": m["request_throughput"], "request_goodput": m["request_goodput"],
           "output_throughput": m["output_throughput"], "total_token_throughput": m["total_token_throughput"],
           **_peaks(ok),
           # vLLM keeps these two lists without --save-detailed; rtfx is its audio figure (0 for text)
           "latencies": [r.latency for r in ok], "queue_times": [r.queue_time for r in ok], "rtfx": 0.0,
           **vllm_spec_keys(m)}
    for name in args.selected_metrics:
        doc.update({k: v for k, v in m.items() if k.endswith(f"_{name}_ms")})
    doc.update({k: v for k, v in m.items() if k not in doc})  # moeserve's own figures
    if args.save_detailed or not (args.save_result or args.append_result):
        doc.update({"input_lens": [r.prompt_len for r in ok], "output_lens": [r.output_tokens for r in ok],
                    "start_times": [r.start for r in ok], "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok],
                    "generated_texts": [r.text for r in ok], "errors": [r.error for r in results if not r.success]})
    return doc


def vllm_spec_keys(m: dict) -> dict:
    """vLLM's spec-decode result keys and units from moeserve's figures (spec_metrics.spec_figures):
    acceptance rate in percent, per-position rates over the run's drafts. moeserve's own names stay beside
    them (its per-position rate is over the drafts that reached each position)."""
    if "spec_decode_num_draft_tokens" not in m:
        return {}
    drafts = m["spec_decode_num_drafts"]
    return {"spec_decode_acceptance_rate": 100.0 * m["spec_decode_acceptance_rate"],
            "spec_decode_acceptance_length": m["spec_decode_mean_accepted_length"],
            "spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": m["spec_decode_num_draft_tokens"],
            "spec_decode_accepted_tokens": m["spec_decode_num_accepted_tokens"],
            "spec_decode_per_position_acceptance_rates": [a / drafts if drafts else 0.0 for a in
                                                          m.get("spec_decode_accepted_tokens_per_pos", [])]}


def _peaks(ok) -> dict:
    """max_output_tokens_per_s (the busiest wall-clock second) and max_concurrent_requests (vLLM's)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    per_second: dict[int, int] = {}
    edges = []
    for r in ok:
        t = r.start + r.ttft
        for gap in [0.0] + list(r.itl):
            t += gap
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        edges += [(r.start, 1), (r.start + r.latency, -1)]
    running = peak = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        running += step
        peak = max(peak, running)
    return {"max_output_tokens_per_s": float(max(per_second.values())), "max_concurrent_requests": peak}


def result_path(args, started_at: datetime) -> str | None:
    """vLLM's file name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json (or --result-filename)."""
    if not (args.save_result or args.append_result):
        return None
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps{conc}-"
                                    f"{os.path.basename(args.model.rstrip('/'))}-{started_at.strftime('%Y%m%d-%H%M%S')}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def save(args, doc: dict, path: str) -> None:
    if args.append_result and os.path.exists(path):
        with open(path, "a") as f:
            f.write("\n" + json.dumps(doc))
        return
    with open(path, "w") as f:
        json.dump(doc, f)

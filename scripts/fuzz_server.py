"""Release check: a long fuzz run against a real `moeserve serve` (the suite's test_fuzz.py is the short one).

    PYTHONPATH=. python scripts/fuzz_server.py --examples 2000            # tiny checkpoint, capped work
    PYTHONPATH=. python scripts/fuzz_server.py --examples 500 --all       # every field, no caps
    PYTHONPATH=. python scripts/fuzz_server.py --url http://127.0.0.1:8000 --examples 500

Bodies come from the server's /openapi.json (plus junk JSON and bytes). Every 5xx is printed with the body
that caused it; after the run a normal request must still be served. Exit code 1 when anything failed.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile

import httpx
from hypothesis import HealthCheck, given, settings

from tests.entrypoints.fuzz import CHEAP, body_schemas, bodies, capped, post
from tests.entrypoints.test_fuzz import ENGINE_SIDE, _without

PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def fuzz(url: str, examples: int, everything: bool) -> int:
    schemas = body_schemas(httpx.get(url + "/openapi.json", timeout=30).json())
    failures = 0
    with httpx.Client(timeout=120) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for path in PATHS:
            schema = capped(schemas[path], {} if everything else CHEAP, model)
            if not everything:
                schema = _without(schema, ENGINE_SIDE)
            codes: collections.Counter = collections.Counter()

            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(bodies(schema))
            def run(body):
                nonlocal failures
                try:
                    r = post(client, url + path, body)
                except httpx.TransportError as e:
                    codes["transport error"] += 1
                    failures += 1
                    print(f"{path}: {type(e).__name__} for {body[:300]!r}", flush=True)
                    return
                codes[r.status_code] += 1
                if r.status_code >= 500:
                    failures += 1
                    print(f"{path}: {r.status_code} for {body[:300]!r}: {r.text[:300]}", flush=True)
            run()
            print(f"{path}: {dict(sorted(codes.items(), key=str))}", flush=True)
        ok = client.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    served = ok.status_code == 200
    print(f"a normal request afterwards: {ok.status_code}; 5xx or transport errors: {failures}")
    return 0 if served and not failures else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one on the tiny checkpoint)")
    ap.add_argument("--examples", type=int, default=1000, help="requests per endpoint")
    ap.add_argument("--all", action="store_true",
                    help="also the sampling fields the suite holds back, and no caps on max_tokens/n")
    args = ap.parse_args()
    if args.url:
        return fuzz(args.url.rstrip("/"), args.examples, args.all)
    from tests.checkpoints import write_checkpoint
    from tests.entrypoints.server import ServerProcess
    with tempfile.TemporaryDirectory() as d:
        server = ServerProcess(write_checkpoint(d, "v3"), "--max-model-len", "64", "--dtype", "float32")
        try:
            return fuzz(server.url, args.examples, args.all)
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())

"""`moeserve proxy --prefill URL... --decode URL...`: the PD front end (entrypoints/pd_proxy.py)."""
from __future__ import annotations

import logging
import os
import sys


def register(sub) -> None:
    from moeserve.help_format import HelpFormatter
    from moeserve.config import DEFAULT_MAX_REQUEST_BODY

    p = sub.add_parser("proxy", help="one OpenAI endpoint over prefill and decode instances (PD disaggregation)",
                       formatter_class=HelpFormatter)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (moeserve serve --kv-transfer-config ...), e.g. http://10.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")
    p.add_argument("--api-key", default=os.environ.get("MOESERVE_PROXY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' from clients (default: $MOESERVE_PROXY_API_KEY)")
    p.add_argument("--instance-api-key", default=os.environ.get("MOESERVE_API_KEY"),
                   help="the key the proxy sends the instances (their --api-key; default: $MOESERVE_API_KEY); "
                        "clients' keys are never forwarded")
    p.add_argument("--max-request-body-size", type=int, default=DEFAULT_MAX_REQUEST_BODY, metavar="BYTES",
                   help="a larger request body is refused with 413 before it is read (as `serve`'s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from moeserve.entrypoints.pd_proxy import Proxy, build_app
    from moeserve.disagg.trust import resolve_secret
    from moeserve.entrypoints.api_server import listen_socket

    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--prefill/--decode take instance URLs such as http://127.0.0.1:8100, got {url!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.max_request_body_size < 1024:
        raise ValueError(f"--max-request-body-size must be >= 1024 bytes, got {args.max_request_body_size}")
    for flag, key in (("--api-key", args.api_key), ("--instance-api-key", args.instance_api_key)):
        if key is not None and not key:
            raise ValueError(f"{flag} must not be empty")
    secret = resolve_secret(None, "moeserve proxy")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [proxy] %(message)s")
    sock = listen_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    app = build_app(Proxy(args.prefill, args.decode, args.timeout, secret=secret, api_key=args.api_key,
                          instance_api_key=args.instance_api_key), args.max_request_body_size)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30))
    # printed whatever the log level: scripts and supervisors wait for this line (as for `serve`)
    print(f"moeserve proxy ready on http://{host}:{port} (prefill {', '.join(args.prefill)}; "
          f"decode {', '.join(args.decode)})", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0

"""`moeserve serve [MODEL]`: the OpenAI-compatible HTTP server (engine flags as for `generate`)."""
from __future__ import annotations

import os

from moeserve.cli import HelpFormatter
from moeserve.config import DEFAULT_MAX_REQUEST_BODY, EngineArgs, ServerConfig


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (default: the bundled model)",
                       formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder (default: the bundled model)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="API-server processes accepting on the one listening socket")
    g.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOESERVE_API_KEY)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 when this many requests already wait in the engine (default: no bound)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint folder's name)")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the tokenizer's, else a plain role: content one)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\": the model decides, --tool-call-parser reads its calls")
    g.add_argument("--tool-call-parser", default=None,
                   help="how the model writes tool calls: deepseek_v3 (DeepSeek V3 / R1 / V3.1 markers)")
    g.add_argument("--reasoning-parser", default=None,
                   help="split thinking into reasoning_content: deepseek_r1 (always thinks), deepseek_v3 "
                        "(V3.1: when chat_template_kwargs has thinking: true)")
    g.add_argument("--max-request-body-size", type=int, default=DEFAULT_MAX_REQUEST_BODY, metavar="BYTES",
                   help="a larger request body is refused with 413 before it is read")
    g.add_argument("--shutdown-timeout", type=float, default=20.0, metavar="S",
                   help="on SIGTERM, seconds the requests in flight (streams too) get to finish")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="engine-core deaths in a row that are restarted (0: none); then the deployment exits 1")
    g.add_argument("--engine-restart-backoff", type=float, default=1.0, metavar="S",
                   help="seconds before the first engine-core restart, doubled for each further one (max 30)")
    g.add_argument("--engine-stall-timeout", type=float, default=5.0, metavar="S",
                   help="/health answers 503 when the engine (or a DP rank with work) made no progress this long")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from moeserve.entrypoints.launcher import serve
    from moeserve.models.registry import resolve_model_path

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given ({args.model_tag!r} and --model {args.model!r}); pass one")
    engine_args = EngineArgs.from_cli(args, args.model_tag or args.model)
    engine_args.model = resolve_model_path(engine_args.model)
    template = None
    if args.chat_template:
        if not os.path.isfile(args.chat_template):
            raise FileNotFoundError(f"--chat-template {args.chat_template!r} is not a file")
        with open(args.chat_template) as f:
            template = f.read()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_tag or args.model
                                                                       or engine_args.model))
    server = ServerConfig(served_model_name=name, host=args.host, port=args.port,
                          api_server_count=args.api_server_count, api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests, chat_template=template,
                          log_level=args.log_level, enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          max_request_body_size=args.max_request_body_size, shutdown_timeout=args.shutdown_timeout,
                          max_engine_restarts=args.max_engine_restarts,
                          engine_restart_backoff=args.engine_restart_backoff,
                          engine_stall_timeout=args.engine_stall_timeout)
    return serve(engine_args, server)

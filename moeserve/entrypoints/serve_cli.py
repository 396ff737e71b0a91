"""`moeserve serve [MODEL]`: the OpenAI-compatible HTTP server (engine flags as for `generate`)."""
from __future__ import annotations

import argparse
import json
import os

from moeserve.help_format import HelpFormatter
from moeserve.config_file import CONFIG_HELP
from moeserve.config import DEFAULT_MAX_REQUEST_BODY, ServerConfig
from moeserve.engine_args import EngineArgs
from moeserve.entrypoints.reasoning import REASONING_PARSERS
from moeserve.entrypoints.tool_calls import TOOL_CALL_PARSERS
from moeserve.entrypoints.vllm_flag_table import add_accepted_flags, check_accepted_flags


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (default: the bundled model)",
                       allow_abbrev=False,  # an unknown vLLM flag must not match a longer one (-dc: -dcp)
                       formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder (default: the bundled model)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--config", default=None, help=CONFIG_HELP)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    g.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="API-server processes accepting on the one listening socket")
    g.add_argument("--api-key", default=os.environ.get("MOESERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOESERVE_API_KEY)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 when this many requests already wait in the engine (default: no bound)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send; the first is the one reported (default: the checkpoint "
                        "folder's name)")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="answer 503 when this many requests are in flight, waiting or running (default: no bound)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's id, prompt length and sampling parameters as it arrives, and its end")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (uvicorn); info logs every request line")
    g.add_argument("--ssl-keyfile", default=None, help="private key file for HTTPS")
    g.add_argument("--ssl-certfile", default=None, help="certificate file for HTTPS")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    g.add_argument("--root-path", default=None,
                   help="path prefix when a proxy serves this under a sub-path (FastAPI root_path)")
    g.add_argument("--allowed-origins", type=json.loads, default=None,
                   help='CORS: JSON list of allowed origins, e.g. \'["https://ui.example"]\' (default: no CORS)')
    g.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: JSON list of methods")
    g.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: JSON list of headers")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False, help="CORS: allow credentials")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the tokenizer's, else a plain role: content one)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help="serve tool_choice \"auto\": the model decides, --tool-call-parser reads its calls")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls: deepseek_v3, deepseek_v31 or deepseek_v32 (one parser reads DeepSeek V3 / R1, V3.1 and V3.2 DSML calls)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
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
    g.add_argument("--engine-standby", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("MOESERVE_ENGINE_STANDBY", "1") != "0",
                   help="keep the next engine core started and waiting (its interpreters up, imports done, DP "
                        "rank processes too), so a restart after a death skips that (default on; "
                        "MOESERVE_ENGINE_STANDBY=0 makes off the default, as the test suite does)")
    v = p.add_argument_group("vLLM ops flags (vLLM's meaning; docs/from-vllm.md)")
    v.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests, also log the prompt and its token ids, each cut to this "
                        "length (default: the log carries prompt lengths, never prompt text)")
    v.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="no access log line per request (there is none below --uvicorn-log-level info)")
    v.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=None,
                   help="usage carries prompt_tokens_details.cached_tokens (default: it always does here; "
                        "--no-enable-prompt-tokens-details leaves it null, as vLLM without the flag)")
    v.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                   help="every stream ends with a usage chunk, as if stream_options.include_usage were set")
    v.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                   help="answers carry an X-Request-Id header: the request's own X-Request-Id, else a fresh id")
    v.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                   help="serve no /docs and no /openapi.json")
    v.add_argument("--response-role", default="assistant",
                   help="the role of chat answers to a generation prompt (with add_generation_prompt false: the "
                        "role of the message continued)")
    v.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                   help="logprobs name tokens as 'token_id:N' (a request's return_tokens_as_token_ids overrides)")
    v.add_argument("--headless", action="store_true",
                   help="vLLM's multi-node DP: this node runs DP ranks and no API server (in moeserve every node "
                        "but node 0 does; this checks the node is one)")
    EngineArgs.add_cli_args(p)
    add_accepted_flags(p)
    p.set_defaults(func=run)


def _vllm_server_options(args) -> dict:
    """Server flags spelled as vLLM spells them (docs/from-vllm.md)."""
    lists = {k: tuple(getattr(args, k) or ()) for k in ("allowed_origins", "allowed_methods", "allowed_headers")}
    for k, v in lists.items():
        if not all(isinstance(x, str) for x in v):
            raise ValueError(f"--{k.replace('_', '-')} must be a JSON list of strings, got {list(v)!r}")
    for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if getattr(args, k) and not os.path.isfile(getattr(args, k)):
            raise FileNotFoundError(f"--{k.replace('_', '-')} {getattr(args, k)!r} is not a file")
    return dict(max_num_queued_reqs=args.max_num_queued_reqs, enable_log_requests=args.enable_log_requests,
                uvicorn_log_level=args.uvicorn_log_level, ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                root_path=args.root_path, allow_credentials=args.allow_credentials, **lists)


def _vllm_ops_flags(args) -> dict:
    """vLLM's ops flags, checked: the ServerConfig fields they set; the accepted-without-effect vLLM flags of
    the table (vllm_flag_table.py) logged once at INFO."""
    import logging

    if args.disable_uvicorn_access_log and args.uvicorn_log_level not in ("info", "debug", "trace"):
        logging.getLogger("moeserve").info("--disable-uvicorn-access-log: there is no access log at "
                                           "--uvicorn-log-level %s anyway", args.uvicorn_log_level)
    if args.max_log_len is not None and not args.enable_log_requests:
        logging.getLogger("moeserve").info("--max-log-len has no effect without --enable-log-requests")
    check_accepted_flags(args, logging.getLogger("moeserve"))
    return dict(enable_force_include_usage=args.enable_force_include_usage,
                enable_request_id_headers=args.enable_request_id_headers,
                disable_fastapi_docs=args.disable_fastapi_docs, max_log_len=args.max_log_len,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids, response_role=args.response_role,
                disable_uvicorn_access_log=args.disable_uvicorn_access_log,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details)


def run(args) -> int:
    import logging

    from moeserve.entrypoints.launcher import serve

    # as launcher.serve configures it, so that build_configs' INFO lines (flags without effect) are shown
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [serve] %(message)s")
    return serve(*build_configs(args))


def build_configs(args) -> tuple[EngineArgs, ServerConfig]:
    """The parsed flags -> (engine options, server options), checked."""
    from moeserve.hf_model import resolve_model, served_model_names
    from moeserve.models.registry import resolve_model_path

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given ({args.model_tag!r} and --model {args.model!r}); pass one")
    ops = _vllm_ops_flags(args)
    engine_args = EngineArgs.from_cli(args, args.model_tag or args.model)
    given = args.model_tag or args.model
    engine_args.model = resolve_model_path(resolve_model(given, engine_args.revision, engine_args.download_dir))
    if engine_args.tokenizer is not None:
        engine_args.tokenizer = resolve_model(engine_args.tokenizer, None, engine_args.download_dir, "--tokenizer")
    if getattr(args, "headless", False):
        engine_args._apply_vllm_mappings()
        if engine_args.node_rank == 0:
            raise ValueError("--headless: this node holds DP rank 0, which serves the API; on the other nodes give "
                             "--data-parallel-start-rank (vLLM) or --node-rank, or drop --headless here")
    template = None
    if args.chat_template:
        if not os.path.isfile(args.chat_template):
            raise FileNotFoundError(f"--chat-template {args.chat_template!r} is not a file")
        with open(args.chat_template) as f:
            template = f.read()
    names = args.served_model_name or served_model_names(given, engine_args.model)
    server = ServerConfig(served_model_name=names[0], served_model_aliases=tuple(names[1:]),
                          host=args.host, port=args.port,
                          api_server_count=args.api_server_count, api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests, chat_template=template,
                          log_level=args.log_level, enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          max_request_body_size=args.max_request_body_size, shutdown_timeout=args.shutdown_timeout,
                          max_engine_restarts=args.max_engine_restarts,
                          engine_restart_backoff=args.engine_restart_backoff,
                          engine_stall_timeout=args.engine_stall_timeout,
                          engine_standby=args.engine_standby,
                          **_vllm_server_options(args), **ops)
    return engine_args, server

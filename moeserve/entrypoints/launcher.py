"""`moeserve serve`: start the engine-core process and the API-server processes, then supervise them.

Lifecycle:
  1. resolve the model and the engine config (bad flags fail here, before anything starts);
  2. reserve the port: a bound, non-listening SO_REUSEPORT socket, so "port in use" is reported at once
     and --port 0 picks one free port that every API server then shares;
  3. spawn the engine core (it loads the model) and wait until it is ready;
  4. spawn --api-server-count API servers and wait until each is connected to the core and listening;
  5. print "ready on http://HOST:PORT" and supervise. If an API server dies the deployment stops. If the
     engine core dies the API servers stay up answering 503 and /health turns unhealthy, so a supervisor
     (Kubernetes, systemd) sees it and restarts the deployment. SIGINT/SIGTERM stop everything.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from moeserve.config import EngineArgs, ServerConfig
from moeserve.entrypoints.api_server import ApiServerSpec, run_api_server
from moeserve.entrypoints.engine_core_proc import run_engine_core

logger = logging.getLogger("moeserve.serve")


class Deployment:
    def __init__(self, engine_args: EngineArgs, server: ServerConfig, ready_timeout: float = 600.0) -> None:
        from moeserve.engine.launch import TorchrunEnv, check_parallel_layout, needs_ranks
        from moeserve.engine.resolve import resolve_engine_config
        from moeserve.entrypoints.metrics import cache_config_info
        from moeserve.generation_defaults import default_sampling, read_generation_config
        from moeserve.models.config import DeepseekArch
        from moeserve.tokenizer import eos_token_ids, load_tokenizer

        self.engine_args, self.server = engine_args, server
        self.ready_timeout = ready_timeout
        path = engine_args.model
        arch = DeepseekArch.from_pretrained(path)
        self.config = resolve_engine_config(engine_args, arch.max_position_embeddings)
        if self.config.model.skip_tokenizer_init:
            raise ValueError("--skip-tokenizer-init is not supported by `moeserve serve` yet (its API servers "
                             "detokenize); use it with LLM(skip_tokenizer_init=True)")
        if needs_ranks(self.config.parallel, TorchrunEnv.detect()):
            check_parallel_layout(self.config, arch)  # here, not as a failure in the engine-core process
        tokenizer_path = self.config.model.tokenizer or path
        eos = eos_token_ids(load_tokenizer(tokenizer_path), arch.eos_token_ids, read_generation_config(path))
        self.reserved = _reserve_port(server.host, server.port)
        self.port = self.reserved.getsockname()[1]
        self.tmpdir = tempfile.mkdtemp(prefix="moeserve-")
        self.engine_address = f"ipc://{self.tmpdir}/engine-0.sock"
        self.spec = dict(server=_with_port(server, self.port), engine_address=self.engine_address,
                         model_path=path, tokenizer_path=tokenizer_path, eos_token_ids=eos,
                         max_model_len=self.config.scheduler.max_model_len,
                         kv_role=self.config.kv_transfer.kv_role if self.config.kv_transfer else None,
                         default_sampling=default_sampling(engine_args.generation_config, path,
                                                          engine_args.override_generation_config),
                         cache_info=cache_config_info(self.config))
        self.ctx = multiprocessing.get_context("spawn")
        self.engine = None
        self.api_servers: list = []

    def start(self) -> None:
        metrics_dir = os.path.join(self.tmpdir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the spawned API servers
        ready = self.ctx.Event()
        self.engine = self.ctx.Process(
            target=run_engine_core, name="moeserve-engine-core-0", daemon=False,
            args=(self.config, self.engine_address, 0, self.server.max_waiting_requests,
                  self.server.log_level.upper(), ready),
            kwargs={"max_num_queued_reqs": self.server.max_num_queued_reqs,
                    "log_stats": not self.engine_args.disable_log_stats})
        self.engine.start()
        logger.info("engine core process pid=%d starting (model %s)", self.engine.pid, self.config.model.model)
        self._wait_ready(ready, self.engine, "the engine core")
        for i in range(self.server.api_server_count):
            ev = self.ctx.Event()
            p = self.ctx.Process(target=run_api_server, name=f"moeserve-api-server-{i}",
                                 args=(ApiServerSpec(index=i, **self.spec), ev))
            p.start()
            self.api_servers.append((p, ev))
        for i, (p, ev) in enumerate(self.api_servers):
            self._wait_ready(ev, p, f"API server {i}")
            logger.info("API server %d pid=%d ready", i, p.pid)

    def _wait_ready(self, event, proc, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not event.wait(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"{what} exited during startup (exit code {proc.exitcode}); see its log above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} was not ready after {self.ready_timeout:.0f} s")

    def supervise(self) -> int:
        """Block until an API server exits (or a signal). Returns the exit code."""
        engine_reported = False
        while True:
            sentinels = [p.sentinel for p, _ in self.api_servers]
            if not engine_reported:
                sentinels.append(self.engine.sentinel)
            multiprocessing.connection.wait(sentinels)
            if not engine_reported and not self.engine.is_alive():
                self.engine.join()
                engine_reported = True
                logger.error("the engine core process exited (code %s); API servers answer 503 and /health "
                             "is unhealthy until the deployment is restarted", self.engine.exitcode)
            dead = [i for i, (p, _) in enumerate(self.api_servers) if not p.is_alive()]
            if dead:
                logger.error("API server %d exited (code %s); stopping", dead[0],
                             self.api_servers[dead[0]][0].exitcode)
                return 1

    def shutdown(self) -> None:
        # The engine core first: it says goodbye to the API servers, which then log a stop, not a crash.
        procs = ([self.engine] if self.engine else []) + [p for p, _ in self.api_servers]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self.reserved.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _reserve_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --host/--port") from None
    return s


def _with_port(server: ServerConfig, port: int) -> ServerConfig:
    import dataclasses
    return dataclasses.replace(server, port=port)


def serve(engine_args: EngineArgs, server: ServerConfig) -> int:
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s [serve] %(message)s")
    dep = Deployment(engine_args, server)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        dep.start()
        host = f"[{server.host}]" if ":" in server.host else server.host
        print(f"moeserve serve: ready on {'https' if server.ssl_certfile else 'http'}://{host}:{dep.port} (model '{server.served_model_name}', "
              f"engine core pid {dep.engine.pid}, API server pids "
              f"{','.join(str(p.pid) for p, _ in dep.api_servers)})", file=sys.stderr, flush=True)
        return dep.supervise()
    except KeyboardInterrupt:
        logger.info("shutting down")
        return 0
    except RuntimeError as e:  # a process failed to start; its own log says why
        print(f"moeserve serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        dep.shutdown()

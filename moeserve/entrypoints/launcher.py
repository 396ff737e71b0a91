"""`moeserve serve`: start the engine-core process and the API-server processes, then supervise them.

Lifecycle:
  1. resolve the model and the engine config (bad flags fail here, before anything starts);
  2. bind and listen on the port once, without SO_REUSEPORT: a port another program (or another
     `moeserve serve`) holds is an error naming --port; the listening socket is handed to every API
     server, so only this deployment's API servers accept on it;
  3. spawn the engine core (it loads the model) and wait until it is ready;
  4. spawn --api-server-count API servers and wait until each is connected to the core and listening;
  5. print "ready on http://HOST:PORT" and supervise:
     - the engine core exits (a crash, a killed DP rank): requests in flight wait, the API servers
       answer 503 and /health is 503, and the core is started again after a backoff (1 s, 2 s, 4 s ...
       --engine-restart-backoff): the standby engine core (--engine-standby, on by default: started ahead
       with its interpreters up and imports done, its DP rank processes too) is told to go, else a fresh
       one starts; the API servers reconnect on their own, resume the requests in flight and serve again. More than
       --max-engine-restarts deaths in a row (without a minute of service between them) stop the
       deployment with exit code 1, for an outer supervisor;
     - an API server exits (a crash, kill -9): its own connections end; the others keep serving on the shared
       listening socket (the launcher keeps a copy of it, so the port never closes) and the launcher starts
       a replacement with the same index after the same backoff as the engine core; more than
       --max-engine-restarts deaths of one API server in a row stop the deployment (exit code 1);
     - SIGTERM/SIGINT: a graceful stop (Deployment.shutdown): the API servers stop accepting and finish the
       requests in flight (streams too) within --shutdown-timeout; those still running then end with an
       error naming the shutdown (a stream: an error event and [DONE]; else a 503); then the engine core stops.
"""
from __future__ import annotations

import dataclasses
import errno
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

from moeserve.config import ServerConfig

from moeserve.engine_args import EngineArgs
from moeserve.entrypoints.api_server import GRACE_BACKSTOP_S, ApiServerSpec, listen_socket, run_api_server
from moeserve.engine.engine_core_proc import run_engine_core

logger = logging.getLogger("moeserve.serve")

HEALTHY_RUN_S = 60.0  # an engine core that served this long before dying starts a fresh restart count
MAX_BACKOFF_S = 30.0
STANDBY_DELAY_S = 2.0  # after a restart, the next standby engine core starts once the new one served this long
ENGINE_STOP_S = 10.0  # after SIGTERM, before SIGKILL


def describe_config(config, server: ServerConfig, engine_args: EngineArgs) -> str:
    """The resolved configuration in one line, as vLLM logs it at start ("Initializing a V1 LLM engine ... with
    config: model=..., tensor_parallel_size=..."), with moeserve's layout terms (EP, MoE transport, nodes)."""
    from moeserve.version import __version__

    m, c, s, p, q = config.model, config.cache, config.scheduler, config.parallel, config.quant
    spec = config.speculative
    kvt = config.kv_transfer
    pool = (f"{c.num_kv_blocks} blocks" if c.num_kv_blocks else f"{c.kv_cache_memory} bytes" if c.kv_cache_memory
            else f"gpu_memory_utilization {c.gpu_memory_utilization}" if c.gpu_memory_utilization else "default")
    fields = {
        "model": repr(m.model), "served_model_name": list(server.served_model_names),
        "tokenizer": repr(m.tokenizer or m.model), "dtype": m.dtype, "max_seq_len": s.max_model_len,
        "quantization": q.method, "checkpoint_format": q.checkpoint_format, "kv_cache_dtype": c.cache_dtype,
        "tensor_parallel_size": p.tensor_parallel_size, "data_parallel_size": p.data_parallel_size,
        "enable_expert_parallel": p.enable_expert_parallel, "moe_comm": p.resolved_moe_comm,
        "nnodes": p.nnodes, "node_rank": p.node_rank,
        "speculative_config": f"{spec.method}(num_speculative_tokens={spec.num_speculative_tokens})" if spec else None,
        "kv_transfer_config": f"{kvt.kv_connector}({kvt.kv_role})" if kvt else None,
        "enforce_eager": m.enforce_eager, "decode_graph_sizes": m.decode_graph_sizes,
        "block_size": c.block_size, "kv_pool": pool, "enable_prefix_caching": c.enable_prefix_caching,
        "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
        "enable_chunked_prefill": s.enable_chunked_prefill, "scheduling_policy": s.policy,
        "enable_eplb": p.enable_eplb, "num_redundant_experts": p.num_redundant_experts, "seed": m.seed,
    }
    return f"Initializing moeserve {__version__} engine with config: " + ", ".join(f"{k}={v}" for k, v in fields.items())


class Deployment:
    def __init__(self, engine_args: EngineArgs, server: ServerConfig, ready_timeout: float = 600.0) -> None:
        from moeserve.engine.launch import TorchrunEnv, check_parallel_layout, needs_ranks
        from moeserve.engine.resolve import resolve_engine_config
        from moeserve.entrypoints.metrics import cache_config_info
        from moeserve.generation_defaults import default_sampling, read_generation_config
        from moeserve.arch import DeepseekArch
        from moeserve.tokenizer import eos_token_ids, load_tokenizer

        self.engine_args, self.server = engine_args, server
        self.ready_timeout = ready_timeout
        path = engine_args.model
        arch = DeepseekArch.from_pretrained(path)
        config = resolve_engine_config(engine_args, arch.max_position_embeddings)
        # the engine core declares a stopped rank dead after the server's --engine-stall-timeout
        self.config = dataclasses.replace(config, parallel=dataclasses.replace(
            config.parallel, stall_timeout=server.engine_stall_timeout))
        if self.config.model.skip_tokenizer_init:
            raise ValueError("--skip-tokenizer-init is not supported by `moeserve serve` yet (its API servers "
                             "detokenize); use it with LLM(skip_tokenizer_init=True)")
        if needs_ranks(self.config.parallel, TorchrunEnv.detect()):
            check_parallel_layout(self.config, arch)  # here, not as a failure in the engine-core process
        logger.info("%s", describe_config(self.config, server, engine_args))
        tokenizer_path = self.config.model.tokenizer or path
        eos = eos_token_ids(load_tokenizer(tokenizer_path), arch.eos_token_ids, read_generation_config(path))
        self.listener = _listen(server.host, server.port)
        self.port = self.listener.getsockname()[1]
        self.tmpdir = tempfile.mkdtemp(prefix="moeserve-")
        self.engine_address = f"ipc://{self.tmpdir}/engine-0.sock"
        self.spec = dict(server=dataclasses.replace(server, port=self.port), engine_address=self.engine_address,
                         model_path=path, tokenizer_path=tokenizer_path, eos_token_ids=eos,
                         max_model_len=self.config.scheduler.max_model_len,
                         kv_role=self.config.kv_transfer.kv_role if self.config.kv_transfer else None,
                         kv_secret=self.config.kv_transfer.kv_secret if self.config.kv_transfer else None,
                         default_sampling=default_sampling(engine_args.generation_config, path,
                                                          engine_args.override_generation_config),
                         cache_info=cache_config_info(self.config), logprobs_mode=self.config.model.logprobs_mode)
        self.ctx = multiprocessing.get_context("spawn")
        self.engine = None
        self.standby = None  # (process, pipe) of the next engine core, waiting (see _spawn_standby)
        self.standby_due: float | None = None  # when to start the next standby (after a restart)
        self.engine_started = 0.0
        self.api_servers: list = []
        self.api_started: dict[int, float] = {}  # API server index -> when it started
        self.api_deaths: dict[int, int] = {}  # API server index -> deaths in a row

    def start(self) -> None:
        metrics_dir = os.path.join(self.tmpdir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the spawned API servers
        self._start_engine()
        ready = [self._spawn_api_server(i) for i in range(self.server.api_server_count)]
        for i, (p, ev) in enumerate(zip(self.api_servers, ready)):
            self._wait_ready(ev, p, f"API server {i}")
            logger.info("API server %d pid=%d ready", i, p.pid)
        # A ready event is a handful of named POSIX semaphores, registered with multiprocessing's resource
        # tracker and unlinked only when the event is freed (or at a normal exit of this process): kept for
        # the deployment's life, a launcher that did not exit normally (a kill, a second signal) left them
        # to the tracker's "leaked semaphore objects" warning. They are needed only until ready.
        ready = ev = None
        self._spawn_standby()  # once all is up: its start does not slow the first one
        # The listening socket stays open here too (never accepted on): a replacement API server gets it, and
        # the port stays open while one is down. shutdown() closes it first.

    def _spawn_api_server(self, index: int):
        """Start API server `index` (at start-up, or replacing one that died); returns its ready event."""
        ready = self.ctx.Event()
        p = self.ctx.Process(target=run_api_server, name=f"moeserve-api-server-{index}",
                             args=(ApiServerSpec(index=index, sock=self.listener, **self.spec), ready))
        p.start()
        if index < len(self.api_servers):
            self.api_servers[index] = p
        else:
            self.api_servers.append(p)
        self.api_started[index] = time.monotonic()
        return ready

    def _engine_process(self, ready=None, standby=None):
        return self.ctx.Process(
            target=run_engine_core, name="moeserve-engine-core-0", daemon=False,
            args=(self.config, self.engine_address, 0, self.server.max_waiting_requests,
                  self.server.log_level.upper(), ready),
            kwargs={"max_num_queued_reqs": self.server.max_num_queued_reqs,
                    "log_stats": not self.engine_args.disable_log_stats, "standby": standby})

    def _start_engine(self) -> None:
        """The engine core: the standby started ahead (it has imported everything and started its rank
        processes) when there is one alive, else a fresh process; returns once it is ready."""
        standby, self.standby = self.standby, None
        if standby is not None and standby[0].is_alive():
            self.engine, conn = standby
            conn.send("go")
            ready = _PipeWait(conn)
            how = "the standby engine core"
        else:
            if standby is not None:
                self._stop_standby(standby)
            ready = self.ctx.Event()
            self.engine = self._engine_process(ready)
            self.engine.start()
            how = "engine core process"
        logger.info("%s pid=%d starting (model %s)", how, self.engine.pid, self.config.model.model)
        self._wait_ready(ready, self.engine, "the engine core")
        self.engine_started = time.monotonic()

    def _spawn_standby(self) -> None:
        """The next engine core, started now and told to go when the current one dies (run_engine_core's
        standby): a restart then skips the interpreters' start and imports. Off with --no-engine-standby."""
        if not self.server.engine_standby or self.standby is not None:
            return
        ours, theirs = self.ctx.Pipe()
        p = self._engine_process(standby=theirs)
        p.start()
        theirs.close()
        self.standby = (p, ours)
        logger.debug("standby engine core pid=%d started", p.pid)

    @staticmethod
    def _stop_standby(standby) -> None:
        p, conn = standby
        conn.close()  # it sees the pipe close and exits (its ranks with it)
        p.join(5.0)
        if p.is_alive():
            p.kill()
        p.join()

    def _wait_ready(self, event, proc, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not event.wait(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"{what} exited during startup (exit code {proc.exitcode}); see its log above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} was not ready after {self.ready_timeout:.0f} s")

    def supervise(self) -> int:
        """Block until an API server exits, or the engine core has died too often (or a signal)."""
        deaths = 0  # engine-core deaths in a row
        while True:
            due = None if self.standby_due is None else max(0.0, self.standby_due - time.monotonic())
            multiprocessing.connection.wait([p.sentinel for p in self.api_servers] + [self.engine.sentinel], due)
            if self.standby_due is not None and time.monotonic() >= self.standby_due and self.engine.is_alive():
                self.standby_due = None
                self._spawn_standby()
            for i in [i for i, p in enumerate(self.api_servers) if not p.is_alive()]:
                if not self._restart_api_server(i):
                    return 1
            if self.engine.is_alive():
                continue
            self.engine.join()
            if time.monotonic() - self.engine_started > HEALTHY_RUN_S:
                deaths = 0
            deaths += 1
            if not self._restart_engine(deaths):
                return 1

    def _restart_api_server(self, index: int) -> bool:
        """Replace API server `index` after the engine core's backoff; False when its restarts are spent.
        The others keep serving meanwhile; the dead one's requests were its own connections' (the engine core
        drops a client it cannot reach, with its requests)."""
        dead = self.api_servers[index]
        dead.join()
        _forget_metrics_of(dead.pid)
        deaths = 1 if time.monotonic() - self.api_started.get(index, 0.0) > HEALTHY_RUN_S else \
            self.api_deaths.get(index, 0) + 1
        self.api_deaths[index] = deaths
        limit = self.server.max_engine_restarts
        if deaths > limit:
            logger.error("API server %d exited (code %s) %d times in a row; giving up after --max-engine-restarts "
                         "%d and stopping the deployment", index, dead.exitcode, deaths, limit)
            return False
        delay = min(MAX_BACKOFF_S, self.server.engine_restart_backoff * 2 ** (deaths - 1))
        logger.error("API server %d (pid %d) exited (code %s); the other API servers keep serving; starting a "
                     "replacement in %.1f s (restart %d of at most %d in a row)", index, dead.pid, dead.exitcode,
                     delay, deaths, limit)
        time.sleep(delay)
        ready = self._spawn_api_server(index)
        try:
            self._wait_ready(ready, self.api_servers[index], f"API server {index}")
        except RuntimeError as e:
            logger.error("restarting API server %d failed: %s", index, e)
            self._stop(self.api_servers[index], 0.0)
            return self._restart_api_server(index)
        finally:
            ready = None  # its semaphores: see start()
        logger.info("API server %d is back (pid %d)", index, self.api_servers[index].pid)
        return True

    def _restart_engine(self, deaths: int) -> bool:
        """Start the engine core again after a backoff, until it is ready or the restarts are spent."""
        limit = self.server.max_engine_restarts
        while True:
            code = self.engine.exitcode
            if deaths > limit:
                logger.error("the engine core exited (code %s) %d times in a row; giving up after "
                             "--max-engine-restarts %d and stopping the deployment", code, deaths, limit)
                return False
            delay = min(MAX_BACKOFF_S, self.server.engine_restart_backoff * 2 ** (deaths - 1))
            logger.error("the engine core exited (code %s); API servers answer 503 meanwhile; restarting it in "
                         "%.1f s (restart %d of at most %d in a row)", code, delay, deaths, limit)
            time.sleep(delay)
            try:
                self._start_engine()
            except RuntimeError as e:
                logger.error("restarting the engine core failed: %s", e)
                self._stop(self.engine, ENGINE_STOP_S)
                deaths += 1
                continue
            logger.info("the engine core is back (pid %d); the API servers reconnect", self.engine.pid)
            # the next standby once the resumed requests' recompute and first steps had the CPU (its start,
            # the interpreters' imports, would take it from them)
            self.standby_due = time.monotonic() + STANDBY_DELAY_S
            return True

    def shutdown(self, graceful: bool = True) -> None:
        """Stop accepting, let the API servers finish what they serve (--shutdown-timeout), then stop the
        engine core. A second signal meanwhile (KeyboardInterrupt) stops everything at once."""
        # ours first: once the API servers close theirs, new connections are refused, not left in the backlog
        self.listener.close()
        try:
            if graceful:
                # their own limit is --shutdown-timeout + GRACE_BACKSTOP_S; then a little to close
                self._stop_api_servers(self.server.shutdown_timeout + GRACE_BACKSTOP_S + 5.0)
        except KeyboardInterrupt:
            logger.warning("second signal: stopping at once")
        finally:
            for p in self.api_servers:
                self._stop(p, 0.0)
            if self.standby is not None:
                self._stop_standby(self.standby)
                self.standby = None
            if self.engine is not None:
                self._stop(self.engine, ENGINE_STOP_S)
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _stop_api_servers(self, timeout: float) -> None:
        procs = [p for p in self.api_servers if p.is_alive()]
        for p in procs:
            p.terminate()  # uvicorn: stop accepting, wait for open requests up to --shutdown-timeout
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _stop(proc, timeout: float) -> None:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout)
        if proc.is_alive():
            proc.kill()
        proc.join()


class _PipeWait:
    """The launcher's side of a standby's ready signal, shaped like the Event _wait_ready polls."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def wait(self, timeout: float) -> bool:
        try:
            return self.conn.poll(timeout) and self.conn.recv() == "ready"
        except (EOFError, OSError):  # it died: _wait_ready sees the process gone
            time.sleep(timeout)
            return False


def _forget_metrics_of(pid: int) -> None:
    """A dead API server's live gauges leave the multiprocess metrics (its counters keep counting)."""
    try:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid)
    except (ImportError, OSError, KeyError):
        pass


def _listen(host: str, port: int) -> socket.socket:
    try:
        return listen_socket(host, port)
    except OSError as e:
        reason = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"cannot listen on {host}:{port} ({reason}); another server holds it: stop it or pass "
                         "another --port (or --host)") from None


def serve(engine_args: EngineArgs, server: ServerConfig) -> int:
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s [serve] %(message)s")
    dep = Deployment(engine_args, server)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    graceful = False
    try:
        dep.start()
        host = f"[{server.host}]" if ":" in server.host else server.host
        print(f"moeserve serve: ready on {'https' if server.ssl_certfile else 'http'}://{host}:{dep.port} (model '{server.served_model_name}', "
              f"engine core pid {dep.engine.pid}, API server pids "
              f"{','.join(str(p.pid) for p in dep.api_servers)})", file=sys.stderr, flush=True)
        return dep.supervise()
    except KeyboardInterrupt:
        logger.info("shutting down: finishing requests in flight (at most %.0f s, --shutdown-timeout)",
                    server.shutdown_timeout)
        graceful = True
        return 0
    except RuntimeError as e:  # a process failed to start; its own log says why
        print(f"moeserve serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        dep.shutdown(graceful)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logger.info("stopped")

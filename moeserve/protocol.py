"""Messages that cross process boundaries, as msgspec structs (msgpack on the wire, never pickle)."""
from __future__ import annotations

import msgspec

from moeserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    # Prefill/decode disaggregation (disagg/params.py): {"do_remote_decode": true} on a prefill instance,
    # the prefill's answer (block ids, agent, ...) with "do_remote_prefill" on a decode instance.
    kv_transfer_params: dict | None = None
    slo_ttft_ms: float | None = None  # SLO-aware admission targets (engine/slo.py); None: the engine's default
    slo_tpot_ms: float | None = None
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's)
    cache_salt: str | None = None  # prefix-cache blocks are shared only among requests with the same salt
    # sampling_params.structured_outputs as the checked llguidance grammar (structured/guidance.py): the
    # builder (API server, LLM) checks it, so the engine's loop never compiles a spec
    structured_grammar: bytes | None = None
    # A request resumed after an engine restart (entrypoints/engine_client.py): the tokens it generated
    # before. They follow the prompt and count as output (max_tokens, min_tokens, penalties, grammar, the
    # seed's position), so it continues exactly where it stopped; its KV is recomputed like a preemption's.
    output_token_ids: list[int] = []


class TokenLogprobsMsg(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobsMsg] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprobsMsg] | None = None  # prompt tokens 1.., with a request's first tokens
    error: str | None = None  # set when the request was rejected
    error_kind: str | None = None  # "invalid" (the request can never run) or "overloaded" (retry later)
    kv_transfer_params: dict | None = None  # a finished do_remote_decode request: what a decode instance pulls
    queue_time: float = 0.0  # with a request's first tokens: seconds from its arrival in the engine to its first step
    retry_after_s: float | None = None  # an "overloaded" rejection: when a retry may succeed (Retry-After)
    num_preemptions: int = 0  # with a request's last output: the times the scheduler preempted it


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    outstanding_tokens: int = 0
    # Totals since start, summed over ranks: bytes sent per collective kind, seconds per MoE/attention phase.
    comm_bytes: dict[str, int] = {}
    phase_seconds: dict[str, float] = {}
    num_steps: int = 0
    num_dummy_steps: int = 0  # lockstep steps a rank ran with no work of its own
    # Speculative decoding (MTP), cumulative counters; see speculative/metrics.py for the derived rates.
    spec_num_drafts: int = 0  # request-steps that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # [k]
    spec_drafts_per_position: list[int] = []  # [k]
    # Prefix caching, cumulative: prompt tokens looked up at admission, and those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Online EPLB (--enable-eplb), cumulative: rebalances run, expert copies moved between ranks.
    eplb_rebalances: int = 0
    eplb_experts_moved: int = 0
    # Seconds a DP rank with work has sent nothing (a hung rank); 0 while every busy rank reports.
    stalled_s: float = 0.0
    # SLO-aware admission (engine/slo.py), cumulative: requests with a target that finished or were turned
    # away, of those the ones inside every target, the turned-away ones; summed |predicted - measured|
    # TTFT / TPOT of admitted requests with the measured sums and counts (prediction error = err / measured).
    slo_requests: int = 0
    slo_met: int = 0
    slo_rejected: int = 0
    slo_ttft_error_s: float = 0.0
    slo_ttft_measured_s: float = 0.0
    slo_ttft_count: int = 0
    slo_tpot_error_s: float = 0.0
    slo_tpot_measured_s: float = 0.0
    slo_tpot_count: int = 0
    step_time_error: float = 0.0  # mean relative error of the step-time model's per-step prediction
    # The admission policy's prediction for a mean request arriving now (the DP router compares ranks by it):
    # its TTFT behind the queue, and the prefill seconds it adds for the next one.
    slo_ttft_estimate_s: float = 0.0
    slo_prefill_estimate_s: float = 0.0
    # --enable-elastic-ep (engine/elastic.py), from the front end: ranks lost so far and replacements that
    # joined (--elastic-ep-replace; the engine runs degraded while lost > replaced), seconds the re-formations
    # took (the last one, all of them), requests re-queued and the tokens (prompt + output so far) they recompute
    elastic_ranks_lost: int = 0
    elastic_ranks_replaced: int = 0
    elastic_last_recovery_s: float = 0.0
    elastic_recovery_s: float = 0.0
    elastic_requeued: int = 0
    elastic_tokens_recomputed: int = 0
    # Decode steps that ran through the compiled graphs (engine/compiled_decode.py), cumulative; per DP rank
    # summed (a TP group counts once)
    num_graph_steps: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens per verification step: 1 + accepted drafts."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


SLO_FIELDS = ("slo_requests", "slo_met", "slo_rejected", "slo_ttft_error_s", "slo_ttft_measured_s", "slo_ttft_count",
              "slo_tpot_error_s", "slo_tpot_measured_s", "slo_tpot_count")


def add_slo_stats(total: EngineStats, s: EngineStats) -> None:
    """total += s for the SLO counters (DP ranks' sums)."""
    for f in SLO_FIELDS:
        setattr(total, f, getattr(total, f) + getattr(s, f))
    total.step_time_error = max(total.step_time_error, s.step_time_error)


SPEC_FIELDS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
               "spec_accepted_per_position", "spec_drafts_per_position")


def add_spec_stats(total: EngineStats, s: EngineStats) -> None:
    """total += s for the speculative-decoding counters (DP ranks' sums; per-position lists elementwise)."""
    for f in SPEC_FIELDS[:3]:
        setattr(total, f, getattr(total, f) + getattr(s, f))
    for f in SPEC_FIELDS[3:]:
        a, b = getattr(total, f), getattr(s, f)
        setattr(total, f, [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))])


# ---- engine-core process <-> API server processes (ZMQ ROUTER/DEALER, see engine/engine_core_proc.py) ----
# Every ZMQ message is two frames: [kind, msgpack payload]. Kinds below; payload struct named beside.
MSG_HELLO = b"H"  # client -> core: EngineCoreHello;  core -> client: EngineCoreReady
MSG_ADD = b"A"  # client -> core: EngineCoreRequest
MSG_ABORT = b"X"  # client -> core: EngineCoreAbort
MSG_OUTPUTS = b"O"  # core -> client: EngineCoreOutputs
MSG_GOODBYE = b"G"  # either way, empty: the sender stops cleanly (a shutdown, not a crash)
MSG_FATAL = b"F"  # core -> client, UTF-8 text: why the core stops now (a rank died or stopped); a crash
MSG_UTILITY = b"U"  # client -> core: EngineCoreUtility;  core -> client: EngineCoreUtilityResult
UTILITY_CALLS = ("reset_prefix_cache",)  # what EngineCoreUtility may call on the engine


class EngineCoreHello(msgspec.Struct, array_like=True, omit_defaults=True):
    client_index: int = 0


class EngineCoreReady(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int = 0
    pid: int = 0
    num_kv_blocks: int = 0


class EngineCoreUtility(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    method: str  # one of UTILITY_CALLS


class EngineCoreUtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: bool | int | str | None = None
    error: str | None = None


class EngineCoreAbort(msgspec.Struct, array_like=True, omit_defaults=True):
    request_ids: list[str]


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's outputs for one client, with the engine's current load (also sent alone as a heartbeat)."""

    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    engine_index: int = 0
    timestamp: float = 0.0
    # A heartbeat's time.monotonic() in the core (0 on other batches). The heartbeat goes to every client at
    # once, the clock is machine-wide and the core shares the API servers' machine (ipc://): every API server
    # measures the core's silence (--engine-stall-timeout) from the same instant, so with --api-server-count
    # > 1 they all turn /health 503 together for a hung core, instead of each when its own event loop got
    # round to reading the last heartbeat (or later still, when a batch of outputs came only to it).
    sent_at: float = 0.0


# ---- multi-rank engine: front end <-> TP-leader ranks (see engine/dp_client.py, engine/dp_worker.py) ----

class RankReform(msgspec.Struct, array_like=True):
    """--enable-elastic-ep (engine/elastic.py): front end -> a surviving rank after a rank died: join epoch
    `epoch` of `world_size` ranks as `rank`, rendezvous at `init_method`."""

    epoch: int
    rank: int
    world_size: int
    init_method: str


class RankCommand(msgspec.Struct, array_like=True, omit_defaults=True):
    """Front end -> the TP-leader rank of one DP rank (and, broadcast, to its TP peers)."""

    requests: list[EngineCoreRequest] = []
    aborts: list[str] = []
    abort_status: str = "abort"  # RequestStatus value the aborted requests finish with
    shutdown: bool = False
    reset_prefix_cache: bool = False
    reform: RankReform | None = None


class RankReport(msgspec.Struct, array_like=True, omit_defaults=True):
    """A TP-leader rank -> the front end, after each step (or once when ready / failing)."""

    dp_rank: int
    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    ready: bool = False
    num_kv_blocks: int = 0  # sent with ready
    error: str | None = None  # the rank stopped; the message names it and the cause
    epoch: int = 0  # --enable-elastic-ep: the process-group epoch it was sent in (older ones are stale)
    # --enable-elastic-ep, sent with ready in a new epoch: the requests a survivor kept scheduled -> the output
    # tokens each has (the front end re-queues only the others)
    kept: dict[str, int] = {}

"""The engine core: one step = schedule -> execute -> update.

Used in-process by LLM and inside the engine-core process of the server. Requests come in as
EngineCoreRequest, results go out as EngineCoreOutput (both msgspec structs, see protocol.py).
"""
from __future__ import annotations

import logging
import time

from moeserve import host_malloc
from moeserve.config import EngineConfig, check_slo_ms
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.request import Request, RequestStatus
from moeserve.engine.scheduler import RequestRejected, ScheduledRequest, Scheduler, SchedulerOutput
from moeserve.arch import DeepseekArch
from moeserve.sampling_params import SamplingParams
from moeserve.protocol import EngineCoreOutput, EngineCoreRequest, EngineStats, TokenLogprobsMsg

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, arch: DeepseekArch | None = None) -> None:
        self.config = config
        host_malloc.keep_freed_memory()  # before the first step's temporaries: they page-fault otherwise
        self.arch = arch or DeepseekArch.from_pretrained(config.model.model)
        from moeserve.layers.attention import amla
        amla.set_decode_impl(config.model.mla_decode)  # the MLA decode path of this process (mla.py's hook)
        self.runner = ModelRunner(config, self.arch)
        # With MTP a block's cached KV also depends on the token after it (the MTP layer's input).
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 enable_caching=config.cache.enable_prefix_caching,
                                 hash_next_token=config.speculative is not None)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.speculative, self._admission(config))
        self._pending: list[EngineCoreOutput] = []  # rejections and aborts reported on the next step
        self.kv_transfer = None  # prefill/decode disaggregation (engine/kv_transfer.py)
        self.structured = None  # guided decoding: built on the first request that asks for it
        if config.kv_transfer is not None:
            from moeserve.engine.kv_transfer import KVTransfer
            from moeserve.distributed.parallel_state import get_world_group
            world = get_world_group()
            self.kv_transfer = KVTransfer(config.kv_transfer, self.kv, self.runner.kv_tensors(), world.rank,
                                          world.world_size)

    @staticmethod
    def _admission(config: EngineConfig):
        """SLO-aware admission (engine/slo.py): inert for requests without targets, so on whenever it can
        be. Not with TP > 1: each TP rank schedules for itself, and decisions from each rank's own clock
        would split their batches."""
        if config.parallel.tensor_parallel_size > 1:
            return None
        from moeserve.engine.slo import SLOAdmission
        from moeserve.engine.step_time import StepTimeModel, planner_prior
        sc = config.scheduler
        return SLOAdmission(StepTimeModel(planner_prior(config.model.model)), time.monotonic,
                            sc.max_num_batched_tokens, sc.slo_ttft_ms, sc.slo_tpot_ms, sc.max_num_seqs)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; a request that can never run is answered with an error output instead."""
        try:
            request = Request(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                              eos_token_ids=list(req.eos_token_ids or self.arch.eos_token_ids),
                              priority=req.priority, cache_salt=req.cache_salt,
                              output_token_ids=list(req.output_token_ids))
            if req.priority and self.config.scheduler.policy != "priority":
                raise RequestRejected(f"priority {req.priority} needs a server started with --scheduling-policy "
                                      "priority")
            self._check_vocab(request)
            request.slo_ttft_ms = check_slo_ms(req.slo_ttft_ms, "slo_ttft_ms")
            request.slo_tpot_ms = check_slo_ms(req.slo_tpot_ms, "slo_tpot_ms")
            self._check_logprobs(req.sampling_params)
            if self.scheduler.admission is None and (request.slo_ttft_ms or request.slo_tpot_ms):
                raise RequestRejected("slo_ttft_ms / slo_tpot_ms need an engine with --tensor-parallel-size 1 "
                                      "(SLO-aware admission); omit them on this server")
            if req.sampling_params.structured_outputs is not None:
                request.grammar = self._structured().matcher(req.sampling_params.structured_outputs,
                                                             req.structured_grammar)
            if req.kv_transfer_params is not None and self._add_disaggregated(request, req.kv_transfer_params):
                return
            self.scheduler.add_request(request)
        except (RequestRejected, ValueError) as e:
            self._pending.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", error=str(e)))
        except Exception as e:  # noqa: BLE001 - whatever one request carries, it must not end the engine core
            logger.exception("request %s could not be added", req.request_id)
            self._pending.append(EngineCoreOutput(req.request_id, [], finish_reason="abort", error_kind="internal",
                                                  error=f"the request could not be added: {type(e).__name__}: {e}"))

    def _add_disaggregated(self, request: Request, raw: dict) -> bool:
        """A PD request: True if it now waits for its KV pull (the scheduler gets it when the KV is here)."""
        from moeserve.disagg.params import KVTransferParams, KVTransferParamsError
        params = KVTransferParams.parse(raw)
        if params.remote is None and not params.do_remote_decode:
            return False
        if self.kv_transfer is None:
            raise KVTransferParamsError("kv_transfer_params need an engine started with --kv-transfer-config "
                                        "'{\"kv_connector\": \"nixl\"}'")
        self.kv_transfer.check(request, params)
        if params.remote is None:
            request.hold_kv = True
            return False
        if request.request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        self.scheduler.check_request(request)
        self.kv_transfer.add_pull(request, params.remote)
        return True

    def _structured(self):
        if self.structured is None:
            from moeserve.structured.grammar import StructuredOutputManager
            self.structured = StructuredOutputManager(self.config.model.tokenizer or self.config.model.model,
                                                      self.arch.vocab_size)
        return self.structured

    def _check_vocab(self, request: Request) -> None:
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.arch.vocab_size - 1})")
        params, vocab = request.sampling_params, self.arch.vocab_size
        for name, ids in (("logit_bias token id", params.logit_bias), ("stop_token_ids entry", params.stop_token_ids),
                          ("allowed_token_ids entry", params.allowed_token_ids or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(f"{name} {bad} is outside the vocabulary (0..{vocab - 1})")

    def _check_logprobs(self, p: SamplingParams) -> None:
        """--max-logprobs (allowed_token_ids are checked against the vocabulary in _check_vocab)."""
        most = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(p, name)
            if n is not None and n > most:
                raise RequestRejected(f"{name} {n} is more than this server returns (--max-logprobs {most})")

    def abort_requests(self, request_ids: list[str], reason: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        for rid in request_ids:
            # PD: a pull in flight is dropped; KV held for a decode instance that will never pull it is freed
            if self.kv_transfer is not None and (self.kv_transfer.abort(rid) | self.kv_transfer.release(rid)):
                continue
            if rid in self.scheduler.requests:
                self.scheduler.requests[rid].hold_kv = False  # its answer is settled: nobody will pull its KV
                self.scheduler.finish_request(rid, reason)
                self.runner.release(rid)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + (len(self.kv_transfer.pulls) if self.kv_transfer else 0)

    def has_unfinished(self) -> bool:
        return self.has_schedulable() or (self.kv_transfer is not None and self.kv_transfer.busy)

    def has_schedulable(self) -> bool:
        """Work a step does now (requests to compute, outputs to report), not just KV transfers to wait on."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def kv_transfer_pending(self) -> bool:
        """KV pulls in flight or blocks held for a decode instance: poll_kv_transfer() soon, even when idle
        (pulls advance and pulled blocks come back without anyone spinning on empty steps)."""
        return self.kv_transfer is not None and (self.kv_transfer.busy or self.kv_transfer.num_held > 0)

    def poll_kv_transfer(self) -> None:
        """Advance KV transfers without computing: free pulled blocks, move pulls on; a request whose KV
        arrived joins the scheduler, a failed one is reported with the next step's outputs."""
        if self.kv_transfer is None:
            return
        ready, errors = self.kv_transfer.poll()
        self._pending.extend(errors)
        for request in ready:  # their KV arrived: from here on they are ordinary decodes
            self.scheduler.add_request(request)

    def step(self, token_budget: int | None = None, lockstep: bool = False) -> list[EngineCoreOutput]:
        """One step. token_budget caps this step's tokens (DP prefill balancing); with lockstep an idle
        rank still runs an empty forward, because the other ranks' MoE layers wait for it."""
        self.poll_kv_transfer()
        outputs, self._pending = self._pending, []
        sched_out = self.scheduler.schedule(token_budget)
        outputs += [EngineCoreOutput(r.request_id, [], finish_reason="abort", error=r.message,
                                     error_kind="overloaded", retry_after_s=r.retry_after_s)
                    for r in sched_out.rejected]
        if sched_out.is_empty:
            if lockstep:
                self.runner.execute_dummy()
            return outputs
        _stamp_first_scheduled(sched_out)
        started = time.monotonic()
        result = self.runner.execute(sched_out)
        if self.scheduler.admission is not None:
            self.scheduler.admission.observe(sched_out.scheduled, time.monotonic() - started)
        if result.prompt_logprobs:  # kept on every TP rank alike: the next step's rows depend on them
            for s in sched_out.scheduled:
                s.request.prompt_logprobs.extend(result.prompt_logprobs.get(s.request.request_id, ()))
        for rid, (kind, message) in result.failed.items():
            outputs.append(self._fail(rid, kind, message))
        finished = {r.request_id: r for r in self.scheduler.update_from_output(sched_out, result.sampled,
                                                                               result.draft_tokens)}
        for s in sched_out.scheduled:
            req = s.request
            new = result.sampled.get(req.request_id)
            if not new:
                continue
            fin = finished.get(req.request_id)
            # A stop may cut the sampled list short (MTP); report only the tokens the request kept.
            kept = new[: req.num_tokens - (s.start + s.num_tokens - len(s.draft_token_ids))]
            lps = result.logprobs.get(req.request_id)
            first = req.num_output_tokens == len(kept)
            outputs.append(EngineCoreOutput(
                req.request_id, kept,
                new_logprobs=[TokenLogprobsMsg(lp.token_id, lp.logprob, lp.top) for lp in lps[: len(kept)]]
                if lps else None,
                finish_reason=fin.status.value if fin else None,
                stop_reason=fin.stop_reason if fin else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                prompt_logprobs=[TokenLogprobsMsg(lp.token_id, lp.logprob, lp.top) for lp in req.prompt_logprobs]
                if first and req.sampling_params.prompt_logprobs is not None else None,
                kv_transfer_params=self.kv_transfer.export(req) if fin and req.hold_kv else None,
                queue_time=_queue_time(req) if first else 0.0,
                num_preemptions=req.num_preemptions if fin else 0))
            if fin:
                self.runner.release(req.request_id)
        return outputs

    def _fail(self, request_id: str, kind: str, message: str) -> EngineCoreOutput:
        """End one request of this step with an error (the others go on); update_from_output skips it."""
        logger.warning("request %s failed while sampling: %s", request_id, message)
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            request.hold_kv = False  # PD prefill: no answer, so no decode instance will pull its KV
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.runner.release(request_id)
        return EngineCoreOutput(request_id, [], finish_reason="abort", error=f"the request failed: {message}",
                                error_kind=kind)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); blocks in use keep their KV."""
        self.kv.pool.reset_cache()
        return True

    def flush_stats(self) -> None:
        """Write --expert-load-stats now (LLM.generate calls it when a batch is done)."""
        self.runner.flush_stats()

    def score(self, prompt_token_ids: list[int]):
        """Logits [L, V] float32 for every position of a prompt, outside the normal schedule."""
        req = Request(f"score-{id(prompt_token_ids)}", list(prompt_token_ids), SamplingParams(max_tokens=1))
        self.scheduler.check_request(req)
        try:  # free() also when the pool is short: allocate_slots left an empty table behind
            if not self.kv.allocate_slots(req, req.num_prompt_tokens):
                raise RequestRejected("no free KV blocks to score the prompt; retry when the engine is idle")
            out = SchedulerOutput([ScheduledRequest(req, 0, req.num_prompt_tokens,
                                                    self.kv.block_tables[req.request_id])])
            return self.runner.all_logits(out)
        finally:
            self.kv.free(req)

    def stats(self) -> EngineStats:
        s = self.scheduler
        spec = s.spec_stats
        return EngineStats(s.num_running, s.num_waiting, self.kv.usage, s.num_preemptions, s.outstanding_tokens(),
                           spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                           spec_num_accepted_tokens=spec.num_accepted_tokens,
                           spec_accepted_per_position=list(spec.accepted_per_position),
                           spec_drafts_per_position=list(spec.drafts_per_position),
                           prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                           num_graph_steps=self.runner.decode_graphs.steps if self.runner.decode_graphs else 0,
                           **self._slo_stats())


    def _slo_stats(self) -> dict:
        a = self.scheduler.admission
        if a is None:
            return {}
        st = a.stats
        ttft, prefill = a.ttft_estimate(self.scheduler.running, self.scheduler.waiting)
        return {"slo_requests": st.requests, "slo_met": st.met, "slo_rejected": st.rejected,
                "slo_ttft_error_s": st.ttft_pred_error_s, "slo_ttft_measured_s": st.ttft_measured_s,
                "slo_ttft_count": st.ttft_count, "slo_tpot_error_s": st.tpot_pred_error_s,
                "slo_tpot_measured_s": st.tpot_measured_s, "slo_tpot_count": st.tpot_count,
                "step_time_error": a.model.mean_step_error, "slo_ttft_estimate_s": ttft,
                "slo_prefill_estimate_s": prefill}


def _stamp_first_scheduled(sched_out: SchedulerOutput) -> None:
    now = time.monotonic()
    for s in sched_out.scheduled:
        if s.request.first_scheduled_time is None:
            s.request.first_scheduled_time = now


def _queue_time(req: Request) -> float:
    """Seconds the request waited in the engine before its first step (vLLM's request_queue_time)."""
    return max(0.0, (req.first_scheduled_time or req.arrival_time) - req.arrival_time)

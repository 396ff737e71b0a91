"""The engine core: one step = schedule -> execute -> update.

Used in-process by LLM and inside the engine-core process of the server. Requests come in as
EngineCoreRequest, results go out as EngineCoreOutput (both msgspec structs, see protocol.py).
"""
from __future__ import annotations

import logging

from moeserve.config import EngineConfig
from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.request import Request, RequestStatus
from moeserve.engine.scheduler import RequestRejected, ScheduledRequest, Scheduler, SchedulerOutput
from moeserve.models.config import DeepseekArch
from moeserve.sampling_params import SamplingParams
from moeserve.protocol import EngineCoreOutput, EngineCoreRequest, EngineStats, TokenLogprobsMsg

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, arch: DeepseekArch | None = None) -> None:
        self.config = config
        self.arch = arch or DeepseekArch.from_pretrained(config.model.model)
        self.runner = ModelRunner(config, self.arch)
        # With MTP a block's cached KV also depends on the token after it (the MTP layer's input).
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 enable_caching=config.cache.enable_prefix_caching,
                                 hash_next_token=config.speculative is not None)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.speculative)
        self._pending: list[EngineCoreOutput] = []  # rejections and aborts reported on the next step
        self.kv_transfer = None  # prefill/decode disaggregation (disagg/kv_transfer.py)
        self.structured = None  # guided decoding: built on the first request that asks for it
        if config.kv_transfer is not None:
            from moeserve.disagg.kv_transfer import KVTransfer
            from moeserve.distributed.parallel_state import get_world_group
            world = get_world_group()
            self.kv_transfer = KVTransfer(config.kv_transfer, self.kv, self.runner.kv_tensors(), world.rank,
                                          world.world_size)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; a request that can never run is answered with an error output instead."""
        try:
            request = Request(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                              eos_token_ids=list(req.eos_token_ids or self.arch.eos_token_ids))
            self._check_vocab(request)
            if req.sampling_params.structured_outputs is not None:
                request.grammar = self._structured().matcher(req.sampling_params.structured_outputs,
                                                             req.structured_dfa)
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
        if sched_out.is_empty:
            if lockstep:
                self.runner.execute_dummy()
            return outputs
        result = self.runner.execute(sched_out)
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
                kv_transfer_params=self.kv_transfer.export(req) if fin and req.hold_kv else None))
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
                           prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)

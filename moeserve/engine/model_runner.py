"""Model runner: tensors in, tokens out. Holds the model, the KV tensors and the sampler; no policy.

It turns a SchedulerOutput into the flat token batch and attention metadata, runs the model, and samples
one token for every request that caught up this step. With speculative decoding (MTP) the batch also holds
each request's drafts; the rejection sampler keeps a prefix of them and the MTP proposer drafts the next
step's tokens from this step's hidden states (speculative/).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from moeserve.config import EngineConfig
from moeserve.device_memory import module_bytes
from moeserve.engine.compiled_decode import CompiledDecode, decode_graph_tokens, warm_up_prefill_kernels, why_eager
from moeserve.engine.kv_memory import check_kv_pool, num_kv_blocks
from moeserve.engine.scheduler import SchedulerOutput
from moeserve.distributed.parallel_state import get_world_group
from moeserve.layers.linear import packed_copy_bytes
from moeserve.layers.attention.metadata import (AttentionMetadata, SeqSpan, attention_context,
                                                build_attention_metadata)
from moeserve.layers.moe.load_stats import ExpertLoadRecorder, recording
from moeserve.layers.moe.placement import build_plan, moe_plan_context
from moeserve.arch import DeepseekArch
from moeserve.models.registry import build_model
from moeserve.sample.logprobs import TokenLogprobs
from moeserve.sample.step import StepSampler


logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: dict[str, list[int]]  # request id -> new tokens
    logprobs: dict[str, list[TokenLogprobs]]
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)  # proposals for the next step (MTP)
    # prompt_logprobs: request id -> entries for the prompt tokens this step's positions predict, in order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (error kind, message): a request this step could not sample (non-finite logits, a failed
    # grammar); the engine core finishes it with that error, the other requests go on
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)


def resolve_dtype(name: str, arch: DeepseekArch) -> torch.dtype:
    if name == "auto":
        name = {"float32": "float32", "float16": "float16"}.get(arch.torch_dtype or "", "bfloat16")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: DeepseekArch) -> None:
        self.config, self.arch = config, arch
        self.dtype = resolve_dtype(config.model.dtype, arch)
        self.block_size = config.cache.block_size
        self.moe_plan = build_plan(config.parallel, arch, get_world_group().rank, mtp=config.speculative is not None)
        with moe_plan_context(self.moe_plan):  # MoE layers read their expert placement from the plan
            # The MTP layer's weights are read only when speculative decoding will use them.
            self.model, self.checkpoint = build_model(config.model.model, arch, self.dtype,
                                                      config.scheduler.max_model_len, config.quant,
                                                      keep_mtp=config.speculative is not None,
                                                      load_format=config.model.load_format)
        # --kv-cache-dtype fp8: the latent cache in e4m3 (written clamped, upcast on read: attention/mla.py)
        self.kv_dtype = torch.float8_e4m3fn if config.cache.fp8_kv else self.dtype
        weight_bytes = module_bytes(self.model) + packed_copy_bytes(self.model)
        self.num_blocks = num_kv_blocks(config, arch, self.kv_dtype, weight_bytes)
        check_kv_pool(self.num_blocks, self.block_size, arch, self.kv_dtype, config.speculative is not None)
        self.kv_caches = [torch.zeros(self.num_blocks, self.block_size, arch.kv_cache_dim, dtype=self.kv_dtype)
                          for _ in range(arch.num_hidden_layers)]
        # logits -> tokens (moeserve/sample/): filters, draws, logprobs, the per-request failure checks
        self.sampler = StepSampler(self.model.compute_logits, config.model.seed,
                                   speculative=config.speculative is not None)
        self.proposer = None
        if config.speculative is not None:
            from moeserve.speculative.proposer import MTPProposer
            with moe_plan_context(self.moe_plan):
                self.proposer = MTPProposer(self.model, self.checkpoint.mtp_weights, self.num_blocks,
                                            self.block_size, self.dtype, self.kv_caches, config.quant,
                                            lockstep=get_world_group().world_size > 1,
                                            num_speculative_tokens=config.speculative.num_speculative_tokens)
            self.checkpoint.mtp_weights.clear()  # copied into the MTP layer: free the memory
        world = get_world_group()
        self.eplb = None  # --enable-eplb: built below, once the recorder exists
        self.load_recorder = (ExpertLoadRecorder(config.parallel.expert_load_stats, arch.n_routed_experts or 0,
                                                 world.rank, world.world_size)
                              if config.parallel.expert_load_stats else None)
        if config.parallel.enable_eplb and self.moe_plan.layers:
            from moeserve.layers.moe.eplb_online import OnlineEPLB
            self.eplb = OnlineEPLB(self._moe_blocks(), arch.n_routed_experts, config.parallel.eplb_step_interval,
                                   self.load_recorder)
            self.load_recorder = self.eplb.recorder  # one recorder: the stats file's, or the in-memory one
        if self.load_recorder is not None:  # before the decode graphs are traced: they record through an op
            for block in self._moe_blocks():
                block.records_load = True
        self.decode_graphs = self._build_decode_graphs()

    def _moe_blocks(self) -> list:
        """The MoE blocks of the model and of the MTP layer (one more layer to balance and record)."""
        from moeserve.layers.moe.layer import MoE
        blocks = [m for m in self.model.modules() if isinstance(m, MoE)]
        if self.proposer is not None:
            blocks += [m for m in self.proposer.mtp.modules() if isinstance(m, MoE)]
        return blocks

    def _build_decode_graphs(self) -> CompiledDecode | None:
        reason = why_eager(self.config, self.arch, self.kv_caches[0].device)
        if reason is not None:
            logger.info("decode runs eagerly: %s", reason)
            return None
        graphs = CompiledDecode(self.model, decode_graph_tokens(self.config)[1], self.config.model.decode_graph_sizes)
        if self.proposer is not None:
            graphs.attach_mtp(self.proposer.mtp.layer)
            self.proposer.graphs = graphs
        graphs.warm_up(self.proposer.kv_caches if self.proposer is not None else self.kv_caches)
        warm_up_prefill_kernels(self)  # prefill's INT8 quantizer and expert passes as kernels too
        return graphs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's final hidden states for one flat batch: a compiled decode graph where one applies."""
        with attention_context(meta):
            if self.decode_graphs is not None and self.decode_graphs.applies(meta, input_ids.shape[0]):
                return self.decode_graphs.run(input_ids, positions)
            return self.model(input_ids, positions)

    sleeping = False

    def sleep(self) -> None:
        """Give the KV cache's memory back (LLM.sleep): the tensors keep their identity, their storage
        shrinks to nothing, so every layer's reference stays valid for wake_up()."""
        if not self.sleeping:
            self._kv_bytes = [t.untyped_storage().nbytes() for t in self.kv_tensors()]
            for t in self.kv_tensors():
                t.untyped_storage().resize_(0)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            for t, n in zip(self.kv_tensors(), self._kv_bytes):
                t.untyped_storage().resize_(n)
                t.zero_()
            self.sleeping = False

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every KV-cache tensor, [num_blocks, block_size, kv_cache_dim] each: the layers', then the MTP
        layer's (what a PD decode instance pulls)."""
        return self.kv_caches + ([self.proposer.kv_cache] if self.proposer is not None else [])

    def lockstep_step_done(self) -> None:
        """After every lockstep step (dp_worker), on every rank at once: online EPLB may rebalance here."""
        if self.eplb is not None:
            applied = bool(self.eplb.pending)  # moves started by the last rebalance, applied now
            self.eplb.step_done()
            if applied and self.decode_graphs is not None:  # new expert maps and packs in the layers
                self.decode_graphs.layer_inputs_changed()

    def flush_stats(self) -> None:
        """Write the expert-load statistics now (end of a run; the file is also refreshed while running)."""
        if self.load_recorder is not None:
            self.load_recorder.write()

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.is_empty:
            return StepResult({}, {})
        with recording(self.load_recorder):
            if self.config.parallel.enable_dbo:
                hidden, sample_rows = self._forward_dbo(out)
                step = None
            else:
                input_ids, positions, meta, sample_rows = self._prepare(out)
                hidden = self.forward(input_ids, positions, meta)
                step = (positions, meta)  # the MTP layer's first pass reuses them
            result = StepResult({}, {})
            if sample_rows:
                self.sampler.sample(hidden, sample_rows, result)
            self.sampler.prompt_logprobs(out, hidden, result)
            if self.proposer is not None:  # a failed request drafts from a placeholder token; it ends anyway
                sampled = {**result.sampled, **{rid: [0] for rid in result.failed}}
                result.draft_tokens = self.proposer.propose(out, hidden, sampled, step)
        if self.load_recorder is not None:
            self.load_recorder.step_done()
        return result

    def _forward_dbo(self, out: SchedulerOutput) -> tuple[torch.Tensor, list]:
        """--enable-dbo: the step's requests in two contiguous micro-batches of about equal tokens (one may
        be empty: every rank runs two, so the collectives pair up); hidden rows back in the batch's order."""
        tokens = [s.num_tokens for s in out.scheduled]
        total, acc, cut = sum(tokens), 0, 0
        while cut < len(tokens) and abs(total - 2 * (acc + tokens[cut])) < abs(total - 2 * acc):
            acc += tokens[cut]
            cut += 1
        first, second = (self._prepare(SchedulerOutput(part)) for part in (out.scheduled[:cut], out.scheduled[cut:]))
        offset = len(first[0])  # the second micro-batch's rows follow the first's
        sample_rows = first[3] + [([r + offset for r in rows], s) for rows, s in second[3]]
        hidden = self.model.forward_dbo([first[:3], second[:3]])
        return torch.cat(hidden), sample_rows

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """A forward over zero tokens: this rank has no work but must join every MoE collective."""
        empty = torch.zeros(0, dtype=torch.long)
        meta = AttentionMetadata(empty, [], None, self.kv_caches)
        if self.config.parallel.enable_dbo:  # the same two micro-batches as the ranks with work
            self.model.forward_dbo([(empty, empty, meta), (empty, empty, meta)])
        else:
            with attention_context(meta):
                self.model(empty, empty)
        if self.proposer is not None:  # the MTP layer's MoE block is a collective too
            self.proposer.execute_dummy()

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [T, V] of every scheduled token (prompt scoring: perplexity, parity checks)."""
        input_ids, positions, meta, _ = self._prepare(out)
        with attention_context(meta):
            return self.model.compute_logits(self.model(input_ids, positions))

    def _prepare(self, out: SchedulerOutput):
        ids, spans, sample_rows = [], [], []
        for s in out.scheduled:
            row = len(ids)
            d = len(s.draft_token_ids)
            ids.extend(s.request.token_ids_slice(s.start, s.start + s.num_tokens - d))
            ids.extend(s.draft_token_ids)
            spans.append(SeqSpan(s.start, s.num_tokens, s.block_ids))
            if s.samples:  # the last real token's row and one per draft
                sample_rows.append((list(range(row + s.num_tokens - d - 1, row + s.num_tokens)), s))
        # with the MTP layer's cache too: its first pass of the step runs on this metadata (speculative/proposer.py)
        kv_caches = self.proposer.kv_caches if self.proposer is not None else self.kv_caches
        positions, meta = build_attention_metadata(spans, self.block_size, kv_caches)
        return torch.tensor(ids, dtype=torch.long), positions, meta, sample_rows


"""Model runner: tensors in, tokens out. Holds the model, the KV tensors and the sampler; no policy.

It turns a SchedulerOutput into the flat token batch and attention metadata, runs the model, and samples
one token for every request that caught up this step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeserve.config import EngineConfig
from moeserve.engine.scheduler import SchedulerOutput
from moeserve.layers.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq, attention_context
from moeserve.layers.sampler import Sampler, TokenLogprobs
from moeserve.models.config import DeepseekArch
from moeserve.models.registry import build_model

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 2 << 30  # cap of the default pool; --kv-cache-memory / --num-kv-blocks override


@dataclass
class StepResult:
    sampled: dict[str, list[int]]  # request id -> new tokens
    logprobs: dict[str, list[TokenLogprobs]]


def resolve_dtype(name: str, arch: DeepseekArch) -> torch.dtype:
    if name == "auto":
        name = {"float32": "float32", "float16": "float16"}.get(arch.torch_dtype or "", "bfloat16")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def num_kv_blocks(config: EngineConfig, arch: DeepseekArch, dtype: torch.dtype) -> int:
    cache, sched = config.cache, config.scheduler
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    bytes_per_block = cache.block_size * arch.num_hidden_layers * arch.kv_cache_dim * dtype.itemsize
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
        if blocks < 1:
            raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory} holds no KV block "
                             f"({bytes_per_block} bytes each); raise it")
        return int(blocks)
    # Default: room for every sequence at full length, capped at DEFAULT_KV_CACHE_BYTES.
    per_seq = -(-sched.max_model_len // cache.block_size)
    cap = max(per_seq, DEFAULT_KV_CACHE_BYTES // bytes_per_block)
    return int(min(per_seq * sched.max_num_seqs, cap))


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: DeepseekArch) -> None:
        self.config, self.arch = config, arch
        self.dtype = resolve_dtype(config.model.dtype, arch)
        self.block_size = config.cache.block_size
        self.model, self.checkpoint = build_model(config.model.model, arch, self.dtype,
                                                  config.scheduler.max_model_len, config.quant)
        self.num_blocks = num_kv_blocks(config, arch, self.dtype)
        self.kv_caches = [torch.zeros(self.num_blocks, self.block_size, arch.kv_cache_dim, dtype=self.dtype)
                          for _ in range(arch.num_hidden_layers)]
        self.sampler = Sampler(config.model.seed)
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.is_empty:
            return StepResult({}, {})
        input_ids, positions, meta, sample_rows = self._prepare(out)
        with attention_context(meta):
            hidden = self.model(input_ids, positions)
        result = StepResult({}, {})
        if not sample_rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor([r for r, _ in sample_rows])])
        reqs = [s.request for _, s in sample_rows]
        params = [r.sampling_params for r in reqs]
        tokens, logprobs = self.sampler(logits, params, [self._generator(r) for r in reqs])
        for req, tok, lp in zip(reqs, tokens, logprobs):
            result.sampled[req.request_id] = [tok]
            if lp is not None:
                result.logprobs[req.request_id] = [lp]
        return result

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [T, V] of every scheduled token (prompt scoring: perplexity, parity checks)."""
        input_ids, positions, meta, _ = self._prepare(out)
        with attention_context(meta):
            return self.model.compute_logits(self.model(input_ids, positions))

    def _generator(self, req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        if req.request_id not in self.generators:
            self.generators[req.request_id] = torch.Generator().manual_seed(seed)
        return self.generators[req.request_id]

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        ids, pos, slots, prefills, sample_rows = [], [], [], [], []
        dec_rows, dec_tables, dec_lens = [], [], []
        for s in out.scheduled:
            row = len(ids)
            end = s.start + s.num_tokens
            ids.extend(s.request.token_ids_slice(s.start, end))
            blocks = torch.tensor(s.block_ids, dtype=torch.long)
            p = torch.arange(s.start, end)
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            if s.num_tokens == 1 and s.start > 0:
                dec_rows.append(row)
                dec_tables.append(s.block_ids[: -(-end // bs)])
                dec_lens.append(end)
            else:
                ctx = torch.arange(end)
                prefills.append(PrefillSeq(row, s.num_tokens, end, blocks[ctx // bs] * bs + ctx % bs))
            if s.samples:
                sample_rows.append((row + s.num_tokens - 1, s))
        meta = AttentionMetadata(torch.cat(slots), prefills, self._decode_batch(dec_rows, dec_tables, dec_lens),
                                 self.kv_caches)
        return torch.tensor(ids, dtype=torch.long), torch.cat(pos), meta, sample_rows

    def _decode_batch(self, rows, tables, lens) -> DecodeBatch | None:
        if not rows:
            return None
        width = max(len(t) for t in tables)
        table = torch.zeros(len(rows), width, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t)
        ctx = torch.tensor(lens)
        mask = torch.arange(width * self.block_size)[None, :] >= ctx[:, None]
        return DecodeBatch(torch.tensor(rows), table, ctx, mask)

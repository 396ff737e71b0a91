"""MTP proposer: drafts for the next step from the main model's hidden states of this step (FusionSpec).

Lifecycle
  1. Built by the model runner once the main model is loaded: the MTP layer is filled from the tensors the
     loader set aside, and gets its own latent KV cache [num_blocks, block_size, kv_lora + rope], indexed by
     the same block tables as the main cache (so the scheduler's blocks cover both).
  2. Every step, right after the main model verified [last token + drafts] and the sampler accepted a prefix,
     propose() runs the MTP layer on the positions the main model just made valid (prefill chunks included),
     with the next token at each position as input, writing MTP KV there. Its output at each request's last
     valid position gives draft 1; re-applying the layer on its own output at the following positions
     (the scheduler's lookahead slots) gives drafts 2..n.
     Given the main forward's positions and attention metadata (`step`), the first pass runs over every row
     of the main batch with them, as the same step's one more layer: no metadata of its own, no gather of
     hidden rows, the main step's graph bucket. Rows past a request's accepted drafts then get token 0 and
     write MTP KV at positions not yet valid, rewritten when they become valid, as the main model's KV there.
  3. Nothing carries over between steps but the drafts (Request.spec_token_ids): MTP KV of rejected and
     lookahead positions is rewritten when those positions become valid, and the scheduler trims the blocks
     past num_computed_tokens after the step, so nothing leaks.
With several ranks (lockstep) the MTP layer's MoE block is a collective: every rank runs exactly k MTP passes
per step, empty ones included (execute_dummy on a rank without work), so the ranks meet in each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.config import QuantConfig
from moeserve.layers.attention.metadata import (AttentionMetadata, SeqSpan, attention_context,
                                               build_attention_metadata)
from moeserve.sample.draw import argmax
from moeserve.speculative.mtp_model import build_mtp

if TYPE_CHECKING:  # annotations only: the engine's scheduler calls down into this module, never the reverse
    from moeserve.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class _Chain:
    """A request that gets drafts this step: where its MTP chain continues."""

    request_id: str
    position: int  # position of the next MTP query (the first draft's position)
    block_ids: list[int]
    remaining: int  # drafts still to make after the first


class MTPProposer:
    def __init__(self, main_model: torch.nn.Module, mtp_weights: dict[str, torch.Tensor], num_blocks: int,
                 block_size: int, dtype: torch.dtype, main_kv_caches: list[torch.Tensor],
                 quant: QuantConfig | None = None, lockstep: bool = False, num_speculative_tokens: int = 1) -> None:
        self.main = main_model
        self.lockstep, self.k = lockstep, num_speculative_tokens
        self.mtp = build_mtp(main_model, mtp_weights, dtype, quant)
        self.block_size = block_size
        arch = main_model.arch
        kv_dtype = main_kv_caches[0].dtype if main_kv_caches else dtype  # FP8 when the main cache is
        self.kv_cache = torch.zeros(num_blocks, block_size, arch.kv_cache_dim, dtype=kv_dtype)
        self.kv_caches = list(main_kv_caches) + [self.kv_cache]  # index num_hidden_layers is the MTP layer's
        self.graphs = None  # the engine's compiled decode graphs (engine/compiled_decode.py), once attached

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, hidden: torch.Tensor, sampled: dict[str, list[int]],
                step: tuple[torch.Tensor, AttentionMetadata] | None = None) -> dict[str, list[int]]:
        """hidden [T, H]: main model output of this step's flat batch -> request id -> next drafts.
        step: the main forward's (positions, metadata) over the same T rows, built with self.kv_caches (the
        first pass then reuses them); None: the first pass covers the valid rows only, with its own."""
        spans, rows, tokens, chains, last_rows = [], [], [], [], []
        row = mtp_rows = 0  # next row of the main batch / of the MTP batch
        for s in out.scheduled:
            new = sampled.get(s.request.request_id, [])
            valid = _num_valid(s, new)
            if step is None:
                spans.append(SeqSpan(s.start, valid, s.block_ids))
                rows.extend(range(row, row + valid))
                tokens.extend(_next_tokens(s, new, valid))
            else:  # every row; those past the valid ones compute what is rewritten later
                nxt = _next_tokens(s, new, valid)
                tokens.extend(nxt + [0] * (s.num_tokens - len(nxt)))
            if s.num_new_drafts > 0 and new:
                last_rows.append(mtp_rows + valid - 1)
                chains.append(_Chain(s.request.request_id, s.start + valid, s.block_ids, s.num_new_drafts - 1))
            row += s.num_tokens
            mtp_rows += valid if step is None else s.num_tokens
        if not out.scheduled and not self.lockstep:
            return {}
        ids = torch.tensor(tokens, dtype=torch.long)
        if step is None:
            h = self._run(spans, ids, hidden[torch.tensor(rows, dtype=torch.long)])  # [T', H]
        else:
            assert hidden.shape[0] == row == step[0].shape[0], "step: the main forward's rows"
            assert len(step[1].kv_caches) == len(self.kv_caches), "step: metadata built with the MTP cache"
            h = self._pass(ids, hidden, *step)
        if not chains and not self.lockstep:
            return {}
        return self._chain(chains, h[torch.tensor(last_rows, dtype=torch.long)])

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """This rank has no work: the k empty MTP passes the other ranks' collectives wait for."""
        self._chain([], self._run([], torch.zeros(0, dtype=torch.long), self.kv_cache.new_zeros(
            0, self.main.arch.hidden_size)))

    def _chain(self, chains: list[_Chain], h: torch.Tensor) -> dict[str, list[int]]:
        """h [B, H]: MTP output at each chain's last valid position -> all drafts of each chain.

        With lockstep the chain makes k - 1 more passes whatever is left in it (possibly nothing)."""
        drafts = {c.request_id: [] for c in chains}
        passes = 1
        while True:
            ids = argmax(self.mtp.compute_logits(h, self.main.lm_head))  # [B]
            for c, t in zip(chains, ids.tolist()):
                drafts[c.request_id].append(t)
            keep = [i for i, c in enumerate(chains) if c.remaining > 0]
            if not keep and not (self.lockstep and passes < self.k):
                return drafts
            passes += 1
            chains = [chains[i] for i in keep]
            sel = torch.tensor(keep, dtype=torch.long)
            spans = [SeqSpan(c.position, 1, c.block_ids) for c in chains]
            h = self._run(spans, ids[sel], h[sel])
            for c in chains:
                c.position += 1
                c.remaining -= 1

    def _run(self, spans: list[SeqSpan], token_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """One MTP pass over the spans' tokens -> h' [T, H] (T may be 0 on a rank without work)."""
        positions, meta = build_attention_metadata(spans, self.block_size, self.kv_caches)
        return self._pass(token_ids, prev_hidden, positions, meta)

    def _pass(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
        with attention_context(meta):
            embeds = self.main.model.embed_tokens(token_ids)
            if self.graphs is not None and self.graphs.applies(meta, embeds.shape[0]):
                return self.graphs.run_mtp(embeds, prev_hidden, positions)
            return self.mtp(embeds, prev_hidden, positions)


def _num_valid(s: ScheduledRequest, new: list[int]) -> int:
    """Positions of this step whose main-model KV and hidden state stand: all but the rejected drafts."""
    accepted = max(len(new) - 1, 0) if s.draft_token_ids else 0
    return s.num_tokens - len(s.draft_token_ids) + accepted


def _next_tokens(s: ScheduledRequest, new: list[int], valid: int) -> list[int]:
    """The token after each valid position start..start+valid-1 (MTP input t_{i+1})."""
    req = s.request
    known = req.token_ids_slice(s.start + 1, min(s.start + valid + 1, req.num_tokens))
    return (known + list(new))[:valid]

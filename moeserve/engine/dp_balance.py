"""How a multi-rank engine spreads work over its DP ranks: plain bookkeeping shared by the DP front end
(dp_client.py routes, dp_worker.py budgets) and the planner's simulator (planner/simulate.py), so the
simulated deployment and the served one follow one policy.

- Routing: a new request goes to the DP rank with the least outstanding work, counted as prompt tokens +
  tokens still to generate of its unfinished requests (ties: the lowest rank). With prefix caching each
  rank has its own cache, so the router remembers the block hashes of the prompts it sent where, and a
  prompt whose first blocks a rank has seen costs that rank that many tokens less: the next turn of a
  chat goes back to the rank holding its history unless another rank is less loaded by more than the
  history's length (the cached tokens are work that rank does not do). The memory is a bounded LRU per
  rank, an estimate of the rank's own cache, which may have evicted since.
- SLO-aware routing: when the request has a TTFT target, the rank whose admission policy (engine/slo.py)
  predicts the shortest TTFT wins: its last report's prediction plus the prefill seconds of each request
  sent to it since (slo_ranked_ttft).
- Prefill budget: the ranks step in lockstep (every MoE layer is a collective), so a step lasts as long as
  its busiest rank. While any rank decodes, each rank's token budget is its own decodes plus an even share
  of the prefill demand of the ranks that have some, so a long prompt next to short ones is chunked to
  their size instead of stalling them and every decode. The share is over ranks with demand, not all
  ranks: a lone prompt shared over D ranks would be cut to 1/D of itself, then 1/D of the rest, step after
  step (`moeserve plan simulate --sim-dp-groups` showed TTFT x5 and TPOT +40% on 4 groups), while
  max_num_batched_tokens already bounds the step as in vLLM. With no decodes anywhere (a prefill instance,
  a burst of new requests) nothing waits on the long prompt, and chunking it would only add steps, each
  reading all the weights again: no cap then.
"""
from __future__ import annotations

from moeserve.engine.kv_cache import block_hash
from moeserve.prefix_memory import PrefixMemory

MIN_PREFILL_CHUNK = 32  # prefill balancing never chunks below this many tokens per rank and step


def prefill_balanced_budget(prefill_demands: list[int], total_decodes: int, max_tokens: int,
                            decodes: int) -> int | None:
    """This rank's token budget for the step (None: no cap beyond the scheduler's own: one DP rank, no
    rank decoding, or at most one rank with prefill demand). `prefill_demands` has one entry per DP rank;
    `total_decodes` is over all ranks; `decodes` is the tokens this rank's decodes take (MTP drafts
    included: a decode counted as one token let its drafts eat the share and starve the prompt)."""
    busy = [d for d in prefill_demands if d > 0]
    if len(prefill_demands) == 1 or total_decodes == 0 or len(busy) <= 1:
        return None
    share = max(-(-sum(busy) // len(busy)), MIN_PREFILL_CHUNK)
    return min(max_tokens, decodes + share)


def slo_ranked_ttft(estimates: list[float], prefill_s: list[float], sent_since: list[int]) -> list[float]:
    """Each rank's predicted TTFT for a new request: its report's estimate plus the prefill of the requests
    routed to it after that report."""
    return [e + p * n for e, p, n in zip(estimates, prefill_s, sent_since)]


class LeastLoadedRouter:
    """Lifecycle: assign() when a request arrives -> progress() as its tokens come out -> forget() when it
    finishes or is aborted (what it still counted leaves its rank's load).

    block_size: the engine's prefix-cache block size, or None (caching off): assign() then ignores the
    prompt's tokens. max_prefix_blocks: block hashes remembered per rank."""

    def __init__(self, dp_size: int, block_size: int | None = None, max_prefix_blocks: int = 1 << 16) -> None:
        self.load = [0] * dp_size  # outstanding tokens per DP rank
        self.owner: dict[str, int] = {}  # unfinished request id -> DP rank
        self.cost: dict[str, int] = {}  # request id -> outstanding tokens it still adds to its rank
        self.block_size = block_size
        self.prefixes = [PrefixMemory(max_prefix_blocks) for _ in range(dp_size)]

    def assign(self, request_id: str, prompt_tokens: int, max_new_tokens: int,
               token_ids: list[int] | None = None, ttft: list[float] | None = None, rank: int | None = None) -> int:
        """ttft: each rank's predicted TTFT for this request (SLO-aware admission, slo_ranked_ttft); the
        least predicted wins, the load breaks ties. rank: the caller's choice instead (elastic EP sends a
        re-queued request back to the survivor whose prefix cache holds it)."""
        hashes = self._hashes(token_ids) if token_ids is not None and self.block_size else []
        cached = [m.matched(hashes) * (self.block_size or 0) for m in self.prefixes]
        dp = rank if rank is not None else min(range(len(self.load)),
                                               key=lambda d: (ttft[d] if ttft else 0.0, self.load[d] - cached[d], d))
        cost = prompt_tokens - cached[dp] + max_new_tokens
        self.owner[request_id], self.cost[request_id] = dp, cost
        self.load[dp] += cost
        self.prefixes[dp].remember(hashes)
        return dp

    def _hashes(self, token_ids: list[int]) -> list[bytes]:
        """Chained hashes of the prompt's full blocks but the last token's (what the engine can share)."""
        out, parent, bs = [], b"", self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def progress(self, request_id: str, num_tokens: int) -> None:
        self.load[self.owner[request_id]] -= num_tokens
        self.cost[request_id] -= num_tokens

    def forget(self, request_id: str) -> int:
        dp = self.owner.pop(request_id)
        self.load[dp] -= self.cost.pop(request_id)
        return dp

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.owner

    def __len__(self) -> int:
        return len(self.owner)

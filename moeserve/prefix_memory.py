"""What prompt prefixes were sent to one place (a DP rank, a prefill instance): a bounded LRU of chained
prefix hashes, the router's estimate of that place's prefix cache. Used by the DP router
(engine/dp_balance.py) and the PD proxy (entrypoints/pd_proxy.py)."""
from __future__ import annotations

from collections import OrderedDict


class PrefixMemory:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def matched(self, hashes: list[bytes]) -> int:
        """Leading hashes of the chain remembered here (a chain counts from its first link)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._seen:
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        # Last link first, so a prompt's head is its most recent entry and eviction takes tails first: a
        # chain missing its head never matches again.
        for h in reversed(hashes):
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

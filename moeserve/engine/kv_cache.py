"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and one block table per request.

This is CPU bookkeeping only; the tensors live in the model runner (engine/kv_tensors.py). A block holds
`block_size` token slots of every layer's [latent | rope key] vector.
"""
from __future__ import annotations

from collections import deque

from moeserve.engine.request import Request


class BlockPool:
    """Free list of block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller checks num_free before allocating"
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    """Maps each request to the blocks holding its tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.held: dict[str, list[int]] = {}  # finished requests whose blocks a remote decode will pull

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's table to hold num_computed + num_new tokens. False if the pool is short."""
        table = self.block_tables.setdefault(request.request_id, [])
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        self.pool.free(self.block_tables.pop(request.request_id, []))

    def hold(self, request: Request) -> None:
        """A finished request keeps its blocks (out of the tables, still allocated) until release_held."""
        self.held[request.request_id] = self.block_tables.pop(request.request_id, [])

    def release_held(self, request_id: str) -> None:
        self.pool.free(self.held.pop(request_id, []))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return blocks past the first num_tokens slots (rejected speculative slots)."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        keep = self.blocks_needed(num_tokens)
        if keep < len(table):
            self.pool.free(table[keep:])
            del table[keep:]

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

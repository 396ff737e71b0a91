"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and one block table per request, with automatic
prefix caching.

This is CPU bookkeeping only; the tensors live in the model runner. A block holds `block_size` token slots
of every layer's [latent | rope key] vector.

Prefix caching (vLLM's automatic prefix caching): a full block whose KV is computed gets a hash of its
tokens chained to the hash of the block before it, so equal hashes mean equal prefixes. Blocks are
reference counted; a block nobody uses is free but keeps its cached prefix until an allocation needs it
(plain free blocks go first, then cached ones least recently freed first). A new request starts from the
longest run of cached blocks its tokens hash to and computes the rest. Shared blocks are never written:
a request writes KV only at positions >= its num_computed_tokens, and only full blocks below that are
shared. A request's cache_salt (vLLM's) seeds its chain, so only requests with the same salt share blocks.
With MTP the hash also covers the token after the block, because the MTP layer's KV at a block's
last position is computed from that token.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from moeserve.engine.request import Request


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained digest of one block's tokens (and, with MTP, the token after it). A cryptographic hash,
    so a prompt cannot be crafted to collide with another user's prefix."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def salt_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: its cache_salt's digest, so requests with different salts
    (tenants) never share cached blocks; no salt is the shared root b""."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode(), digest_size=16).digest()


class BlockPool:
    """Block ids 0..num_blocks-1 with reference counts and the cached-prefix index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, no cached prefix
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached prefix; LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free, "caller checks num_free before allocating"
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently freed cached block
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
            self._refs[b] = 1
            ids.append(b)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a request's last blocks go first when evicted."""
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def lookup(self, h: bytes) -> int | None:
        return self._cached.get(h)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks a new request shares."""
        for b in block_ids:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(self, block_id: int, h: bytes) -> None:
        """Index an in-use full block under its prefix hash (the first block with that hash keeps it)."""
        if h not in self._cached and block_id not in self._hash_of:
            self._cached[h] = block_id
            self._hash_of[block_id] = h

    def reset_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._cached.clear()


class KVCacheManager:
    """Maps each request to the blocks holding its tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 hash_next_token: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_caching = enable_caching
        self.hash_next_token = hash_next_token  # MTP: a block's hash covers the token after it
        self.block_tables: dict[str, list[int]] = {}
        self.held: dict[str, list[int]] = {}  # finished requests whose blocks a remote decode will pull
        # request id -> chained hashes of its blocks, extended as they become defined (tokens are only ever
        # appended, so a hash once computed stays right); dropped with the request's blocks
        self._chains: dict[str, list[bytes]] = {}
        self._registered: dict[str, int] = {}  # request id -> leading blocks of its table in the index

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashable_blocks(self, request: Request, num_tokens: int) -> int:
        """Full blocks among the first num_tokens whose hash is defined (with MTP: the next token known)."""
        n = num_tokens // self.block_size
        if self.hash_next_token:
            n = min(n, (request.num_tokens - 1) // self.block_size)
        return n

    def _chain(self, request: Request, n: int) -> list[bytes]:
        """The request's first n block hashes (n within _hashable_blocks), computing only the new ones."""
        chain = self._chains.setdefault(request.request_id, [])
        bs, extra = self.block_size, 1 if self.hash_next_token else 0
        while len(chain) < n:
            start = len(chain) * bs
            root = chain[-1] if chain else salt_root(request.cache_salt)
            chain.append(block_hash(root, request.token_ids_slice(start, start + bs + extra)))
        return chain[:n]

    def looks_up(self, request: Request) -> bool:
        """Whether take_cached_prefix searches the cache for this request: caching is on and the request has
        nothing computed or allocated (a PD decode request arrives with its pulled KV), and it does not want
        prompt logprobs (cached positions have no logits to report; vLLM skips the cache for these too)."""
        return (self.enable_caching and not request.num_computed_tokens
                and not self.block_tables.get(request.request_id)
                and request.sampling_params.prompt_logprobs is None)

    def take_cached_prefix(self, request: Request) -> int:
        """Start a request with nothing computed from its longest cached prefix: the shared blocks become
        the head of its table and num_computed_tokens moves past them. At least one token stays to compute
        (its logits give the next token). Returns the tokens taken; undo with free() on failure."""
        if not self.looks_up(request):
            return 0
        blocks = []
        for h in self.prefix_hashes(request):
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        if not blocks:
            return 0
        self.pool.touch(blocks)
        self.block_tables[request.request_id] = blocks
        self._registered[request.request_id] = len(blocks)
        request.num_computed_tokens = len(blocks) * self.block_size
        return request.num_computed_tokens

    def untake(self, request: Request) -> None:
        """Undo take_cached_prefix for a request that is not admitted after all (its hashes stay)."""
        self._registered.pop(request.request_id, None)
        self.pool.free(self.block_tables.pop(request.request_id, []))
        request.num_computed_tokens = 0

    def prefix_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the blocks a request could share: its full blocks but the last token's."""
        return self._chain(request, self._hashable_blocks(request, request.num_tokens - 1))

    def uncomputed_prefix(self, request: Request) -> list[bytes]:
        """Hashes of the shareable blocks the request has still to compute."""
        return self.prefix_hashes(request)[request.num_computed_tokens // self.block_size:]

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's newly completed full blocks (after a step advanced num_computed_tokens)."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        n = self._hashable_blocks(request, request.num_computed_tokens)
        chain = self._chain(request, n)
        for i in range(self._registered.get(request.request_id, 0), n):
            self.pool.register(table[i], chain[i])
        self._registered[request.request_id] = n

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
        self._drop_hashes(request)
        self.pool.free(self.block_tables.pop(request.request_id, []))

    def hold(self, request: Request) -> None:
        """A finished request keeps its blocks (out of the tables, still allocated) until release_held."""
        self._drop_hashes(request)
        self.held[request.request_id] = self.block_tables.pop(request.request_id, [])

    def _drop_hashes(self, request: Request) -> None:
        self._chains.pop(request.request_id, None)
        self._registered.pop(request.request_id, None)

    def release_held(self, request_id: str) -> None:
        self.pool.free(self.held.pop(request_id, []))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return blocks past the first num_tokens slots (rejected speculative slots). Never a registered
        block: those lie below num_computed_tokens."""
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

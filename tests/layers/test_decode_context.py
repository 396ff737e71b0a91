"""gather_decode_context: each decode sequence's paged latent context, stale slots cleared, in the step's
scratch buffer shared by the layers."""
import pytest
import torch

from moeserve.layers.attention.kv_dtype import gather_decode_context
from moeserve.layers.attention.metadata import _decode_batch

BLOCK = 4


def _reference(cache: torch.Tensor, table: list[list[int]], lens: list[int], dtype) -> torch.Tensor:
    width = max(len(t) for t in table)
    out = torch.zeros(len(table), width * BLOCK, cache.shape[-1], dtype=dtype)
    for i, (blocks, n) in enumerate(zip(table, lens)):
        rows = cache[torch.tensor(blocks)].reshape(-1, cache.shape[-1]).to(dtype)
        out[i, :n] = rows[:n]
    return out


@pytest.mark.parametrize("cache_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float8_e4m3fn, torch.bfloat16)])
def test_contexts_equal_the_reference_with_stale_slots_cleared(cache_dtype, dtype):
    g = torch.Generator().manual_seed(0)
    table = [[7, 2, 9], [4], [1, 8]]  # ragged: 3, 1 and 2 blocks
    lens = [10, 3, 8]
    d = _decode_batch([0, 1, 2], table, lens, BLOCK)
    for layer in range(2):  # the second layer reuses the first one's buffer
        cache = torch.randn(12, BLOCK, 6, generator=g).to(cache_dtype)
        cache[9, 3] = float("nan")  # a stale slot (past sequence 0's 10 tokens) holding a failed request's NaN
        got = gather_decode_context(cache, d, dtype)
        assert got.dtype == dtype and got.shape == (3, 3 * BLOCK, 6)
        assert torch.equal(got, _reference(cache, table, lens, dtype)), layer
    buffers = list(d._context.values())  # the output's, and the cache dtype's staging one when they differ
    assert len(buffers) == (1 if cache_dtype == dtype else 2)
    assert got.data_ptr() == d._context[(dtype, BLOCK * 6, cache.device)].data_ptr()  # one row per block

"""MLA's absorbed decode applies W_UK weight-first (stored [H, C, dn]): q_nope @ W_UK per head, the same bits
in BF16 (float32 GEMMs may sum in another order: within float32 rounding)."""
import pytest
import torch

from moeserve import LLM


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_absorbed_query_equals_the_query_times_w_uk(ckpt_dir, dtype):
    llm = LLM(ckpt_dir("v3"), dtype=dtype, max_model_len=256, enforce_eager=True)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    w = attn.kv_b_proj.dequantized_weight().view(attn.num_heads, attn.dn + attn.dv, attn.kv_lora_rank)
    w_uk = w[:, : attn.dn]  # [H, dn, C]
    g = torch.Generator().manual_seed(0)
    for b in (1, 3, 32):
        q = torch.randn(b, attn.num_heads, attn.dn, generator=g).to(w.dtype)
        want = torch.bmm(q.transpose(0, 1), w_uk).transpose(0, 1)
        got = attn.absorb_query(q)
        if dtype == "bfloat16":
            assert torch.equal(got, want), b
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

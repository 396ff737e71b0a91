"""MLA decode's absorbed-matrix products through vLLM's CPU library's bmm_cpu (layers/attention/mla_bmm.py) agree
with aten's weight-first bmm's (the same arithmetic; rare last-bit ties apart).

These run where the library is installed and may run its GEMMs (scripts/setup.sh installs it on x86 CPUs with
AVX-512 BF16; AMX, where the CPU has it, usable); elsewhere skipped, and the aten bmm's run (tests/layers/test_mla_absorb.py)."""
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.layers.attention import mla_bmm
from moeserve.layers.linear import packed_copy_bytes

pytestmark = pytest.mark.skipif(not mla_bmm.usable(torch.zeros(1, 32, 32, dtype=torch.bfloat16)),
                                reason="vLLM's CPU kernel library (bmm_cpu) is not available here")

H, C, DN, DV = 16, 512, 128, 128  # DeepSeek-V3's latent dims, 16 heads


def _agrees(got: torch.Tensor, aten: torch.Tensor, exact: torch.Tensor) -> None:
    """Float32 accumulation and one rounding, as aten's: equal but for rare last-bit ties (a few outputs in 10^4
    one BF16 rounding apart), and as close to the float32 product as aten's."""
    got, aten = got.float(), aten.float()
    assert (got != aten).float().mean().item() < 1e-3
    assert ((got - aten).abs() <= aten.abs() * 2.0 ** -7).all()
    assert (got - exact).abs().max().item() <= (aten - exact).abs().max().item() * 1.01


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 32, 100])
def test_both_products_agree_with_aten_bmm(rows):
    g = torch.Generator().manual_seed(rows)
    w_uk_t = (torch.randn(H, C, DN, generator=g) * 0.05).bfloat16()  # [H, C, dn] as mla.py stores it
    w_uv = (torch.randn(H, DV, C, generator=g) * 0.05).bfloat16()  # [H, dv, C]
    q = torch.randn(rows, H, DN + 64, generator=g).bfloat16()[..., :DN]  # a strided slice, as q.split gives
    o_lat = torch.randn(rows, H, C, generator=g).bfloat16()
    absorbed = mla_bmm.per_head(q, mla_bmm.pack(w_uk_t), C)
    _agrees(absorbed, torch.bmm(w_uk_t, q.permute(1, 2, 0)).permute(2, 0, 1),
            torch.bmm(w_uk_t.float(), q.float().permute(1, 2, 0)).permute(2, 0, 1))
    valued = mla_bmm.per_head(o_lat, mla_bmm.pack(w_uv), DV)
    assert valued.is_contiguous()
    # against aten's weight-first product (mla.py's up to 32 rows; past them its data-first bmm)
    _agrees(valued, torch.bmm(w_uv, o_lat.permute(1, 2, 0)).permute(2, 0, 1),
            torch.bmm(w_uv.float(), o_lat.float().permute(1, 2, 0)).permute(2, 0, 1))
    column_major = o_lat.transpose(0, 2).contiguous().transpose(0, 2)  # last dim strided: copied first
    assert torch.equal(mla_bmm.per_head(column_major, mla_bmm.pack(w_uv), DV), valued)


def test_applies_to_bf16_widths_in_32s_when_switched_on(monkeypatch):
    assert mla_bmm.pack(torch.zeros(H, C, DN, dtype=torch.bfloat16)) is not None
    assert mla_bmm.pack(torch.zeros(H, C, DN)) is None  # float32
    assert mla_bmm.pack(torch.zeros(4, 32, 16, dtype=torch.bfloat16)) is None  # dn 16 (the tiny test models)
    monkeypatch.setenv(mla_bmm.ENV, "0")
    assert mla_bmm.pack(torch.zeros(H, C, DN, dtype=torch.bfloat16)) is None


def test_the_engine_gives_the_same_tokens_with_and_without(ckpt_dir, monkeypatch):
    """A BF16 model whose latent widths are multiples of 32: decode through the compiled graphs, the library's
    bmm on and off (switched at load), the same greedy tokens (its logits peaked: no near-ties for a last-bit
    difference to flip); its copies counted for the KV sizing."""
    path = ckpt_dir("v3", qk_nope_head_dim=32, v_head_dim=32)
    prompts = [[5 + i, 17, 99 + 3 * i, 42] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens, copies = {}, {}
    for switch in ("1", "0"):
        monkeypatch.setenv(mla_bmm.ENV, switch)
        llm = LLM(path, dtype="bfloat16", max_model_len=128)
        attn = llm.engine.runner.model.model.layers[1].self_attn
        assert (attn.w_uk_packed is not None) == (switch == "1")
        copies[switch] = packed_copy_bytes(llm.engine.runner.model)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[switch] = [o.outputs[0].token_ids for o in outputs]
        del llm
    assert tokens["1"] == tokens["0"] and len(tokens["1"][0]) == 12
    heads, layers = 4, 3  # the tiny model's; its copies: W_UK and W_UV, [4 x 32 x 32] BF16 each, per layer
    assert copies["1"] - copies["0"] == layers * 2 * heads * 32 * 32 * 2

"""--attention-tp-dp-switch: attention's low-rank projections on each TP rank's token shard, one all-gather of
the projected query and latent, head-parallel attention, reduce-scatter back. Real rank processes over gloo,
float32: the tokens of one process, and the gathered bytes of the formula."""
import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError, ParallelConfig

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], [300, 12], list(range(20, 45)), [7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def run(path, prompts=PROMPTS, repeat=1, **kw):
    llm = LLM(path, dtype="float32", distributed_timeout=30, **kw)
    try:
        return [tokens(llm, prompts) for _ in range(repeat)], dict(llm.engine.stats().comm_bytes)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def path(ckpt_dir):
    return ckpt_dir("v3")  # hidden 64, q_lora 48, kv_lora 32, rope 8, 4 heads, 3 layers


@pytest.fixture(scope="module")
def reference(path):
    return tokens(LLM(path, dtype="float32"))


@pytest.mark.parametrize("layout", [
    dict(tensor_parallel_size=2, max_num_batched_tokens=16),  # chunked prefill, odd shards
    dict(tensor_parallel_size=4),
    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
], ids=["tp2-chunked", "tp4", "dp2-tp2-ep"])
def test_switch_matches_single_process(path, reference, layout):
    # twice: the second pass reads its prompts from the prefix cache (block_size 4: most of each prompt)
    runs, _ = run(path, repeat=2, attention_tp_dp_switch=True, block_size=4, **layout)
    assert runs == [reference, reference]


def test_switch_a8w8_mtp_matches_flashcomm(mtp_ckpt_dir):
    """A8W8 + MTP at TP=2: the switch gives FlashComm's tokens (both quantize o_proj's input per rank, which
    already differs slightly from TP=1 A8W8; the projections on a shard quantize each token as on all)."""
    model = mtp_ckpt_dir("v3")
    kw = dict(tensor_parallel_size=2, quantization="a8w8",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    (flash,), _ = run(model, flashcomm="on", **kw)
    (switched,), _ = run(model, attention_tp_dp_switch=True, **kw)
    assert switched == flash


def test_gathered_bytes_match_the_formula(path):
    """One 10-token prefill at TP=2 (shards of 5 rows): each of the 3 layers gathers per row hidden = 64
    float32 values with FlashComm, q_lora + kv_lora + rope = 88 with the switch (the tiny model's low-rank
    dims are not small; DeepSeek-V3's 1536 + 512 + 64 = 2112 against 7168 are); INT8: 88 int8 + a float32
    scale; the final norm's output gathered for lm_head in float32 either way."""
    prompt = [list(range(10, 20))]
    one = SamplingParams(temperature=0, max_tokens=1)

    def gathered(**kw):
        llm = LLM(path, dtype="float32", tensor_parallel_size=2, enable_prefix_caching=False,
                  distributed_timeout=30, **kw)
        try:
            llm.generate(prompt_token_ids=prompt, sampling_params=one)
            return llm.engine.stats().comm_bytes["allgather_tp"]
        finally:
            llm.shutdown()

    peers, width, layers, final = 1, 5, 3, 5 * 64 * 4
    assert gathered(flashcomm="on") == layers * peers * width * 64 * 4 + final
    assert gathered(attention_tp_dp_switch=True) == layers * peers * width * 88 * 4 + final
    assert gathered(attention_tp_dp_switch=True, flashcomm="int8") == layers * peers * width * (88 + 4) + final


def test_switch_needs_tensor_parallelism():
    with pytest.raises(ConfigError, match="--attention-tp-dp-switch .*--tensor-parallel-size > 1"):
        ParallelConfig(attention_tp_dp_switch=True)
    assert ParallelConfig(tensor_parallel_size=2, attention_tp_dp_switch=True).token_sharding == "on"


def test_int8_gather_error_within_the_codec_bound():
    """The INT8 gather quantizes each token's [q_lora | kv_lora | rope] row with one scale (amax / 127): every
    value comes back within half a step, scale / 2, even where the parts' magnitudes differ."""
    import torch

    from moeserve.layers.quant import quantize_per_token

    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randn(16, 48, generator=g), torch.randn(16, 32, generator=g) * 0.1,
                      torch.randn(16, 8, generator=g) * 30], dim=-1)
    q, scale = quantize_per_token(rows)
    err = (q.float() * scale - rows).abs()
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    assert torch.allclose(scale, rows.abs().amax(dim=-1, keepdim=True) / 127)

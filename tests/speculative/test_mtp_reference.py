"""The drafts the engine proposes at every step equal a dense reference MTP built on transformers.

The reference runs the whole sequence at once: the main model (transformers) gives h_i, the MTP block is
transformers' DeepseekV3DecoderLayer with the test MTP weights, and the input projection / norms are the
formula of speculative/mtp_model.py. Equality at every step checks the MTP layer's paged KV cache across chunked
prefill, rejected drafts and the k > 1 chain.
"""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moeserve.engine_args import EngineArgs
from moeserve.engine.engine_core import EngineCore
from moeserve.protocol import EngineCoreRequest
from moeserve.sampling_params import SamplingParams
from tests.checkpoints import mtp_hf_block

PROMPTS = [list(range(20, 61)), [300, 12], [5, 17, 99, 200, 3, 45, 67]]


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceMTP:
    def __init__(self, path: str):
        self.main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.block_model, self.L = mtp_hf_block("v3", 0)
        t = load_file(f"{path}/model.safetensors")
        p = f"model.layers.{self.L}."
        self.enorm, self.hnorm = t[p + "enorm.weight"], t[p + "hnorm.weight"]
        self.eh_proj, self.head_norm = t[p + "eh_proj.weight"], t[p + "shared_head.norm.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """Drafts after `tokens`: MTP at the last position e-1 (input t_e), then re-applied on its output."""
        ids = torch.tensor([tokens])
        h = self.main.model(ids).last_hidden_state[0][:-1]  # h_0..h_{e-1}
        emb = self.main.model.embed_tokens
        nxt = ids[0, 1:]  # t_1..t_e
        out = []
        for _ in range(k):
            x = torch.cat([rms(emb(nxt), self.enorm), rms(h, self.hnorm)], -1) @ self.eh_proj.T
            y = self._block(x)
            tok = int((rms(y[-1], self.head_norm) @ self.main.lm_head.weight.T).argmax())
            out.append(tok)
            h, nxt = torch.cat([h, y[-1:]]), torch.cat([nxt, torch.tensor([tok])])  # chain: own output
        return out

    def _block(self, x):
        n = x.shape[0]
        pos = torch.arange(n)[None]
        pe = self.block_model.model.rotary_emb(x[None], pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.block_model.model.layers[self.L](x[None], attention_mask=mask, position_ids=pos,
                                                      position_embeddings=pe)[0]


def engine_with_prompts(path: str, k: int) -> EngineCore:
    """A float32 MTP engine (chunked prefill at 32 tokens) with PROMPTS added, greedy, 12 tokens each."""
    args = EngineArgs(model=path, dtype="float32", max_num_batched_tokens=32,
                      speculative_config={"method": "mtp", "num_speculative_tokens": k})
    engine = EngineCore(args.create_config(512))
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineCoreRequest(str(i), p, SamplingParams(temperature=0, max_tokens=12,
                                                                       ignore_eos=True)))
    return engine


@pytest.mark.parametrize("k", [1, 2])
def test_engine_drafts_match_dense_reference(mtp_ckpt_dir, k):
    path = mtp_ckpt_dir("v3")
    ref = ReferenceMTP(path)
    engine = engine_with_prompts(path, k)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            if req.spec_token_ids:
                tokens = req.prompt_token_ids + req.output_token_ids
                assert req.spec_token_ids == ref.drafts(tokens, len(req.spec_token_ids)), f"at {len(tokens)}"
                checked += 1
    assert checked >= 20
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens >= 2  # accepted drafts moved the MTP positions
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # rejected rows were in the passes too


def test_first_pass_runs_on_the_main_steps_metadata(mtp_ckpt_dir, monkeypatch):
    """k = 1: the MTP pass of every step is the step's one more layer, on the main forward's positions and
    metadata (rows past the accepted drafts included): the proposer builds no metadata of its own, and the
    drafts still equal the reference (the test above)."""
    import moeserve.speculative.proposer as proposer

    built = []
    real = proposer.build_attention_metadata
    monkeypatch.setattr(proposer, "build_attention_metadata", lambda *a: built.append(a) or real(*a))
    engine = engine_with_prompts(mtp_ckpt_dir("v3"), 1)
    passes = []
    engine.runner.proposer.mtp.register_forward_hook(lambda m, a, out: passes.append(out.shape[0]))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert not built and len(passes) == steps
    assert engine.stats().spec_num_accepted_tokens < engine.stats().spec_num_draft_tokens

"""Fixtures shared by the multi-rank engine tests (test_dp_engine.py, test_elastic_ep*.py): the tiny V3
checkpoint (also in FP8) and the single-process engine's greedy tokens for the requesting module's PROMPTS and GREEDY (a
module that defines its own `path` or `reference` overrides these)."""
import pytest

from moeserve import LLM
from tests.quant.test_loading import _write_fp8


@pytest.fixture(scope="module")
def path(ckpt_dir):
    return ckpt_dir("v3")


@pytest.fixture(scope="module")
def fp8_path(ckpt_dir, tmp_path_factory):
    """The tiny V3 checkpoint with its weights in FP8 (e4m3 + 128x128 block scales), as DeepSeek ships V3."""
    path = str(tmp_path_factory.mktemp("fp8") / "v3")
    _write_fp8(ckpt_dir("v3"), path)
    return path


@pytest.fixture(scope="module")
def reference(path, request):
    """Each of the module's PROMPTS greedily decoded by an unfailed single-process engine, float32 (the tokens
    every multi-rank layout must reproduce). The module's own constants: test_dp_engine.py decodes 8 tokens,
    the elastic tests 16."""
    prompts, greedy = request.module.PROMPTS, request.module.GREEDY
    llm = LLM(path, dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]

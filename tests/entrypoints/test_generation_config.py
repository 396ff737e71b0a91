"""--generation-config: the checkpoint's generation_config.json gives defaults for fields a request leaves
unset (vLLM's "auto"), offline and over HTTP; "vllm" ignores it; bad files say which and how to opt out."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from moeserve import LLM, SamplingParams
from moeserve.generation_defaults import default_sampling
from tests.entrypoints.server import ServerProcess

PROMPT = [5, 17, 99, 200, 3, 45, 67]


@pytest.fixture(scope="module")
def gen_ckpt(ckpt_dir, tmp_path_factory):
    """The tiny checkpoint plus a generation_config.json recommending greedy decoding and 5 new tokens."""
    path = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(ckpt_dir("v3"), path)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.0, "top_p": 0.9, "max_new_tokens": 5, "eos_token_id": 1}))
    return str(path)


def test_defaults_read_from_the_file(gen_ckpt, tmp_path):
    assert default_sampling("auto", gen_ckpt) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert default_sampling("vllm", gen_ckpt) == {}
    assert default_sampling(gen_ckpt, str(tmp_path)) == default_sampling("auto", gen_ckpt)  # another folder's file
    assert default_sampling("auto", str(tmp_path)) == {}  # no file
    (tmp_path / "generation_config.json").write_text('{"top_p": 7}')
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in"):
        default_sampling("auto", str(tmp_path))
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm or a folder"):
        default_sampling("nope", gen_ckpt)


def test_offline_uses_them_when_given_no_params(gen_ckpt):
    llm = LLM(gen_ckpt, dtype="float32")
    assert llm.get_default_sampling_params().max_tokens == 5
    out = llm.generate(prompt_token_ids=[PROMPT])[0].outputs[0]
    greedy = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=5))
    assert out.token_ids == greedy[0].outputs[0].token_ids
    plain = LLM(gen_ckpt, dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == 16 and plain.get_default_sampling_params().temperature == 1


def test_server_fills_unset_fields(gen_ckpt):
    server = ServerProcess(gen_ckpt, "--dtype", "float32", "--max-model-len", "256")
    try:
        url = server.base_url + "/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        unset = httpx.post(url, json={"messages": msgs}, timeout=60).json()
        greedy = httpx.post(url, json={"messages": msgs, "temperature": 0, "max_tokens": 5}, timeout=60).json()
        assert unset["usage"]["completion_tokens"] <= 5
        assert unset["choices"][0]["message"] == greedy["choices"][0]["message"]  # temperature 0 from the file
        longer = httpx.post(url, json={"messages": msgs, "max_tokens": 9, "ignore_eos": True}, timeout=60).json()
        assert longer["usage"]["completion_tokens"] == 9  # the request's own value wins
        done = httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "ignore_eos": True}, timeout=60)
        assert done.json()["usage"]["completion_tokens"] == 5  # completions' default 16, capped by the file (vLLM)
        done = httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "ignore_eos": True,
                                                                   "max_tokens": 16}, timeout=60)
        assert done.json()["usage"]["completion_tokens"] == 16  # an explicit 16 wins
    finally:
        server.stop()


def test_generate_command_uses_the_file_and_flags_win(gen_ckpt, monkeypatch, capsys):
    """`moeserve generate` samples with generation_config's fields unless a flag sets them."""
    from moeserve.cli import main
    seen = []
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params: seen.append(params) or real(self, prompts, params))
    assert main(["generate", "--model", gen_ckpt, "--max-tokens", "2", "--dtype", "float32"]) == 0
    assert main(["generate", "--model", gen_ckpt, "--max-tokens", "2", "--dtype", "float32", "--top-p", "0.5"]) == 0
    assert (seen[0].top_p, seen[0].temperature) == (0.9, 0.0) and seen[1].top_p == 0.5


def test_override_generation_config(gen_ckpt):
    assert default_sampling("auto", gen_ckpt, '{"top_p": 0.5, "max_new_tokens": 7}') == \
        {"temperature": 0.0, "top_p": 0.5, "max_tokens": 7}
    assert default_sampling("vllm", gen_ckpt, {"temperature": 0.3}) == {"temperature": 0.3}
    with pytest.raises(ValueError, match="unknown key"):
        default_sampling("auto", gen_ckpt, '{"colour": 1}')

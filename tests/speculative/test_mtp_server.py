"""`moeserve serve --speculative-config ...` as a user runs it: same greedy text, spec counters in /metrics."""
import json

import openai
import pytest

from moeserve import LLM, SamplingParams
from tests.entrypoints.server import ServerProcess


@pytest.fixture(scope="module")
def mtp_server(mtp_ckpt_dir):
    server = ServerProcess(mtp_ckpt_dir("v3"), "--max-model-len", "256", "--dtype", "float32",
                           "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}))
    yield server
    server.stop()


def test_served_greedy_matches_offline_and_metrics_count_drafts(mtp_server, mtp_ckpt_dir):
    client = openai.OpenAI(base_url=mtp_server.base_url, api_key="none")
    model = client.models.list().data[0].id
    prompts = [[5, 17, 99, 200, 3, 45, 67], [300, 12]]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    offline = LLM(mtp_ckpt_dir("v3"), dtype="float32").generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert sorted(c.text for c in r.choices) == sorted(o.outputs[0].text for o in offline)
    drafts = mtp_server.wait_metric("vllm:spec_decode_num_draft_tokens_total", lambda v: v > 0)
    accepted = mtp_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafts
    assert mtp_server.metric("vllm:spec_decode_num_drafts_total") > 0
    pos0 = mtp_server.metric("moeserve:spec_decode_num_draft_tokens_per_pos_total", position="0")
    pos1 = mtp_server.metric("moeserve:spec_decode_num_draft_tokens_per_pos_total", position="1")
    assert pos0 + pos1 == drafts and pos0 >= pos1 > 0
    assert mtp_server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_bench_serve_reports_acceptance(mtp_server, tmp_path):
    from moeserve.cli import main

    before = {n: mtp_server.metric(f"vllm:spec_decode_{n}_total")
              for n in ("num_draft_tokens", "num_accepted_tokens")}
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", mtp_server.url, "--model", "v3", "--dataset", "random",
               "--input-len", "12", "--output-len", "10", "--num-prompts", "4", "--ignore-eos",
               "--result-json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    after = {n: mtp_server.metric(f"vllm:spec_decode_{n}_total") for n in before}
    assert r["spec_decode_num_draft_tokens"] == after["num_draft_tokens"] - before["num_draft_tokens"] > 0
    assert r["spec_decode_acceptance_rate"] == pytest.approx(
        (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / r["spec_decode_num_draft_tokens"])
    assert len(r["spec_decode_per_position_acceptance"]) == 2
    assert 1.0 <= r["spec_decode_mean_accepted_length"] <= 3.0

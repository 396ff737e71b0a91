"""Model ids resolved as vLLM resolves them (issue 33): a local folder, else the Hugging Face cache (a real
hub cache layout written in a tmp dir: refs, blobs, snapshots with symlinks), HF_HUB_OFFLINE honoured,
--download-dir and --revision honoured, the served model name is the id as given. No network: every test
that could reach for it runs with HF_HUB_OFFLINE=1."""
from __future__ import annotations

import hashlib
import os

import httpx
import pytest

from moeserve.cli import build_parser
from moeserve.hf_model import resolve_model, served_model_names
from moeserve.entrypoints.serve_cli import build_configs
from tests.entrypoints.server import ServerProcess

REPO = "deepseek-ai/DeepSeek-V3"


def populate_hub_cache(cache: str, repo: str, checkpoint: str, revision: str = "main") -> str:
    """What `huggingface-cli download repo` leaves in cache: blobs by hash, a snapshot of symlinks to them
    named by commit, refs/<revision> holding the commit. Returns the snapshot folder."""
    folder = os.path.join(cache, "models--" + repo.replace("/", "--"))
    commit = hashlib.sha1((repo + revision).encode()).hexdigest()
    snapshot = os.path.join(folder, "snapshots", commit)
    os.makedirs(os.path.join(folder, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in os.listdir(checkpoint):
        with open(os.path.join(checkpoint, name), "rb") as f:
            data = f.read()
        blob = os.path.join(folder, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    with open(os.path.join(folder, "refs", revision), "w") as f:
        f.write(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, ckpt_dir, monkeypatch):
    cache = str(tmp_path / "hub")
    snapshot = populate_hub_cache(cache, REPO, ckpt_dir("v3"))
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, snapshot


def test_an_id_resolves_from_the_cache_offline(hub):
    cache, snapshot = hub
    path = resolve_model(REPO)
    assert os.path.realpath(path) == os.path.realpath(snapshot)
    assert os.path.isfile(os.path.join(path, "config.json")) and os.path.islink(os.path.join(path, "config.json"))


def test_serve_takes_the_id_and_serves_it_under_that_name(hub):
    engine, server = build_configs(build_parser().parse_args(["serve", REPO, "--trust-remote-code"]))
    assert os.path.realpath(engine.model) == os.path.realpath(hub[1])
    assert server.served_model_name == REPO and server.served_model_aliases == ()


def test_download_dir_is_the_cache_looked_in(hub, tmp_path, ckpt_dir, monkeypatch):
    other = str(tmp_path / "elsewhere")
    snapshot = populate_hub_cache(other, "someone/Other-V3", ckpt_dir("v3"))
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("someone/Other-V3")
    assert "not in HF_HUB_CACHE=" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    assert os.path.realpath(resolve_model("someone/Other-V3", download_dir=other)) == os.path.realpath(snapshot)
    engine, _ = build_configs(build_parser().parse_args(["serve", "someone/Other-V3", "--download-dir", other]))
    assert os.path.realpath(engine.model) == os.path.realpath(snapshot)


def test_revision_picks_the_snapshot(hub, ckpt_dir):
    cache, main_snapshot = hub
    v2 = populate_hub_cache(cache, REPO, ckpt_dir("v2_lite"), revision="v2-branch")
    assert os.path.realpath(resolve_model(REPO, revision="v2-branch")) == os.path.realpath(v2)
    assert os.path.realpath(resolve_model(REPO, revision=os.path.basename(main_snapshot))) == \
        os.path.realpath(main_snapshot)  # a commit hash
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(REPO, revision="no-such-branch")
    assert "at revision no-such-branch" in str(e.value)


def test_offline_miss_and_bad_names_are_clear_errors(hub, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("deepseek-ai/DeepSeek-R1")
    assert "'deepseek-ai/DeepSeek-R1' is not a local folder and not in HF_HUB_CACHE=" in str(e.value)
    assert "HF_HUB_OFFLINE is set" in str(e.value)
    for bad in ("./no/such/folder", "a b/c"):
        with pytest.raises(FileNotFoundError) as e:
            resolve_model(bad)
        assert "neither a local folder nor a Hugging Face repo id" in str(e.value)
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model(str(f))


def test_an_incomplete_snapshot_is_named(hub, tmp_path):
    cache = str(tmp_path / "partial")
    os.makedirs(tmp_path / "empty-ckpt")
    populate_hub_cache(cache, "x/Partial", str(tmp_path / "empty-ckpt"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model("x/Partial", download_dir=cache)


def test_local_folder_wins_and_is_named_as_given(ckpt_dir, caplog):
    import logging
    folder = ckpt_dir("v3")
    with caplog.at_level(logging.INFO, logger="moeserve"):
        assert resolve_model(folder, revision="main") == folder
    assert "--revision main has no effect" in caplog.text
    assert served_model_names(folder, folder) == [folder, os.path.basename(folder)]
    assert served_model_names(None, "/x/bundled-model") == ["bundled-model"]


def test_llm_takes_the_id(hub):
    from moeserve import LLM, SamplingParams
    llm = LLM(REPO, max_model_len=128, enforce_eager=True, trust_remote_code=True)
    assert os.path.realpath(llm.config.model.model) == os.path.realpath(hub[1])
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_real_server_on_a_hub_id(hub):
    """`moeserve serve deepseek-ai/DeepSeek-V3` from a populated cache, offline: /v1/models lists the id and a
    client that sends it is served."""
    server = ServerProcess(REPO, "--max-model-len", "256", "--enforce-eager")
    try:
        models = httpx.get(server.base_url + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        r = httpx.post(server.base_url + "/completions", json={"model": REPO, "prompt": "hi", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200 and r.json()["model"] == REPO
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


def test_not_cached_and_online_it_tries_the_download(tmp_path):
    """Without HF_HUB_OFFLINE a missing id is downloaded; here the Hub endpoint is a closed local port, so the
    error says the cache missed and the download failed (huggingface_hub reads HF_ENDPOINT at import, hence a
    fresh process)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub"))
    code = ("from moeserve.hf_model import resolve_model\n"
            "try:\n    resolve_model('someone/Missing')\nexcept FileNotFoundError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "'someone/Missing' is not a local folder, not in HF_HUB_CACHE=" in out and "the download failed" in out

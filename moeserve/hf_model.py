"""Model ids as vLLM resolves them (issue 33): `moeserve serve deepseek-ai/DeepSeek-V3`.

A local folder is used as it is. Anything else is a Hugging Face repo id, looked up with huggingface_hub:
first in the cache only (no network), then, unless HF_HUB_OFFLINE is set, downloaded where the network
allows. --download-dir is the cache folder to use (vLLM passes it as huggingface_hub's cache_dir), else
HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface/hub as huggingface_hub decides; --revision picks a branch, tag
or commit. Only the files a checkpoint needs are downloaded (never code: moeserve runs none).
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger("moeserve")

# what moeserve reads from a checkpoint: config, weights, tokenizer, generation defaults, chat template
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _offline() -> bool:
    """HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) as huggingface_hub reads them, at call time."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None,
                  flag: str = "model") -> str | None:
    """A local folder, else the snapshot folder of the Hugging Face repo id `model` (cache first, then a
    download unless offline). None stays None (the bundled model). Raises FileNotFoundError saying where
    it looked."""
    if model is None:
        return None
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        if revision is not None:
            log.info("--revision %s has no effect: %s %s is a local folder, read as it is", revision, flag, model)
        return expanded
    if os.path.exists(expanded):
        raise FileNotFoundError(f"{flag} {model!r} is a file; give the checkpoint folder or a Hugging Face id")
    if not _REPO_ID.match(model):
        raise FileNotFoundError(f"{flag} {model!r} is neither a local folder nor a Hugging Face repo id "
                                "(organization/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        raise FileNotFoundError(f"{flag} {model!r} is not a local folder, and huggingface_hub (to look up "
                                "Hugging Face ids) is not installed: pip install huggingface_hub") from None
    cache_dir = download_dir or os.environ.get("HF_HUB_CACHE") or None
    where = f"--download-dir {download_dir}" if download_dir else (
        f"HF_HUB_CACHE={cache_dir}" if cache_dir else "the Hugging Face cache")
    kwargs = dict(revision=revision, cache_dir=cache_dir, allow_patterns=DOWNLOAD_PATTERNS)
    rev = f" at revision {revision}" if revision else ""
    try:
        path = snapshot_download(model, local_files_only=True, **kwargs)
        found = "found in"
    except Exception as cached_error:  # LocalEntryNotFoundError, or the cache lacks that revision
        if _offline():
            raise FileNotFoundError(f"{flag} {model!r}{rev} is not a local folder and not in {where}, and "
                                    "HF_HUB_OFFLINE is set, so it is not downloaded "
                                    f"({type(cached_error).__name__})") from None
        log.info("%s %s%s is not in %s: downloading it from the Hugging Face Hub", flag, model, rev, where)
        try:
            path = snapshot_download(model, **kwargs)
        except Exception as e:
            raise FileNotFoundError(f"{flag} {model!r}{rev} is not a local folder, not in {where}, and the "
                                    f"download failed: {type(e).__name__}: {e}".splitlines()[0]) from None
        found = "downloaded to"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{flag} {model!r}{rev}: the snapshot {path} has no config.json (an incomplete "
                                "download? run it again without HF_HUB_OFFLINE, or huggingface-cli download)")
    log.info("%s %s%s: %s %s (%s)", flag, model, rev, found, where, path)
    return path


def served_model_names(given: str | None, path: str) -> list[str]:
    """vLLM's default served model name: the model argument as given (`deepseek-ai/DeepSeek-V3`, or the path
    typed). For a local folder its last path component is accepted too (moeserve's earlier default)."""
    if given is None:
        return [os.path.basename(os.path.normpath(path))]
    names = [given]
    base = os.path.basename(os.path.normpath(given))
    if os.path.isdir(os.path.expanduser(given)) and base and base != given:
        names.append(base)
    return names

"""vLLM's request fields that moeserve does not serve: refused with a 400 naming the field, never accepted
and ignored. A field at vLLM's default value (false, 0, empty, null) asks for nothing and passes.

The fields moeserve serves are declared on the request models (openai_protocol.py); the test
tests/entrypoints/test_vllm_fields.py walks vLLM's own request models (captured from vLLM's source into
tests/entrypoints/vllm_request_fields.json) and checks every field is one or the other.
"""
from __future__ import annotations

# field -> why (the 400 says it); both endpoints
REFUSED = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "logprob_token_ids": "logprobs of chosen token ids are not supported; use logprobs / top_logprobs",
    "return_token_offsets": "token offsets are not supported; completions' logprobs carry text_offset",
    "spaces_between_special_tokens": "detokenization always puts spaces between special tokens",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "mm_payload": "multimodal inputs are not supported (the models served are text-only)",
    "return_mm_kwargs": "multimodal inputs are not supported (the models served are text-only)",
    "mm_processor_kwargs": "multimodal inputs are not supported (the models served are text-only)",
    "media_io_kwargs": "multimodal inputs are not supported (the models served are text-only)",
    "ec_transfer_params": "encoder-cache transfer is not supported",
    "repetition_detection": "repetition detection is not supported",
    "routed_experts_prompt_start": "returning routed experts is not supported",
    "session_id": "sessions are not supported",
    "stream_interval": "streaming sends every engine step's tokens",
    "thinking_token_budget": "thinking_token_budget is served on /v1/chat/completions (with --reasoning-parser)",
    "vllm_xargs": "vllm_xargs: moeserve has no custom logits processors to read them",
    "watermarking": "watermarking is not supported",
    "request_id": "caller-chosen request ids are not supported; the response's id names the request",
    "chat_template": "a per-request chat template is not accepted; start the server with --chat-template",
    "documents": "documents for the chat template are not supported",
    "include_reasoning": "reasoning is always returned (reasoning_content) with --reasoning-parser",
    "return_prompt_text": "return_prompt_text is not supported",
}
# vLLM's defaults: a field at one of these asks for nothing
DEFAULTS = {"use_beam_search": (False,), "length_penalty": (1.0, 1), "return_token_offsets": (False,),
            "spaces_between_special_tokens": (True,),
            "mm_payload": ("tensors",), "routed_experts_prompt_start": (0,), "include_reasoning": (True,),
            "return_prompt_text": (False,)}


def refuse_unserved(data, endpoint: str, served=()) -> None:
    """Raise APIError for the first vLLM field the raw request sets to something moeserve cannot serve (served:
    the endpoint's own fields, e.g. thinking_token_budget on chat, refused on completions)."""
    from moeserve.entrypoints.errors import APIError

    if not isinstance(data, dict):
        return
    for name, why in REFUSED.items():
        if name in served:
            continue
        value = data.get(name)
        if value is None or value in DEFAULTS.get(name, ()) or value in ([], {}, ""):
            continue
        raise APIError(f"'{name}' is not supported by this server ({endpoint}): {why}", param=name)

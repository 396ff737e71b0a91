"""Chat messages -> prompt text with the checkpoint's chat template: one rule for the server's
/v1/chat/completions and /tokenize and for the offline LLM.chat().

A checkpoint without a chat template gets DEFAULT_CHAT_TEMPLATE (documented in docs/serving.md): the BOS
token, a "tools: <JSON>" line when tools are given, then one "<role>: <content>" line per message, then
"assistant:" when a reply is wanted.
"""
from __future__ import annotations

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template could not render the messages (the message says why)."""


def resolve_template(tokenizer, chat_template: str | None = None) -> str:
    """An explicit template, else the tokenizer's, else DEFAULT_CHAT_TEMPLATE."""
    return chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render(tokenizer, conversation: list[dict], template: str, add_generation_prompt: bool = True,
           tools: list[dict] | None = None, template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids). The template writes the special tokens itself (BOS): none are added.
    tools (OpenAI's function definitions) are the template's `tools` variable, as HF templates expect;
    template_kwargs (vLLM's chat_template_kwargs, e.g. {"thinking": true}) are more template variables."""
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tools=tools,
                                             add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja raises TemplateError (incl. raise_exception) and others
        raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)

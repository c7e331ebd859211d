"""Chat messages to a prompt, with the model's own chat template (the replica holds the real tokenizer)."""

from __future__ import annotations

from ..errors import InvalidRequest


def render_chat(tokenizer: object, messages: list[dict[str, str]]) -> str:
    """The prompt text of ``messages`` under the tokenizer's chat template (``InvalidRequest`` if none).

    A leading BOS the template writes is dropped when the tokenizer adds BOS itself on encode, so the
    prompt is not tokenised with two.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model has no chat template, so /v1/chat/completions cannot format messages; "
            "use /v1/completions with a prompt"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template that rejects the messages (e.g. role order)
        raise InvalidRequest(f"the chat template cannot render these messages: {err}") from None
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and text.startswith(bos) and bos_id is not None and bos_id in tokenizer.encode(""):
        text = text[len(bos) :]
    return text

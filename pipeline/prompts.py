"""From one input row to prompt token ids and sampling settings. Any problem is a ValueError that
the actor turns into that row's error (finish_reason="error"), leaving the other rows alone."""

from __future__ import annotations

import json
from typing import Any

from pipeline.actors.engine import SamplingParams
from pipeline.config import template_fields


def prompt_text(row: dict[str, Any], source: str, template: str | None, tokenizer: Any, chat: bool) -> str:
    """The prompt as text. source: "template", "messages" or "prompt" (see pipeline.io.prompt_source)."""
    if source == "messages":
        return render_chat(tokenizer, parse_messages(row.get("messages")))
    if source == "template":
        missing = [k for k in template_fields(template) if row.get(k) is None]
        if missing:
            raise ValueError(f"template columns {missing} are null")
        try:
            text = template.format_map(row)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"prompt_template failed on this row: {e!r}") from None
    else:
        text = row.get("prompt")
        if text is None:
            raise ValueError("prompt is null")
        if not isinstance(text, str):
            raise ValueError(f"prompt must be text, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("prompt is empty")
    return render_chat(tokenizer, [{"role": "user", "content": text}]) if chat else text


def parse_messages(value: Any) -> list[dict[str, str]]:
    """A chat list: list of {"role", "content"} (or the same as a JSON string)."""
    if value is None:
        raise ValueError("messages is null")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"messages is not a chat list nor JSON of one: {e}") from None
    if not isinstance(value, list) or not value:
        raise ValueError("messages is empty" if value == [] else "messages must be a list of {role, content}")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs text 'role' and 'content', got {m!r}")
    if not any(m["content"].strip() for m in value):
        raise ValueError("messages hold no text")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def token_ids(tokenizer: Any, text: str, chat_rendered: bool) -> list[int]:
    """Token ids; a chat-rendered prompt already has its special tokens."""
    return list(tokenizer(text, add_special_tokens=not chat_rendered)["input_ids"])


def sampling(row: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """The job's sampling settings overridden by the row's `sampling_params` (a mapping or JSON of one)."""
    value = row.get("sampling_params")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"sampling_params is not JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"sampling_params must be a mapping, got {type(value).__name__}")
    return SamplingParams.from_dict(value, defaults)

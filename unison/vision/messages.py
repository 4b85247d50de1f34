"""Chat messages with images, in transformers' processor format: a message's ``content`` a list of parts,
``{"type": "image"}`` placeholders (the pixels travel beside the messages, as ``row["images"]``) and ``{"type":
"text", "text": ...}``.

Every message's content becomes a part list, text-only ones included: SmolVLM's and Idefics3's chat templates
iterate ``message['content']`` as parts and would render a plain string character by character, while Qwen2.5-VL's
and Gemma-3's take either form.

>>> chat_messages("How many circles?", 1, "Be brief.")[1]
{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'How many circles?'}]}
"""

from __future__ import annotations

from collections.abc import Sequence

IMAGE_KEYS = ("image", "path", "url")
"""Where an image part may carry its image itself, as transformers' processors read it."""


def is_part_list(content) -> bool:
    """A message content of parts: ``{"type": "text", "text": str}`` and ``{"type": "image", ...}``."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and (p.get("type") == "image" or p.get("type") == "text" and isinstance(p.get("text"), str))
        for p in content)


def image_parts(conversation: list[dict]) -> list[dict]:
    """The ``{"type": "image"}`` parts of a conversation's messages, in order."""
    return [p for m in conversation if isinstance(m.get("content"), list) for p in m["content"]
            if p.get("type") == "image"]


def user_content(prompt: str, images: int | Sequence) -> list[dict]:
    """A user message's parts: one image placeholder per image (``images``: the images, or how many), then the
    text. The images come before the text, as TRL and the model cards put them."""
    n = images if isinstance(images, int) else len(images)
    return [{"type": "image"} for _ in range(n)] + [{"type": "text", "text": prompt}]


def chat_messages(prompt: str | list[dict], images: int | Sequence, system_prompt: str | None = None) -> list[dict]:
    """The messages a processor's chat template renders for a row: ``system_prompt`` first (unless the
    conversation opens with a system message of its own, as ``unison.rollout.loop.encode_prompt`` does for text),
    then the user message (``prompt`` a string: its images before its text) or the conversation, its image parts
    reduced to placeholders. A conversation without image parts gets them at the start of its first user message
    (TRL's ``prepare_multimodal_messages`` does the same); one with image parts must have one per image."""
    n = images if isinstance(images, int) else len(images)
    system = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}] if system_prompt else []
    if isinstance(prompt, str):
        return [*system, {"role": "user", "content": user_content(prompt, n)}]
    if prompt and prompt[0].get("role") == "system":
        system = []
    messages = [{**m, "content": _parts(m["content"])} for m in prompt]
    placed = len(image_parts(messages))
    if placed == 0 and n:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise ValueError(f"a conversation with {n} image(s) needs a user message to put them in")
        first_user["content"] = [{"type": "image"} for _ in range(n)] + first_user["content"]
    elif placed != n:
        raise ValueError(f"the conversation has {placed} image part(s) and the row {n} image(s)")
    return system + messages


def placeholder(part: dict) -> dict:
    """An image part without its image (the pixels travel beside the messages); any other part as it is."""
    return {k: v for k, v in part.items() if k not in IMAGE_KEYS} if part.get("type") == "image" else dict(part)


def _parts(content: str | list[dict]) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else [placeholder(p) for p in content]

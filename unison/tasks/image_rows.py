"""Rows with images, in TRL's two vision-language shapes: an ``images`` column (a list, or one image; ``image``
is accepted too) beside a prompt, and conversations whose message contents are part lists with ``{"type":
"image"}`` parts (which may carry the image under ``image``, ``path`` or ``url``).

``with_images`` gives every such row ``images``: a list of RGB PIL images (``unison.vision.images.load_image``),
and leaves the prompt as it was but for an image part's payload, which moves to ``images`` (the part stays, a
placeholder). A string prompt's images come before its text (``unison.vision.messages.chat_messages``). A relative
image path is looked up in the working directory, then beside the data file.
"""

from __future__ import annotations

from pathlib import Path

from unison.config import InvalidInputError
from unison.vision.images import load_image
from unison.vision.messages import IMAGE_KEYS, image_parts, placeholder


def has_images(row: dict, prompt) -> bool:
    return "images" in row or "image" in row or (isinstance(prompt, list) and bool(image_parts(prompt)))


def with_images(row: dict, base_dir: Path | None = None) -> dict:
    """``row`` (its ``prompt`` a string or a conversation) with ``images`` a list of RGB PIL images. Raises
    ``InvalidInputError`` for an image that does not load, or image parts that do not match the images."""
    row = dict(row)
    given = _column(row)
    prompt = row["prompt"]
    if isinstance(prompt, list):
        parts = image_parts(prompt)
        carried = [next((p[k] for k in IMAGE_KEYS if p.get(k) is not None), None) for p in parts]
        if given and parts and len(parts) != len(given):
            raise InvalidInputError(f"the conversation has {len(parts)} image part(s) and the images column "
                                    f"{len(given)} image(s)")
        if not given:
            if None in carried:
                raise InvalidInputError(f"image part {carried.index(None)} carries no image (under {IMAGE_KEYS}) "
                                        "and the row has no images column")
            given = carried
        row["prompt"] = [_placeholders(m) for m in prompt]
    images = []
    for i, value in enumerate(given):
        try:
            images.append(load_image(_beside(value, base_dir)))
        except InvalidInputError as e:
            raise InvalidInputError(f"image {i}: {e}") from None
    row["images"] = images
    return row


def _column(row: dict) -> list:
    """The row's images column as a list (``image`` singular moved to ``images``)."""
    if "image" in row:
        if row.get("images") not in (None, []):
            raise InvalidInputError("the row has both an 'image' and an 'images' column")
        row["images"] = row.pop("image")
    given = row.get("images")
    if given is None:
        return []
    return list(given) if isinstance(given, list | tuple) else [given]


def _placeholders(message: dict) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    return {**message, "content": [placeholder(p) for p in content]}


def _beside(value, base_dir: Path | None):
    """A relative path that is not in the working directory but is beside the data file: that one."""
    if isinstance(value, dict) and value.get("bytes") is None and value.get("path") is not None:
        return _beside(value["path"], base_dir)
    if base_dir is None or not isinstance(value, str | Path) or str(value).startswith(("data:", "http://", "https://")):
        return value
    path = Path(value).expanduser()
    if not path.is_absolute() and not path.exists() and (base_dir / path).exists():
        return base_dir / path
    return value

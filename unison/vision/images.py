"""Images as rows carry them: loaded to RGB, identified by their pixels, encoded for JSON.

``load_image`` takes every form a data set gives an image in: a PIL image, the file's bytes, a local path, a
``data:image/...;base64,...`` URL, or the storage dict of Hugging Face ``datasets``' Image feature (``{"bytes": ...,
"path": ...}``, as a parquet row holds it). pillow is imported only here, when an image is touched.

>>> from PIL import Image
>>> image = load_image(encode_image(Image.new("RGBA", (2, 1), "red")))
>>> image.mode, image.size, len(image_digest(image))
('RGB', (2, 1), 16)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path

from unison.config import InvalidInputError, MissingInputError


def pil():
    """The ``PIL.Image`` module; ``MissingInputError`` naming the extra to install where pillow is missing."""
    try:
        from PIL import Image
    except ImportError:
        raise MissingInputError("images need pillow: pip install 'unison[vision]'") from None
    return Image


def load_image(value):
    """``value`` as an RGB ``PIL.Image.Image``: a PIL image, bytes of an image file (PNG, JPEG, ...), a local path
    (str or Path), a ``data:image/...;base64,`` URL, or a ``{"bytes": ...}`` / ``{"path": ...}`` dict. Raises
    ``InvalidInputError`` naming the path, the type or the first bytes of what is not an image."""
    Image = pil()
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return load_image(value["bytes"])
        if value.get("path") is not None:
            return load_image(value["path"])
        raise InvalidInputError(f"an image dict needs 'bytes' or 'path' (the datasets Image feature's form), got "
                                f"keys {sorted(value)}")
    if isinstance(value, bytes | bytearray | memoryview):
        return _decode(bytes(value), f"image bytes starting {bytes(value)[:16]!r}")
    if isinstance(value, str) and value.startswith("data:"):
        return _decode(_data_url_bytes(value), f"data URL {value[:40]!r}...")
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise InvalidInputError(f"image {value[:80]!r}: URLs are not fetched; download the image and give its path")
    if isinstance(value, str | Path):
        path = Path(value).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"image file {path} does not exist" if not path.exists() else
                                    f"image path {path} is not a file")
        return _decode(path.read_bytes(), f"image file {path}")
    raise InvalidInputError(f"an image must be a PIL image, bytes, a path, a data: URL or a {{'bytes'|'path'}} dict, "
                            f"got {type(value).__name__}")


def _decode(data: bytes, what: str):
    Image = pil()
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode now: a truncated file fails here, not in a later step
            return image.convert("RGB")
    except Image.UnidentifiedImageError:
        raise InvalidInputError(f"{what} does not decode as an image: not a format pillow reads (PNG, JPEG, WebP, "
                                "GIF, ...)") from None
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:  # truncated, corrupt, huge
        raise InvalidInputError(f"{what} does not decode as an image ({type(e).__name__}: {str(e)[:200]})") from None


def _data_url_bytes(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64") or not head[len("data:"):].startswith("image/"):
        raise InvalidInputError(f"data URL {url[:40]!r}... is not data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"data URL {url[:40]!r}... has invalid base64 ({e})") from None


def image_digest(image) -> bytes:
    """16 bytes of blake2b over the image's size and RGB pixels: the same picture from any file or form gives the
    same digest, a single changed pixel another."""
    rgb = image.convert("RGB")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"RGB {rgb.width}x{rgb.height}\0".encode())
    digest.update(rgb.tobytes())
    return digest.digest()


def encode_image(image) -> str:
    """A ``data:image/png;base64,`` URL of the image (lossless: ``load_image`` gives back the same pixels), for
    JSON requests such as ``unison serve``'s."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


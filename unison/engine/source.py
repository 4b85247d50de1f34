"""A function's statements as text, for the checks that swap a transformers forward for a fused one only where the
class computes exactly what the fused forward computes."""

from __future__ import annotations

import functools
import inspect


@functools.cache
def body(fn) -> tuple[str, ...]:
    """The stripped lines of ``fn``'s body after its signature, comments and blank lines left out (``()`` where
    the source cannot be read). transformers' rename of ``past_key_values`` to ``cache`` (5.25) reads as ``cache``
    in both versions."""
    try:
        lines = inspect.getsource(fn).splitlines()
    except (OSError, TypeError):
        return ()
    ends = [i for i, line in enumerate(lines) if line.strip().startswith(")") and line.rstrip().endswith(":")]
    first = ends[0] + 1 if ends else next((i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(":")), 0)
    out, docstring = [], False
    for line in lines[first:]:
        text = line.split("  #")[0].strip()
        if docstring:  # inside a docstring, up to the line that closes it
            docstring = not text.endswith('"""')
            continue
        if text.startswith('"""'):
            docstring = not (len(text) > 3 and text.endswith('"""'))  # a one-line docstring closes itself
            continue
        if not text or text.startswith("#"):
            continue
        out.append(text.replace("past_key_values", "cache"))
    return tuple(out)

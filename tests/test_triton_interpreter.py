"""tests/triton_interpreter.py: the interpreter's device calls without their re-patching wrap exactly what the
interpreter wraps, its dtype answers are the interpreter's, and a device call inside a kernel that patched its
language runs without a patch of its own."""

from __future__ import annotations

import pytest

interpreter = pytest.importorskip("triton.runtime.interpreter")
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import count_calls  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(interpreter._patch_builtin, "original"),
                                reason="the CPU tests' interpreter (TRITON_INTERPRET) is not in use")
NAMESPACES = [tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base]


def _wrapped(patch, pkg, scope=None) -> list[str]:
    """The names ``patch`` wraps in ``pkg`` (restored after unless ``scope`` is given, which keeps them)."""
    own = scope or interpreter._LangPatchScope()
    before = len(own._changes)
    patch(pkg, interpreter.interpreter_builder, own)
    names = sorted(name for obj, name, _ in own._changes[before:] if obj is pkg)
    if scope is None:
        own.restore()
    return names


@pytest.mark.parametrize("pkg", NAMESPACES, ids=lambda p: getattr(p, "__name__", str(p)))
def test_the_same_builtins_are_wrapped(pkg):
    fast = interpreter._patch_builtin
    names = _wrapped(fast.original, pkg)
    assert names and _wrapped(fast, pkg) == names
    assert all(tl.core.is_builtin(getattr(pkg, name)) for name in names)  # restored: the builtins are back
    held = interpreter._LangPatchScope()  # inside a kernel's run (the language patched), neither wraps anything more
    try:
        assert _wrapped(fast, pkg, held) == names
        assert _wrapped(fast.original, pkg) == _wrapped(fast, pkg) == []
    finally:
        held.restore()


def test_dtype_answers_are_the_interpreters():
    fast = interpreter._get_np_dtype
    types = [tl.float32, tl.bfloat16, tl.int1, tl.int64, tl.float8e4nv, tl.pointer_type(tl.float32),
             tl.block_type(tl.int32, [4]), tl.block_type(tl.bfloat16, [2, 8]),
             tl.block_type(tl.pointer_type(tl.int8), [4])]
    for t in types + types:  # the second round from the memo
        assert fast(t) == fast.original(t), t
    with pytest.raises(KeyError):
        fast(tl.void)  # what the interpreter cannot store, it still refuses


@triton.jit
def _doubled(x):
    return x * 2


@triton.jit
def _double_kernel(X, Out, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(Out + i, _doubled(tl.load(X + i)))


def test_a_device_call_runs_in_its_kernels_patch(monkeypatch):
    """Three programs each call a helper: the language is patched once, for the kernel (the interpreter alone patches
    it again at each call: four times), the results are the helper's, and the builtins are back after the launch."""
    patches = count_calls(monkeypatch, interpreter, ["_patch_lang_core"])
    x = torch.arange(12, dtype=torch.float32)
    out = torch.empty_like(x)
    _double_kernel[(3,)](x, out, N=4)
    assert patches["_patch_lang_core"] == 1
    assert torch.equal(out, 2 * x)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__mul__)

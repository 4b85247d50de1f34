"""Triton's interpreter (the CPU tests' way of running the engine's and the trainer's kernels), with its device-call
overhead taken out.

Each call of a ``@triton.jit`` helper inside a kernel re-patches ``triton.language`` for the interpreter
(``InterpretedFunction.__call__`` -> ``_patch_lang``): ``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math`` and ``tl.core.tensor_descriptor_base``, sorted, to find the builtins to wrap, ~3 ms a call. The kernels
call helpers once per program instance, so a test of the Triton engine spent about a third of its time there
(cProfile of ``test_prefill_wait``'s staggered episodes: 90 of 280 s in ``_patch_builtin``).

``speed_up()`` keeps the interpreter's semantics and drops that search: the names holding builtins in each of those
namespaces are listed once, here, before any kernel runs (nothing is patched yet), and ``_patch_builtin`` then wraps
whichever of those names still holds a builtin, as it did. The set of builtins is fixed when triton.language
is imported (a patch swaps a builtin for its wrapper, a restore puts it back), so the wrappers are the same. Where
the interpreter's internals differ from what this reads (Triton 3.9's), nothing is changed. It also remembers
``_get_np_dtype``'s answers (the interpreter builds a dict of 19 numpy dtypes at each of its calls, ~40 us, and calls
it for most operations: another 16 s there), keyed on the Triton type's class and value, which alone decide it (a
block type, unhashable, on its element type's, which decides its answer). And a device call inside a running kernel
skips the re-patch altogether where the kernel's patch covers it (the patch left ~0.3 ms a call after the search was
gone, and the scan of the callee's globals for the language modules; ``_skip_device_call_patches``): the decode
attention kernel's launch 7-12% faster.
"""

from __future__ import annotations

import inspect


def speed_up() -> bool:
    """Patch the interpreter's ``_patch_builtin`` (see the module's docstring); False where its internals are not
    the ones read here (then nothing is changed)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or hasattr(original, "original"):  # (absent, or patched already)
        return False
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False
    builtins = {pkg: tuple(name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member))
                for pkg in (tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None))
                if pkg is not None}  # (modules and classes: keyed by identity)

    def _patch_builtin(pkg, builder, scope):
        if pkg not in builtins:
            return original(pkg, builder, scope)
        for name in builtins[pkg]:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.original = original
    interpreter._patch_builtin = _patch_builtin
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        known_dtypes: dict = {}

        def _get_np_dtype(tt_dtype):
            if isinstance(tt_dtype, tl.block_type):  # (unhashable; its answer is its element type's)
                tt_dtype = tt_dtype.element_ty
            key = (type(tt_dtype), tt_dtype)
            try:
                return known_dtypes[key]
            except KeyError:
                known_dtypes[key] = found = np_dtype(tt_dtype)
                return found
            except TypeError:  # (unhashable: not a Triton type; the interpreter's own answer or error)
                return np_dtype(tt_dtype)

        _get_np_dtype.original = np_dtype
        interpreter._get_np_dtype = _get_np_dtype
    _skip_device_call_patches(interpreter, tl)
    return True


def _skip_device_call_patches(interpreter, tl) -> None:
    """A device call inside a running kernel skips ``_patch_lang`` where the kernel's own patch already covers the
    language modules the callee sees (what it would patch is patched: its builtins wrapped, the tensor's and the
    core's attributes set to the same functions). Where the callee sees a module the kernel does not, the
    interpreter's own patch runs, as before."""
    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_call = vars(getattr(interpreter, "GridExecutor", object)).get("__call__")
    if patch_lang is None or grid_call is None or list(inspect.signature(patch_lang).parameters) != ["fn"]:
        return
    running: list[list] = []  # a kernel run's [language modules patched, whether its own patch ran], innermost last
    seen: dict = {}

    def languages(fn) -> frozenset:
        try:
            return seen[fn]
        except KeyError:  # (the interpreter's own test: the module objects among the function's globals)
            seen[fn] = found = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
            return found

    def _patch_lang(fn):
        if running:
            run, mine = running[-1], languages(fn)
            if run[1] and mine <= run[0]:
                return interpreter._LangPatchScope()  # nothing to restore
            run[0], run[1] = run[0] | mine, True
        return patch_lang(fn)

    def __call__(self, *args, **kwargs):
        running.append([frozenset(), False])
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    _patch_lang.original = patch_lang
    __call__.original = grid_call
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__

"""Shared plumbing for the kernel modules: optional Triton import and the impl dispatcher.

Triton is optional. When it cannot be imported every public function runs its PyTorch
reference. When it can, ``impl="auto"`` uses Triton for CUDA tensors only: on CPU tensors the
Triton kernels only run under the interpreter (``TRITON_INTERPRET=1``), which is for tests,
so ``auto`` never picks it there.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

try:  # the import itself can fail in odd ways (missing libs), so catch broadly
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    _TRITON_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"

IMPLS = ("auto", "torch", "triton")


def _interpreter_loop_bounds_fix() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with ``int(array)``, which
    NumPy >= 2.4 refuses for its one-element arrays (triton-lang/triton#9171, fixed upstream after
    3.6): every kernel with a data-dependent ``range`` fails under ``TRITON_INTERPRET=1``. Squeeze
    first, as the upstream fix does. Interpreter only; compiled kernels never see this path."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_dspark_squeezes", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch._dspark_squeezes = True
    interpreter._patch_lang_tensor = patch


def triton_available() -> bool:
    """True when ``triton`` imports (kernels can run on CUDA, or on CPU under the interpreter)."""
    return HAS_TRITON


def triton_interpreting() -> bool:
    """True when Triton was set up to interpret kernels on the CPU (``TRITON_INTERPRET=1``).

    ``@triton.jit`` reads the variable when the kernel modules are imported, so it must be set
    before ``dspark.kernels`` (and ``triton``) are first imported in the process.
    """
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


if triton_interpreting():
    _interpreter_loop_bounds_fix()


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """Map ``impl`` to the backend that will run: ``"torch"`` or ``"triton"``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "auto":
        return "triton" if HAS_TRITON and on_cuda else "torch"
    if not HAS_TRITON:
        raise RuntimeError(f"impl='triton' requested but triton cannot be imported ({_TRITON_ERROR})")
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if not (on_cuda or (on_cpu and triton_interpreting())):
        devices = sorted({str(t.device) for t in tensors})
        raise RuntimeError(
            f"impl='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
            f"import); got devices {devices}"
        )
    return "triton"


_SELF_CHECKS: dict[tuple, bool] = {}


def self_check_results() -> list[dict]:
    """Every self-check this process ran: the kernel, its key (device first) and whether it runs,
    for a benchmark's report: a timing taken on a fallback says so."""
    return [{"kernel": k[0], "key": [str(x) for x in k[1:]], "runs": ok} for k, ok in _SELF_CHECKS.items()]


def self_check(kernel: str, key: tuple, check: Callable[[], tuple[bool, str]], fallback: str) -> bool:
    """Whether ``kernel`` may run for ``key`` (its device first, then what its code depends on):
    ``check()`` runs it once per process and key on a small case against its reference and says
    (ok, why not). A failure, or an error compiling or launching it, says no with one warning naming
    the ``fallback`` that runs instead: a caller keeps its reference path rather than losing a run
    to a kernel the device rejects."""
    if (kernel, *key) not in _SELF_CHECKS:
        try:
            ok, why = check()
        except Exception as exc:  # a compiler or launch failure on this device
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            message = f"{kernel}'s Triton kernel is off on {key[0]} ({why}): {fallback} runs instead"
            warnings.warn(message, stacklevel=3)
        _SELF_CHECKS[(kernel, *key)] = ok
    return _SELF_CHECKS[(kernel, *key)]

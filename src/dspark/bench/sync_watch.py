"""Host↔device synchronisations of the training step, counted on any device (the CPU included).

On CUDA a host read of a device value (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.numpy()``) and a data-dependent shape (``nonzero``, ``masked_select``, boolean indexing,
``unique``) make the host wait until the device has run everything queued before them. On the CPU
nothing waits, so ``torch.cuda.set_sync_debug_mode`` has nothing to say there; ``SyncWatch``
instead follows which tensors hold *device data*: those marked (``mark``: parameters, buffers, the
batch once on the device) and every result of an operator that read one. A syncing call on such a
tensor is recorded with the line that made it. Tensors made from host numbers alone are host
data, reading them is free; except a factory's result asked for a device by name (``torch.arange(…,
device=x.device)``: on CUDA it is made on the GPU, as transformers makes its positions) and the
numbers given to ``LightningModule.log``, which Lightning puts on the module's device (and reads back
with ``.item()`` on every later step): those are device data.

    with SyncWatch() as watch:
        watch.mark(module, batch)
        ...                        # the step
    watch.events                   # [SyncEvent(op, where), …]

``SyncWatchCallback`` marks what a Lightning fit puts on its device and counts the events of each
optimizer step (from one ``on_train_batch_start`` to the next, so Lightning's logging after the
step is in it). A test on the CPU then fails when a step gains a sync (tests/test_host_syncs.py).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SYNC_OPS", "SyncEvent", "SyncWatch", "SyncWatchCallback"]

# Operators that make the host wait for the device on CUDA (their result's value or shape is read
# on the host). Boolean indexing (aten.index.Tensor / index_put_ with a bool index) runs nonzero
# inside the kernel, repeat_interleave with tensor repeats sums them unless given output_size: both
# told apart by their arguments (SyncWatch._syncs). A copy to the host (.cpu()) is seen at the read
# that follows it: on the CPU it is no operator.
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::equal",
    }
)
# Factories whose result is made where ``device=`` says: on the GPU when named, whatever its inputs.
_FACTORIES = (
    "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "tensor", "as_tensor", "linspace",
    "eye",
)  # fmt: skip
_BOOL_INDEXED = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
_ROOT = Path(__file__).resolve().parents[1]  # src/dspark
_TO_TENSOR = "_LightningModule__to_tensor"  # LightningModule.log's number -> tensor (name-mangled)
_INHERITED = object()  # a patched attribute that came from a base class


@dataclass(frozen=True)
class SyncEvent:
    op: str  # "aten::_local_scalar_dense", "Tensor.tolist", …
    where: str  # the innermost caller outside torch: "dspark/module.py:96 in compute"

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _caller() -> str:
    """The innermost frame outside torch's own code (dspark's, Lightning's, a test's)."""
    frames = traceback.extract_stack()
    for f in reversed(frames):
        path = f.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("sync_watch.py"):
            continue
        try:
            short = str(Path(path).resolve().relative_to(_ROOT.parent))
        except ValueError:
            short = "/".join(Path(path).parts[-2:])
        return f"{short}:{f.lineno} in {f.name}"
    return "?"


class SyncWatch(TorchDispatchMode):
    """Records the syncing calls made on device data while active (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.events: list[SyncEvent] = []
        self._device = WeakIdKeyDictionary()
        self._patched: list[tuple[type, str, object]] = []  # (owner, name, what was there)

    # ---- device data ---------------------------------------------------------------------------
    def mark(self, *things) -> None:
        """Mark tensors as device data: tensors, modules (parameters and buffers), and dicts / lists /
        tuples of them."""
        for thing in things:
            if isinstance(thing, nn.Module):
                self.mark(*thing.parameters(), *thing.buffers())
            elif isinstance(thing, Tensor):
                self._add(thing)
            else:
                leaves, _ = tree_flatten(thing)
                for leaf in leaves:
                    if isinstance(leaf, (Tensor, nn.Module)):
                        self.mark(leaf)

    def _add(self, t: Tensor) -> None:
        self._device[t] = True
        if t._base is not None:  # a write through a view puts device data into its base
            self._device[t._base] = True
        if t.grad is not None:
            self._device[t.grad] = True

    def on_device(self, t) -> bool:
        if not isinstance(t, Tensor):
            return False
        return t in self._device or (t._base is not None and t._base in self._device)

    # ---- the dispatch hook ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        device = any(self.on_device(t) for t in inputs)
        if device and self._syncs(func, args, kwargs):
            self.events.append(SyncEvent(func._schema.name, _caller()))
        out = func(*args, **kwargs)
        if device:
            outputs, _ = tree_flatten(out)
            for t in outputs:
                if isinstance(t, Tensor):
                    self._add(t)
        return out

    @staticmethod
    def _syncs(func, args, kwargs) -> bool:
        name = func._schema.name
        if name in SYNC_OPS:
            return True
        if name in _BOOL_INDEXED and len(args) > 1:
            indices = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
        if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
            return kwargs.get("output_size") is None  # repeat_interleave.Tensor(repeats, *, output_size)
        return False

    # ---- host reads that dispatch no operator ----------------------------------------------------
    def _patch(self, owner: type, name: str, value) -> None:
        """Set ``owner.name`` until the watch ends (``__exit__`` puts back what was there)."""
        self._patched.append((owner, name, owner.__dict__.get(name, _INHERITED)))
        setattr(owner, name, value)

    def _wrap(self, name: str):
        original = getattr(Tensor, name)
        watch = self

        def read(t, *args, **kwargs):
            if watch.on_device(t):
                watch.events.append(SyncEvent(f"Tensor.{name}", _caller()))
            return original(t, *args, **kwargs)

        self._patch(Tensor, name, read)

    def _wrap_factory(self, name: str) -> None:
        """``torch.<name>(…, device=…)`` called outside torch: device data (on CUDA made on the GPU,
        whatever its inputs), where on the CPU nothing tells it from host data. torch's own calls
        are left out: its optimizers keep their step counts on the host by naming the CPU."""
        original = getattr(torch, name)
        watch = self

        def make(*args, **kwargs):
            out = original(*args, **kwargs)
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if kwargs.get("device") is not None and "/torch/" not in caller:
                watch._add(out)
            return out

        self._patch(torch, name, make)

    def _wrap_lightning_log(self) -> None:
        """``LightningModule.log`` turns a logged number into a tensor on the module's device (a
        copy to the device, then a read back per use): such tensors are device data."""
        original = getattr(L.LightningModule, _TO_TENSOR, None)
        if original is None:  # another Lightning: logged numbers are then not followed
            return
        watch = self

        def to_tensor(module, value, name):
            out = original(module, value, name)
            if not isinstance(value, Tensor):
                watch._add(out)
            return out

        self._patch(L.LightningModule, _TO_TENSOR, to_tensor)

    def __enter__(self):
        for name in ("tolist", "numpy", "__array__"):
            self._wrap(name)
        for name in _FACTORIES:
            self._wrap_factory(name)
        self._wrap_lightning_log()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._patched):
                if original is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._patched.clear()


class SyncWatchCallback(L.Callback):
    """Marks what a fit holds on its device (the module, the target, each batch) for ``watch``, and
    keeps the events of each optimizer step: ``steps[n]`` holds those from the start of optimizer
    step n (its first micro-batch) to the start of the next, so Lightning's logging after the step
    is in it."""

    def __init__(self, watch: SyncWatch):
        self.watch = watch
        self.steps: dict[int, list[SyncEvent]] = {}
        self._open: int | None = None
        self._seen = 0

    def _close(self) -> None:
        if self._open is not None:
            self.steps.setdefault(self._open, []).extend(self.watch.events[self._seen :])
        self._seen = len(self.watch.events)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._close()
        self._open = int(trainer.global_step)
        target = getattr(module, "target", None)
        held = [target] if isinstance(target, nn.Module) else []  # DraftingModule's target is unregistered
        # Not the optimizers' state: what of it derives from the parameters is device data through
        # the operators that made it, while a step count made from a number stays on the host (the
        # non-fused AdamW's, which it reads with .item() every step, on a GPU as well).
        self.watch.mark(module, batch, *held)

    def on_train_end(self, trainer, module) -> None:
        self._close()
        self._open = None


@contextlib.contextmanager
def watching():
    """``SyncWatch`` and its callback: ``with watching() as (watch, cb): L.Trainer(callbacks=[cb])``."""
    with SyncWatch() as watch:
        yield watch, SyncWatchCallback(watch)

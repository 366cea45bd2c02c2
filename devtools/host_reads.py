"""Counting host reads of tensor values on the CPU (repository tooling, not installed).

On a GPU every read of a device tensor's values by the host (``.item()``, ``.tolist()``,
``bool(t)``, ``int(t)``, ``.cpu()``, ``torch.equal``, ``nonzero`` and the like) waits for the
device: a synchronisation. ``torch.cuda.set_sync_debug_mode`` reports them on CUDA only; on the
CPU they cost nothing and go unseen. :class:`HostReadCounter` is a ``TorchFunctionMode`` that
records the name of each such call made while it is active, so that CPU tests and
``benchmarks/host_overhead.py`` can count the synchronisations a code path would make on a GPU.

While a ``TorchFunctionMode`` is active, ``_ops.call_fwd`` calls the op through its autograd
kernel (the mode may add tensors that require grad): the results are the same, the host time is
not, so time nothing inside one.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HOST_READS", "HostReadCounter"]

HOST_READS = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "cpu",
    "numpy", "nonzero", "argwhere", "equal", "allclose", "unique", "unique_consecutive",
    "masked_select", "repeat_interleave",
})
"""Tensor functions whose result depends on values the host must read (a synchronisation on a
GPU; ``repeat_interleave`` with tensor repeats and ``masked_select`` have data-dependent output
shapes)."""


class HostReadCounter(TorchFunctionMode):
    """``with HostReadCounter() as reads: ...``; ``reads.names`` lists the host reads made."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.names)

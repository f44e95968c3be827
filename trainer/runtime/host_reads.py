"""Device-to-host reads, found on any device, a CPU included.

A CUDA step that reads a value back to the host (``.item()``, ``bool(t)``, ``if mask.all():``, an
output whose size depends on the data) waits there for the GPU to finish all the work queued before
it. Meanwhile the CPU queues nothing, so the launch time it had hidden behind the GPU's work shows in
the step time. ``torch.cuda.set_sync_debug_mode("error")`` finds such reads, but only on a GPU, and
the project's GPU time is a few minutes a session. The reads go through a few ATen operators on every
device, though, so a dispatch mode that watches for them finds them on a CPU too: CI keeps the step
free of them between GPU sessions (tests/gpu/test_gpu.py on a CPU rank).

What counts as a read (:func:`is_host_read`): the operators that return a host value
(``_local_scalar_dense``, behind ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, and which the
composite ``is_nonzero`` and ``allclose`` reach a dispatch mode as; ``equal``), those whose output size
depends on the data (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without an
output size) and indexing with a boolean mask (a hidden ``nonzero``). Not one: ``_assert_async``,
which fails on the device without the host waiting. Not seen on a CPU: ``.cpu()`` and ``.tolist()``
of a device tensor, which are no-ops there; on a GPU the sync debug mode remains the authority.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ALWAYS = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default}
ALWAYS |= {aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
ALWAYS |= {aten.repeat_interleave.Tensor}  # its output_size= overload is .Tensor too: checked below
BOOL_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def is_host_read(func: OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether the operator, on these arguments, needs a tensor's value on the host."""
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in ALWAYS:
        return True
    return func in BOOL_INDEX and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or [])
    )


class HostReadError(RuntimeError):
    """Raised by :class:`HostReads` (``fail=True``) at the first read."""


def caller() -> str:
    """``file:line (function)`` of the innermost frame outside torch: the code that asked for the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<torch>"


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads:`` counts the reads by call site (``reads.sites``); with
    ``fail=True`` the first read raises :class:`HostReadError` there, naming the site."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func: OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if is_host_read(func, args, kwargs):
            site = caller()
            if self.fail:
                raise HostReadError(f"{func} reads a device value back to the host at {site}")
            self.sites[site] += 1
        return func(*args, **kwargs)

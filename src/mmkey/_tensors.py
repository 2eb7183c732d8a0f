"""Tensors read off the caller's thread: when they are ready, one plain C-order CPU form,
and their bytes as a memoryview.

`host_ready` marks when a caller's (possibly CUDA, possibly in-flight) tensors may be read by
another thread; `plain_cpu` is the one normalisation shared by hashing and storing;
`byte_view` is the zero-copy view of a tensor's bytes that keeps the tensor alive.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["HostReady", "byte_view", "host_ready", "nbytes_of", "plain_cpu"]


def plain_cpu(value: object, action: str, expected: str, fix: str) -> torch.Tensor:
    """`value` as a contiguous CPU tensor without autograd, conj or neg bits.

    Copies only when needed (device, strides, lazy conj/neg). Raises `TypeError`
    ("`expected`, got <type>; `fix`") for anything that is not a tensor, and naming the fix
    for sparse and quantized tensors, which cannot be `action`-ed ("hash", "store") as bytes.
    """
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{expected}, got {type(value).__name__}; {fix}")
    if value.layout != torch.strided:
        raise TypeError(f"cannot {action} a {value.layout} tensor; call .to_dense() first")
    if value.is_quantized:
        raise TypeError(f"cannot {action} a quantized tensor; call .dequantize() or .int_repr()")
    t = value.detach() if value.requires_grad else value
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def nbytes_of(t: torch.Tensor) -> int:
    """The bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def byte_view(t: torch.Tensor, *, writable: bool = False) -> memoryview:
    """The bytes of a CPU tensor (made contiguous first) as a flat ``uint8`` memoryview, without
    a copy.

    Any dtype, bf16 too: the bytes are reinterpreted, never converted. The view is made by
    address (about 3 µs less than through numpy) over a ctypes array that holds the tensor,
    so it may outlive every other reference to ``t``; read-only unless ``writable``. The
    array's length is the byte count rounded up to a power of two (so that only a few dozen
    array types are ever made), and the view is cut back to the tensor's bytes.
    """
    if t.device.type != "cpu":
        raise TypeError(f"byte_view() takes a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    array: Any = (ctypes.c_ubyte * (1 << (nbytes - 1).bit_length() if nbytes else 0)).from_address(
        t.data_ptr()
    )
    array.tensor = t  # the view's exporter holds the memory
    view = memoryview(array).cast("B")[:nbytes]
    return view if writable else view.toreadonly()


@attrs.frozen(slots=True)
class HostReady:
    """The point, on the caller's CUDA streams, after which its tensors may be read elsewhere.

    Made by `host_ready` on the thread that produced the tensors; `wait` is what another thread
    calls before it reads them (for example to copy them to the CPU). Empty when every tensor
    lives on the CPU: `wait` then returns at once.
    """

    events: tuple[torch.cuda.Event, ...] = ()

    def wait(self) -> None:
        """Block until the work queued on the recorded streams before `host_ready` has finished."""
        for event in self.events:
            event.synchronize()


_NOTHING_QUEUED = HostReady()


def host_ready(tensors: Sequence[object]) -> HostReady:
    """Record, on the calling thread, when `tensors` are ready to be read from another thread.

    The current CUDA stream is per thread: a tensor written under ``torch.cuda.stream(s)`` may
    still be in flight when a worker thread (whose current stream differs) copies it. This
    records a CUDA event on the caller's current stream of each CUDA device the tensors live on;
    the worker calls `HostReady.wait` before reading. CPU tensors (and anything that is not a
    tensor, left for the reader's own checks) need no event; CUDA is not initialised then.
    """
    if "torch" not in sys.modules:  # no tensor can exist before torch is imported
        return _NOTHING_QUEUED
    import torch

    devices = sorted({v.get_device() for v in tensors if isinstance(v, torch.Tensor) and v.is_cuda})
    if not devices:
        return _NOTHING_QUEUED
    events: list[torch.cuda.Event] = []
    for index in devices:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves __new__ untyped
        event.record(torch.cuda.current_stream(index))
        events.append(event)
    return HostReady(tuple(events))

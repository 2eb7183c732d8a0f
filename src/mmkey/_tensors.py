"""One normalisation of tensors for hashing and storing: a plain C-order CPU tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["plain_cpu"]


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

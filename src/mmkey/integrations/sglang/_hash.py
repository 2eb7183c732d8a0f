"""Opt-in 128-bit feature hashes for SGLang (``MMKEY_SGLANG_HASH=blake3``).

SGLang names a multimodal item by a 64-bit hash of its feature tensor: SHA-256 cut to 8
bytes on CPU, a non-cryptographic Triton hash on GPU. 64 bits collide by chance after about
2**32 distinct items (a 1 in 2 chance among 5 billion images; 1 in 10**8 among 600 000), and
can be made to collide on purpose with the GPU hash; a collision serves one image's
embedding for another. With the switch, the plugin registers two hooks with SGLang's own
hook registry (``sglang.srt.plugins.hook_registry``):

- ``sglang.srt.managers.mm_utils.tensor_hash`` is replaced by `feature_hash`: mmkey's BLAKE3
  (`mmkey.hash_tensor`, over dtype, shape and bytes; a CUDA tensor is copied to the host
  first) as a 128-bit int;
- ``MMEncoder._calculate_hashes_from_features`` of the encode server is wrapped: SGLang's
  ``MultimodalDataItem`` keeps only the low 64 bits of a hash, so the wrapper hands the
  encoder's store the full 128-bit value each hash was cut from (`full_width_hashes`).

The store then reads canonical decimal below ``2**128`` as `HashScheme.BLAKE3` digests.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from mmkey.digest import HashScheme
from mmkey.hashing import hash_bytes, hash_tensor

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ENCODER_HASHES", "TENSOR_HASH", "feature_hash", "full_width_hashes", "install", "installed"]

TENSOR_HASH = "sglang.srt.managers.mm_utils.tensor_hash"
"""SGLang's hash of a feature tensor or list of tensors."""
ENCODER_HASHES = "sglang.srt.disaggregation.encoder.server.MMEncoder._calculate_hashes_from_features"
"""The encode server's hashes of one batch's items, as its embedding store receives them."""

_LOW_64 = (1 << 64) - 1
_installed = False
_seen = threading.local()
"""Per thread, while `full_width_hashes` runs: low 64 bits -> the full hash they came from."""


def _tensors(value: object) -> list[Any]:
    import torch

    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return [value if isinstance(value, torch.Tensor) else torch.as_tensor(value)]


def feature_hash(tensor_list: object) -> int:
    """BLAKE3-128 of a tensor, or of a (nested) list of tensors, as an int (what SGLang's
    ``tensor_hash`` returns, 128 bits wide). One tensor gives ``int(hash_tensor(t))``; several
    give the BLAKE3 of their digests in order."""
    tensors = _tensors(tensor_list)
    if len(tensors) == 1:
        value = int(hash_tensor(tensors[0], HashScheme.BLAKE3))
    else:
        digests = b"".join(int(hash_tensor(t, HashScheme.BLAKE3)).to_bytes(16, "big") for t in tensors)
        value = int(hash_bytes(digests, HashScheme.BLAKE3))
    seen: dict[int, int] | None = getattr(_seen, "values", None)
    if seen is not None:
        seen[value & _LOW_64] = value
    return value


def full_width_hashes(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """SGLang's hashes of a batch, each widened back to the 128-bit `feature_hash` it was
    cut from (a hash SGLang did not compute here, e.g. a caller's, is left as it is)."""
    previous = getattr(_seen, "values", None)
    seen: dict[int, int] = {}
    _seen.values = seen
    try:
        hashes = original(*args, **kwargs)
    finally:
        _seen.values = previous
    if not isinstance(hashes, list):
        return hashes
    return [seen.get(h, h) if isinstance(h, int) and not isinstance(h, bool) else h for h in hashes]


def installed() -> bool:
    """Whether `install` registered the hooks in this process."""
    return _installed


def install() -> None:
    """Register both hooks with SGLang's hook registry (applied by SGLang's ``load_plugins``,
    or by ``HookRegistry.apply_hooks()``)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TENSOR_HASH, feature_hash, HookType.REPLACE)
    HookRegistry.register(ENCODER_HASHES, full_width_hashes, HookType.AROUND)
    _installed = True

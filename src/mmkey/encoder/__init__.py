"""Cache-aware encoding of multimodal items: digests and keys per item, and
`encode_with_cache` (with its async twin) so that only cache misses reach the encoder.

Importing this module imports torch. May import the caches' protocol, keys, hashing,
digests, errors and ``mmkey._tensors``; never a Mooncake, stack or command-line module.
"""

from __future__ import annotations

from mmkey.encoder.cached import (
    OFFLOAD_HASH_BYTES,
    AsyncListEncoder,
    AsyncPackedEncoder,
    ListEncoder,
    PackedEncoder,
    aencode_with_cache,
    aencode_with_cache_report,
    encode_with_cache,
    encode_with_cache_report,
)
from mmkey.encoder.items import (
    Features,
    Grid,
    GridTHW,
    embedding_keys,
    hashes_from_features,
    keys_from_features,
)
from mmkey.encoder.report import EncodeReport, EncodeResult

__all__ = [
    "OFFLOAD_HASH_BYTES",
    "AsyncListEncoder",
    "AsyncPackedEncoder",
    "EncodeReport",
    "EncodeResult",
    "Features",
    "Grid",
    "GridTHW",
    "ListEncoder",
    "PackedEncoder",
    "aencode_with_cache",
    "aencode_with_cache_report",
    "embedding_keys",
    "encode_with_cache",
    "encode_with_cache_report",
    "hashes_from_features",
    "keys_from_features",
]

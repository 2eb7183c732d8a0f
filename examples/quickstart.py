"""Quick start: hash features, build keys, cache embeddings, and read a key back."""

from __future__ import annotations

import torch

from mmkey import EmbeddingKey, HashScheme, MemoryCache, Modality, hash_tensor
from mmkey.encoder import encode_with_cache


def main() -> None:
    torch.manual_seed(0)
    pixels = torch.randn(64, 1176)  # one image: 64 patches of a Qwen2-VL-style processor
    digest = hash_tensor(pixels)  # an MMHash: an int digest, never a store key by itself
    key = EmbeddingKey("qwen2-vl-7b@main", Modality.IMAGE, HashScheme.BLAKE3, digest)
    print(key.to_key())
    assert EmbeddingKey.from_key(key.to_key()) == key

    calls = 0

    def encode(features: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """Stands in for a vision encoder: one [patches / 4, 8] embedding per missed image."""
        nonlocal calls
        calls += 1
        return [torch.ones(int(n) // 4, 8) for n in grids.prod(dim=-1)]

    cache = MemoryCache(max_bytes=64 << 20)
    batch = torch.cat([pixels, pixels])  # the same image twice in one request
    runs = [
        encode_with_cache(
            batch, [(1, 8, 8), (1, 8, 8)], encode=encode, cache=cache, namespace="qwen2-vl-7b@main"
        )
        for _ in range(3)
    ]
    out = runs[-1]
    print(f"{len(out)} embeddings of shape {tuple(out[0].shape)}; encoder called {calls} time(s)")
    print(cache.stats())


if __name__ == "__main__":
    main()

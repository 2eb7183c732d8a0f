"""A small vision tower shaped like Qwen2-VL's: patch embedding, transformer blocks with
attention within each image, and a 2x2 patch merger. Fixed seed, CPU, inference only.

It takes what the Qwen2-VL processor produces (`pixel_values` of shape
``[sum(t*h*w), channels * temporal_patch * patch * patch]`` and `grid_thw`) and returns
one embedding per item, ``[t*h*w / 4, out_dim]``, as `encode_with_cache` expects.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TinyVisionEncoder", "VisionConfig"]


@attrs.frozen(slots=True)
class VisionConfig:
    """The shape of a `TinyVisionEncoder`; part of the cache namespace of its embeddings."""

    channels: int = 3
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    dim: int = 256
    depth: int = 6
    heads: int = 8
    out_dim: int = 512
    seed: int = 0

    @property
    def row_features(self) -> int:
        """Features per patch row: ``channels * temporal_patch * patch * patch``."""
        return self.channels * self.temporal_patch * self.patch * self.patch

    @property
    def name(self) -> str:
        """A namespace naming this model: everything that changes its embeddings."""
        return (
            f"mmkey-demo/tiny-vit-p{self.patch}t{self.temporal_patch}m{self.merge}"
            f"-d{self.dim}x{self.depth}h{self.heads}o{self.out_dim}@seed{self.seed}"
        )


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, dim // self.heads).unbind(1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(0, 1).reshape(n, dim))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class _Merger(nn.Module):
    """Qwen2-VL's merger: each 2x2 window of patches (consecutive rows) becomes one token."""

    def __init__(self, dim: int, out_dim: int, merge: int) -> None:
        super().__init__()
        self.window: int = merge * merge
        self.norm: nn.LayerNorm = nn.LayerNorm(dim)
        hidden = dim * self.window
        self.mlp: nn.Sequential = nn.Sequential(
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, dim]`` patch rows in, ``[n / merge**2, out_dim]`` merged tokens out."""
        merged = self.norm(x).reshape(-1, self.window * x.shape[-1])
        out: torch.Tensor = self.mlp(merged)
        return out


class TinyVisionEncoder(nn.Module):
    """A 6-million-parameter Qwen2-VL-shaped vision encoder, deterministic for a config."""

    def __init__(self, config: VisionConfig = VisionConfig()) -> None:
        super().__init__()
        if config.dim % (4 * config.heads):
            raise ValueError("dim must be a multiple of 4 * heads")
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.patch_embed: nn.Linear = nn.Linear(config.row_features, config.dim, bias=False)
            blocks = (_Block(config.dim, config.heads) for _ in range(config.depth))
            self.blocks: nn.ModuleList = nn.ModuleList(blocks)
            self.merger: _Merger = _Merger(config.dim, config.out_dim, config.merge)
        self.eval()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One embedding ``[t*h*w / merge**2, out_dim]`` per item of the request."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        outputs: list[torch.Tensor] = []
        start = 0
        for grid in grids:
            size = grid[0] * grid[1] * grid[2]
            item = x[start : start + size] + self._positions(grid)
            start += size
            for block in self.blocks:
                item = block(item)
            outputs.append(self.merger(item))
        return outputs

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """`forward` without autograd: the `encode` callback of `encode_with_cache`."""
        result: list[torch.Tensor] = self(pixel_values, grid_thw)
        return result

    def _positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """2-D sine-cosine positions of the patches, in the processor's 2x2-window order."""
        t, h, w = grid
        m = self.config.merge
        if h % m or w % m:
            raise ValueError(f"grid {grid}: h and w must be multiples of the merge size {m}")
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        order = (h // m, m, w // m, m)
        rows = rows.reshape(order).permute(0, 2, 1, 3).reshape(-1).repeat(t)
        cols = cols.reshape(order).permute(0, 2, 1, 3).reshape(-1).repeat(t)
        quarter = self.config.dim // 4
        freqs = torch.exp(torch.arange(quarter) * (-math.log(10000.0) / quarter))
        angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

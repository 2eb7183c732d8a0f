"""A deterministic stream of synthetic image requests with realistic repeats, patchified
like the Qwen2-VL processor.

Images are drawn from a fixed pool by a Zipf-like popularity (a few images, such as a
logo or a meme, come back again and again; most are rare), so requests repeat images
across and sometimes within requests. The same image id always gives the same pixels.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import attrs
import torch
from torch.nn import functional as F

from mmkey.cli.demo.vision import VisionConfig
from mmkey.encoder import Grid

__all__ = ["DemoRequest", "StreamConfig", "patchify", "synthetic_image", "synthetic_requests"]

_SIZES = ((224, 224), (224, 336), (336, 224), (280, 280), (336, 336), (224, 448))
"""Image sizes (height, width) in pixels: multiples of patch * merge = 28."""
_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)


@attrs.frozen(slots=True)
class StreamConfig:
    """The shape of a synthetic request stream."""

    requests: int = 80
    pool: int = 100
    max_images: int = 4
    zipf: float = 1.1
    seed: int = 0


@attrs.frozen(slots=True)
class DemoRequest:
    """One request: its image ids, packed `pixel_values` and `grid_thw`."""

    index: int
    image_ids: tuple[int, ...]
    pixel_values: torch.Tensor
    grid_thw: list[Grid]


def synthetic_image(image_id: int, seed: int = 0) -> torch.Tensor:
    """The uint8 ``[3, H, W]`` pixels of image `image_id`: smooth colour fields and noise."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + image_id)
    height, width = _SIZES[image_id % len(_SIZES)]
    coarse = torch.rand(1, 3, 6, 6, generator=gen)
    smooth = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
    grain = torch.rand(3, height, width, generator=gen) * 0.1
    return ((smooth * 0.9 + grain) * 255).to(torch.uint8)


def patchify(image: torch.Tensor, config: VisionConfig = VisionConfig()) -> tuple[torch.Tensor, Grid]:
    """Qwen2-VL processing of one image: normalise, repeat over the temporal patch, and
    cut into ``[t*h*w, C*tp*p*p]`` patch rows, each 2x2 merge window contiguous."""
    p, tp, m = config.patch, config.temporal_patch, config.merge
    channels, height, width = image.shape
    pixels = (image.float() / 255 - _MEAN) / _STD
    frames = pixels.unsqueeze(0).expand(tp, channels, height, width)
    gh, gw = height // p, width // p
    x = frames.reshape(1, tp, channels, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, channels * tp * p * p), (1, gh, gw)


def synthetic_requests(
    stream: StreamConfig = StreamConfig(), vision: VisionConfig = VisionConfig()
) -> Iterator[DemoRequest]:
    """The requests of `stream`, the same on every run for the same seeds."""
    rng = random.Random(stream.seed)
    ids = list(range(stream.pool))
    weights = [1.0 / (rank + 1) ** stream.zipf for rank in ids]
    for index in range(stream.requests):
        count = rng.randint(1, stream.max_images)
        image_ids = tuple(rng.choices(ids, weights, k=count))
        patches = [patchify(synthetic_image(i, stream.seed), vision) for i in image_ids]
        yield DemoRequest(
            index,
            image_ids,
            torch.cat([rows for rows, _ in patches]),
            [grid for _, grid in patches],
        )

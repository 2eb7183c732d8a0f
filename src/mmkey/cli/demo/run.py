"""The demo's main job: a synthetic request stream through `encode_with_cache`, timed
against the same requests encoded directly (no cache), with the results compared."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import torch

from mmkey.cache.protocol import CacheStats, EmbeddingCache
from mmkey.cli.demo.stream import StreamConfig, synthetic_requests
from mmkey.cli.demo.vision import TinyVisionEncoder, VisionConfig
from mmkey.digest import HashScheme
from mmkey.encoder import EncodeReport, encode_with_cache_report

__all__ = ["DemoResult", "run_demo"]


@attrs.frozen(slots=True)
class DemoResult:
    """What a demo run measured."""

    requests: int
    """Requests encoded."""
    report: EncodeReport
    """The encode counters summed over all requests."""
    cached_seconds: float
    """Wall time of `encode_with_cache` over the stream (hashing and cache calls included)."""
    direct_seconds: float | None
    """Wall time of the encoder alone over the same requests, every item encoded
    (measured, not estimated); None when the baseline was skipped."""
    max_abs_diff: float | None
    """Largest difference between cached and directly encoded embeddings, or None."""
    cache_stats: CacheStats
    """The cache's own counters after the run."""
    namespace: str
    """The namespace the embeddings were cached under."""

    @property
    def speedup(self) -> float | None:
        """Direct time over cached time, when the baseline ran."""
        if self.direct_seconds is None or self.cached_seconds <= 0:
            return None
        return self.direct_seconds / self.cached_seconds

    @property
    def hash_gb_per_s(self) -> float:
        """Feature bytes hashed per second of hashing, in GB/s."""
        seconds = self.report.hash_seconds
        return self.report.hashed_bytes / seconds / 1e9 if seconds > 0 else 0.0


def run_demo(
    cache: EmbeddingCache,
    *,
    stream: StreamConfig = StreamConfig(),
    vision: VisionConfig = VisionConfig(),
    scheme: HashScheme = HashScheme.BLAKE3,
    baseline: bool = True,
    on_request: Callable[[EncodeReport], None] | None = None,
) -> DemoResult:
    """Encode `stream` through `cache`; with `baseline`, also encode every request
    directly (interleaved, so both see the same machine state) and compare results.

    `on_request` is called after each request with that request's report.
    """
    model = TinyVisionEncoder(vision)
    namespace = vision.name
    total = EncodeReport()
    cached_seconds = 0.0
    direct_seconds = 0.0
    max_diff = 0.0
    warmed = False
    for request in synthetic_requests(stream, vision):
        grid = torch.tensor(request.grid_thw, dtype=torch.long)
        if not warmed:  # first-call set-up cost out of both timings
            model.encode(request.pixel_values, grid)
            warmed = True
        start = time.perf_counter()
        result = encode_with_cache_report(
            request.pixel_values,
            grid,
            encode=model.encode,
            cache=cache,
            namespace=namespace,
            scheme=scheme,
        )
        cached_seconds += time.perf_counter() - start
        total += result.report
        if baseline:
            start = time.perf_counter()
            direct = model.encode(request.pixel_values, grid)
            direct_seconds += time.perf_counter() - start
            for mine, theirs in zip(result.embeddings, direct, strict=True):
                max_diff = max(max_diff, (mine - theirs).abs().max().item())
        if on_request is not None:
            on_request(result.report)
    return DemoResult(
        requests=stream.requests,
        report=total,
        cached_seconds=cached_seconds,
        direct_seconds=direct_seconds if baseline else None,
        max_abs_diff=max_diff if baseline else None,
        cache_stats=cache.stats(),
        namespace=namespace,
    )

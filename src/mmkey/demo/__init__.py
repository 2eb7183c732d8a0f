"""The `mmkey demo` job: synthetic Qwen2-VL-style image requests, a small real vision
encoder, and `encode_with_cache` over an embedding cache. Imports torch."""

from __future__ import annotations

from mmkey.demo.run import DemoResult, run_demo
from mmkey.demo.stream import DemoRequest, StreamConfig, patchify, synthetic_requests
from mmkey.demo.vision import TinyVisionEncoder, VisionConfig

__all__ = [
    "DemoRequest",
    "DemoResult",
    "StreamConfig",
    "TinyVisionEncoder",
    "VisionConfig",
    "patchify",
    "run_demo",
    "synthetic_requests",
]

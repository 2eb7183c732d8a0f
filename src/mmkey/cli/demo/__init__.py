"""The `mmkey demo` job: synthetic Qwen2-VL-style image requests, a small real vision
encoder, and `encode_with_cache` over an embedding cache.

The job (``run``, ``stream``, ``vision``) imports torch, so its names load on first use;
the click command is in ``command``. May import anything in the library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmkey.cli.demo.run import DemoResult, run_demo
    from mmkey.cli.demo.stream import DemoRequest, StreamConfig, patchify, synthetic_requests
    from mmkey.cli.demo.vision import TinyVisionEncoder, VisionConfig

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

_HOMES = {
    "DemoResult": "run",
    "run_demo": "run",
    "DemoRequest": "stream",
    "StreamConfig": "stream",
    "patchify": "stream",
    "synthetic_requests": "stream",
    "TinyVisionEncoder": "vision",
    "VisionConfig": "vision",
}


if not TYPE_CHECKING:
    # hidden from type checkers, so a misspelt name stays a type error

    def __getattr__(name: str) -> object:
        # torch loads with the job, not with the command line
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{home}"), name)

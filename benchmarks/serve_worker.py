"""A vLLM worker extension for the serving benchmark: what each engine's tower and connector did.

``vllm serve --worker-extension-cls benchmarks.serve_worker.TowerCounter`` mixes it into each
worker; with ``VLLM_SERVER_DEV_MODE=1`` the benchmark asks ``POST /collective_rpc
{"method": "mmkey_counts"}``. The first call installs the counters (a forward hook on the
vision tower; wrappers around the EC connector's load and save calls), so it answers zeros.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["TowerCounter"]


def _nbytes(value: Any) -> int:
    return int(value.numel() * value.element_size()) if hasattr(value, "element_size") else 0


class TowerCounter:
    """Worker methods: counts of tower images and seconds, and of bytes the connector moved."""

    model_runner: Any
    _mmkey_counts: dict[str, float]

    def mmkey_counts(self) -> dict[str, float]:
        if not hasattr(self, "_mmkey_counts"):
            self._mmkey_counts = dict.fromkeys(
                ("tower_images", "tower_s", "loaded_items", "loaded_bytes", "saved_items", "saved_bytes"), 0.0
            )
            self._mmkey_hook_tower()
            self._mmkey_wrap_connector()
        counts = dict(self._mmkey_counts)
        connector = self._mmkey_connector()
        if connector is not None and hasattr(connector, "totals"):  # mmkey's: saves it really made
            saved = connector.totals().get("saved", 0)
            per_item = counts["saved_bytes"] / counts["saved_items"] if counts["saved_items"] else 0.0
            counts["saved_bytes"], counts["saved_items"] = saved * per_item, float(saved)
        return counts

    def _mmkey_hook_tower(self) -> None:
        counts = self._mmkey_counts
        tower = self.model_runner.get_model().vision_tower
        started: list[float] = []

        def before(module: Any, args: Any) -> None:
            started.append(time.perf_counter())

        def after(module: Any, args: Any, output: Any) -> None:
            pixels: Any = args[0] if args else None
            counts["tower_images"] += int(pixels.shape[0]) if hasattr(pixels, "shape") else 1
            counts["tower_s"] += time.perf_counter() - started.pop()

        tower.register_forward_pre_hook(before)
        tower.register_forward_hook(after)

    @staticmethod
    def _mmkey_connector() -> Any:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

        return get_ec_transfer() if has_ec_transfer() else None

    def _mmkey_wrap_connector(self) -> None:
        connector = self._mmkey_connector()
        if connector is None:
            return
        counts = self._mmkey_counts
        load, save = connector.start_load_caches, connector.save_caches

        def start_load_caches(encoder_cache: Any, **kwargs: Any) -> Any:
            before = set(encoder_cache)
            result = load(encoder_cache, **kwargs)
            for key in set(encoder_cache) - before:
                counts["loaded_items"] += 1
                counts["loaded_bytes"] += _nbytes(encoder_cache[key])
            return result

        def save_caches(encoder_cache: Any, mm_hash: str, **kwargs: Any) -> Any:
            if connector.is_producer:
                counts["saved_items"] += 1
                counts["saved_bytes"] += _nbytes(encoder_cache.get(mm_hash))
            return save(encoder_cache, mm_hash, **kwargs)

        connector.start_load_caches = start_load_caches
        connector.save_caches = save_caches

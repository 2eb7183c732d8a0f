"""A caller's own ``hashes`` get a key space of their own, apart from the server's hashes.

SGLang's encode server takes a request's ``hashes`` field (``/encode``) as the names of its
items instead of hashing their features. Left as they are, a caller could name its own
pixels by the hash the server computes for another image, and have them stored, and served
to everyone, as that image. The plugin registers `scope_caller_hashes` as a ``BEFORE`` hook
of ``MMEncoder._prepare_encode_context``: every hash a request supplies becomes
``caller:<text>``. The store reads such text as an opaque identifier (`HashScheme.ID`, see
``_keys``), never as a feature hash, and SGLang's own in-process cache sees a different
name too; callers that agree on their names still share entries among themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["CALLER_PREFIX", "PREPARE_CONTEXT", "caller_text", "install", "installed", "scope_caller_hashes"]

CALLER_PREFIX = "caller:"
"""What every caller-supplied hash text starts with once scoped (server hashes are decimal)."""
PREPARE_CONTEXT = "sglang.srt.disaggregation.encoder.server.MMEncoder._prepare_encode_context"
"""Where the encode server reads each request's ``hashes`` (on every TP rank)."""

_installed = False


def caller_text(value: object) -> str:
    """The scoped text of one caller-supplied hash."""
    return CALLER_PREFIX + str(value)


def _scoped(request: object) -> object:
    if not isinstance(request, dict) or request.get("hashes") is None:
        return request
    hashes = request["hashes"]
    if not isinstance(hashes, Iterable):  # SGLang's own length check refuses it
        return request
    return {**request, "hashes": [caller_text(h) for h in hashes]}


def scope_caller_hashes(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """SGLang ``BEFORE`` hook: the same call with each request's ``hashes`` scoped (new request
    dicts; the caller's are left as they are). ``None`` (no change) where no request has any."""
    if "requests" in kwargs:
        requests = kwargs["requests"]
    elif len(args) > 1:
        requests = args[1]
    else:
        return None
    if not isinstance(requests, list) or not any(
        isinstance(r, dict) and r.get("hashes") is not None for r in requests
    ):
        return None
    scoped = [_scoped(r) for r in requests]
    if "requests" in kwargs:
        return args, {**kwargs, "requests": scoped}
    return (args[0], scoped, *args[2:]), kwargs


def installed() -> bool:
    """Whether `install` registered the hook in this process."""
    return _installed


def install() -> None:
    """Register `scope_caller_hashes` with SGLang's hook registry (applied by ``load_plugins``)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PREPARE_CONTEXT, scope_caller_hashes, HookType.BEFORE)
    _installed = True

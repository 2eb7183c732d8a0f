"""Embedding caches: the protocol, health, the in-memory, tiered and asyncio caches.

The Mooncake backend is the subpackage ``mmkey.cache.mooncake``. May import ``mmkey.entry``,
``mmkey.keys``, ``mmkey.digest``, ``mmkey.errors`` and the private helpers (``mmkey._deadline``,
``mmkey._tensors``, ``mmkey._log``); never ``mmkey.encoder``, ``mmkey.integrations``,
``mmkey.metrics``, ``mmkey.testing`` or ``mmkey.cli``.
"""

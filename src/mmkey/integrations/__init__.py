"""Integrations with serving stacks, one module per stack (``mmkey.integrations.<stack>``).

Nothing in mmkey's core imports this package; each module imports its stack when it is
itself imported, which only that stack's processes (or its tests) do. An integration may
import the encoder, the caches (the Mooncake client too), entries, keys, hashing, digests
and the private helpers, and ``_common`` / ``_background_saver`` here; never another
stack's integration, ``mmkey.metrics``, ``mmkey.testing`` or ``mmkey.cli``.
"""

"""Helpers for downstream test suites: hypothesis strategies, a cache model test, a real
local Mooncake master and a fleet of holders (with pytest fixtures), and an in-process fake
Mooncake store for logic tests (`mmkey.testing.fake_mooncake`). Import the submodule you need.

May import the encoder, the caches (the Mooncake client too), entries, keys, hashing and
digests; never its siblings in the layers (``mmkey.integrations``, ``mmkey.metrics``) or
``mmkey.cli``. Nothing in the library imports this package.
"""

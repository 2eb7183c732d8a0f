"""Helpers for downstream test suites: hypothesis strategies, a cache model test, a real local
Mooncake master (with a pytest fixture), and an in-process fake Mooncake store for logic tests
(`mmkey.testing.fake_mooncake`). Import the submodule you need."""

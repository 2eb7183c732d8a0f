"""Helpers for downstream test suites: hypothesis strategies, a cache model test, and a
real local Mooncake master (with a pytest fixture). Import the submodule you need."""

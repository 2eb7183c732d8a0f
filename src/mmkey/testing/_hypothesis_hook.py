"""Entry point hypothesis calls at import, so `st.from_type(MMHash)` yields valid digests."""

from __future__ import annotations


def setup() -> None:
    """Register mmkey's strategies for its types with hypothesis."""
    from mmkey.testing.strategies import register_type_strategies

    register_type_strategies()

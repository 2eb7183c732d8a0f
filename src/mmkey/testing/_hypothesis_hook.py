"""Entry point hypothesis calls at import, so `st.from_type(MMHash)` yields valid digests."""

from __future__ import annotations

import sys

_STRATEGIES = "mmkey.testing.strategies"


def setup() -> None:
    """Register mmkey's strategies for its types with hypothesis."""
    importing = sys.modules.get(_STRATEGIES)
    if importing is not None and not hasattr(importing, "register_type_strategies"):
        # hypothesis is being imported by the strategies module itself, which registers
        # them once it is done
        return
    from mmkey.testing.strategies import register_type_strategies

    register_type_strategies()

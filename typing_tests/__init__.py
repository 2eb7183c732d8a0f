"""Type-level tests, checked by mypy only and never executed.

A line that must NOT type-check carries ``# type: ignore[<code>]``; mypy runs with
``warn_unused_ignores``, so the check fails if that error ever disappears.
"""

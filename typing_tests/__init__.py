"""Type-level tests, checked by mypy and by pyright (both strict) and never executed.

A line that must NOT type-check carries two comments, one per checker:
``# type: ignore[<mypy code>]  # pyright: ignore[<pyright rule>]``. mypy runs with
``warn_unused_ignores`` and pyright with ``reportUnnecessaryTypeIgnoreComment`` (and
``enableTypeIgnoreComments`` off, so it reads only its own comment): if the error ever
disappears, or turns into a different one, BOTH checks fail.
"""

"""Integrations with serving stacks, one module per stack (``mmkey.integrations.<stack>``).

Nothing in mmkey's core imports this package; each module imports its stack when it is
itself imported, which only that stack's processes (or its tests) do.
"""

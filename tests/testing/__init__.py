"""`mmkey.testing`: the master and fleet harness, strategies, the busy host."""

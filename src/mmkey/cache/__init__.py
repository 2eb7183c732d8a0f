"""Embedding caches: the protocol, the entry codec and the implementations."""

"""The stored form of an embedding: the entry format (``codec``) and its MAC (``auth``).

An entry is a wire format like the key format: what every cache writes and verifies on
read, whatever store holds it. May import ``mmkey.keys``, ``mmkey.digest``, ``mmkey.errors``
and ``mmkey._tensors``; never a cache, the encoder, an integration, ``mmkey.testing`` or
``mmkey.cli``.
"""

"""`mmkey.encoder`: encoding with a cache, sync and asyncio."""

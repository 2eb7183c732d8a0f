"""The cache protocol's implementations that need no store: memory, tiered, asyncio, guards."""

"""Keys, digests, hashing and the small shared modules at the top of `mmkey`."""

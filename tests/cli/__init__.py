"""The `mmkey` command and its demo."""

"""The entry format: its codec and authentication."""

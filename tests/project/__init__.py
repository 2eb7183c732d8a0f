"""The project's own files: README and docs, examples, the typing tests' guard, the suite's profiles."""

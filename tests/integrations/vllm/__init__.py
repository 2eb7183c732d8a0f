"""The vLLM connector, against vLLM's wheel and its CPU engine."""

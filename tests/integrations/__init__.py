"""What the vLLM and SGLang integrations share, and their packages' shape."""

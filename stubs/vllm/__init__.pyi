# Stubs of the few vLLM (0.33) names that mmkey.integrations.vllm and its tests use, so
# mypy --strict checks them in environments without vLLM. Each name is checked against the
# real package by tests/integrations/vllm/test_vllm_stubs.py in vLLM's own environment.

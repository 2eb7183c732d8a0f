# Stubs for the parts of SGLang (0.5.23) that mmkey's integration and its tests use.
__version__: str

# Stubs for the `mooncake` package of mooncake-transfer-engine(-non-cuda) 0.3.13.
# Only the `mooncake.store` binding is typed (see store.pyi); the package's pure-Python
# modules are not used by mmkey and are deliberately left out.

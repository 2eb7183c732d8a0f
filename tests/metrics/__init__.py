"""`mmkey.metrics`: Prometheus metrics of any cache."""

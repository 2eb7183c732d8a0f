"""`MooncakeCache` and its parts, mostly against a real local `mooncake_master`."""

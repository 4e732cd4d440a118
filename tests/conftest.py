"""Test set-up: 8 virtual CPU devices so sharding is tested on a (data, fsdp, tensor) mesh."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

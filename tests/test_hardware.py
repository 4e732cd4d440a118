"""model.dtype=auto: bf16 where the hardware has fast bf16 matmuls, f32 elsewhere."""

import jax.numpy as jnp
import pytest

import tiny
from agentgym_jax import config as config_lib, hardware, learner
from agentgym_jax import state as state_lib
from agentgym_jax import settings as settings_lib


@pytest.mark.parametrize(
    "backend, flags, expected",
    [
        ("tpu", frozenset(), "bfloat16"),
        ("gpu", frozenset(), "bfloat16"),
        # Intel Sapphire Rapids: AMX tiles.
        ("cpu", frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}), "bfloat16"),
        # AMD Zen 4, Intel Cooper Lake: AVX512-BF16 dot products.
        ("cpu", frozenset({"avx2", "avx512f", "avx512_bf16"}), "bfloat16"),
        # AVX2 (and AVX-512 without BF16): bf16 is converted around every dot.
        ("cpu", frozenset({"avx2", "fma"}), "float32"),
        ("cpu", frozenset({"avx2", "avx512f", "avx512bw"}), "float32"),
        ("cpu", frozenset(), "float32"),
    ])
def test_auto_picks_bf16_only_where_the_hardware_runs_it_fast(backend, flags, expected):
  dtype, why = hardware.auto_dtype(backend, flags)
  assert dtype == expected
  assert why  # The reason is printed by benchmarks and logged by runs.


def test_auto_names_the_flags_it_found():
  _, why = hardware.auto_dtype("cpu", frozenset({"avx512_bf16", "amx_bf16"}))
  assert "amx_bf16" in why and "avx512_bf16" in why


def test_this_machines_flags_are_read():
  # Every x86-64 CPU this runs on has SSE2; a machine without /proc/cpuinfo reports none.
  flags = hardware.cpu_flags()
  assert not flags or "sse2" in flags


def test_the_vocabulary_projection_blocks_follow_the_backend():
  """Cache-sized blocks on a CPU, one block per chunk on an accelerator; the learner's loss
  settings take the running backend's."""
  assert hardware.logits_block_tokens("cpu") == 64
  assert hardware.logits_block_tokens("tpu") == hardware.logits_block_tokens("gpu") == 0
  assert learner.LossConfig().logprob_block_tokens == hardware.logits_block_tokens()


def test_an_explicit_dtype_is_kept_and_auto_is_resolved():
  assert hardware.matmul_dtype("float32") == "float32"
  assert hardware.matmul_dtype("bfloat16") == "bfloat16"
  assert hardware.matmul_dtype("auto") == hardware.auto_dtype()[0]


def test_a_run_with_auto_loads_its_policy_in_the_picked_dtype(tmp_path):
  c = config_lib.base_config()
  c.model.name = str(tiny.make_checkpoint(tmp_path))
  c.model.dtype = "auto"
  _, model, _ = state_lib.load_policy(settings_lib.Settings.from_config(c))
  assert jnp.dtype(model.dtype) == jnp.dtype(hardware.auto_dtype()[0])


def test_an_unknown_dtype_fails_at_start_up():
  c = config_lib.base_config()
  c.model.dtype = "fp8"
  with pytest.raises(config_lib.ConfigError, match=r"model.dtype='fp8' is not one of .*'auto'"):
    settings_lib.Settings.from_config(c)


def test_cpu_devices_share_the_hosts_memory():
  import jax
  bytes_per_device, source = hardware.device_memory(jax.devices("cpu")[0])
  # tests/conftest.py makes 8 virtual CPU devices: each gets an eighth of the host's memory.
  assert "shared by 8 cpu device(s)" in source
  host = float(source.split("(")[1].split(" GiB")[0]) * 2**30
  assert abs(bytes_per_device - host / 8) <= 0.05 * 2**30 / 8  # The GiB figure is rounded.


def test_splash_attention_off_tpu_fails_at_start_up(tmp_path):
  c = config_lib.base_config()
  c.model.name = str(tiny.make_checkpoint(tmp_path))
  c.model.attention = "splash"
  with pytest.raises(config_lib.ConfigError, match="model.attention=splash runs a TPU kernel"):
    state_lib.load_policy(settings_lib.Settings.from_config(c))

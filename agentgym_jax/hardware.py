"""What the hardware offers: the matmul dtype `model.dtype=auto` picks (and why), and the memory
of a device, against which `model.remat=auto` picks a rematerialisation policy.

bf16 matmuls run at up to twice the f32 rate (or more) on TPUs, GPUs and on CPUs with bf16 dot
instructions: AMX (Intel Sapphire Rapids and later: amx_bf16) or AVX512-BF16 (Intel Cooper Lake,
AMD Zen 4 and later: avx512_bf16). A CPU without them (AVX2 only) converts bf16 to f32 around
every dot, so bf16 matmuls there run slower than f32 ones.
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def _proc_field(path: str, field: str) -> str:
  """The value of the first `field` line of a Linux /proc file ("" elsewhere)."""
  try:
    text = pathlib.Path(path).read_text()
  except OSError:
    return ""
  for line in text.splitlines():
    name, _, value = line.partition(":")
    if name.strip() == field:
      return value.strip()
  return ""


@functools.cache
def _cpuinfo(field: str) -> str:
  return _proc_field("/proc/cpuinfo", field)


def cpu_flags() -> frozenset[str]:
  """The instruction-set flags of this machine's CPU (empty where unknown)."""
  return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
  """This machine's CPU model name, for benchmark headers."""
  return _cpuinfo("model name") or "unknown CPU"


def auto_dtype(backend: str | None = None, flags: frozenset[str] | None = None) -> tuple[str, str]:
  """(matmul dtype, why) for `backend` (default: JAX's) and, on a CPU, its `flags`."""
  backend = backend or jax.default_backend()
  if backend != "cpu":
    return "bfloat16", f"the {backend} backend runs bf16 matmuls natively"
  flags = cpu_flags() if flags is None else flags
  found = [flag for flag in BF16_CPU_FLAGS if flag in flags]
  if found:
    return "bfloat16", f"the CPU has bf16 dot instructions ({', '.join(found)})"
  return "float32", (f"the CPU has no bf16 dot instructions ({' or '.join(BF16_CPU_FLAGS)}), "
                     "so bf16 matmuls would run slower than f32")


def matmul_dtype(name: str) -> str:
  """A config's model.dtype with "auto" resolved."""
  return auto_dtype()[0] if name == "auto" else name


def logits_block_tokens(backend: str | None = None) -> int:
  """Tokens per block of the learner's vocabulary projection (rl.chunked_token_logprobs_and_
  entropy, learner.LossConfig.logprob_block_tokens) on `backend` (default: JAX's): on a CPU
  ~64, whose f32 logits (12 MiB at a 49k vocabulary) stay in cache from the matmul through the
  exp and the reductions (a whole chunk's, 0.8 GB at 8 x 512 tokens, took 3x as long); 0
  elsewhere, one block per chunk (an accelerator fuses them into the matmul's output tiles)."""
  return 64 if (backend or jax.default_backend()) == "cpu" else 0


def describe() -> str:
  """One line for benchmark headers: the CPU, and what model.dtype=auto picks here and why."""
  dtype, why = auto_dtype()
  return f"CPU: {cpu_model()}; model.dtype=auto picks {dtype}: {why}"


def device_memory(device: jax.Device | None = None) -> tuple[int, str]:
  """(bytes `device` (default: the first local one) can hold, where the figure comes from).

  An accelerator reports its own limit (memory_stats' bytes_limit). CPU devices share the host:
  each gets an equal part of the memory available now (/proc/meminfo MemAvailable, or all of
  the physical memory where that is unknown).
  """
  device = device or jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if limit:
    return int(limit), f"the {device.platform} device's memory limit"
  available = _proc_field("/proc/meminfo", "MemAvailable").split()
  if available:
    host, source = int(available[0]) * 1024, "available host memory"
  else:
    host, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
  devices = len(jax.local_devices(backend=device.platform))
  return host // devices, (f"{source} ({host / 2**30:.1f} GiB) shared by {devices} "
                           f"{device.platform} device(s)")

"""The compiled decode loop copies neither the KV cache nor the weights: read off the optimized HLO.

A decode call is one XLA while loop whose body runs a step: every layer's projections, its
cache write and its attention. What a step may touch, it must touch in place: each layer's
cache is a loop-carried buffer that the step scatters its new token into (an in-place update)
and reads chunk by chunk; the weights are loop-invariant buffers the dots read. A copy of a
layer's cache, or a slice of the stacked weights inside the loop (what a scan over stacked
layers compiles to: a dynamic-slice of every weight, every step), is a defect these tests find.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from agentgym_jax import sampling
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder
from agentgym_jax.sampling import Sampler

# Sizes whose products (the weights' element counts) no activation of the step shares.
CONFIG = ModelConfig(model_type="llama", vocab_size=100, hidden_size=40, intermediate_size=72,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=10,
                     tie_word_embeddings=True)
BATCH, SLOTS = 4, 512  # More slots than a decode chunk: a chunk read is not a whole layer.

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(")


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """The HLO module's computations (name -> instruction lines) and the entry's name."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match and not line.startswith(" "):
      current = match.group(1)
      computations[current] = []
      entry = current if line.startswith("ENTRY") else entry
    elif current is not None and line.startswith("  "):
      computations[current].append(line)
  return computations, entry


def _loop_instructions(text: str) -> list[tuple[str, str, str]]:
  """(opcode, shape, root opcode of a fusion's computation) of every instruction the decode loop
  runs: those of the entry's while body and of the computations it runs (nested loops,
  conditionals, calls), but not the inside of a fusion, which is one instruction."""
  computations, entry = _computations(text)
  bodies = [
      re.search(r"body=%?([\w.\-]+)", line).group(1) for line in computations[entry]
      if " while(" in line
  ]
  assert len(bodies) == 1, bodies  # The decode loop.
  roots = {
      name: _INSTRUCTION.match(line).group(3) for name, lines in computations.items()
      for line in lines if line.lstrip().startswith("ROOT")
  }
  instructions, seen, todo = [], set(), [bodies[0]]
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for line in computations[name]:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      opcode = match.group(3)
      fused = re.search(r"calls=%?([\w.\-]+)", line)
      root = roots.get(fused.group(1), "") if opcode == "fusion" and fused else ""
      instructions.append((opcode, match.group(2), root))
      if opcode != "fusion":
        todo.extend(
            re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)",
                       line))
  return instructions


def _dims(shape: str) -> tuple[int, ...] | None:
  """'u16[3,4,2,512,8]{4,3,2,1,0}' -> (3, 4, 2, 512, 8); None for a tuple."""
  match = re.match(r"\w+\[([\d,]*)\]", shape)
  return None if match is None else tuple(int(d) for d in match.group(1).split(",") if d)


@pytest.fixture(scope="module", params=[None, [2]], ids=["every_row", "compact"])
def decode_hlo(request) -> str:
  """The decode program on every row, or on row 2 alone (`compact_decode`)."""
  model = Decoder(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  rows = None if request.param is None else jnp.asarray(request.param, jnp.int32)
  lowered = sampler._decode.lower(sampler.params, sampler.empty(),
                                  sampler._row_keys(jax.random.key(0)), jnp.zeros(BATCH, jnp.int32),
                                  jnp.zeros(BATCH, jnp.int32),
                                  jnp.zeros(sampling.MAX_STOP_IDS, jnp.int32), rows, width=8,
                                  sampling=sampling.SamplingParams())
  return lowered.compile().as_text()


def test_the_decode_loop_updates_each_layer_cache_in_place(decode_hlo):
  layer_cache = (BATCH, CONFIG.num_kv_heads, SLOTS, CONFIG.head_dim)
  made = [(op, root) for op, shape, root in _loop_instructions(decode_hlo)
          if _dims(shape) == layer_cache and op not in ("parameter", "get-tuple-element", "bitcast")
         ]
  # One in-place write of the new keys and one of the values per layer (a scatter, or for a
  # single row a dynamic-update-slice), and nothing else of a layer cache's size: no copy, no
  # slice, no gather of it.
  assert len(made) == 2 * CONFIG.num_layers, made
  assert {made[0]} == set(made) and made[0] in {("fusion", "scatter"),
                                                ("fusion", "dynamic-update-slice")}, made
  # No stacked [layers, ...] cache anywhere in the program.
  assert f"[{CONFIG.num_layers},{BATCH},{CONFIG.num_kv_heads},{SLOTS}" not in decode_hlo
  # The donated cache buffers come back as outputs: every layer's keys and values alias.
  aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", decode_hlo).group(1)
  assert aliases.count("may-alias") >= 2 * CONFIG.num_layers


def test_the_decode_loop_reads_the_weights_without_copying_them(decode_hlo):
  e, f, d = CONFIG.hidden_size, CONFIG.intermediate_size, CONFIG.head_dim
  h, k = CONFIG.num_heads, CONFIG.num_kv_heads
  # Each weight's size as stored and as laid out for decoding (q, k and v fused, gate and up).
  weight_sizes = {
      e * h * d, e * k * d, e * f, CONFIG.vocab_size * e, e * (h + 2 * k) * d, 2 * e * f
  }
  loop = _loop_instructions(decode_hlo)
  made = [(op, shape) for op, shape, _ in loop
          if op not in ("parameter", "get-tuple-element", "bitcast",
                        "dot") and _size(shape) in weight_sizes]
  assert made == [], made
  # The stacked weights never enter the loop (a vector of num_layers entries is an index).
  stacked = [
      shape for _, shape, _ in loop
      if len(_dims(shape) or ()) > 1 and _dims(shape)[0] == CONFIG.num_layers
  ]
  assert stacked == [], stacked


def _size(shape: str) -> int:
  return math.prod(_dims(shape) or (0,))

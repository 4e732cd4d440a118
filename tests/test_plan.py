"""The memory plan of Qwen2.5-7B-Instruct on 8 devices, from abstract arrays only.

The expected per-device bytes are derived by hand from the rules table, so a sharding mistake
(a parameter left replicated, an axis split twice) shows here without any weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from agentgym_jax import sharding
from agentgym_jax import settings as settings_lib
from agentgym_jax import state as state_lib
from agentgym_jax import memory as plan  # The memory planner.
from agentgym_jax.models.config import ModelConfig

QWEN_7B = plan.model_config("qwen2.5-7b-instruct")
# Replicated on every device: the RMSNorm weights (2 per layer + the final one) ...
NORMS = 28 * 2 * 3584 + 3584
# ... and the q/k/v biases [layers, heads, head_dim], whose only split axis is heads on tensor.
BIASES = 28 * (28 + 4 + 4) * 128


def test_qwen_7b_config_counts_its_published_parameters():
  assert QWEN_7B.num_params == 7_615_616_512  # "7.61B" on the model card.
  assert (QWEN_7B.head_dim, QWEN_7B.attention_bias, QWEN_7B.tie_word_embeddings) == (128, True,
                                                                                     False)


@pytest.mark.parametrize(
    "mesh_shape, per_device_params",
    [
        # fsdp=8 splits every matrix on its embed axis (3584 = 8 * 448); norms and biases stay whole.
        ((1, 8, 1), (QWEN_7B.num_params - NORMS - BIASES) // 8 + BIASES + NORMS),
        # fsdp=4 x tensor=2: matrices split 8-way (embed / 4, heads or mlp or vocab / 2), biases 2-way.
        ((1, 4, 2), (QWEN_7B.num_params - NORMS - BIASES) // 8 + BIASES // 2 + NORMS),
    ])
def test_sharded_parameters_take_an_eighth_per_device(mesh_shape, per_device_params):
  memory = plan.plan(QWEN_7B, sharding.make_mesh(*mesh_shape), plan.StepShape(8, 4096),
                     compile=False)
  assert memory.param_bytes == 4 * per_device_params  # f32 parameters.
  # The replicated 0.3M norm and bias weights put it 0.03% above an even eighth.
  assert abs(memory.param_bytes / (4 * QWEN_7B.num_params / 8) - 1) < 5e-4
  # AdamW: two f32 moments per parameter, sharded alike, its int32 step count, and the
  # non-finite guard's counters (two int32 and a bool).
  assert memory.optimizer_bytes == 2 * memory.param_bytes + 4 + 9
  # The minibatch splits over data x fsdp only; tensor devices hold the same rows: per row the
  # Batch's tokens, loss mask and sampler log-probs over 4096 positions, its reward and group,
  # and the Experience's six f32 arrays over the 4095 targets and its kept flag per row.
  rows = 8 // (mesh_shape[0] * mesh_shape[1])
  assert memory.batch_bytes == rows * (3 * 4096 * 4 + 4 + 4 + 6 * 4095 * 4 + 4)


def test_forward_lowers_and_compiles_on_abstract_sharded_inputs():
  mesh = sharding.make_mesh(1, 8, 1)
  compiled = plan.lower_forward(QWEN_7B, mesh, batch=8, seq=128).compile()
  stats = compiled.memory_analysis()
  # The compiled program takes exactly the planned shards: nothing was gathered at the input.
  expected = plan.plan(QWEN_7B, mesh, plan.StepShape(8, 128), compile=False)
  assert stats.argument_size_in_bytes == expected.param_bytes + plan.device_bytes(
      plan.abstract_batch(mesh, 8, 128))
  # Logits [8, 128, 152064] f32 leave split over the 8 batch rows.
  assert stats.output_size_in_bytes == 128 * 152064 * 4


def test_train_step_compiles_with_donated_sharded_state():
  mesh = sharding.make_mesh(1, 4, 2)
  memory = plan.plan(QWEN_7B, mesh, plan.StepShape(8, 128, dtype=jnp.bfloat16, remat="full"))
  # The learner's own update step takes every parameter and moment shard as planned (a
  # gathered one would add gigabytes) and, jit dropping inputs it never reads, of the optimizer
  # state all but the non-finite guard's 1-byte `last_finite` flag (written, never read), and
  # of the minibatch what GRPO's update reads: tokens and loss mask (2 rows x 128 positions a
  # device), old log-probs, advantages and rollout-correction weights (2 rows x 127 targets)
  # and each row's kept flag, 4 bytes each.
  state = memory.param_bytes + memory.optimizer_bytes - 1
  assert memory.argument_bytes == state + 2 * (2 * 128 * 4 + 3 * 127 * 4 + 4)
  # Parameters and moments are updated in place: only the flag and the scalar metrics are
  # fresh outputs.
  assert memory.alias_bytes == state
  assert memory.output_bytes - memory.alias_bytes < 1024
  # The f32 gradients (as large as the parameters' shards) live in the step's scratch space.
  assert memory.param_bytes < memory.temp_bytes
  assert memory.peak_bytes == (memory.argument_bytes + memory.output_bytes - memory.alias_bytes +
                               memory.temp_bytes)


def test_an_unknown_model_is_refused():
  with pytest.raises(FileNotFoundError, match=r"neither a planned model"):
    plan.model_config("qwen9-1t")


# A 2-layer Qwen2 with the 7B's structure (GQA, q/k/v biases): compiles in seconds.
SMALL = ModelConfig.from_hf({
    **plan.HF_CONFIGS["qwen2.5-7b-instruct"], "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2
})
# 8 rows of 256 cache slots, prefills of 32 tokens, decode calls of 16.
SAMPLER = plan.SamplerShape(8, 256, prefill_tokens=32, max_new_tokens=16)


def test_sampler_plan_holds_the_cache_shard_and_updates_it_in_place():
  mesh = sharding.make_mesh(2, 2, 2)
  memory = plan.plan_sampler(SMALL, mesh, SAMPLER)
  # Keys and values: 2 layers x 8 rows x 2 kv heads x 256 slots x 64 head_dim, bf16 bits; rows
  # split over data x fsdp (4-way), kv heads over tensor (2-way).
  assert memory.cache_bytes == 2 * (2 * 8 * 2 * 256 * 64 * 2) // 8
  assert memory.param_bytes == plan.plan(SMALL, mesh, plan.StepShape(8, 32),
                                         compile=False).param_bytes
  assert memory.peak_bytes == (memory.param_bytes + memory.cache_bytes +
                               max(memory.prefill_bytes, memory.decode_bytes))
  prefill, decode = (
      lowered.compile().memory_analysis() for lowered in plan.lower_sampler(SMALL, mesh, SAMPLER))
  # The donated state comes back in place: the cache is never copied.
  assert prefill.alias_size_in_bytes == decode.alias_size_in_bytes > memory.cache_bytes
  # Both take the planned shards of the parameters and the state: the cache, 2 rows' lengths
  # and f32 hidden states [2, 256]. Decode adds 8 keys (64 B), 2 offsets, 2 budgets and 8 stop
  # ids (32 B).
  # Prefill never reads the lm_head (f32 [256, 1024] split 4-way: 262144 B), so jit drops it,
  # and adds a [2, 32] shard of tokens and 2 counts.
  state_bytes = memory.cache_bytes + 2 * 4 + 2 * 256 * 4
  assert decode.argument_size_in_bytes == memory.param_bytes + state_bytes + 64 + 2 * 2 * 4 + 32
  assert prefill.argument_size_in_bytes == (memory.param_bytes - 262144 + state_bytes + 2 * 32 * 4 +
                                            2 * 4)


def test_train_step_with_the_tpu_attention_kernel_compiles_on_a_tpu_shaped_mesh():
  # The Pallas splash kernel (interpreted off TPU) inside the learner's update step, run per
  # shard: rows over fsdp, the 4 heads and 2 kv heads over tensor.
  mesh = sharding.make_mesh(1, 4, 2)
  memory = plan.plan(SMALL, mesh, plan.StepShape(8, 256, remat="none", attention="splash"))
  # It takes the planned shards and nothing gathered (see the 7B test above): parameters and
  # moments less the 1-byte flag, and 2 rows a device of tokens and loss mask (256 positions)
  # and of old log-probs, advantages and rollout-correction weights (255 targets), and each
  # row's kept flag.
  state = memory.param_bytes + memory.optimizer_bytes - 1
  assert memory.argument_bytes == state + 2 * (2 * 256 * 4 + 3 * 255 * 4 + 4)


# --- model.remat=auto

GIB = 2**30
PEAKS = {"none": 10 * GIB, "dots": 6 * GIB, "full": 3 * GIB}


@pytest.mark.parametrize(
    "device_gib, expected, asked, why",
    [
        # Budgets are 90% of the device; 2 GiB stay resident beside the step.
        (100, "none", ["none"], "none needs 12.00 GiB per device, within 90% of 100.00 GiB"),
        # none: 12 > 11.25; dots: 8 <= 11.25.
        (12.5, "dots", ["none", "dots"],
         "none needs 12.00 GiB, dots needs 8.00 GiB per device, within 90% of 12.50 GiB"),
        # full: 5 <= 5.4.
        (6, "full", ["none", "dots", "full"], "full needs 5.00 GiB per device, within 90% of 6.00"),
        # full: 5 > 4.5, the least memory there is.
        (5, "full", ["none", "dots", "full"],
         "none fits: none needs 12.00 GiB, dots needs 8.00 GiB, full needs 5.00 GiB per device, "
         "over 90% of 5.00 GiB"),
    ])
def test_remat_auto_takes_the_fastest_policy_that_fits(device_gib, expected, asked, why):
  calls = []
  peak = lambda remat: calls.append(remat) or PEAKS[remat]
  remat, reason = plan.choose_remat(peak, int(device_gib * GIB), resident_bytes=2 * GIB)
  assert (remat, calls) == (expected, asked)  # Policies past the first that fits are not compiled.
  assert why in reason


def test_remat_auto_without_a_memory_analysis_is_full():
  assert plan.choose_remat(lambda remat: None,
                           GIB) == ("full", "the compiler gives no memory analysis to choose by")


@pytest.mark.slow
def test_a_training_run_resolves_remat_auto_from_its_compiled_update_step(
    tmp_path, monkeypatch, caplog):
  import logging
  import re

  import tiny
  from agentgym_jax import config as config_lib, hardware

  c = config_lib.base_config()
  c.model.name = str(tiny.make_checkpoint(tmp_path))
  c.model.dtype = "float32"
  c.rollout.tasks_per_step, c.rollout.samples_per_task = 4, 4
  c.rollout.max_new_tokens, c.rollout.max_context = 32, 256
  c.algorithm.num_minibatches = 2  # Update steps of 8 rows x 256 tokens.
  settings = settings_lib.Settings.from_config(c)
  assert state_lib.update_shape(settings) == (8, 256)
  monkeypatch.setattr(hardware, "device_memory", lambda: (1 << 40, "a test budget"))
  # On XLA:CPU the only policy tried is full, the fastest there.
  with caplog.at_level(logging.INFO):
    mesh, model, _ = state_lib.load_policy(settings, training=True)
  assert model.remat == "full"
  assert re.search(
      r"model.remat=auto: full, as a 8 x 256 update step: full needs [\d.]+ MiB "
      r"per device, within 90% of 1024.00 GiB \(a test budget\)", caplog.text)
  # Sampling-only loads (evaluation) never compile an update step.
  assert state_lib.load_policy(settings)[1].remat == "none"
  # An accelerator's order, none first.
  monkeypatch.setitem(plan.REMAT_PREFERENCE, "cpu", plan.ACCELERATOR_REMAT)
  assert state_lib.auto_remat(settings, model, mesh)[0] == "none"
  # A device too small for any policy: full, the smallest; the compiled steps' needs shrink
  # as the backward pass recomputes more.
  monkeypatch.setattr(hardware, "device_memory", lambda: (1, "one byte"))
  remat, why = state_lib.auto_remat(settings, model, mesh)
  needs = [float(n) for n in re.findall(r"(?:none|dots|full) needs ([\d.]+) MiB", why)]
  assert remat == "full" and "none fits" in why and len(needs) == 3
  assert needs[0] > needs[1] > needs[2], why


def test_lora_plan_trains_and_holds_moments_of_the_adapters_only():
  from agentgym_jax.models import lora

  r = 64
  settings = lora.LoraSettings(rank=r, alpha=128.0)
  full = plan.plan(QWEN_7B, sharding.make_mesh(1, 8, 1), plan.StepShape(8, 4096), compile=False)
  memory = plan.plan(QWEN_7B, sharding.make_mesh(1, 8, 1), plan.StepShape(8, 4096, lora=settings),
                     compile=False)
  assert memory.param_bytes == full.param_bytes  # The frozen base, sharded as before.
  # Per layer, A takes its weight's input axes and B its output axes: on fsdp=8 the embed axes
  # split 8 ways (A of q, k, v, gate, up; B of o, down) while heads, kv_heads and mlp (tensor=1)
  # stay whole (A of o [28 x 128, r], A of down [18944, r]; B of q, k, v, gate, up).
  e, h, k, d, f = 3584, 28, 4, 128, 18944
  per_layer = r * (7 * e // 8 + 2 * h * d + 2 * k * d + 3 * f)
  assert memory.adapter_bytes == 4 * 28 * per_layer
  # AdamW's two f32 moments of the adapters and the same counters as above: 0.91 GiB against
  # full fine-tuning's 7.09 GiB of moments.
  assert memory.optimizer_bytes == 2 * memory.adapter_bytes + 4 + 9
  assert round(memory.optimizer_bytes / 2**30, 2) == 0.91
  assert round(full.optimizer_bytes / 2**30, 2) == 7.09


def test_lora_step_donates_the_adapters_and_only_reads_the_base():
  from agentgym_jax.models import lora

  config = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)
  mesh = sharding.make_mesh(1, 4, 2)
  memory = plan.plan(
      config, mesh,
      plan.StepShape(8, 64, dtype=jnp.float32, remat="full",
                     lora=lora.LoraSettings(rank=4, alpha=8.0)))
  # Arguments: the frozen base, the adapters and their moments (less the guard's unread flag),
  # GRPO's minibatch (2 rows a device: tokens, mask; old log-probs, advantages, weights; kept).
  state = memory.adapter_bytes + memory.optimizer_bytes - 1
  assert memory.argument_bytes == memory.param_bytes + state + 2 * (2 * 64 * 4 + 3 * 63 * 4 + 4)
  # Adapters and moments are updated in place; the base is neither donated nor returned.
  assert memory.alias_bytes == state
  assert memory.output_bytes - memory.alias_bytes < 1024

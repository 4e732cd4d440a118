"""The memory plan of Qwen2.5-7B-Instruct on 8 devices, from abstract arrays only.

The expected per-device bytes are derived by hand from the rules table, so a sharding mistake
(a parameter left replicated, an axis split twice) shows here without any weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from agentgym_jax import plan, sharding

QWEN_7B = plan.model_config("qwen2.5-7b-instruct")
# Replicated on every device: the RMSNorm weights (2 per layer + the final one) ...
NORMS = 28 * 2 * 3584 + 3584
# ... and the q/k/v biases [layers, heads, head_dim], whose only split axis is heads on tensor.
BIASES = 28 * (28 + 4 + 4) * 128


def test_qwen_7b_config_counts_its_published_parameters():
  assert QWEN_7B.num_params == 7_615_616_512  # "7.61B" on the model card.
  assert (QWEN_7B.head_dim, QWEN_7B.attention_bias, QWEN_7B.tie_word_embeddings) == (128, True,
                                                                                     False)


@pytest.mark.parametrize("mesh_shape, per_device_params", [
    # fsdp=8 splits every matrix on its embed axis (3584 = 8 * 448); norms and biases stay whole.
    ((1, 8, 1), (QWEN_7B.num_params - NORMS - BIASES) // 8 + BIASES + NORMS),
    # fsdp=4 x tensor=2: matrices split 8-way (embed / 4, heads or mlp or vocab / 2), biases 2-way.
    ((1, 4, 2), (QWEN_7B.num_params - NORMS - BIASES) // 8 + BIASES // 2 + NORMS),
])
def test_sharded_parameters_take_an_eighth_per_device(mesh_shape, per_device_params):
  memory = plan.plan(QWEN_7B, sharding.make_mesh(*mesh_shape), batch=8, seq=4096, compile=False)
  assert memory.param_bytes == 4 * per_device_params  # f32 parameters.
  # The replicated 0.3M norm and bias weights put it 0.03% above an even eighth.
  assert abs(memory.param_bytes / (4 * QWEN_7B.num_params / 8) - 1) < 5e-4
  # AdamW: two f32 moments per parameter, sharded alike, and an int32 step count.
  assert memory.optimizer_bytes == 2 * memory.param_bytes + 4
  # The int32 token batch splits over data x fsdp only; tensor devices hold the same rows.
  assert memory.batch_bytes == 8 * 4096 * 4 // (mesh_shape[0] * mesh_shape[1])


def test_forward_lowers_and_compiles_on_abstract_sharded_inputs():
  mesh = sharding.make_mesh(1, 8, 1)
  compiled = plan.lower_forward(QWEN_7B, mesh, batch=8, seq=128).compile()
  stats = compiled.memory_analysis()
  # The compiled program takes exactly the planned shards: nothing was gathered at the input.
  expected = plan.plan(QWEN_7B, mesh, batch=8, seq=128, compile=False)
  assert stats.argument_size_in_bytes == expected.param_bytes + expected.batch_bytes
  # Logits [8, 128, 152064] f32 leave split over the 8 batch rows.
  assert stats.output_size_in_bytes == 128 * 152064 * 4


def test_train_step_compiles_with_donated_sharded_state():
  mesh = sharding.make_mesh(1, 4, 2)
  memory = plan.plan(QWEN_7B, mesh, batch=8, seq=128, dtype=jnp.bfloat16, remat="full")
  assert memory.argument_bytes == (memory.param_bytes + memory.optimizer_bytes
                                   + memory.batch_bytes)
  # Parameters and moments are updated in place: only the scalar loss is a fresh output.
  assert memory.alias_bytes == memory.param_bytes + memory.optimizer_bytes
  assert memory.output_bytes - memory.alias_bytes < 1024
  # The f32 gradients (as large as the parameters' shards) live in the step's scratch space.
  assert memory.param_bytes < memory.temp_bytes
  assert memory.peak_bytes == (memory.argument_bytes + memory.output_bytes - memory.alias_bytes
                               + memory.temp_bytes)


def test_cli_prints_a_table_per_mesh(capsys):
  plan.main(["--model=qwen2.5-7b-instruct", "--mesh=1,8,1", "--mesh=1,4,2", "--no_compile"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "qwen2.5-7b-instruct: 7.62B parameters; GiB per device"
  # 3808974848 B = 3.55 GiB of parameters, 2x that of moments.
  assert lines[3].split() == ["1,8,1", "8", "x", "4096", "3.55", "7.09", "-", "-", "-"]
  assert lines[4].split()[:5] == ["1,4,2", "8", "x", "4096", "3.55"]


def test_cli_rejects_meshes_it_cannot_build():
  with pytest.raises(SystemExit, match=r"mesh \(1, 16, 1\) needs 16 devices"):
    plan.main(["--mesh=1,16,1", "--no_compile"])
  with pytest.raises(SystemExit):
    plan.main(["--mesh=1,8"])
  with pytest.raises(FileNotFoundError, match=r"neither a planned model"):
    plan.model_config("qwen9-1t")

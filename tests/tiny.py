"""A tiny randomly initialised checkpoint directory (weights, config, ChatML tokenizer) for tests.

The tokenizer is word-level over a handful of tokens so that a random policy hits an echo
environment's symbols often enough for RL to have a signal from the first step.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import tokenizers
from flax import nnx
from tokenizers import decoders, models, pre_tokenizers

from agentgym_jax.models import weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder

SPECIAL = ["<|im_start|>", "<|im_end|>", "[UNK]"]
WORDS = ["\n", " ", "user", "assistant", "0", "1"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tokenizer(directory: pathlib.Path) -> int:
  vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
  backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"\s|\w+|[^\w\s]"),
                                               behavior="isolated")
  backend.decoder = decoders.Fuse()
  backend.add_special_tokens(SPECIAL[:2])
  backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "chat_template": CHATML}))
  return len(vocab)


def make_checkpoint(directory: str | pathlib.Path, *, seed: int = 0, hidden_size: int = 64,
                    num_layers: int = 2) -> pathlib.Path:
  """Writes config.json, model.safetensors and the tokenizer files; returns the directory."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  vocab_size = write_tokenizer(directory)
  config = ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=4,
                       num_kv_heads=2, head_dim=hidden_size // 4, tie_word_embeddings=True,
                       max_position_embeddings=4096, eos_token_id=1)
  model = Decoder(config, rngs=nnx.Rngs(seed))
  weights.save_hf(model, directory, dtype=jnp.float32)
  return directory

"""Model loading shared by the model, tokenizer and checkpoint-location tests."""

import jax.numpy as jnp
import numpy as np

from agentgym_jax import models
from agentgym_jax.models import gguf


def load_hf_smollm2(auto_class, **kwargs):
  """transformers' own loading (`auto_class`, e.g. AutoTokenizer) of the embedded SmolLM2 GGUF."""
  path = gguf.smollm2_gguf_path()
  return auto_class.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)


def assert_loads_the_same(name: str, reference: str) -> None:
  """The model `name` loads with the same logits and tokenizer as the model `reference`."""
  model, tokenizer = models.load_model(name)
  reference_model, reference_tokenizer = models.load_model(reference)
  ids = jnp.array([[0, 4, 2, 5, 1]])
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(reference_model(ids)))
  assert tokenizer.encode("user 0 1") == reference_tokenizer.encode("user 0 1")

"""A tiny randomly initialised checkpoint directory (weights, config, tokenizer) for tests.

The tokenizer is word-level over a handful of tokens so that a random policy hits an echo
environment's symbols often enough for RL to have a signal from the first step. Its chat
template is one of three families (`CHATS`): plain ChatML, a Qwen3-style ChatML (thinking
switch, think-block removal, tools in the system turn) or a Llama 3.2-style layout (BOS, header
tokens, date lines, tools in the first user turn). The Qwen3 and Llama 3.x templates were
written for these tests from each family's documented prompt format; test_tokenizer.py checks
our layouts against them through transformers.
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
QWEN3_LIKE_TEMPLATE = r"""
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
  {{- '# Tools\n\nFunctions you may call:\n<tools>' }}
  {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
  {{- '\n</tools>\n\nCall one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
  {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set content = message.content %}
    {%- set thought = '' %}
    {%- if '</think>' in content %}
      {%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_user and (loop.last or thought) %}
      {{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + content }}
    {%- else %}
      {{- '<|im_start|>assistant\n' + content }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}
    {{- '<think>\n\n</think>\n\n' }}
  {%- endif %}
{%- endif %}
"""
LLAMA31_TEMPLATE = r"""
{{- bos_token }}
{%- if date_string is not defined %}DATE{%- endif %}
{%- if messages[0]['role'] == 'system' %}
  {%- set system_message = messages[0]['content'] | trim %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}
{{- system_message + '<|eot_id|>' }}
{%- if tools is not none %}
  {%- set first_user = messages[0]['content'] | trim %}
  {%- set messages = messages[1:] %}
  {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
  {{- 'Answer with a JSON function call {"name": function name, "parameters": arguments}.\n\n' }}
  {%- for tool in tools %}{{- tool | tojson(indent=4) + '\n\n' }}{%- endfor %}
  {{- first_user + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
LLAMA31_LIKE_TEMPLATE = LLAMA31_TEMPLATE.replace("DATE", "{%- set date_string = '26 Jul 2024' %}")
LLAMA32_LIKE_TEMPLATE = LLAMA31_TEMPLATE.replace(
    "DATE", "{%- set date_string = strftime_now('%d %b %Y') %}")
LLAMA31_LIKE_TEMPLATE = LLAMA31_TEMPLATE.replace("DATE", "{%- set date_string = '26 Jul 2024' %}")
LLAMA32_LIKE_TEMPLATE = LLAMA31_TEMPLATE.replace(
    "DATE", "{%- set date_string = strftime_now('%d %b %Y') %}")

LLAMA3_SPECIAL = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[UNK]"
]
# Per chat family: (the vocabulary's leading tokens, how many of them are special, added
# tokens that are not special, tokenizer_config.json's special tokens, the template, the
# model_type).
CHATS = {
    "chatml": (SPECIAL, 2, [], {"eos_token": "<|im_end|>",
                                "pad_token": "<|im_end|>"}, CHATML, "llama"),
    "qwen3": (SPECIAL, 2, ["<think>",
                           "</think>"], {"eos_token": "<|im_end|>",
                                         "pad_token": "<|im_end|>"}, QWEN3_LIKE_TEMPLATE, "qwen3"),
    "llama3":
        (LLAMA3_SPECIAL, 4, [],
         {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
          "pad_token": "<|eot_id|>"}, LLAMA32_LIKE_TEMPLATE, "llama"),
}


def write_tokenizer(directory: pathlib.Path, chat: str = "chatml") -> int:
  """Writes tokenizer.json and tokenizer_config.json of chat family `chat`; returns the
  vocabulary size."""
  leading, num_special, added, config, template, _ = CHATS[chat]
  vocab = {token: i for i, token in enumerate(leading + WORDS + added)}
  backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"\s|\w+|[^\w\s]"),
                                               behavior="isolated")
  backend.decoder = decoders.Fuse()
  backend.add_special_tokens(leading[:num_special])
  backend.add_tokens(
      [tokenizers.AddedToken(token, special=False, normalized=False) for token in added])
  backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({**config,
                                                               "chat_template": template}))
  return len(vocab)


def make_checkpoint(directory: str | pathlib.Path, *, seed: int = 0, hidden_size: int = 64,
                    num_layers: int = 2, chat: str = "chatml") -> pathlib.Path:
  """Writes config.json, model.safetensors and the tokenizer files; returns the directory."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  vocab_size = write_tokenizer(directory, chat)
  eos = CHATS[chat][3]["eos_token"]
  config = ModelConfig(model_type=CHATS[chat][5], vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=4,
                       num_kv_heads=2, head_dim=hidden_size // 4, tie_word_embeddings=True,
                       qk_norm=chat == "qwen3", max_position_embeddings=4096,
                       eos_token_id=CHATS[chat][0].index(eos))
  model = Decoder(config, rngs=nnx.Rngs(seed))
  weights.save_hf(model, directory, dtype=jnp.float32)
  return directory


def one_device(monkeypatch) -> None:
  """Makes runs use one device, as on a workstation (sharding is tested on the 8-device mesh)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from agentgym_jax import sharding  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(
      sharding, "make_mesh", lambda *a, **k: sharding.Mesh(
          np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES))

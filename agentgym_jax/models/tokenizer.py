"""Tokenization and chat rendering: the one place where text becomes token ids and back.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` built either from a checkpoint directory
(`tokenizer.json` + `tokenizer_config.json`) or from the vocabulary stored in a GGUF file.
`ChatTemplate` (reached as `tokenizer.chat`) lays out conversations in ChatML:

    <|im_start|>{role}\n{content}<|im_end|>\n  ...  <|im_start|>assistant\n

which is the template of SmolLM2-Instruct, Qwen2, Qwen2.5 and Qwen3. A family differs only in the
system message it inserts when a conversation has none; that default is read off the model's own
Jinja template by rendering a probe conversation, and the whole layout is then checked against
that template, so a model whose template is not ChatML is refused with a clear error instead of
being prompted in a format it was not trained on.

Multi-turn rollouts are token-in/token-out: the sampler appends its own ids to the prompt, and the
rollout appends `continuation_ids(...)` after each generated turn. Two rules make that stream equal
to `render(...)` of the finished conversation, token for token:

  * Special tokens are never produced from text. Message content is encoded with special-token
    matching off, so an environment observation or model output containing the string
    "<|im_end|>" stays plain text and cannot forge a turn boundary.
  * An assistant turn's content is encoded apart from its `assistant\n` header, exactly as it is
    generated after the generation prompt. Every other turn is encoded as `{role}\n{content}`, one
    text segment between special tokens, as Hugging Face's `apply_chat_template` does. The two
    agree unless an assistant turn starts with a run of whitespace that a joint split would fuse
    with the header's newline ("\n\n\n" read as "\n\n" + "\n" instead of "\n" | "\n" + "\n");
    the text is the same either way.

Qwen3: its Jinja template removes `<think>...</think>` blocks from assistant turns before the
last user message, and can pre-fill an empty think block when thinking is disabled. Here assistant
content is always kept verbatim and the generation prompt is the plain `<|im_start|>assistant\n`
(Qwen3's default thinking mode): the policy is trained on exactly the tokens it saw and produced.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from agentgym_jax.models import gguf

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# llama.cpp token types (`tokenizer.ggml.token_type`).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Pre-tokenizers for the `tokenizer.ggml.pre` names whose split llama.cpp defines as GPT-2's
# byte-level regex. "smollm" first isolates every digit (llama.cpp: `\p{N}`, then the GPT-2 regex).
_GGUF_PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
}


class Tokenizer:
  """Text <-> token ids for one model; `encode` never adds special tokens implicitly."""

  def __init__(
      self,
      backend: tokenizers.Tokenizer,
      *,
      bos_id: int | None,
      eos_id: int | None,
      pad_id: int | None,
      chat_template_source: str | None = None,
  ):
    """Wraps `backend`.

    Args:
      backend: the Hugging Face fast tokenizer; padding and truncation are switched off on a copy.
      bos_id, eos_id, pad_id: the model's special ids (None where the model has none).
      chat_template_source: the model's Jinja chat template, read by `chat`.
    """
    # Two copies of the backend: one that matches special-token strings in text (for callers
    # that pass them on purpose) and one that treats them as plain text (everything else).
    self._backend = tokenizers.Tokenizer.from_str(backend.to_str())
    self._backend.no_padding()
    self._backend.no_truncation()
    self._backend.encode_special_tokens = False
    self._text_backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
    self._text_backend.encode_special_tokens = True
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.pad_id = pad_id
    self.chat_template_source = chat_template_source
    self.special_ids = frozenset(
        token_id for token_id, token in self._backend.get_added_tokens_decoder().items()
        if token.special)

  @classmethod
  def from_gguf(cls, path: str | pathlib.Path | None = None) -> Tokenizer:
    """The byte-level BPE tokenizer stored in a GGUF file (default: the embedded SmolLM2).

    The file stores the vocabulary already spelled in the GPT-2 byte alphabet, the merges, a
    type per token (control tokens become special added tokens, user-defined ones plain added
    tokens), the special ids, the pre-tokenizer's name and the chat template.
    """
    path = gguf.smollm2_gguf_path() if path is None else pathlib.Path(path)
    metadata = gguf.read_gguf_metadata(path)
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
      raise ValueError(
          f"{path} stores a {model_type!r} tokenizer; only byte-level BPE ('gpt2') is supported.")
    pre_name = metadata.get("tokenizer.ggml.pre", "gpt2")
    if pre_name not in _GGUF_PRE_TOKENIZERS:
      raise ValueError(
          f"{path} names pre-tokenizer {pre_name!r}; supported: {sorted(_GGUF_PRE_TOKENIZERS)}.")

    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={token: index for index, token in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre_name]()
    backend.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([
        tokenizers.AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types) if token_type == _GGUF_CONTROL])
    backend.add_tokens([
        tokenizers.AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types) if token_type == _GGUF_USER_DEFINED])
    return cls(
        backend,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        chat_template_source=metadata.get("tokenizer.chat_template"))

  @classmethod
  def from_pretrained(cls, directory: str | pathlib.Path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (Qwen2/2.5/3, Llama family).

    Reads `tokenizer.json`, the special tokens of `tokenizer_config.json`, and the chat template
    from `chat_template.jinja` or else `tokenizer_config.json`'s `chat_template`.
    """
    directory = pathlib.Path(directory)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
      raise FileNotFoundError(f"{directory} has no tokenizer.json (a fast tokenizer is required).")
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}

    def special_id(name: str) -> int | None:
      token = config.get(name)
      if isinstance(token, Mapping):
        token = token.get("content")
      if token is None:
        return None
      token_id = backend.token_to_id(token)
      if token_id is None:
        raise ValueError(f"{config_file} names {name} {token!r}, which is not in the vocabulary.")
      return token_id

    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
      chat_template_source = template_file.read_text()
    else:
      chat_template_source = _default_template(config.get("chat_template"), config_file)
    return cls(
        backend,
        bos_id=special_id("bos_token"),
        eos_id=special_id("eos_token"),
        pad_id=special_id("pad_token"),
        chat_template_source=chat_template_source)

  @property
  def vocab_size(self) -> int:
    """Number of tokens the tokenizer knows, added tokens included.

    A model's embedding table may have more rows (Qwen pads it to a multiple of 128).
    """
    return self._backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int:
    """The id of one token as spelled in the vocabulary, e.g. "<|im_end|>"."""
    token_id = self._backend.token_to_id(token)
    if token_id is None:
      raise KeyError(f"{token!r} is not a token of this vocabulary.")
    return token_id

  def id_to_token(self, token_id: int) -> str:
    """The vocabulary spelling of one id (byte-level alphabet for BPE tokens)."""
    token = self._backend.id_to_token(int(token_id))
    if token is None:
      raise KeyError(f"{token_id} is not an id of this vocabulary (size {self.vocab_size}).")
    return token

  def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
    """Token ids of `text`, with no BOS/EOS added.

    Args:
      text: the text to encode.
      allow_special: if True, special-token strings in `text` ("<|im_end|>") become their ids;
        by default they are encoded as the plain text they are.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode takes a str, got {type(text).__name__}.")
    backend = self._backend if allow_special else self._text_backend
    return backend.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
    """The text of `ids`; special tokens are written out unless `skip_special_tokens`."""
    ids = [int(token_id) for token_id in ids]
    if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
      raise ValueError(f"ids outside the vocabulary [0, {self.vocab_size}): {ids}")
    return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def save_pretrained(self, directory: str | pathlib.Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json (special tokens, chat template), which
    `from_pretrained` and transformers' AutoTokenizer read back."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self._backend.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                           ("pad_token", self.pad_id)):
      if token_id is not None:
        config[name] = self.id_to_token(token_id)
    if self.chat_template_source is not None:
      config["chat_template"] = self.chat_template_source
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

  @functools.cached_property
  def chat(self) -> ChatTemplate:
    """The model's chat template, checked to be ChatML (see `ChatTemplate.from_jinja`)."""
    if self.chat_template_source is None:
      raise ValueError("This tokenizer has no chat template (a base model?).")
    return ChatTemplate.from_jinja(self, self.chat_template_source)


class ChatTemplate:
  """ChatML conversations as token ids, whole (`render`) or turn by turn (`continuation_ids`).

  Invariant (the rollout relies on it): for a conversation `messages` and a generated assistant
  turn whose ids are `encode(reply) + [im_end_id]`,

      render(messages) + encode(reply) + [im_end_id] + continuation_ids("user", observation)
        == render(messages + [assistant: reply, user: observation])

  and the same holds turn after turn.
  """

  def __init__(self, tokenizer: Tokenizer, default_system: str | None = None):
    """ChatML over `tokenizer`'s vocabulary.

    Args:
      tokenizer: a tokenizer whose vocabulary has `<|im_start|>` and `<|im_end|>`.
      default_system: the system message inserted when a conversation does not start with one
        (None: insert nothing).
    """
    try:
      self.im_start_id = tokenizer.token_to_id(IM_START)
      self.im_end_id = tokenizer.token_to_id(IM_END)
    except KeyError as error:
      raise ValueError(f"Not a ChatML vocabulary: {error}") from error
    self.tokenizer = tokenizer
    self.default_system = default_system
    # The model may also end a turn with its EOS token; the sampler stops on either.
    eos_ids = () if tokenizer.eos_id in (None, self.im_end_id) else (tokenizer.eos_id,)
    self.turn_end_ids: tuple[int, ...] = (self.im_end_id, *eos_ids)
    self.generation_prompt_ids: list[int] = self._ids(self._generation_prompt())

  @classmethod
  def from_jinja(cls, tokenizer: Tokenizer, source: str) -> ChatTemplate:
    """The ChatML template equivalent to a model's Jinja chat template.

    The default system message is what the template writes before a lone user message. The
    template must then render probe conversations (with and without a system message, with and
    without the generation prompt) exactly as this class does, or a ValueError says where they
    differ.
    """
    user_turn = f"{IM_START}user\nProbe question?{IM_END}\n"
    text = _render_jinja(source, tokenizer, [{"role": "user", "content": "Probe question?"}],
                         add_generation_prompt=False)
    match = re.fullmatch(
        rf"(?:{re.escape(IM_START)}system\n(.*){re.escape(IM_END)}\n)?{re.escape(user_turn)}",
        text, flags=re.DOTALL)
    if match is None:
      raise ValueError(
          "The model's chat template is not ChatML: a lone user message renders as "
          f"{text!r}, expected {user_turn!r}, optionally after a system turn.")
    template = cls(tokenizer, default_system=match.group(1))

    exchange = [{"role": "user", "content": "First question?"},
                {"role": "assistant", "content": "First answer."},
                {"role": "user", "content": "Second question?"}]
    for messages in (exchange, [{"role": "system", "content": "Probe system."}, *exchange]):
      for add_generation_prompt in (True, False):
        expected = template.render_text(messages, add_generation_prompt)
        actual = _render_jinja(source, tokenizer, messages, add_generation_prompt)
        if actual != expected:
          raise ValueError(
              "The model's chat template does not render as ChatML with default system message "
              f"{template.default_system!r}: it gives {actual!r} where ChatML gives {expected!r}.")
    return template

  def render(self, messages: Sequence[Mapping[str, str]],
             add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a whole conversation of `{"role": ..., "content": ...}` messages."""
    return self._ids(self._conversation(messages, add_generation_prompt))

  def render_text(self, messages: Sequence[Mapping[str, str]],
                  add_generation_prompt: bool = True) -> str:
    """The text `render` encodes (for logs and for checking against a Jinja template)."""
    return self._text(self._conversation(messages, add_generation_prompt))

  def message_ids(self, role: str, content: str) -> list[int]:
    """Token ids of one complete turn, `<|im_start|>{role}\n{content}<|im_end|>\n`."""
    return self._ids(self._message(role, content))

  def continuation_ids(self, role: str, content: str) -> list[int]:
    """The ids to append after a generated assistant turn that ended with `<|im_end|>`.

    That is `\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n`: the newline
    closing the assistant turn, the new turn (typically the environment's observation as
    "user"), and the prompt for the next assistant turn. A turn that stopped any other way
    (EOS, length limit) does not end in `<|im_end|>`; the rollout closes it first.
    """
    return self._ids(["\n", *self._message(role, content), *self._generation_prompt()])

  # A conversation is laid out as pieces: ints are special-token ids, strs are text segments,
  # each encoded on its own (special tokens bound pre-tokenization, so a segment never merges
  # with its neighbours). `render` and `render_text` read the same pieces.

  def _conversation(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool) -> list[int | str]:
    if isinstance(messages, (str, Mapping)) or not messages:
      raise ValueError(f"A conversation is a non-empty list of messages, got {messages!r}.")
    pieces = []
    for index, message in enumerate(messages):
      if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
        raise ValueError(
            f"Message {index} must be a mapping with exactly 'role' and 'content', "
            f"got {message!r}.")
      if index == 0 and message["role"] != "system" and self.default_system is not None:
        pieces += self._message("system", self.default_system)
      pieces += self._message(message["role"], message["content"])
    if add_generation_prompt:
      pieces += self._generation_prompt()
    return pieces

  def _message(self, role: str, content: str) -> list[int | str]:
    if not isinstance(role, str) or not role or "\n" in role or IM_START in role:
      raise ValueError(f"A role is a one-line name such as 'user', got {role!r}.")
    if not isinstance(content, str):
      raise ValueError(f"Message content must be a str, got {type(content).__name__}: {content!r}.")
    # Assistant content is encoded apart from its header, as the sampler generates it.
    body = [f"{role}\n", content] if role == "assistant" else [f"{role}\n{content}"]
    return [self.im_start_id, *body, self.im_end_id, "\n"]

  def _generation_prompt(self) -> list[int | str]:
    return [self.im_start_id, "assistant\n"]

  def _ids(self, pieces: list[int | str]) -> list[int]:
    ids = []
    for piece in pieces:
      if isinstance(piece, int):
        ids.append(piece)
      else:
        ids += self.tokenizer.encode(piece)
    return ids

  def _text(self, pieces: list[int | str]) -> str:
    return "".join(
        self.tokenizer.id_to_token(piece) if isinstance(piece, int) else piece
        for piece in pieces)


def _default_template(chat_template: Any, config_file: pathlib.Path) -> str | None:
  """`tokenizer_config.json`'s chat template: a string, or a list of named ones ("default")."""
  if chat_template is None or isinstance(chat_template, str):
    return chat_template
  named = {entry.get("name"): entry.get("template") for entry in chat_template}
  if "default" not in named:
    raise ValueError(f"{config_file} has chat templates {sorted(named)} but none named 'default'.")
  return named["default"]


def _render_jinja(source: str, tokenizer: Tokenizer, messages: list[dict[str, str]],
                  add_generation_prompt: bool) -> str:
  """Renders a model's Jinja chat template the way Hugging Face transformers does."""

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  environment.globals["raise_exception"] = raise_exception
  special_tokens = {
      f"{name}_token": tokenizer.id_to_token(token_id)
      for name, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id),
                             ("pad", tokenizer.pad_id)) if token_id is not None}
  try:
    return environment.from_string(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
  except jinja2.exceptions.TemplateError as error:
    raise ValueError(
        f"The model's chat template failed on a probe conversation: {error}") from error

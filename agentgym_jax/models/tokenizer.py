"""Tokenization and chat rendering: the one place where text becomes token ids and back.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` built either from a checkpoint directory
(`tokenizer.json` + `tokenizer_config.json`) or from the vocabulary stored in a GGUF file.
`ChatTemplate` (reached as `tokenizer.chat`, or `tokenizer.chat_template(thinking=...)`) lays out
conversations in one of two turn layouts:

    ChatML   <|im_start|>{role}\n{content}<|im_end|>\n  ...  <|im_start|>assistant\n
             (SmolLM2-Instruct, Qwen2, Qwen2.5, Qwen3)
    Llama 3  <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
             ...  <|start_header_id|>assistant<|end_header_id|>\n\n
             (Llama 3, 3.1, 3.2; content is stripped of surrounding whitespace, as their
             templates `trim` it)

A family differs in what its template writes around the turns: whether a conversation opens with
the BOS token, the system message it inserts when a conversation has none (SmolLM2's and
Qwen2.5's default; none for Qwen3), and text it puts before every system message (Llama 3.1 and
3.2: "Cutting Knowledge Date: ...\nToday Date: ...\n\n", the date as transformers renders it on
the day the template is read, so the layout is fixed for the life of the process). These are
read off the model's own Jinja template by rendering probe conversations, and the whole layout is
then checked against that template, so a model whose template fits neither layout is refused
with one line instead of being prompted in a format it was not trained on.

Multi-turn rollouts are token-in/token-out: the sampler appends its own ids to the prompt, and the
rollout appends `continuation_ids(...)` after each generated turn. Two rules make that stream equal
to `render(...)` of the finished conversation, token for token:

  * Special tokens are never produced from text. Message content is encoded with special-token
    matching off, so an environment observation or model output containing the string
    "<|im_end|>" stays plain text and cannot forge a turn boundary.
  * An assistant turn's content is encoded apart from its header, exactly as it is generated
    after the generation prompt. Every other turn's content is encoded together with the text
    of its header, one text segment between special tokens, as Hugging Face's
    `apply_chat_template` does. The two agree unless an assistant turn starts with a run of
    whitespace that a joint split would fuse with the header's newline ("\n\n\n" read as "\n\n" +
    "\n" instead of "\n" | "\n" + "\n"); the text is the same either way.

Thinking (Qwen3). With `thinking=True` (the default) the generation prompt is the plain assistant
header and the model opens its own `<think>` block; with `thinking=False` the prompt pre-fills an
empty one ("<think>\n\n</think>\n\n"), as Qwen3's template does with `enable_thinking=False`; the
template must have that switch. Either way every assistant turn of a conversation is laid out as
the policy saw and produced it: its header is the generation prompt and its content is kept
verbatim, think blocks included. Qwen3's template removes the think blocks of assistant turns
before the last user message (and the empty pre-filled one); doing so here would change tokens
the KV cache already holds, so the trained tokens of a turn are always the ones it was sampled
with, in the context it was sampled in.

Tools. `render(..., tools=[JSON schemas])` lays out the opening of a conversation (its system
message, if any, and first user message) as the model's template renders it with those tools:
Qwen2.5 and Qwen3 list them in the system turn, Llama 3.1 in the first user turn. That opening is
checked against the template on every call. A template that ignores tools (SmolLM2's) gets them
appended to the system message as plain text (`TOOLS_TEXT`).
"""

from __future__ import annotations

import dataclasses
import datetime
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
    "gpt2":
        lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm":
        lambda: pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        ]),
}


class Tokenizer:
  """Text <-> token ids for one model; `encode` never adds special tokens implicitly."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None, eos_id: int | None,
               pad_id: int | None, chat_template_source: str | None = None):
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
    self._chat_templates: dict[bool, ChatTemplate] = {}
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
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre_name]()
    backend.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([
        tokenizers.AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types) if token_type == _GGUF_CONTROL
    ])
    backend.add_tokens([
        tokenizers.AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types) if token_type == _GGUF_USER_DEFINED
    ])
    return cls(backend, bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
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
    return cls(backend, bos_id=special_id("bos_token"), eos_id=special_id("eos_token"),
               pad_id=special_id("pad_token"), chat_template_source=chat_template_source)

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
    for name, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token",
                                                                                    self.pad_id)):
      if token_id is not None:
        config[name] = self.id_to_token(token_id)
    if self.chat_template_source is not None:
      config["chat_template"] = self.chat_template_source
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

  def has_token(self, token: str) -> bool:
    return self._backend.token_to_id(token) is not None

  @property
  def chat(self) -> ChatTemplate:
    """The model's chat template with thinking on (see `chat_template`)."""
    return self.chat_template()

  def chat_template(self, *, thinking: bool = True) -> ChatTemplate:
    """The model's chat template, its layout read off and checked against the model's Jinja
    template (`ChatTemplate.from_jinja`); `thinking=False` pre-fills an empty think block."""
    if self.chat_template_source is None:
      raise ValueError("This tokenizer has no chat template (a base model?).")
    if thinking not in self._chat_templates:
      self._chat_templates[thinking] = ChatTemplate.from_jinja(self, self.chat_template_source,
                                                               thinking=thinking)
    return self._chat_templates[thinking]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a template family spells one turn; special tokens by their vocabulary spelling.

      {header_open}{role}[{header_close}]{header_text}{content}{turn_end}{after_turn}

  `trims`: whether the family's templates strip each message's content of surrounding
  whitespace (Jinja's `trim`). `also_ends`: other tokens with which the family's models may end
  a turn (Llama 3.1's `<|eom_id|>` after a tool call), where the vocabulary has them.
  """

  name: str
  header_open: str
  header_close: str | None
  header_text: str
  turn_end: str
  after_turn: str
  trims: bool
  also_ends: tuple[str, ...] = ()

  @property
  def special_tokens(self) -> tuple[str, ...]:
    return tuple(t for t in (self.header_open, self.header_close, self.turn_end) if t)


CHATML = Layout("ChatML", IM_START, None, "\n", IM_END, "\n", trims=False)
LLAMA3 = Layout("Llama 3", "<|start_header_id|>", "<|end_header_id|>", "\n\n", "<|eot_id|>", "",
                trims=True, also_ends=("<|eom_id|>",))
LAYOUTS = (CHATML, LLAMA3)

# Tools for a template that does not render them, appended to the system message (`render`).
TOOLS_TEXT = """\
# Tools

You can call the functions described by these JSON schemas, one per line:
<tools>
{schemas}
</tools>

To call one, write its name and arguments as a JSON object between <tool_call> and </tool_call>:
<tool_call>
{{"name": <function name>, "arguments": <arguments object>}}
</tool_call>"""
# Stands for message content in the probe that finds where a template puts its tools.
_PLACEHOLDER = "PROBE-CONTENT-"

Piece = Any  # An int (a special token id), a str (text) or _CUT.
# Ends a text segment: the text on either side is encoded apart (an assistant turn's content).
_CUT = object()
Message = Mapping[str, str]


class ChatTemplate:
  """Conversations as token ids, whole (`render`) or turn by turn (`continuation_ids`), in one
  of the `LAYOUTS`.

  Invariant (the rollout relies on it): for a conversation `messages` and a generated assistant
  turn whose ids are `reply_ids(reply)` (its text followed by `reply_end_id`),

      render(messages) + reply_ids(reply) + continuation_ids("user", observation)
        == render(messages + [assistant: reply, user: observation])

  and the same holds turn after turn (for Llama 3 with replies and observations that have no
  surrounding whitespace, which its templates strip).
  """

  def __init__(self, tokenizer: Tokenizer, layout: Layout = CHATML, *, bos: bool = False,
               default_system: str | None = None, system_preamble: str = "",
               generation_prefill: str = "", source: str | None = None):
    """`layout` over `tokenizer`'s vocabulary.

    Args:
      tokenizer: a tokenizer whose vocabulary has the layout's special tokens.
      layout: CHATML or LLAMA3.
      bos: whether a conversation opens with the tokenizer's BOS token.
      default_system: the system message inserted when a conversation does not start with one
        (None: insert nothing).
      system_preamble: text written before the content of a conversation's system message.
      generation_prefill: text after the assistant header in the generation prompt, and so
        in every assistant turn ("<think>\\n\\n</think>\\n\\n" with thinking off).
      source: the model's Jinja template, which `render` reads when given tools.
    """
    try:
      self.header_open_id = tokenizer.token_to_id(layout.header_open)
      self.header_close_id = (None if layout.header_close is None else tokenizer.token_to_id(
          layout.header_close))
      self.reply_end_id = tokenizer.token_to_id(layout.turn_end)
    except KeyError as error:
      raise ValueError(f"Not a {layout.name} vocabulary: {error}") from error
    if bos and tokenizer.bos_id is None:
      raise ValueError("bos=True needs a tokenizer with a BOS token")
    self.tokenizer = tokenizer
    self.layout = layout
    self.begin_ids: list[int] = [tokenizer.bos_id] if bos else []
    self.default_system = default_system
    self.system_preamble = system_preamble
    self.generation_prefill = generation_prefill
    self.source = source
    # The model may also end a turn with its EOS token or the layout's other ends; the sampler
    # stops on any of them.
    ends = [
        self.reply_end_id, tokenizer.eos_id,
        *(tokenizer.token_to_id(token) for token in layout.also_ends if tokenizer.has_token(token))
    ]
    self.turn_end_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ends if i is not None))
    self.generation_prompt_ids: list[int] = self._ids(self._generation_prompt())

  @classmethod
  def from_jinja(cls, tokenizer: Tokenizer, source: str, *, thinking: bool = True) -> ChatTemplate:
    """The layout of a model's Jinja chat template.

    The layout is the one whose turn header the template writes first (after the BOS token, if
    it writes one). What the template writes before a given system message is the preamble;
    the system message it writes before a lone user message, less the preamble, is the default.
    The template must then render probe conversations (with and without a system message, with
    and without the generation prompt) exactly as this class does, or a ValueError says where
    they differ. With `thinking=False` the generation prompt is the template's with
    `enable_thinking=False`, which must pre-fill something after the assistant header.
    """
    lone = _render_jinja(source, tokenizer, [_user("Probe question?")], False)
    bos_text = "" if tokenizer.bos_id is None else tokenizer.id_to_token(tokenizer.bos_id)
    for layout in LAYOUTS:
      if not all(tokenizer.has_token(token) for token in layout.special_tokens):
        continue
      bos = bool(bos_text) and lone.startswith(bos_text + layout.header_open)
      if lone[len(bos_text) if bos else 0:].startswith(layout.header_open):
        return cls._read(tokenizer, source, layout, bos, thinking)
    raise ValueError(
        f"The model's chat template fits none of the supported layouts "
        f"({', '.join(layout.name for layout in LAYOUTS)}): a lone user message renders as "
        f"{lone!r}.")

  @classmethod
  def _read(cls, tokenizer: Tokenizer, source: str, layout: Layout, bos: bool,
            thinking: bool) -> ChatTemplate:
    """`from_jinja` once the layout and BOS are known: reads and checks the rest."""
    draft = cls(tokenizer, layout, bos=bos, source=source)
    begin = draft._text(list(draft.begin_ids))

    def turns(messages: list[Message], what: str) -> list[tuple[str, str]]:
      text = _render_jinja(source, tokenizer, messages, False)
      parsed = draft.parse_text(text[len(begin):]) if text.startswith(begin) else None
      roles = [role for role, _ in parsed or []]
      if parsed is None or roles[-1:] != ["user"] or roles[:-1] not in ([], ["system"]):
        raise ValueError(f"The model's chat template does not render as {layout.name}: "
                         f"{what} renders as {text!r}.")
      return parsed

    lone = turns([_user("Probe question?")], "a lone user message")
    given = turns([{"role": "system", "content": "Probe system."},
                   _user("Probe question?")], "a system and a user message")
    system = given[0][1] if len(given) == 2 else ""
    if not system.endswith("Probe system."):
      raise ValueError(f"The model's chat template drops or rewrites the system message: it "
                       f"writes the system turn {system!r} for the message 'Probe system.'.")
    preamble = system[:-len("Probe system.")]
    default = lone[0][1] if len(lone) == 2 else None
    if default is not None and not default.startswith(preamble):
      raise ValueError(f"The model's chat template writes {preamble!r} before a given system "
                       f"message but its default system turn is {default!r}.")
    options = dict(bos=bos, source=source, system_preamble=preamble,
                   default_system=None if default is None else default[len(preamble):])
    template = cls(tokenizer, layout, **options)

    exchange = [
        _user("First question?"), {"role": "assistant", "content": "First answer."},
        _user("Second question?")
    ]
    for messages in (exchange, [{"role": "system", "content": "Probe system."}, *exchange]):
      for add_generation_prompt in (True, False):
        expected = template.render_text(messages, add_generation_prompt)
        actual = _render_jinja(source, tokenizer, messages, add_generation_prompt)
        if actual != expected:
          raise ValueError(
              f"The model's chat template does not render as {layout.name} with default system "
              f"message {template.default_system!r}: it gives {actual!r} where {layout.name} "
              f"gives {expected!r}.")
    if thinking:
      return template
    # Thinking off: the same layout, with what the template pre-fills after the header.
    plain = template.render_text(exchange, True)
    prompt = _render_jinja(source, tokenizer, exchange, True, enable_thinking=False)
    if not prompt.startswith(plain) or prompt == plain:
      raise ValueError(
          "thinking off needs a chat template with a thinking switch: with "
          f"enable_thinking=False this one ends the prompt {prompt[-80:]!r}, where the plain "
          f"generation prompt ends it {plain[-80:]!r}.")
    return cls(tokenizer, layout, generation_prefill=prompt[len(plain):], **options)

  def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of a whole conversation of `{"role": ..., "content": ...}` messages, with
    `tools` (JSON schemas) shown as the template shows them."""
    return self._ids(self._conversation(messages, add_generation_prompt, tools))

  def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The text `render` encodes (for logs and for checking against a Jinja template)."""
    return self._text(self._conversation(messages, add_generation_prompt, tools))

  def message_ids(self, role: str, content: str) -> list[int]:
    """Token ids of one complete turn (without the BOS or a system preamble)."""
    return self._ids(self._message(role, content))

  def reply_ids(self, content: str) -> list[int]:
    """An assistant turn's ids after the generation prompt: its content, then `reply_end_id`.

    This is what the sampler generates for that reply, when it ends the turn itself."""
    return self._ids([self._content(content), self.reply_end_id])

  def reply_text(self, generated: Sequence[int]) -> str:
    """A generated turn's text: its ids but the turn ends, decoded without special tokens."""
    return self.tokenizer.decode([t for t in generated if t not in self.turn_end_ids],
                                 skip_special_tokens=True)

  def closing_ids(self, generated: Sequence[int]) -> list[int]:
    """What closes a generated turn: nothing if it ended with `reply_end_id`; else (EOS, another
    of `turn_end_ids`, the length limit) `reply_end_id`."""
    return [] if list(generated[-1:]) == [self.reply_end_id] else [self.reply_end_id]

  def continuation_ids(self, role: str, content: str) -> list[int]:
    """The ids to append after a generated assistant turn that ended with `reply_end_id`.

    That is the rest of the assistant turn (ChatML: "\\n"), the new turn (typically the
    environment's observation as "user"), and the prompt for the next assistant turn. A turn
    that stopped any other way (EOS, length limit) is closed first (`closing_ids`).
    """
    return self._ids(
        [self.layout.after_turn, *self._message(role, content), *self._generation_prompt()])

  def parse_text(self, text: str) -> list[tuple[str, str]] | None:
    """The (role, content) turns of text written in this layout (without the BOS), or None
    if it is not. Content is read up to the next turn end, so it must not contain one."""
    layout, turns, position = self.layout, [], 0
    while position < len(text):
      if not text.startswith(layout.header_open, position):
        return None
      position += len(layout.header_open)
      role_end = text.find(layout.header_close or layout.header_text, position)
      if role_end < 0:
        return None
      role, position = text[position:role_end], role_end
      if layout.header_close is not None:
        position += len(layout.header_close)
      if not text.startswith(layout.header_text, position):
        return None
      position += len(layout.header_text)
      content_end = text.find(layout.turn_end, position)
      if content_end < 0:
        return None
      turns.append((role, text[position:content_end]))
      position = content_end + len(layout.turn_end)
      if not text.startswith(layout.after_turn, position):
        return None
      position += len(layout.after_turn)
    return turns

  # A conversation is laid out as pieces: ints are special-token ids, strs are text, and runs
  # of text are encoded as one segment up to a special token or _CUT (special tokens bound
  # pre-tokenization, so a segment never merges with its neighbours). `render` and
  # `render_text` read the same pieces.

  def _conversation(self, messages: Sequence[Message], add_generation_prompt: bool,
                    tools: Sequence[Mapping[str, Any]] | None) -> list[Piece]:
    if isinstance(messages, (str, Mapping)) or not messages:
      raise ValueError(f"A conversation is a non-empty list of messages, got {messages!r}.")
    for index, message in enumerate(messages):
      if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
        raise ValueError(f"Message {index} must be a mapping with exactly 'role' and 'content', "
                         f"got {message!r}.")
    pieces, rest = list(self.begin_ids), list(messages)
    if tools:
      opening, rest = _split_opening(rest)
      pieces += self._opening_with_tools(opening, tools)
    elif rest[0]["role"] == "system":
      pieces += self._system(rest.pop(0)["content"])
    elif self.default_system is not None:
      pieces += self._system(self.default_system)
    for message in rest:
      pieces += self._message(message["role"], message["content"])
    if add_generation_prompt:
      pieces += self._generation_prompt()
    return pieces

  def _opening_with_tools(self, opening: list[Message],
                          tools: Sequence[Mapping[str, Any]]) -> list[Piece]:
    """The system message (if any) and first user message with `tools`, as the template
    writes them: the template is rendered with placeholder contents to find the turns and
    where each message's content goes, then checked with the real contents."""
    tools = [dict(tool) for tool in tools]
    if self.source is None:
      raise ValueError("This chat template was not read from a Jinja template; it cannot "
                       "render tools.")
    probe = [{"role": message["role"], "content": f"{_PLACEHOLDER}{index}"}
             for index, message in enumerate(opening)]
    text = _render_jinja(self.source, self.tokenizer, probe, False, tools=tools)
    if text == _render_jinja(self.source, self.tokenizer, probe, False):
      return self._opening_with_tools_text(opening, tools)
    begin = self._text(list(self.begin_ids))
    turns = self.parse_text(text[len(begin):]) if text.startswith(begin) else None
    if turns is None:
      raise ValueError(f"The model's chat template does not render tools in the "
                       f"{self.layout.name} layout: {text!r}.")
    contents = {
        f"{_PLACEHOLDER}{index}": self._content(message["content"])
        for index, message in enumerate(opening)
    }
    pieces = []
    for role, content in turns:
      parts = re.split(f"({re.escape(_PLACEHOLDER)}[0-9]+)", content)
      pieces += self._turn(role, "".join(contents.get(part, part) for part in parts))
    expected = _render_jinja(self.source, self.tokenizer, opening, False, tools=tools)
    if begin + self._text(pieces) != expected:
      raise ValueError(f"The model's chat template renders this opening with tools as "
                       f"{expected!r}, not as {begin + self._text(pieces)!r}.")
    return pieces

  def _opening_with_tools_text(self, opening: list[Message],
                               tools: Sequence[Mapping[str, Any]]) -> list[Piece]:
    system = opening[0]["content"] if opening[0]["role"] == "system" else self.default_system
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    tools_text = TOOLS_TEXT.format(schemas=schemas)
    pieces = self._system(f"{system}\n\n{tools_text}" if system else tools_text)
    return pieces + self._message(opening[-1]["role"], opening[-1]["content"])

  def _system(self, content: str) -> list[Piece]:
    """The conversation's opening system turn: the preamble, then the message."""
    return self._turn("system", self.system_preamble + self._content(content))

  def _message(self, role: str, content: str) -> list[Piece]:
    if not isinstance(role, str) or not role or "\n" in role or self.layout.header_open in role:
      raise ValueError(f"A role is a one-line name such as 'user', got {role!r}.")
    if role == "assistant":  # Encoded apart from its header, as the sampler generates it.
      return [
          *self._generation_prompt(), _CUT,
          self._content(content), self.reply_end_id, self.layout.after_turn
      ]
    return self._turn(role, self._content(content))

  def _turn(self, role: str, content: str) -> list[Piece]:
    """A turn whose content is written as given (already trimmed where the layout trims)."""
    return [*self._header(role), content, self.reply_end_id, self.layout.after_turn]

  def _header(self, role: str) -> list[Piece]:
    close = [] if self.header_close_id is None else [self.header_close_id]
    return [self.header_open_id, role, *close, self.layout.header_text]

  def _generation_prompt(self) -> list[Piece]:
    return [*self._header("assistant"), self.generation_prefill]

  def _content(self, content: str) -> str:
    if not isinstance(content, str):
      raise ValueError(f"Message content must be a str, got {type(content).__name__}: {content!r}.")
    return content.strip() if self.layout.trims else content

  def _ids(self, pieces: list[Piece]) -> list[int]:
    ids, text = [], ""
    for piece in [*pieces, _CUT]:
      if isinstance(piece, str):
        text += piece
        continue
      if text:
        ids += self.tokenizer.encode(text)
        text = ""
      if isinstance(piece, int):
        ids.append(piece)
    return ids

  def _text(self, pieces: list[Piece]) -> str:
    return "".join(
        self.tokenizer.id_to_token(piece) if isinstance(piece, int) else piece for piece in pieces
        if piece is not _CUT)


def _user(content: str) -> dict[str, str]:
  return {"role": "user", "content": content}


def _split_opening(messages: list[Message]) -> tuple[list[Message], list[Message]]:
  """(the system message, if any, and the first user message; the rest)."""
  first = 1 if messages[0]["role"] == "system" else 0
  if len(messages) <= first or messages[first]["role"] != "user":
    raise ValueError("Tools are shown with the first user message; this conversation has "
                     f"roles {[message['role'] for message in messages]}.")
  return messages[:first + 1], messages[first + 1:]


def _default_template(chat_template: Any, config_file: pathlib.Path) -> str | None:
  """`tokenizer_config.json`'s chat template: a string, or a list of named ones ("default")."""
  if chat_template is None or isinstance(chat_template, str):
    return chat_template
  named = {entry.get("name"): entry.get("template") for entry in chat_template}
  if "default" not in named:
    raise ValueError(f"{config_file} has chat templates {sorted(named)} but none named 'default'.")
  return named["default"]


def _render_jinja(source: str, tokenizer: Tokenizer, messages: list[Message],
                  add_generation_prompt: bool, *, tools: list[dict[str, Any]] | None = None,
                  **options: Any) -> str:
  """Renders a model's Jinja chat template the way Hugging Face transformers does, with the
  template variables messages, tools, add_generation_prompt, the special tokens and `options`
  (enable_thinking)."""
  special_tokens = {
      f"{name}_token": tokenizer.id_to_token(token_id)
      for name, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id),
                             ("pad", tokenizer.pad_id)) if token_id is not None
  }
  try:
    return _compile_jinja(source).render(messages=[dict(message) for message in messages],
                                         tools=tools, add_generation_prompt=add_generation_prompt,
                                         **special_tokens, **options)
  except jinja2.exceptions.TemplateError as error:
    raise ValueError(f"The model's chat template failed to render: {error}") from error


@functools.lru_cache(maxsize=8)
def _compile_jinja(source: str) -> jinja2.Template:
  """A chat template compiled as transformers compiles it: its `tojson` (plain json.dumps, keys
  in order), `strftime_now` (today's date) and `raise_exception`."""

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                             extensions=[jinja2.ext.loopcontrols])
  environment.filters["tojson"] = tojson
  environment.globals["raise_exception"] = raise_exception
  environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
  try:
    return environment.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as error:
    raise ValueError(f"The model's chat template is not valid Jinja: {error}") from error

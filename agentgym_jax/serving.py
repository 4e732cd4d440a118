"""An OpenAI-compatible chat completions server for a policy: concurrent requests decoded together
on one jitted `Sampler`.

    with PolicyServer(model, tokenizer, model_name="smollm2-135m-instruct") as server:
      client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
      completion = client.chat.completions.create(model="smollm2-135m-instruct",
                                                  messages=[{"role": "user", "content": "Hi"}])

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions, GET /health (rows
in use, requests waiting).

Prompts. A request's messages are laid out by the model's own chat template
(`ChatTemplate.render`; its `tools` shown as the template shows tools). OpenAI's message shapes
become the template's {role, content} turns (`template_messages`): "developer" is the system
role; text content parts are joined by newlines; an assistant message's `tool_calls` are written
after its content as the replies this project's tool_call format samples ("<tool_call>\\n{"name":
..., "arguments": {...}}\\n</tool_call>", environments/base.py); `tool` results become what the
family's template makes of them: in ChatML (SmolLM2, Qwen) one user turn per run of results, each
in <tool_response> tags, and in Llama 3 an "ipython" turn each.

Sampling. temperature (0: greedy), top_p, top_k (an extension: `extra_body={"top_k": 40}`),
max_tokens (or max_completion_tokens; by default the rest of the context), stop strings, seed
and n. A prompt whose length plus max_tokens exceeds `max_context` is refused (400,
context_length_exceeded). With a seed, a request's replies are reproducible whatever else the
server decodes at the time: choice i's t-th token draws from a key of (seed, i, t) and a row's
tokens depend only on its own tokens and key (`Sampler`).

Batching. One scheduler thread owns the sampler and its state, a KV cache of `max_batch` rows of
`max_context` tokens. Each choice of a request takes a free row (a finished row is released, a
new prompt appended: `Sampler.release`, `Sampler.append`); choices beyond the rows wait in a
queue, and every decode call, `chunk_tokens` tokens long, runs every live row at once. Between
two calls the scheduler admits waiting choices, streams the new text, and frees finished rows,
so requests join and leave the batch as they come and go. The sampling settings are compile-time
constants of the sampler: live rows whose requests differ in temperature, top_p or top_k are
decoded by one call per setting, and every new setting compiles a decode program once.
`batch_window_s` lets the first request to reach an idle server wait that long for others (until
the rows are full), so that a burst of requests starts in one prefill and one decode batch.

Streaming (`stream=true`) answers with server-sent events: `data: {chat.completion.chunk}` lines,
then `data: [DONE]`; each decode call's new text is one chunk, and with
`stream_options.include_usage` a last chunk carries the usage. The streamed deltas add up to the
content of the same request unstreamed: text that may still become part of a stop string, an
incomplete UTF-8 character, or (with tools) the start of a tool call is held back until it is
settled.

Tool calls. When a request has tools (and tool_choice is not "none"), a reply that ends its turn
holding one or more well-formed <tool_call>{json}</tool_call> blocks, or that is one bare
{"name": ..., "parameters": {...}} object naming a requested tool (Llama 3.1's format), is
returned as `message.tool_calls` (finish_reason "tool_calls"), the text before the first call as
its content (`parse_tool_calls`). A reply with a malformed call is returned as text, so the
client sees what the model wrote.

Errors are OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for a request that
is not valid JSON or breaks the API's types and ranges, an unknown argument, an unsupported
feature (log-probs, penalties, images, a forced tool choice, ...); 404 an unknown model or
route; 413 a body over `max_body_bytes`; 429 a full queue. Nothing a client sends gets a 5xx (a
503 answers only the requests in flight at shutdown). A client that goes away, mid-stream or
while its completion is decoded, frees its rows at the next decode call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hmac
import json
import queue
import re
import secrets
import select
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

import agentgym_jax
from agentgym_jax.models.decoder import Decoder
from agentgym_jax.models.tokenizer import ChatTemplate, Tokenizer
from agentgym_jax.sampling import Sampler, SamplingParams
from environments.http import httpd

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_STOPS = 16
MAX_N = 128
MAX_TOOLS = 128
# How long a waiting request thread sleeps between two checks that its client is still there.
_POLL_S = 0.25
# At shutdown, how long answers being written (the 503s of requests in flight) may take before
# the connections are dropped.
_SHUTDOWN_GRACE_S = 2.0


class RequestError(Exception):
  """An error answer in OpenAI's shape: HTTP status, message, and the error's type, param, code."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status = status
    self.message = message
    self.param = param
    self.code = code
    self.kind = kind

  def body(self) -> dict[str, Any]:
    return {
        "error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code
        }
    }


def _bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
  return RequestError(400, message, param=param, code=code)


# Requests.


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A validated chat completion request: the prompt's ids and how to sample the replies."""

  prompt: list[int]
  sampling: SamplingParams
  max_tokens: int
  n: int
  seed: int  # in [0, 2^64)
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  tool_names: frozenset[str] | None  # The tools a reply may call; None: replies are text.


# Arguments read; the accepted-and-ignored ones change nothing a local policy does.
_ARGUMENTS = frozenset({
    "model", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
    "n", "seed", "stop", "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls",
    "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "logit_bias",
    "response_format", "user", "metadata", "store", "service_tier"
})
_JSON_KINDS = {
    str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
    dict: "an object"
}


def _typed(value: Any, kind: type, param: str) -> Any:
  """`value` checked to be JSON of `kind` (float admits integers; bool is no number)."""
  kinds = (int, float) if kind is float else kind
  if not isinstance(value, kinds) or (kind is not bool and isinstance(value, bool)):
    raise _bad(f"{param} must be {_JSON_KINDS[kind]}, got {_shown(value)}", param)
  return value


def _shown(value: Any) -> str:
  text = json.dumps(value, ensure_ascii=False)
  return text if len(text) <= 80 else text[:77] + "..."


def chat_request(payload: Any, *, model_name: str, chat: ChatTemplate,
                 max_context: int) -> CompletionRequest:
  """Validates a /v1/chat/completions body and renders its prompt; RequestError if invalid."""
  if not isinstance(payload, dict):
    raise _bad(f"the request body must be a JSON object, got {_shown(payload)}")
  unknown = sorted(set(payload) - _ARGUMENTS)
  if unknown:
    raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0],
               "unknown_parameter")
  args = {key: value for key, value in payload.items() if value is not None}
  if "model" not in args:
    raise _bad("you must provide a model parameter", "model", "missing_required_parameter")
  if _typed(args["model"], str, "model") != model_name:
    raise RequestError(
        404, f"The model {args['model']!r} does not exist; this server serves "
        f"{model_name!r}", param="model", code="model_not_found")
  _check_neutral(args)
  tools, tool_names = _tools(args)
  stream = _typed(args.get("stream", False), bool, "stream")
  include_usage = False
  if "stream_options" in args:
    if not stream:
      raise _bad("stream_options can only be set when stream is true", "stream_options")
    options = _typed(args["stream_options"], dict, "stream_options")
    extra = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if extra:
      raise _bad(f"stream_options has no field {extra[0]!r}", f"stream_options.{extra[0]}")
    include_usage = _typed(options.get("include_usage", False), bool,
                           "stream_options.include_usage")
  sampling = _sampling(args)
  n = _typed(args.get("n", 1), int, "n")
  if not 1 <= n <= MAX_N:
    raise _bad(f"n must be in [1, {MAX_N}], got {n}", "n")
  seed = _typed(args["seed"], int, "seed") if "seed" in args else secrets.randbits(64)
  stop = args.get("stop", [])
  stop = [stop] if isinstance(stop, str) else _typed(stop, list, "stop")
  if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
    raise _bad(
        f"stop must be a non-empty string or up to {MAX_STOPS} of them, got "
        f"{_shown(args['stop'])}", "stop")
  if "messages" not in args:
    raise _bad("you must provide messages", "messages", "missing_required_parameter")
  messages = template_messages(_typed(args["messages"], list, "messages"), chat.layout.name)
  try:
    prompt = chat.render(messages, tools=tools)
  except ValueError as error:  # The template's own limits (e.g. tools need a first user turn).
    raise _bad(str(error), "messages") from None
  max_tokens = _max_tokens(args, len(prompt), max_context)
  return CompletionRequest(prompt=prompt, sampling=sampling, max_tokens=max_tokens, n=n,
                           seed=seed % (1 << 64), stop=tuple(dict.fromkeys(stop)), stream=stream,
                           include_usage=include_usage, tool_names=tool_names)


def _check_neutral(args: Mapping[str, Any]) -> None:
  """Arguments this server takes only at their neutral values (it has no penalties, biases,
  log-probs or structured output)."""
  for param in ("frequency_penalty", "presence_penalty"):
    if _typed(args.get(param, 0), float, param) != 0:
      raise _bad(f"{param} is not supported by this server (only 0)", param, "unsupported_value")
  logprobs = _typed(args.get("logprobs", False), bool, "logprobs")
  if logprobs or _typed(args.get("top_logprobs", 0), int, "top_logprobs"):
    raise _bad("logprobs are not supported by this server", "logprobs", "unsupported_value")
  if _typed(args.get("logit_bias", {}), dict, "logit_bias"):
    raise _bad("logit_bias is not supported by this server", "logit_bias", "unsupported_value")
  response_format = _typed(args.get("response_format", {"type": "text"}), dict, "response_format")
  if response_format.get("type") != "text":
    raise _bad("response_format other than {\"type\": \"text\"} is not supported by this server",
               "response_format", "unsupported_value")
  for param, kind in (("parallel_tool_calls", bool), ("user", str), ("metadata", dict),
                      ("store", bool), ("service_tier", str)):
    if param in args:
      _typed(args[param], kind, param)


def _sampling(args: Mapping[str, Any]) -> SamplingParams:
  temperature = _typed(args.get("temperature", 1.0), float, "temperature")
  if not 0 <= temperature <= 2:
    raise _bad(f"temperature must be in [0, 2], got {temperature}", "temperature")
  top_p = _typed(args.get("top_p", 1.0), float, "top_p")
  if not 0 < top_p <= 1:
    raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
  top_k = _typed(args.get("top_k", 0), int, "top_k")
  if top_k < 0:
    raise _bad(f"top_k must be >= 0 (0: off), got {top_k}", "top_k")
  if temperature == 0:  # Greedy: one compiled setting, whatever top_p and top_k say.
    return SamplingParams(0.0)
  return SamplingParams(float(temperature), float(top_p), top_k)


def _max_tokens(args: Mapping[str, Any], prompt_tokens: int, max_context: int) -> int:
  values = {
      param: _typed(args[param], int, param) for param in ("max_tokens", "max_completion_tokens")
      if param in args
  }
  if len(set(values.values())) > 1:
    raise _bad("max_tokens and max_completion_tokens differ; give one", "max_tokens")
  room = max_context - prompt_tokens
  if not values:
    if room < 1:
      raise _bad(
          f"the prompt is {prompt_tokens} tokens, and this server's context holds "
          f"{max_context}: no room for a reply", "messages", "context_length_exceeded")
    return room
  param, max_tokens = next(iter(values.items()))
  if max_tokens < 1:
    raise _bad(f"{param} must be >= 1, got {max_tokens}", param)
  if max_tokens > room:
    raise _bad(
        f"the prompt ({prompt_tokens} tokens) and {param}={max_tokens} exceed this "
        f"server's context of {max_context} tokens", param, "context_length_exceeded")
  return max_tokens


def _tools(args: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, frozenset[str] | None]:
  """(the tools to show in the prompt, the names a reply may call), both None without tools or
  with tool_choice "none"."""
  choice = args.get("tool_choice", "auto")
  if choice not in ("auto", "none"):
    kind = "a named tool" if isinstance(choice, dict) else _shown(choice)
    raise _bad(
        f"tool_choice {kind} is not supported by this server: it cannot force a call "
        "(use \"auto\" or \"none\")", "tool_choice", "unsupported_value")
  if "tools" not in args:
    return None, None
  tools = _typed(args["tools"], list, "tools")
  if not 1 <= len(tools) <= MAX_TOOLS:
    raise _bad(f"tools must hold 1 to {MAX_TOOLS} tools, got {len(tools)}", "tools")
  names = [_tool_name(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
  if len(set(names)) < len(names):
    raise _bad(f"tools names a function twice: {names}", "tools")
  if choice == "none":
    return None, None
  return [dict(tool) for tool in tools], frozenset(names)


def _tool_name(tool: Any, param: str) -> str:
  """A function tool's name, its schema checked: {"type": "function", "function": {"name",
  "description"?, "parameters"? (a JSON schema of an object), "strict"?}}."""
  _typed(tool, dict, param)
  if tool.get("type") != "function" or set(tool) - {"type", "function"}:
    raise _bad(
        f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}, got "
        f"{_shown(tool)}", param)
  function = _typed(tool.get("function"), dict, f"{param}.function")
  extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
  if extra:
    raise _bad(f"{param}.function has no field {extra[0]!r}", f"{param}.function.{extra[0]}")
  name = _typed(function.get("name"), str, f"{param}.function.name")
  if not _FUNCTION_NAME.fullmatch(name):
    raise _bad(f"{param}.function.name must be 1-64 letters, digits, _ or -, got {_shown(name)}",
               f"{param}.function.name")
  if "description" in function:
    _typed(function["description"], str, f"{param}.function.description")
  if "strict" in function:
    _typed(function["strict"], bool, f"{param}.function.strict")
  if "parameters" in function:
    _check_parameters(function["parameters"], f"{param}.function.parameters")
  return name


def _check_parameters(schema: Any, param: str) -> None:
  """A function's parameters: a JSON schema of an object, whose properties are schemas and whose
  required names are properties."""
  _typed(schema, dict, param)
  if schema.get("type", "object") != "object":
    raise _bad(
        f"{param} must be a JSON schema of type \"object\", got type "
        f"{_shown(schema.get('type'))}", param)
  properties = _typed(schema.get("properties", {}), dict, f"{param}.properties")
  for key, value in properties.items():
    _typed(value, dict, f"{param}.properties.{key}")
  required = _typed(schema.get("required", []), list, f"{param}.required")
  missing = [name for name in required if not isinstance(name, str) or name not in properties]
  if missing:
    raise _bad(f"{param}.required names {_shown(missing[0])}, which is not a property",
               f"{param}.required")


# Messages.

_MESSAGE_FIELDS = {
    "system": {"content", "name"},
    "developer": {"content", "name"},
    "user": {"content", "name"},
    "assistant": {"content", "name", "tool_calls", "refusal"},
    "tool": {"content", "tool_call_id"},
}
# The role a layout's templates give tool results (see the module docstring).
_TOOL_RESULT_ROLES = {"ChatML": "user", "Llama 3": "ipython"}


def template_messages(messages: Sequence[Any], layout: str = "ChatML") -> list[dict[str, str]]:
  """OpenAI chat messages as the chat template's {role, content} turns (module docstring), for a
  template of `layout` (ChatTemplate.layout.name); RequestError for a malformed message."""
  if not messages:
    raise _bad("messages must hold at least one message", "messages")
  turns: list[dict[str, str]] = []
  tool_results: list[str] = []
  tool_role = _TOOL_RESULT_ROLES.get(layout, "user")

  def flush_tool_results():
    if tool_results:
      wrapped = (f"<tool_response>\n{result}\n</tool_response>" for result in tool_results)
      turns.append({"role": tool_role, "content": "\n".join(wrapped)})
      tool_results.clear()

  for index, message in enumerate(messages):
    param = f"messages[{index}]"
    _typed(message, dict, param)
    role = message.get("role")
    if not isinstance(role, str) or role not in _MESSAGE_FIELDS:
      raise _bad(f"{param}.role must be one of {', '.join(_MESSAGE_FIELDS)}, got {_shown(role)}",
                 f"{param}.role")
    given = {key for key, value in message.items() if value is not None}  # null: absent
    extra = sorted(given - _MESSAGE_FIELDS[role] - {"role"})
    if extra:
      raise _bad(f"{param} ({role}) has no field {extra[0]!r}", f"{param}.{extra[0]}")
    if "name" in given:
      _typed(message["name"], str, f"{param}.name")
    content = _content(message.get("content"), f"{param}.content", role)
    if role == "tool":
      _typed(message.get("tool_call_id"), str, f"{param}.tool_call_id")
      if tool_role == "user":  # ChatML: consecutive results share one user turn.
        tool_results.append(content)
      else:
        turns.append({"role": tool_role, "content": content})
      continue
    flush_tool_results()
    if role == "assistant":
      calls = message.get("tool_calls") or []
      blocks = [
          _call_block(call, f"{param}.tool_calls[{i}]")
          for i, call in enumerate(_typed(calls, list, f"{param}.tool_calls"))
      ]
      if blocks:
        content = "\n\n".join(filter(None, (content, "\n".join(blocks))))
    turns.append({"role": "system" if role == "developer" else role, "content": content})
  flush_tool_results()
  return turns


def _content(content: Any, param: str, role: str) -> str:
  """A message's text: a string, or text parts joined by newlines (an assistant's refusal parts
  too); null only for an assistant (one that only calls tools)."""
  if content is None:
    if role != "assistant":
      raise _bad(f"{param} is required for a {role} message", param)
    return ""
  if isinstance(content, str):
    return content
  parts = _typed(content, list, param)
  texts = []
  for index, part in enumerate(parts):
    _typed(part, dict, f"{param}[{index}]")
    kind = part.get("type")
    if kind not in (("text", "refusal") if role == "assistant" else ("text",)):
      raise _bad(f"{param}[{index}] has type {_shown(kind)}; this server reads text parts only",
                 f"{param}[{index}].type")
    texts.append(_typed(part.get(kind), str, f"{param}[{index}].{kind}"))
  return "\n".join(texts)


def _call_block(call: Any, param: str) -> str:
  """An assistant message's tool call as the block a reply writes for it."""
  _typed(call, dict, param)
  if call.get("type", "function") != "function":
    raise _bad(f"{param}.type must be \"function\", got {_shown(call.get('type'))}", param)
  _typed(call.get("id", ""), str, f"{param}.id")
  function = _typed(call.get("function"), dict, f"{param}.function")
  name = _typed(function.get("name"), str, f"{param}.function.name")
  arguments = _typed(function.get("arguments", "{}"), str, f"{param}.function.arguments")
  try:
    parsed = json.loads(arguments)
  except (ValueError, RecursionError):
    parsed = None
  if not isinstance(parsed, dict):
    raise _bad(
        f"{param}.function.arguments must be a JSON object's text, got "
        f"{_shown(arguments)}", f"{param}.function.arguments")
  return tool_call_block(name, parsed)


def tool_call_block(name: str, arguments: Mapping[str, Any]) -> str:
  """One call as replies write it: a <tool_call> block holding {"name", "arguments"}."""
  call = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
  return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


# Replies.


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A call read from a reply: the function's name and its arguments as JSON text."""

  name: str
  arguments: str


def parse_tool_calls(text: str, tool_names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
  """(content, calls) of a reply: its <tool_call> blocks, or its one bare JSON call naming one of
  `tool_names`, as calls, and the text before the first call (trailing whitespace dropped; None
  if empty) as content. A reply without calls, or with a block that is not a JSON object with a
  string "name" and object "arguments" (or "parameters"), or an unclosed <tool_call>, is text:
  (text, [])."""
  blocks = _TOOL_CALL_BLOCK.findall(text)
  if blocks:
    if TOOL_CALL_OPEN in _TOOL_CALL_BLOCK.sub("", text):  # A block left open.
      return text, []
    calls = [_read_call(block) for block in blocks]
    if None in calls:
      return text, []
    content = text[:text.index(TOOL_CALL_OPEN)].rstrip()
    return content or None, calls
  if TOOL_CALL_OPEN not in text and text.strip().startswith("{"):
    call = _read_call(text)
    if call is not None and call.name in tool_names:
      return None, [call]
  return text, []


def _read_call(text: str) -> ToolCall | None:
  try:
    call = json.loads(text)
  except (ValueError, RecursionError):
    return None
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    return None
  arguments = call.get("arguments", call.get("parameters", {}))
  if not isinstance(arguments, dict):
    return None
  return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class Reply:
  """One choice's reply as its tokens arrive: its ids and text, the text it may stream, and how
  it finished.

  Each `extend` takes the tokens of a decode call and returns the new text a stream may send. The
  reply ends on a turn-end id ("stop"; the id counts as a completion token but is not text), a
  stop string ("stop"; the text ends before it and the tokens with the one that completed it),
  its token budget or a full cache ("length"). A reply that stopped holding tool calls (when
  `tool_names` is given) finishes "tool_calls". The streamed text is always a prefix of the final
  content, so a stream's deltas add up to it.
  """

  def __init__(self, decode: Callable[[list[int]], str], *, end_ids: Sequence[int], max_tokens: int,
               stop: Sequence[str] = (), tool_names: frozenset[str] | None = None):
    self._decode = decode
    self._end_ids = frozenset(end_ids)
    self._stop = tuple(stop)
    self.max_tokens = max_tokens
    self.tool_names = tool_names
    self.ids: list[int] = []
    self.text = ""
    self.streamed = ""
    self.finish_reason: str | None = None
    self.content: str | None = None
    self.tool_calls: list[ToolCall] = []

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  def extend(self, new_ids: Sequence[int], *, cache_full: bool = False) -> str:
    """Adds a decode call's tokens; returns the text newly safe to stream."""
    if self.finished:
      raise ValueError("the reply has finished")
    before = len(self.ids)
    for token in list(new_ids)[:self.max_tokens - before]:
      self.ids.append(int(token))
      if token in self._end_ids:
        self.finish_reason = "stop"
        break
    else:
      if len(self.ids) >= self.max_tokens or cache_full:
        self.finish_reason = "length"
    text = self._text(self.ids)
    if self._stop:
      text = self._cut_at_stop(text, before)
    self.text = text
    if self.finished:
      self._settle()
      visible = self.content or ""
    else:
      visible = self._streamable(text)
    delta = visible[len(self.streamed):] if visible.startswith(self.streamed) else ""
    self.streamed += delta
    return delta

  def _text(self, ids: Sequence[int]) -> str:
    return self._decode([token for token in ids if token not in self._end_ids])

  def _cut_at_stop(self, text: str, before: int) -> str:
    """The text up to the first stop string, if one appeared; then the ids end with the token
    that completed it."""
    start = max(0, len(self.text) - max(map(len, self._stop)))
    found = [p for p in (text.find(stop, start) for stop in self._stop) if p >= 0]
    if not found:
      return text
    position = min(found)
    for count in range(before + 1, len(self.ids) + 1):
      partial = self._text(self.ids[:count])
      if any(partial.find(stop, start) == position for stop in self._stop):
        del self.ids[count:]
        break
    self.finish_reason = "stop"
    return text[:position]

  def _settle(self) -> None:
    self.content = self.text
    if self.tool_names is not None and self.finish_reason == "stop":
      content, calls = parse_tool_calls(self.text, self.tool_names)
      if calls:
        self.content, self.tool_calls, self.finish_reason = content, calls, "tool_calls"

  def _streamable(self, text: str) -> str:
    """The part of an unfinished reply's text that no later token can take back."""
    text = text.rstrip("\ufffd")  # An incomplete UTF-8 character.
    held = max((_overlap(text, stop) for stop in self._stop), default=0)
    text = text[:len(text) - held]
    if self.tool_names is None:
      return text
    if text.lstrip().startswith("{"):  # Perhaps a bare JSON call: settled at the end.
      return ""
    start = text.find(TOOL_CALL_OPEN)
    text = text[:start] if start >= 0 else text[:len(text) - _overlap(text, TOOL_CALL_OPEN)]
    return text.rstrip()


def _overlap(text: str, marker: str) -> int:
  """The length of the longest end of `text` that begins `marker` (shorter than it)."""
  for size in range(min(len(text), len(marker) - 1), 0, -1):
    if marker.startswith(text[-size:]):
      return size
  return 0


# The scheduler.


@dataclasses.dataclass(eq=False)
class _Event:
  """What a request's thread hears from the scheduler about one choice."""

  index: int
  text: str = ""
  reply: Reply | None = None  # Set when the choice finished.
  error: RequestError | None = None


@dataclasses.dataclass(eq=False)
class _Request:
  """A request in flight: its parameters, its choices' events, and whether its client left."""

  params: CompletionRequest
  events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
  cancelled: bool = False
  client_checked: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(eq=False)
class _Choice:
  """One choice of a request: the row it decodes on and its reply so far."""

  request: _Request
  index: int
  reply: Reply
  row: int = -1
  sampled: int = 0  # Tokens sampled so far: the draw offset of the next decode call.


@jax.jit
def _row_keys(seeds: jax.Array, choices: jax.Array) -> jax.Array:
  """[B] PRNG keys: row b draws for choice choices[b] of a request seeded seeds[b] ([B, 2]
  uint32: the seed's low and high words); its k-th token with fold_in(key, k)."""

  def key(seed, choice):
    base = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    return jax.random.fold_in(base, choice)

  return jax.vmap(key)(seeds, choices)


class _Scheduler:
  """Owns the sampler's state: admits queued choices to free rows, decodes every live row in
  chunks of `chunk_tokens`, and reports each choice's text to its request (module docstring)."""

  def __init__(self, sampler: Sampler, chat: ChatTemplate, *, chunk_tokens: int,
               batch_window_s: float, max_queue: int):
    self.sampler = sampler
    self.chat = chat
    self.chunk_tokens = chunk_tokens
    self.batch_window_s = batch_window_s
    self.max_queue = max_queue
    self._state = sampler.empty()
    self.cache_bytes = sum(x.nbytes for x in jax.tree.leaves(self._state))
    self._lengths = np.zeros(sampler.max_batch, np.int32)  # Tokens each row holds.
    self._live: dict[int, _Choice] = {}  # row -> its choice
    self._pending: collections.deque[_Choice] = collections.deque()
    self._cond = threading.Condition()
    self._stopping = False
    self._thread = threading.Thread(target=self._run, name="policy-scheduler", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    """Stops after the current decode call; every request still waiting or decoding gets 503."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread.is_alive():
      self._thread.join()
    gone = RequestError(503, "the server is shutting down", kind="server_error")
    with self._cond:
      choices = [*self._pending, *self._live.values()]
      self._pending.clear()
      self._live.clear()
    for choice in choices:
      choice.request.events.put(_Event(choice.index, error=gone))

  def submit(self, request: _Request) -> None:
    """Queues the request's choices; 429 if the queue is full."""
    params, decode = request.params, self._decode
    choices = [
        _Choice(
            request, index,
            Reply(decode, end_ids=self.chat.turn_end_ids, max_tokens=params.max_tokens,
                  stop=params.stop, tool_names=params.tool_names)) for index in range(params.n)
    ]
    with self._cond:
      if self._stopping:
        raise RequestError(503, "the server is shutting down", kind="server_error")
      if len(self._pending) + len(choices) > self.max_queue:
        raise RequestError(
            429, f"the server's queue is full ({len(self._pending)} choices wait for "
            f"{self.sampler.max_batch} rows); retry later", code="queue_full",
            kind="rate_limit_error")
      self._pending.extend(choices)
      self._cond.notify_all()

  def cancel(self, request: _Request) -> None:
    """Drops the request's choices: queued ones now, live ones' rows at the next decode call."""
    with self._cond:
      request.cancelled = True
      self._pending = collections.deque(c for c in self._pending if c.request is not request)
      self._cond.notify_all()

  def load(self) -> dict[str, int]:
    with self._cond:
      return {"rows": self.sampler.max_batch, "live": len(self._live), "queued": len(self._pending)}

  def _decode(self, ids: list[int]) -> str:
    return self.chat.tokenizer.decode(ids, skip_special_tokens=True)

  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._stopping and not self._pending and not self._live:
          self._cond.wait()
        if not self._live and self.batch_window_s > 0:
          deadline = time.monotonic() + self.batch_window_s
          while (not self._stopping and len(self._pending) < self.sampler.max_batch
                 and (left := deadline - time.monotonic()) > 0):
            self._cond.wait(left)
        if self._stopping:
          return
      try:
        self._step()
      except Exception:  # A defect of ours: fail what was decoding, start over, keep serving.
        logging.exception("PolicyServer: a decode step failed")
        self._fail_live()

  def _step(self) -> None:
    """Admits choices to free rows, frees cancelled ones, then one decode call per sampling
    setting of the live rows."""
    with self._cond:
      free = [row for row in range(self.sampler.max_batch) if row not in self._live]
      admitted = []
      while free and self._pending:
        choice = self._pending.popleft()
        choice.row = free.pop(0)
        admitted.append(choice)
      cancelled = [row for row, choice in self._live.items() if choice.request.cancelled]
      # Live before their prefill, so that a failing prefill fails their requests too.
      self._live.update((choice.row, choice) for choice in admitted)
    if admitted:
      # Every admitted row is empty (released when it was freed): each distinct prompt is
      # prefilled once, into all the rows that share it (Sampler.append).
      self._state = self.sampler.append(self._state,
                                        {c.row: c.request.params.prompt for c in admitted})
      for choice in admitted:
        self._lengths[choice.row] = len(choice.request.params.prompt)
    self._free(cancelled)
    groups: dict[SamplingParams, list[int]] = collections.defaultdict(list)
    for row, choice in sorted(self._live.items()):
      groups[choice.request.params.sampling].append(row)
    for sampling, rows in groups.items():
      self._free(self._decode_rows(rows, sampling))

  def _decode_rows(self, rows: list[int], sampling: SamplingParams) -> list[int]:
    """One decode call of `rows`; reports the new text; returns the rows that finished."""
    seeds = np.zeros((self.sampler.max_batch, 2), np.uint32)
    choices = np.zeros(self.sampler.max_batch, np.int32)
    offsets = np.zeros(self.sampler.max_batch, np.int32)
    for row in rows:
      choice = self._live[row]
      seed = choice.request.params.seed
      seeds[row] = (seed & 0xFFFFFFFF, seed >> 32)
      choices[row], offsets[row] = choice.index, choice.sampled
    self._state, out = self.sampler.generate(self._state, _row_keys(seeds, choices),
                                             max_new_tokens=self.chunk_tokens,
                                             stop_ids=self.chat.turn_end_ids, rows=rows,
                                             sampling=sampling, lengths=self._lengths.copy(),
                                             offsets=offsets)
    tokens, lengths = jax.device_get((out.tokens, out.lengths))
    finished = []
    for row in rows:
      choice, count = self._live[row], int(lengths[row])
      self._lengths[row] += count
      choice.sampled += count
      full = self._lengths[row] >= self.sampler.cache_slots
      text = choice.reply.extend(tokens[row, :count].tolist(), cache_full=full)
      if text or choice.reply.finished:
        reply = choice.reply if choice.reply.finished else None
        choice.request.events.put(_Event(choice.index, text=text, reply=reply))
      if choice.reply.finished:
        finished.append(row)
    return finished

  def _free(self, rows: list[int]) -> None:
    """Releases rows, so that a free row always holds nothing."""
    if not rows:
      return
    self._state = self.sampler.release(self._state, rows)
    self._lengths[rows] = 0
    with self._cond:
      for row in rows:
        del self._live[row]

  def _fail_live(self) -> None:
    error = RequestError(500, "the policy server failed while decoding this request",
                         kind="server_error", code="internal_error")
    with self._cond:
      choices, self._live = list(self._live.values()), {}
    for choice in choices:
      choice.request.events.put(_Event(choice.index, error=error))
    self._state = self.sampler.empty()
    self._lengths[:] = 0


# The server.

_ROUTES = {
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
    "/v1/models/{id}": "GET",
    "/health": "GET",
}


class PolicyServer(httpd.App):
  """Serves one policy behind OpenAI's chat completions API (module docstring).

  Args:
    model, tokenizer: the policy and its tokenizer (`agentgym_jax.load_model`).
    model_name: the id clients name in `model` (GET /v1/models lists it).
    chat: the chat template (default: the tokenizer's, thinking on).
    host, port: where to listen; port 0 picks a free port (see `.port`).
    max_batch: the sampler's rows: choices decoded at once.
    max_context: tokens a row holds, prompt and reply.
    cache_dtype: dtype of the cached keys and values (default: the model's matmul dtype).
    chunk_tokens: tokens per decode call: what a stream sends at a time, and how often waiting
      requests may join the batch.
    batch_window_s: how long the first request to reach an idle server waits for others.
    max_queue: choices that may wait for a row; beyond, requests get 429.
    max_body_bytes: larger request bodies get 413.
    api_key: if set, requests must carry `Authorization: Bearer <api_key>` (else 401).
  """

  def __init__(self, model: Decoder, tokenizer: Tokenizer, *, model_name: str,
               chat: ChatTemplate | None = None, host: str = "127.0.0.1", port: int = 0,
               max_batch: int = 16, max_context: int = 4096, cache_dtype: Any = None,
               chunk_tokens: int = 16, batch_window_s: float = 0.0, max_queue: int = 1024,
               max_body_bytes: int = 8 << 20, api_key: str | None = None):
    if max_context < 2:
      raise ValueError(f"max_context must be >= 2, got {max_context}")
    if chunk_tokens < 1 or max_queue < 1 or max_body_bytes < 1:
      raise ValueError(f"chunk_tokens ({chunk_tokens}), max_queue ({max_queue}) and "
                       f"max_body_bytes ({max_body_bytes}) must be >= 1")
    if batch_window_s < 0:
      raise ValueError(f"batch_window_s must be >= 0, got {batch_window_s}")
    self.model_name = model_name
    self.chat = tokenizer.chat if chat is None else chat
    self.max_context = max_context
    self.max_body_bytes = max_body_bytes
    self._api_key = api_key
    self.sampler = Sampler(model, cache_slots=max_context, max_batch=max_batch,
                           cache_dtype=cache_dtype)
    self.scheduler = _Scheduler(self.sampler, self.chat, chunk_tokens=chunk_tokens,
                                batch_window_s=batch_window_s, max_queue=max_queue)
    self.created = int(time.time())
    self._fingerprint = f"agentgym-jax-{agentgym_jax.__version__}"
    super().__init__((host, port), _Handler, name="PolicyServer", max_body_bytes=max_body_bytes)
    self._thread: threading.Thread | None = None
    self._shut_down = False

  @property
  def cache_bytes(self) -> int:
    """The bytes of the sampler's KV cache and row states."""
    return self.scheduler.cache_bytes

  def load(self) -> dict[str, int]:
    """{"rows": the sampler's rows, "live": rows decoding, "queued": choices waiting}."""
    return self.scheduler.load()

  def start(self) -> PolicyServer:
    """Serves in background threads until `shutdown()`."""
    self.scheduler.start()
    self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1},
                                    name="policy-http", daemon=True)
    self._thread.start()
    return self

  def shutdown(self) -> None:
    """Stops serving: requests in flight get 503, open connections are dropped. Idempotent."""
    if self._shut_down:
      return
    self._shut_down = True
    if self._thread is not None:
      self._http.shutdown()
      self._thread.join()
    self._http.server_close()
    self.scheduler.stop()
    self._http.drop_connections(grace_s=_SHUTDOWN_GRACE_S)

  # Requests (called by the connection threads).

  def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes,
             client_gone: Callable[[], bool]) -> tuple[int, Any] | Iterator[bytes] | None:
    """Answers one request: (status, JSON payload), the byte chunks of an event stream, or None
    for a client that left before its answer was ready."""
    path = urllib.parse.urlsplit(target).path.rstrip("/") or "/"
    route = "/v1/models/{id}" if path.startswith("/v1/models/") else path
    try:
      if route not in _ROUTES:
        raise RequestError(404, f"Invalid URL ({method} {path})", code="unknown_url")
      if method != _ROUTES[route]:
        raise RequestError(405, f"{path} takes {_ROUTES[route]}, not {method}",
                           code="method_not_allowed")
      self._check_key(headers.get("Authorization", ""))
      if route == "/v1/chat/completions":
        return self._chat_completions(body, client_gone)
      if route == "/v1/models":
        return 200, {"object": "list", "data": [self._model_card()]}
      if route == "/health":
        return 200, {"status": "ok", "model": self.model_name, **self.load()}
      name = urllib.parse.unquote(path[len("/v1/models/"):])
      if name != self.model_name:
        raise RequestError(
            404, f"The model {name!r} does not exist; this server serves "
            f"{self.model_name!r}", param="model", code="model_not_found")
      return 200, self._model_card()
    except RequestError as error:
      return error.status, error.body()
    except _ClientGone:
      return None
    except Exception as error:  # A defect of ours: answer it, log it, keep serving.
      logging.exception("PolicyServer: %s %s failed", method, path)
      return 500, RequestError(500, f"internal error: {type(error).__name__}: {error}",
                               kind="server_error", code="internal_error").body()

  def _check_key(self, authorization: str) -> None:
    if self._api_key is None:
      return
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                             self._api_key.encode()):
      raise RequestError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                         code="invalid_api_key")

  def _model_card(self) -> dict[str, Any]:
    return {
        "id": self.model_name, "object": "model", "created": self.created,
        "owned_by": "agentgym-jax"
    }

  def _chat_completions(self, body: bytes,
                        client_gone: Callable[[], bool]) -> tuple[int, Any] | Iterator[bytes]:
    params = chat_request(_json_body(body), model_name=self.model_name, chat=self.chat,
                          max_context=self.max_context)
    request = _Request(params)
    self.scheduler.submit(request)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def header(kind: str) -> dict[str, Any]:
      return {
          "id": completion_id, "object": kind, "created": created, "model": self.model_name,
          "system_fingerprint": self._fingerprint
      }

    if params.stream:
      return self._stream(request, header, client_gone)
    try:
      replies = [None] * params.n
      while None in replies:
        event = self._next_event(request, client_gone)
        if event.error is not None:
          raise event.error
        if event.reply is not None:
          replies[event.index] = event.reply
    finally:
      self.scheduler.cancel(request)  # Nothing left to drop, unless the client went away.
    choices = [{
        "index": index, "message": _message(reply), "logprobs": None,
        "finish_reason": reply.finish_reason
    } for index, reply in enumerate(replies)]
    return 200, {**header("chat.completion"), "choices": choices, "usage": _usage(params, replies)}

  def _stream(self, request: _Request, header: Callable[[str], dict[str, Any]],
              client_gone: Callable[[], bool]) -> Iterator[bytes]:
    """The request's chunks as server-sent events; a client that leaves cancels the request
    (the generator is closed, or `client_gone` says so)."""
    params = request.params
    usage_field = {"usage": None} if params.include_usage else {}

    def event(choices: list[dict[str, Any]], **fields: Any) -> bytes:
      payload = {**header("chat.completion.chunk"), "choices": choices, **usage_field, **fields}
      return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

    def delta(index: int, fields: dict[str, Any], finish_reason: str | None = None) -> bytes:
      return event(
          [{"index": index, "delta": fields, "logprobs": None, "finish_reason": finish_reason}])

    try:
      for index in range(params.n):
        yield delta(index, {"role": "assistant", "content": ""})
      replies: list[Reply | None] = [None] * params.n
      while None in replies:
        item = self._next_event(request, client_gone)
        if item.error is not None:
          yield b"data: " + json.dumps(item.error.body()).encode() + b"\n\n"
          return
        if item.text:
          yield delta(item.index, {"content": item.text})
        if item.reply is not None:
          replies[item.index] = item.reply
          if item.reply.tool_calls:
            calls = _tool_calls(item.reply)
            for position, call in enumerate(calls):
              call["index"] = position
            yield delta(item.index, {"tool_calls": calls})
          yield delta(item.index, {}, item.reply.finish_reason)
      if params.include_usage:
        yield event([], usage=_usage(params, replies))
      yield b"data: [DONE]\n\n"
    except _ClientGone:
      return
    finally:
      self.scheduler.cancel(request)

  def _next_event(self, request: _Request, client_gone: Callable[[], bool]) -> _Event:
    """The request's next event; _ClientGone if its client has left (checked every _POLL_S,
    whether or not events come)."""
    while True:
      if time.monotonic() - request.client_checked >= _POLL_S:
        request.client_checked = time.monotonic()
        if client_gone():
          raise _ClientGone()
      with contextlib.suppress(queue.Empty):
        return request.events.get(timeout=_POLL_S)


class _ClientGone(Exception):
  """The client closed its connection before its answer was complete."""


def _message(reply: Reply) -> dict[str, Any]:
  message = {"role": "assistant", "content": reply.content, "refusal": None}
  if reply.tool_calls:
    message["tool_calls"] = _tool_calls(reply)
  return message


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
  return [{
      "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
      "function": {"name": call.name, "arguments": call.arguments}
  } for call in reply.tool_calls]


def _usage(params: CompletionRequest, replies: Sequence[Reply]) -> dict[str, int]:
  """Prompt tokens (once, as n replies share the prompt) and every reply's generated tokens."""
  completion = sum(len(reply.ids) for reply in replies)
  return {
      "prompt_tokens": len(params.prompt), "completion_tokens": completion,
      "total_tokens": len(params.prompt) + completion
  }


def _json_body(body: bytes) -> Any:
  """The request's JSON; NaN and Infinity, which JSON lacks, are malformed too, and so is a lone
  UTF-16 surrogate ("\\ud800"), which no text holds."""
  if not body.strip():
    raise _bad("the request has no JSON body")

  def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")

  try:
    value = json.loads(body.decode(), parse_constant=no_constant)
    json.dumps(value, ensure_ascii=False).encode()  # UnicodeEncodeError for a lone surrogate.
    return value
  except (ValueError, RecursionError) as error:  # UnicodeError is a ValueError.
    raise _bad(f"the request body is not valid JSON: {error}"[:300], code="invalid_json") from None


# HTTP.


class _Handler(httpd.Handler):
  """OpenAI's answers: JSON, an event stream, or none for a client that left; errors in OpenAI's
  shape."""

  ensure_ascii = False

  def respond(self, method: str, body: bytes) -> httpd.Answer:
    return self.server.app.handle(method, self.path, self.headers, body, self._client_gone)

  def error_payload(self, status: int, message: str, code: str) -> dict[str, Any]:
    return RequestError(status, message, code=code).body()

  def _client_gone(self) -> bool:
    """Whether the client closed its end (a readable socket with nothing to read)."""
    try:
      readable, _, _ = select.select([self.connection], [], [], 0)
      return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
      return True

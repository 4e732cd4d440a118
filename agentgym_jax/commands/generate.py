r"""agentgym-generate: chats with a model in the terminal, turn after turn on the sampler's live
KV cache.

  agentgym-generate --prompt="Name three uses of redstone."   # one reply, then exit
  agentgym-generate                                           # a chat on stdin
  agentgym-generate --model=qwen2.5-0.5b-instruct --temperature=0.7 --top_p=0.9

(From a checkout, `python launch/generate.py` with the same flags.) --model is a registry name
(agentgym_jax.models.MODELS) or a Hugging Face checkpoint directory; the default,
SmolLM2-135M-Instruct, ships with the package. Replies are printed as they are sampled,
--stream_tokens at a time (each chunk continues the row on the live cache). Conversations use
the model's chat template (ChatML or Llama 3; --nothinking pre-fills Qwen3's empty think
block). Each user turn is appended to the live cache as token ids after the reply's own ids:
earlier turns are never encoded or prefilled again. An empty line or end of input ends the
chat. The sampling flags are checked before the model loads.
"""

from __future__ import annotations

import sys

import jax
from absl import app, flags

from agentgym_jax import cli
from agentgym_jax.sampling import Sampler, SamplingParams

_MODEL_FLAGS = cli.define_model_flags(__name__)
_PROMPT = flags.DEFINE_string("prompt", None, "Reply to this one message and exit.")
_SYSTEM = flags.DEFINE_string("system", None,
                              "System message (default: the chat template's own, if any).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Token budget of each reply.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "Sampling temperature; 0 is greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_CACHE_SLOTS = flags.DEFINE_integer("cache_slots", 4096, "Tokens the whole chat can hold.")
_STREAM_TOKENS = flags.DEFINE_integer("stream_tokens", 8,
                                      "Tokens sampled between two prints of the reply.")


def _check_flags() -> None:
  """The sampling flags, before the model loads."""
  if _STREAM_TOKENS.value <= 0:
    raise app.UsageError(f"--stream_tokens={_STREAM_TOKENS.value} must be > 0")
  if _MAX_NEW_TOKENS.value <= 0 or _CACHE_SLOTS.value <= _MAX_NEW_TOKENS.value:
    raise app.UsageError(f"need 0 < --max_new_tokens ({_MAX_NEW_TOKENS.value}) < "
                         f"--cache_slots ({_CACHE_SLOTS.value})")
  if _TEMPERATURE.value < 0:
    raise app.UsageError(f"--temperature={_TEMPERATURE.value} must be >= 0 (0: greedy)")
  if not 0 < _TOP_P.value <= 1:
    raise app.UsageError(f"--top_p={_TOP_P.value} must be in (0, 1] (1: off)")
  if _TOP_K.value < 0:
    raise app.UsageError(f"--top_k={_TOP_K.value} must be >= 0 (0: off)")


def _generate() -> None:
  _check_flags()
  model, _, chat = _MODEL_FLAGS.load()
  sampler = Sampler(model, cache_slots=_CACHE_SLOTS.value, max_batch=1,
                    cache_dtype=_MODEL_FLAGS.cache_dtype)
  interactive = _PROMPT.value is None
  system = [] if _SYSTEM.value is None else [{"role": "system", "content": _SYSTEM.value}]
  message = _PROMPT.value if not interactive else _read_user_turn()
  if not message:
    return
  state = sampler.start([chat.render([*system, {"role": "user", "content": message}])])
  key = jax.random.key(_SEED.value)
  for turn in range(sys.maxsize):
    state, reply, stopped = _stream_reply(sampler, state, jax.random.fold_in(key, turn), chat)
    if not interactive:
      return
    if not stopped:
      print(f"[the reply reached {_MAX_NEW_TOKENS.value} tokens or the end of the cache]",
            file=sys.stderr)
    message = _read_user_turn()
    if not message:
      return
    # A reply that did not end its turn (token budget, EOS) is closed first.
    closing = chat.closing_ids(reply)
    continuation = closing + chat.continuation_ids("user", message)
    used = int(state.lengths[0])
    if used + len(continuation) + _MAX_NEW_TOKENS.value > _CACHE_SLOTS.value:
      print(
          f"[the chat holds {used} tokens; another turn would pass --cache_slots="
          f"{_CACHE_SLOTS.value}]", file=sys.stderr)
      return
    state = sampler.append(state, {0: continuation})


def _stream_reply(sampler: Sampler, state, key: jax.Array, chat) -> tuple[object, list[int], bool]:
  """Samples a reply --stream_tokens at a time, printing its text as it grows; returns (state,
  reply ids, whether it ended on a turn-end id)."""
  reply, shown = [], ""
  while len(reply) < _MAX_NEW_TOKENS.value:
    budget = min(_STREAM_TOKENS.value, _MAX_NEW_TOKENS.value - len(reply))
    state, out = sampler.generate(
        state, jax.random.fold_in(key, len(reply)), max_new_tokens=budget,
        stop_ids=chat.turn_end_ids, sampling=SamplingParams(_TEMPERATURE.value, _TOP_P.value,
                                                            _TOP_K.value))
    chunk = out.token_lists()[0]
    reply += chunk
    # Decoding the whole reply, not the chunk: a character may span tokens of two chunks.
    text = chat.reply_text(reply)
    print(text[len(shown):], end="", flush=True)
    shown = text
    if bool(out.stopped[0]) or len(chunk) < budget:  # A turn end, or a full cache.
      print(flush=True)
      return state, reply, bool(out.stopped[0])
  print(flush=True)
  return state, reply, False


def _read_user_turn() -> str:
  try:
    return input("> ").strip()
  except EOFError:
    return ""


def main() -> None:
  """agentgym-generate."""
  cli.run(_generate)

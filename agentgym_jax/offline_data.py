"""Offline training data: conversations as token arrays for SFT, preference pairs for DPO.

A conversation becomes tokens and a loss mask exactly as a rollout builds a trajectory
(agentgym_jax/rollout.py), so offline and online training see the same layout:

  prompt   chat.render(turns before the first reply, True, tools=record's tools)    mask 0
  reply    chat.reply_ids(reply): its text, then the turn end                        mask 1
  turn     chat.continuation_ids(role, observation)                                 mask 0
  reply    ...                                                                      mask 1

By ChatTemplate's invariant these tokens equal chat.render(conversation,
add_generation_prompt=False) without what follows the last reply's turn end (ChatML's "\\n"). A
conversation ends with a reply (a rollout does not append the observation that answers its last
reply).

Batches are `batch.Batch`es of numpy arrays, rows right-padded with 0 to a bucketed length
(`batch.packed_length`, capped at `max_length`), so a run compiles one program per bucket. A
conversation longer than `max_length` is dropped and counted, never cut: a cut would train on a
reply without its end or on a context the policy never sees whole.

Order. Epoch e shuffles the examples with the generator seeded by (seed, e), drops the last
len % batch_size, sorts each window of `sort_window` batches by length (rows of similar length
share a batch, so less padding) and shuffles the batches. `batch(step)` is a pure function of
(data, seed, step), so a resumed run continues the same sequence.

DPO pairs (`dpo_pairs`) compare trajectories of one task: success beats failure, and between
equals in success a reward higher by more than `min_reward_gap` wins.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from absl import logging

from agentgym_jax.batch import Batch, packed_length
from agentgym_jax.models.tokenizer import ChatTemplate
from environments.base import ENV_ERROR, ENV_TIMEOUT

Message = Mapping[str, str]
# A conversation: a record with "messages" (and optionally "reward" and "tools"), or the message
# list.
Conversation = Mapping[str, Any] | Sequence[Message]

ASSISTANT = "assistant"


def tokenize_conversation(
    chat: ChatTemplate, messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[int], list[int]]:
  """(tokens, loss_mask) of a conversation, built turn by turn as a rollout builds it, its
  prompt showing `tools` (the JSON schemas of a tool_call conversation) if given.

  The turns before the first assistant reply form the prompt (a system message, if any, and the
  first user message); after it, replies and other turns alternate, and the last turn is a
  reply. loss_mask is 1 exactly on the reply tokens and the turn end closing each reply
  (`<|im_end|>`, `<|eot_id|>`).
  """
  if isinstance(messages, (str, Mapping)) or not messages:
    raise ValueError(f"a conversation is a non-empty list of messages, got {messages!r:.200}")
  roles = [message.get("role") if isinstance(message, Mapping) else None for message in messages]
  if ASSISTANT not in roles:
    raise ValueError(f"the conversation has no assistant reply (roles {roles}): nothing to train")
  first = roles.index(ASSISTANT)
  if first == 0:
    raise ValueError("the conversation starts with an assistant reply; it needs a prompt first")
  tokens = chat.render(messages[:first], add_generation_prompt=True, tools=tools)
  loss_mask = [0] * len(tokens)
  for offset, message in enumerate(messages[first:]):
    index = first + offset
    if not isinstance(message, Mapping):
      raise ValueError(f"message {index} is a {type(message).__name__}, not a role/content mapping")
    is_reply = offset % 2 == 0
    if (message.get("role") == ASSISTANT) != is_reply:
      raise ValueError(f"message {index} has role {message.get('role')!r}: after the prompt, "
                       f"assistant replies and other turns must alternate (roles {roles})")
    content = message.get("content")
    if not isinstance(content, str):
      raise ValueError(f"message {index} has content of type {type(content).__name__}, not str")
    if is_reply:
      ids = chat.reply_ids(content)
    else:
      ids = chat.continuation_ids(message["role"], content)
    tokens += ids
    loss_mask += [int(is_reply)] * len(ids)
  if roles[-1] != ASSISTANT:
    raise ValueError(f"the conversation ends with a {roles[-1]!r} turn, not a reply: a rollout "
                     "never ends with an observation, and a trailing turn trains nothing")
  return tokens, loss_mask


def _parts(conversation: Conversation,
           index: int) -> tuple[Sequence[Message], float, Sequence[Mapping[str, Any]] | None]:
  """(messages, reward, tools) of a conversation."""
  if isinstance(conversation, Mapping):
    if "messages" not in conversation:
      raise ValueError(f"conversation {index} is a record without 'messages' "
                       f"(keys {sorted(conversation)})")
    return (conversation["messages"], float(conversation.get("reward",
                                                             0.0)), conversation.get("tools"))
  return conversation, 0.0, None


@dataclasses.dataclass(frozen=True)
class _Tokenized:
  tokens: np.ndarray  # int32[T]
  loss_mask: np.ndarray  # f32[T]
  reward: float


def _tokenize(chat: ChatTemplate, conversation: Conversation, index: int) -> _Tokenized:
  messages, reward, tools = _parts(conversation, index)
  try:
    tokens, loss_mask = tokenize_conversation(chat, messages, tools)
  except ValueError as error:
    raise ValueError(f"conversation {index}: {error}") from error
  return _Tokenized(np.asarray(tokens, np.int32), np.asarray(loss_mask, np.float32), reward)


def _pad(rows: Sequence[_Tokenized], length: int) -> Batch:
  """Right-pads rows with token 0 and mask 0 into a Batch; each row is its own group."""
  tokens = np.zeros((len(rows), length), np.int32)
  loss_mask = np.zeros((len(rows), length), np.float32)
  for i, row in enumerate(rows):
    tokens[i, :len(row.tokens)] = row.tokens
    loss_mask[i, :len(row.loss_mask)] = row.loss_mask
  return Batch(tokens=tokens, loss_mask=loss_mask, sampler_logprobs=np.zeros(
      (len(rows), length), np.float32), rewards=np.asarray([row.reward for row in rows],
                                                           np.float32),
               group_ids=np.arange(len(rows), dtype=np.int32))


class _Batches:
  """The examples that fit `max_length` in batches, endlessly, epoch after epoch (module
  docstring, "Order"); a subclass's `batch(step)` pads the examples of `rows(step)`.

  Attributes:
    num_dropped: examples longer than `max_length`, left out.
    steps_per_epoch: batches per epoch (kept examples // batch_size).
  """

  def __init__(self, examples: Sequence[Any], lengths: Sequence[int], *, batch_size: int,
               max_length: int, seed: int, sort_window: int, what: str):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if sort_window < 1:
      raise ValueError(f"sort_window must be >= 1 batch, got {sort_window}")
    kept = [i for i, length in enumerate(lengths) if length <= max_length]
    self.examples = [examples[i] for i in kept]
    self.num_dropped = len(examples) - len(kept)
    if self.num_dropped:
      logging.warning("Dropped %d of %d %s longer than max_length=%d tokens.", self.num_dropped,
                      len(examples), what, max_length)
    if len(kept) < batch_size:
      raise ValueError(f"{len(kept)} {what} fit max_length, fewer than one batch of "
                       f"{batch_size}")
    self.lengths = np.asarray([lengths[i] for i in kept])
    self.max_length = max_length
    self.batch_size = batch_size
    self.seed = seed
    self.sort_window = sort_window
    self.steps_per_epoch = len(kept) // batch_size

  def rows(self, step: int) -> list[Any]:
    """The examples of the batch at global `step`, shortest first."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    epoch, position = divmod(int(step), self.steps_per_epoch)
    return [self.examples[i] for i in self._epoch(epoch)[position]]

  @functools.lru_cache(maxsize=2)
  def _epoch(self, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, epoch])
    used = rng.permutation(len(self.lengths))[:self.steps_per_epoch * self.batch_size]
    window = self.sort_window * self.batch_size
    batches = []
    for start in range(0, len(used), window):
      chunk = used[start:start + window]
      # Stable sort by length; equal lengths keep their shuffled order.
      chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
      batches += list(chunk.reshape(-1, self.batch_size))
    return np.stack(batches)[rng.permutation(len(batches))]

  def __iter__(self) -> Iterator[Any]:
    """batch(0), batch(1), ... without end; the caller decides how many steps to take."""
    return map(self.batch, itertools.count())


class SFTBatches(_Batches):
  """Padded SFT batches of a set of conversations (`_Batches`); `num_examples` of them fit
  `max_length` and are batched."""

  def __init__(self, conversations: Sequence[Conversation], chat: ChatTemplate, *, batch_size: int,
               max_length: int, seed: int = 0, sort_window: int = 16):
    tokenized = [_tokenize(chat, c, i) for i, c in enumerate(conversations)]
    super().__init__(tokenized, [len(t.tokens) for t in tokenized], batch_size=batch_size,
                     max_length=max_length, seed=seed, sort_window=sort_window,
                     what="conversations")
    self.num_examples = len(self.examples)

  def batch(self, step: int) -> Batch:
    """The batch of global step `step` (deterministic)."""
    rows = self.rows(step)
    return _pad(rows, _padded_length(max(len(r.tokens) for r in rows), self.max_length))


def sft_batches(conversations: Sequence[Conversation], chat: ChatTemplate, batch_size: int,
                max_length: int, seed: int = 0, *, sort_window: int = 16) -> SFTBatches:
  """SFT batches of `conversations` (records with "messages", or message lists)."""
  return SFTBatches(conversations, chat, batch_size=batch_size, max_length=max_length, seed=seed,
                    sort_window=sort_window)


def _padded_length(longest: int, max_length: int) -> int:
  return min(packed_length(longest), max_length)


# --- DPO -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  """Two trajectories of one task; `chosen` is the better one."""

  task_id: int
  chosen: Mapping[str, Any]
  rejected: Mapping[str, Any]


def _outcome(record: Mapping[str, Any]) -> tuple[bool, float]:
  return bool(record.get("success", False)), float(record.get("reward", 0.0))


def _prompt(record: Mapping[str, Any]) -> list[Any]:
  """The tools and the turns before the first reply: what both sides of a pair must share."""
  messages = record["messages"]
  roles = [m.get("role") for m in messages]
  turns = messages[:roles.index(ASSISTANT)] if ASSISTANT in roles else messages
  return [record.get("tools"), *turns]


def dpo_pairs(trajectories: Sequence[Mapping[str, Any]], *, min_reward_gap: float = 0.0,
              max_pairs_per_task: int | None = None) -> list[PreferencePair]:
  """Preference pairs among trajectories of the same task (rollout records and/or demos).

  Per task, trajectories are ranked best first by (success, reward, fewer turns), ties in input
  order. Pair k is (k-th best, k-th worst), k = 0, 1, ..., each trajectory used at most once,
  while the first strictly beats the second:

    a beats b  iff  (a succeeded and b did not)
                    or (both or neither succeeded and reward(a) - reward(b) > min_reward_gap).

  Once a pair fails, all inner ones do (the ranking is by the same keys). Episodes the
  environment broke (termination env_error / env_timeout) and trajectories without a reply are
  left out. Example, one task, (success, reward) in input order
    A (F, 0.0), B (T, 1.0), C (F, 0.0), D (T, 1.0), E (F, 0.0)
  ranks B, D, A, C, E and pairs (B, E), (D, C); A is the middle one, unpaired.

  Args:
    trajectories: records with task_id, messages, reward and success; records naming
      different "env"s may not be mixed.
    min_reward_gap: between equals in success, how much more reward the chosen one needs.
    max_pairs_per_task: keep at most this many pairs per task (the outermost ones).

  Returns:
    The pairs, tasks in order of first appearance.
  """
  envs = {record["env"] for record in trajectories if "env" in record}
  if len(envs) > 1:
    raise ValueError(f"trajectories of several environments {sorted(envs)}: task ids are "
                     "per environment, so pair each environment's trajectories on their own")
  by_task: dict[int, list[Mapping[str, Any]]] = {}
  for index, record in enumerate(trajectories):
    if "task_id" not in record or "messages" not in record:
      raise ValueError(f"trajectory {index} lacks task_id or messages (keys {sorted(record)})")
    if record.get("termination") in (ENV_ERROR, ENV_TIMEOUT):
      continue
    if not any(m.get("role") == ASSISTANT for m in record["messages"]):
      continue
    by_task.setdefault(int(record["task_id"]), []).append(record)

  def beats(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    (a_success, a_reward), (b_success, b_reward) = _outcome(a), _outcome(b)
    if a_success != b_success:
      return a_success
    return a_reward - b_reward > min_reward_gap

  pairs = []
  for task_id, records in by_task.items():
    ranked = sorted(records, key=lambda r:
                    (not _outcome(r)[0], -_outcome(r)[1], int(r.get("num_turns", 0))))
    for k in range(len(ranked) // 2):
      if max_pairs_per_task is not None and k >= max_pairs_per_task:
        break
      chosen, rejected = ranked[k], ranked[-1 - k]
      if not beats(chosen, rejected):
        break
      if _prompt(chosen) != _prompt(rejected):
        raise ValueError(f"task {task_id}: two trajectories start from different prompts, so "
                         "they cannot be compared (were they made with different instructions "
                         "or environment versions?)")
      pairs.append(PreferencePair(task_id, chosen, rejected))
  return pairs


class DPOBatches(_Batches):
  """(chosen, rejected) Batch pairs, padded to one length (`_Batches`); `num_pairs` pairs have
  both sides within `max_length` and are batched.

  Row i of the chosen batch and row i of the rejected batch are the two sides of one pair.
  """

  def __init__(self, pairs: Sequence[PreferencePair], chat: ChatTemplate, *, batch_size: int,
               max_length: int, seed: int = 0, sort_window: int = 16):
    tokenized = [
        (_tokenize(chat, p.chosen, i), _tokenize(chat, p.rejected, i)) for i, p in enumerate(pairs)
    ]
    super().__init__(tokenized, [max(len(c.tokens), len(r.tokens)) for c, r in tokenized],
                     batch_size=batch_size, max_length=max_length, seed=seed,
                     sort_window=sort_window, what="pairs (by their longer side)")
    self.num_pairs = len(self.examples)

  def batch(self, step: int) -> tuple[Batch, Batch]:
    """(chosen, rejected) of global step `step` (deterministic)."""
    rows = self.rows(step)
    longest = max(max(len(c.tokens), len(r.tokens)) for c, r in rows)
    length = _padded_length(longest, self.max_length)
    return _pad([c for c, _ in rows], length), _pad([r for _, r in rows], length)


def dpo_batches(pairs: Sequence[PreferencePair], chat: ChatTemplate, batch_size: int,
                max_length: int, seed: int = 0, *, sort_window: int = 16) -> DPOBatches:
  """DPO batches of `pairs` (from `dpo_pairs`)."""
  return DPOBatches(pairs, chat, batch_size=batch_size, max_length=max_length, seed=seed,
                    sort_window=sort_window)

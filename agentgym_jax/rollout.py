"""Multi-turn rollouts: the sampler and the environment pool taking turns, token in, token out.

For B tasks x n samples, every trajectory is one row of the sampler's KV cache and one slot of
the env pool. Each turn:
  1. the sampler generates the assistant turn of every live row (stopping at the turn end;
     with `Player.decode_chunk` a few tokens a call, each row stepping its env as soon as its
     own reply ends);
  2. the replies (decoded once, for the environment only) go to the pool, concurrently;
  3. each observation is rendered as the next user turn plus the assistant header and appended
     to that row's live cache; finished rows drop out.
The trajectory keeps exactly the token ids the sampler saw, so the learner never re-tokenizes
text and sampler and learner agree token for token (the reference re-tokenizes every turn). In
the tool_call action format the first prompt shows the environment's tools as the model's chat
template shows them, and the trajectory records their schemas. The instruction, the tools and
any turn cap of its own are those of the episode's environment (`EnvPool.environment`): in a
mixture of environments (environments/mixture.py) each task's own.

A trajectory ends when the environment says done, at the horizon cap (ScalingInter-RL), when
the next turn would not fit the context, or when the environment fails (recorded, never fatal).

Context management (`ContextPolicy`): a row's context may hold less than the whole episode. A
policy other than `full` rewrites the conversation every k turns (from turn 2k on, and whenever
the next turn would not fit), keeping the first user turn and the last k turns (`window`) or
every reply with the observations older than the last k turns replaced by a placeholder
(`mask_observations`). The row is released and the rewritten conversation prefilled into it, so
between rewrites a row's cache only grows, and holds k to 2k whole turns. The trajectory records
each context in turn (`Trajectory.rewrites`): training reads every context as its own sequence
(pack's `contexts`), so the learner sees exactly what the sampler saw.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import time
from typing import Any, Callable, Iterator, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.batch import Batch, context_windows, packed_length, share_prompts
from agentgym_jax.models.tokenizer import ChatTemplate
from agentgym_jax.sampling import Sampler, SamplingParams
from environments import jsonl
from environments.base import CONTEXT, DONE, ENV_ERROR, ENV_TIMEOUT, HORIZON, EnvError, StepResult
from environments.mixture import MixturePool
from environments.pool import EnvPool, Environment

T = TypeVar("T")

# The terminations that cut an episode short rather than end it: the turn cap, the context
# limit, and an environment step slower than the pool's timeout (an environment failure too).
TRUNCATIONS = (HORIZON, CONTEXT, ENV_TIMEOUT)

CONTEXTS = ("full", "window", "mask_observations")
# What a masked observation shows in place of its text.
OMITTED_OBSERVATION = "[earlier observation omitted]"


@dataclasses.dataclass(frozen=True)
class ContextPolicy:
  """What a row's context holds of its episode (module docstring).

  Attributes:
    kind: "full" (every turn, as played), "window" (the first user turn and the last `turns`
      turns) or "mask_observations" (every reply; the observations of all but the last `turns`
      turns replaced by OMITTED_OBSERVATION).
    turns: k, the turns a rewritten context keeps whole.
  """

  kind: str = "full"
  turns: int = 4

  def __post_init__(self):
    if self.kind not in CONTEXTS:
      raise ValueError(f"context {self.kind!r} is not one of {CONTEXTS}")
    if self.turns < 1:
      raise ValueError(f"a context policy keeps turns={self.turns} turns; it must be >= 1")

  @property
  def rewrites(self) -> bool:
    return self.kind != "full"

  def due(self, turns: int) -> bool:
    """Whether the context is rewritten after `turns` whole turns (it then holds 2k, or 2k
    after the last rewrite's k), before it would outgrow the row."""
    return self.rewrites and turns >= 2 * self.turns and turns % self.turns == 0

  def messages(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation [first user turn, reply 1, observation 1, ...] as a rewritten context
    shows it."""
    head, turns = list(messages[:1]), list(messages[1:])
    kept = 2 * self.turns
    if self.kind == "window":
      return head + turns[-kept:]
    masked = len(turns) - kept
    return head + [
        dict(m, content=OMITTED_OBSERVATION) if i < masked and m["role"] == "user" else m
        for i, m in enumerate(turns)
    ]


@dataclasses.dataclass
class Trajectory:
  """One episode as the sampler saw it, plus what the environment said."""

  task_id: int
  group: int  # Trajectories of the same task in one step share a group.
  env: str = ""
  category: str = ""
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 on generated tokens.
  sampler_logprobs: list[float] = dataclasses.field(default_factory=list)
  messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
  tools: list[dict[str, Any]] | None = None  # The tools' schemas in the tool_call format.
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  # [start, end) of the tokens each assistant turn answers: the prompt for the first, then the
  # observation the environment returned (its user turn and the assistant header).
  observation_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  # Each context rewrite: (the token where the new context starts, the tokens it left out of
  # what the row would have held). tokens[start:] is then what the sampler's row holds.
  rewrites: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  success: bool = False
  termination: str = ""
  error: str = ""
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  # The updates of the policy that played it (behind the trained one with rollout.max_staleness).
  policy_version: int = 0
  # The version of the policy that generated each turn's reply: policy_version's, or newer ones
  # with partial rollouts (PolicySwitches).
  turn_versions: list[int] = dataclasses.field(default_factory=list)

  @property
  def reward(self) -> float:
    """The outcome reward: the sum of the environment's step rewards."""
    return float(sum(self.turn_rewards))

  @property
  def num_turns(self) -> int:
    return len(self.turn_rewards)

  @property
  def env_failed(self) -> bool:
    return self.termination in (ENV_ERROR, ENV_TIMEOUT)

  @property
  def truncated(self) -> bool:
    return self.termination in TRUNCATIONS

  @property
  def context_start(self) -> int:
    """Where the context the sampler's row holds starts in `tokens`."""
    return self.rewrites[-1][0] if self.rewrites else 0

  def context_lengths(self) -> list[int]:
    """The tokens of each context the episode was played in, in order."""
    bounds = [0] + [start for start, _ in self.rewrites] + [len(self.tokens)]
    return [end - start for start, end in zip(bounds, bounds[1:])]

  def reply_lengths(self) -> list[int]:
    """The tokens the sampler generated in each turn: the lengths of the trained runs."""
    return [len(list(run)) for trained, run in itertools.groupby(self.loss_mask) if trained]

  def extend(self, tokens: Sequence[int], trained: bool,
             logprobs: Sequence[float] | None = None) -> None:
    self.tokens.extend(int(t) for t in tokens)
    self.loss_mask.extend([int(trained)] * len(tokens))
    self.sampler_logprobs.extend([float(x) for x in logprobs] if logprobs is not None else [0.0] *
                                 len(tokens))

  def observe(self, tokens: Sequence[int]) -> None:
    """Appends (untrained) the observation that the next assistant turn answers."""
    self.observation_spans.append((len(self.tokens), len(self.tokens) + len(tokens)))
    self.extend(tokens, trained=False)

  def to_json(self) -> dict[str, Any]:
    record = {
        "task_id": self.task_id, "group": self.group, "env": self.env, "category": self.category,
        "reward": self.reward, "success": self.success, "num_turns": self.num_turns,
        "termination": self.termination, "error": self.error, "turn_rewards": self.turn_rewards,
        "messages": self.messages, "num_tokens": len(self.tokens),
        "num_trained_tokens": int(sum(self.loss_mask)), "info": jsonl.json_safe(self.info)
    }
    record["policy_version"] = self.policy_version
    if any(version != self.policy_version for version in self.turn_versions):
      record["turn_versions"] = self.turn_versions
    if self.tools is not None:
      record["tools"] = self.tools
    if self.rewrites:
      record["context_lengths"] = self.context_lengths()
    return record

  def state(self) -> dict[str, Any]:
    """Every field, JSON-safe (a checkpoint's buffered rollouts); `from_state` inverts it, info
    up to jsonl.json_safe."""
    return {**dataclasses.asdict(self), "info": jsonl.json_safe(self.info)}

  @classmethod
  def from_state(cls, state: dict[str, Any]) -> Trajectory:
    return cls(
        **{
            **state, "observation_spans": [tuple(span) for span in state["observation_spans"]],
            "rewrites": [tuple(rewrite) for rewrite in state["rewrites"]]
        })


@dataclasses.dataclass(frozen=True)
class TurnSampling:
  """How each assistant turn is sampled."""

  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def tokens(self) -> SamplingParams:
    """How each token of a turn is drawn."""
    return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclasses.dataclass
class RolloutStats:
  """Where a rollout's time went, from the host's clock.

  generate_s is the time the device was busy generating (from each decode call to its outputs
  being ready), env_s the time the env pool was busy (resets and steps), env_hidden_s the part
  of env_s during which generation was in flight too: env time that pipelining hid.
  decode_row_steps counts the rows of every decode step (a generate call runs the rows it
  computes on, `Sampler.decode_rows`, until its longest reply ends or half its rows are done),
  of which generated_tokens were live, no_episode_row_steps held no episode (none was left to
  start: the tail of a rollout) and stepping_row_steps waited for their env step; the rest
  were rows whose reply had ended before the last of their call. judge_s is the time a judge
  (agentgym_jax/judge.py) took to score the episodes, if one did.
  """

  generate_s: float = 0.0
  env_s: float = 0.0
  env_hidden_s: float = 0.0
  generated_tokens: int = 0
  decode_row_steps: int = 0
  no_episode_row_steps: int = 0
  stepping_row_steps: int = 0
  judge_s: float = 0.0

  @property
  def env_hidden_fraction(self) -> float:
    return self.env_hidden_s / self.env_s if self.env_s > 0 else 0.0

  @property
  def idle_row_fraction(self) -> float:
    """The share of decode row-steps that generated nothing: rows whose episode had ended (or
    that held none), and rows whose reply ended before the longest of their call."""
    return 1.0 - self.generated_tokens / self.decode_row_steps if self.decode_row_steps else 0.0

  def idle_parts(self) -> dict[str, float]:
    """idle_row_fraction by what the idle rows were doing, as shares of all decode row-steps:
    holding no episode, waiting for their env step, or done with their reply before the last
    reply of their call."""
    if not self.decode_row_steps:
      return {"no_episode": 0.0, "env_step": 0.0, "reply_ended": 0.0}
    share = lambda count: count / self.decode_row_steps
    no_episode, env_step = share(self.no_episode_row_steps), share(self.stepping_row_steps)
    return {
        "no_episode": no_episode, "env_step": env_step,
        "reply_ended": self.idle_row_fraction - no_episode - env_step
    }

  @classmethod
  def total(cls, parts: Sequence[RolloutStats]) -> RolloutStats:
    """The stats of rollouts played one after the other."""
    return cls(*(sum(getattr(s, f.name) for s in parts) for f in dataclasses.fields(cls)))


@dataclasses.dataclass
class PolicySwitches:
  """Partial rollouts (rollout.partial_rollouts): the policies a step's rollout decodes with.

  The rollout starts with the policy after `first` updates. After every `every` rounds of
  replies of the step (a decode call that starts replies, with the smaller calls that finish
  its last ones: `_Episodes.play`), counted over its pipelined groups and waves in the order
  they are made (so a rerun switches at the same calls, whatever the timing), it moves to the
  next version, up to `last`: the step's own, or that of an earlier update at which the learner
  waits for the step's rollout (trainer.py). `fetch(version)` returns that policy as the
  sampler runs it, waiting until the learner has made it. A group that switches re-prefills its
  live rows under the new policy (`collect`), so every token after the switch is sampled from
  it exactly.
  """

  first: int
  last: int
  every: int
  fetch: Callable[[int], Any]
  calls: int = 0
  current: tuple[int, Any] | None = None  # The newest version fetched, and its parameters.

  def __post_init__(self):
    if self.every < 1 or self.last < self.first:
      raise ValueError(f"partial rollouts switch every {self.every} (>= 1) decode calls from "
                       f"version {self.first} to {self.last} (>= {self.first})")

  def next_call(self) -> tuple[int, Any]:
    """(version, parameters) of the step's next decode call."""
    version = min(self.last, self.first + self.calls // self.every)
    self.calls += 1
    if self.current is None or self.current[0] != version:  # Versions only grow call by call.
      self.current = (version, self.fetch(version))
    return self.current


@dataclasses.dataclass(frozen=True)
class Player:
  """What plays episodes: a sampler with the policy's parameters (after `version` updates),
  the environment pool, the chat layout, how each turn samples, the context limit, the
  pipelined groups a call splits its rows into (`collect`), whether `collect_waves` refills a
  row as soon as its episode ends (continuous batching) instead of playing waves, what a row's
  context holds, with partial rollouts the newer policies it moves to (`switches`), and the
  tokens of a reply one decode call samples at most (`decode_chunk`, 0: the whole reply; see
  `collect`).
  """

  sampler: Sampler
  params: Any
  pool: EnvPool | MixturePool
  chat: ChatTemplate
  sampling: TurnSampling
  max_context: int
  groups: int = 1
  refill: bool = False
  context: ContextPolicy = ContextPolicy()
  version: int = 0
  switches: PolicySwitches | None = None
  decode_chunk: int = 0

  def __post_init__(self):
    if self.decode_chunk < 0:
      raise ValueError(f"decode_chunk={self.decode_chunk} must be >= 0 (0: a whole reply)")
    if self.decode_chunk and self.switches is not None:
      raise ValueError("partial rollouts switch policies after a count of decode calls, which "
                       "with decode_chunk depends on when env steps come back: use one or the "
                       "other")

  def chunk(self) -> int:
    """The tokens of a reply one decode call samples at most."""
    return min(self.decode_chunk or self.sampling.max_new_tokens, self.sampling.max_new_tokens)

  def in_groups(self, rows: int) -> Player:
    """This player for a call of `rows` rows: at most that many groups."""
    return dataclasses.replace(self, groups=min(self.groups, rows))


def collect_waves(player: Player, tasks: Sequence[tuple[int, int]], *, wave_rows: int, horizon: int,
                  key: jax.Array, first_row: int = 0) -> tuple[list[Trajectory], RolloutStats]:
  """`collect` over `tasks` on `wave_rows` rows at a time, the sampler's rows and the pool's
  slots from 0: in consecutive waves, each waiting for its longest episode, or with
  `player.refill` in one call whose rows take the next episode as soon as theirs ends. A
  trajectory draws from the keys of its row in the whole (first_row + its index), as in one
  call; only `wave_rows` episodes are alive at a time."""
  if player.refill:
    return collect(player.in_groups(min(wave_rows, len(tasks))), tasks, horizon=horizon, key=key,
                   first_row=first_row, rows=wave_rows)
  played, stats = [], []
  for start in range(0, len(tasks), wave_rows):
    wave = tasks[start:start + wave_rows]
    trajectories, wave_stats = collect(player.in_groups(len(wave)), wave, horizon=horizon, key=key,
                                       first_row=first_row + start)
    played.extend(trajectories)
    stats.append(wave_stats)
  return played, RolloutStats.total(stats)


def collect(player: Player, tasks: Sequence[tuple[int, int]], *, horizon: int, key: jax.Array,
            first_row: int = 0, rows: int | None = None,
            progress: Callable[[int], None] | None = None) -> tuple[list[Trajectory], RolloutStats]:
  """Plays one episode per (task_id, group) in `tasks` with `player`, up to `horizon` turns (or
  the lower cap of the task's environment, `Environment.cap`), on `rows` rows at once (default:
  one per task); `progress(ended)` is called with the number of episodes ended so far whenever
  some end.

  The rows are the pool's slots 0..rows-1 and the sampler's rows. Episodes start in order, each
  on the first free row; with fewer rows than tasks, a row whose episode ends takes the next
  one at once (continuous batching): its cache row is released and the new prompt prefilled
  while the other rows keep their episodes. The recorded log-probs are the sampler's log
  q(token) under the distribution it actually drew from. Turn t of trajectory i draws from
  fold_in(fold_in(key, t), first_row + i), whichever row plays it: a process playing rows from
  `first_row` of a larger batch samples what one sampler holding every row would, and an
  episode samples the same tokens on any row (up to the rounding of other batch shapes).

  Chunks. By default a decode call samples each row's whole reply, so rows whose reply ends
  early wait for the longest one, and the group's env steps run as one batch before any row
  decodes again. With `player.decode_chunk` = c a call samples up to c tokens of every reply
  (token j of a reply still draws from its key's j-th fold, whatever the chunks): a row whose
  reply ends steps its env on its own while the other rows keep decoding, and rejoins the next
  call after its step is back. Which rows share a call then depends on timing; what each
  episode samples does not.

  Pipelining. The rows are split into `player.groups` groups of consecutive rows, each on its
  own state of the sampler (which needs as many rows as the largest group). The groups take
  turns on the host: a group dispatches its decode (JAX returns before the device finishes) and
  hands over, so the host steps another group's environments while the device decodes. A
  trajectory samples exactly what it would in one group; only the decode batches are smaller.
  """
  sampler, pool, groups = player.sampler, player.pool, player.groups
  rows = len(tasks) if rows is None else min(rows, len(tasks))
  if not 1 <= groups <= max(rows, 1):
    raise ValueError(f"groups={groups} must be in [1, {rows}] for {rows} rows")
  group_size = max(-(-rows // groups), 1)
  if rows > pool.num_slots or group_size > sampler.max_batch:
    raise ValueError(f"{rows} trajectories at once in {groups} groups need {rows} env slots "
                     f"and {group_size} sampler rows; the pool has {pool.num_slots}, the "
                     f"sampler {sampler.max_batch}")
  task_ids = {t for t, _ in tasks}
  environments = {t: pool.environment(t) for t in task_ids}
  categories = {t: _category(pool, t) for t in task_ids}
  trajectories = [
      Trajectory(task_id=t, group=g, env=environments[t].name, category=categories[t])
      for t, g in tasks
  ]
  with _Timeline(groups) as timeline:
    episodes = _Episodes(player, trajectories, environments, horizon=horizon, key=key,
                         first_row=first_row, timeline=timeline,
                         queue=collections.deque(range(len(tasks))), progress=progress)
    _round_robin([
        episodes.play(range(start, min(start + group_size, rows)))
        for start in range(0, rows, group_size)
    ])
  return trajectories, timeline.stats(episodes.rows)


@dataclasses.dataclass
class _Episodes:
  """What the groups of one `collect` call share: the environment of each task (its
  instruction, tools and turn cap), the episodes still to start (`queue`, indices of
  `trajectories`); `play` runs one group of rows."""

  player: Player
  trajectories: list[Trajectory]
  environments: dict[int, Environment]
  horizon: int
  key: jax.Array
  first_row: int
  timeline: _Timeline
  queue: collections.deque[int]
  progress: Callable[[int], None] | None = None
  rows: RolloutStats = dataclasses.field(default_factory=RolloutStats)  # Row-step counts.
  ended: int = 0

  def play(self, slots: range) -> Iterator[None]:
    """Plays episodes on the pool's `slots`, slot i on sampler row i - slots.start of this
    group's own state, each row taking the queue's next episode when its own ends.

    A decode call samples up to `Player.decode_chunk` tokens of each row's reply (default: the
    whole reply), and ends early once half its rows are done (`Sampler.generate`'s shrink): the
    next call continues the rest on fewer rows. A row whose reply is complete steps its env at
    once and sits out while the step runs. With chunks the other rows keep decoding meanwhile,
    and it rejoins once the step is back. With whole replies the rows rejoin together once every
    reply of the round is complete and every step is back, so the calls a rollout makes do not
    depend on when steps come back (partial rollouts count them: `PolicySwitches`). Yields
    after dispatching each decode and each batch of env steps: the caller runs the other groups.
    """
    sampler, chat, sampling = self.player.sampler, self.player.chat, self.player.sampling
    params, version, switches = self.player.params, self.player.version, self.player.switches
    chunk = self.player.chunk()
    whole = chunk == sampling.max_new_tokens
    # The trajectory each row plays (-1: none), the last one it played (its tokens are the row's
    # cache until it takes another), the turn it is at, whether its env step is in flight, and
    # the tokens and sampler log-probs of its reply so far.
    held, last = np.full(sampler.max_batch, -1), np.full(sampler.max_batch, -1)
    turn = np.zeros(sampler.max_batch, np.int32)
    stepping = np.zeros(sampler.max_batch, bool)
    reply: list[list[int]] = [[] for _ in range(sampler.max_batch)]
    reply_logprobs: list[list[float]] = [[] for _ in range(sampler.max_batch)]
    # Env steps in flight: the future of a batch and its rows' complete replies.
    pending: list[tuple[concurrent.futures.Future, list[tuple[int, list[int]]]]] = []
    state = sampler.append(sampler.empty(), self._start(slots, range(len(slots)),
                                                        (held, last, turn)), params=params)
    while (held >= 0).any():
      decoding = (held >= 0) & ~stepping
      if decoding.any():
        if switches is not None and not any(reply):  # Switches between rounds of replies.
          newest, newest_params = switches.next_call()
          if newest != version:  # Partial rollouts: the live rows continue under a newer policy.
            params, version = newest_params, newest
            rows = np.flatnonzero(decoding).tolist()
            contexts = {row: self._context(held[row]) for row in rows}
            state = sampler.append(sampler.release(state, rows), contexts, params=params)
        # A free row draws with its own slot's index; it decodes nothing.
        index = np.where(decoding, held, slots.start + np.arange(sampler.max_batch))
        row_keys = jax.vmap(lambda t, i: jax.random.fold_in(jax.random.fold_in(self.key, t), i))(
            jnp.asarray(turn), self.first_row + jnp.asarray(index))
        sampled = np.array([len(tokens) for tokens in reply], np.int32)
        budgets = np.where(decoding, np.minimum(chunk, sampling.max_new_tokens - sampled), 0)
        computed = sampler.decode_rows(decoding)  # The rows the call runs, decoding or not.
        held_tokens = self._lengths(last)
        started = time.perf_counter()
        state, output = sampler.generate(state, row_keys, max_new_tokens=chunk,
                                         stop_ids=chat.turn_end_ids,
                                         rows=np.flatnonzero(decoding).tolist(),
                                         sampling=sampling.tokens(), params=params,
                                         lengths=held_tokens + sampled, budgets=budgets,
                                         offsets=sampled, shrink=True)
        self.timeline.device(started, output)
        yield  # The device decodes this group while the others step their envs.
        tokens = output.token_lists()
        logprobs, stopped = jax.device_get((output.sampling_logprobs, output.stopped))
        steps = max(map(len, tokens))
        self.rows.decode_row_steps += len(computed) * steps
        self.rows.no_episode_row_steps += steps * int((held[computed] < 0).sum())
        self.rows.stepping_row_steps += steps * int(stepping[computed].sum())
        replied = []  # (row, its complete reply, the reply's text)
        for row in np.flatnonzero(decoding):
          generated = tokens[row]
          self.rows.generated_tokens += len(generated)
          reply[row].extend(generated)
          reply_logprobs[row].extend(logprobs[row, :len(generated)].tolist())
          # Complete: the turn ended, the reply's budget is spent, or the cache is full.
          if not (stopped[row] or len(reply[row]) == sampling.max_new_tokens
                  or held_tokens[row] + len(reply[row]) == sampler.cache_slots):
            continue
          generated, reply[row] = reply[row], []
          trajectory = self.trajectories[held[row]]
          trajectory.extend(generated, trained=True, logprobs=reply_logprobs[row])
          reply_logprobs[row] = []
          trajectory.turn_versions.append(version)
          text = chat.reply_text(generated)
          trajectory.messages.append({"role": "assistant", "content": text})
          replied.append((int(row), generated, text))
        if replied:
          stepping[[row for row, _, _ in replied]] = True
          # Whole replies: the call's replies in one batch. Chunks: a slow step holds back its
          # row only.
          for batch in [replied] if whole else [[one] for one in replied]:
            future = self.player.pool.step_async([
                (slots.start + row, text) for row, _, text in batch
            ])
            pending.append((self.timeline.env(future), [(row, gen) for row, gen, _ in batch]))
          yield  # The pool steps this group's envs while the device decodes the others.
      if whole and any(reply):
        continue  # The round's other replies go on; its steps come back when they are done.
      if not ((held >= 0) & ~stepping).any():  # No row can decode: wait for env steps.
        concurrent.futures.wait([future for future, _ in pending],
                                return_when=concurrent.futures.ALL_COMPLETED
                                if whole else concurrent.futures.FIRST_COMPLETED)
      # Each future asked once: one finishing in between would otherwise fall out of both lists.
      done = [future.done() for future, _ in pending]
      stepped = [entry for entry, ready in zip(pending, done) if ready]
      pending = [entry for entry, ready in zip(pending, done) if not ready]

      appends: dict[int, list[int]] = {}
      ended, fresh = [], []  # Rows whose episode ended, rows prefilled anew.
      for future, replies in stepped:
        for (row, generated), result in zip(replies, future.result()):
          stepping[row] = False
          continuation = self._continue(self.trajectories[held[row]], result, int(turn[row]),
                                        generated)
          if continuation is None:
            ended.append(row)
            continue
          appends[row], rewritten = continuation
          if rewritten:
            fresh.append(row)
          turn[row] += 1
      held[ended] = -1
      self._count_ended(len(ended))
      if ended and self.queue:
        refills = self._start(slots, ended, (held, last, turn))
        fresh.extend(refills)
        appends.update(refills)
      state = sampler.release(state, fresh)
      if appends:
        # Reads back this group's lengths: its decode, the last work on the state, is done.
        state = sampler.append(state, appends, params=params)

  def _continue(self, trajectory: Trajectory, result: StepResult, turn: int,
                generated: list[int]) -> tuple[list[int], bool] | None:
    """Records turn `turn`'s env step; returns the tokens that continue the episode and whether
    they start a new context (a rewrite, prefilled into the emptied row), or None if it ended.
    Appended to the row's context they are the closing of a reply cut by the token limit, the
    observation turn and the assistant header."""
    trajectory.turn_rewards.append(float(result.reward))
    trajectory.info = dict(result.info)
    if result.done:
      termination = result.info.get("termination", DONE)
      _end(trajectory, termination if termination in (ENV_ERROR, ENV_TIMEOUT) else DONE,
           result.info)
      return None
    if turn + 1 == self.environments[trajectory.task_id].cap(self.horizon):
      _end(trajectory, HORIZON, result.info)
      return None
    trajectory.messages.append({"role": "user", "content": result.observation})
    # A reply cut by the token limit has no turn end yet: close it (untrained) first.
    chat = self.player.chat
    closing = chat.closing_ids(generated)
    observation = chat.continuation_ids("user", result.observation)
    context = self.player.context
    held = len(trajectory.tokens) - trajectory.context_start + len(closing) + len(observation)
    fits = held + self.player.sampling.max_new_tokens <= self.player.max_context
    if context.rewrites and (context.due(turn + 1) or not fits):
      prompt = chat.render(context.messages(trajectory.messages), add_generation_prompt=True,
                           tools=trajectory.tools)
      if len(prompt) + self.player.sampling.max_new_tokens <= self.player.max_context:
        trajectory.rewrites.append((len(trajectory.tokens), held - len(prompt)))
        trajectory.observe(prompt)
        return prompt, True
    if not fits:
      _end(trajectory, CONTEXT, result.info)
      return None
    trajectory.extend(closing, trained=False)
    trajectory.observe(observation)
    return closing + observation, False

  def _start(self, slots: range, rows: Sequence[int],
             table: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict[int, list[int]]:
    """Starts the queue's next episodes on the free `rows`, each reset on its row's pool slot,
    and enters them in `table` (`play`'s held, last and turn per row); a row whose episode
    cannot start (its environment failed, or the prompt does not fit the context) takes the
    next one. Returns each started row's prompt."""
    held, last, turn = table
    prompts: dict[int, list[int]] = {}
    rows = list(rows)
    while rows and self.queue:
      starts = [(row, self.queue.popleft()) for row in rows[:len(self.queue)]]
      rows = rows[len(starts):]
      resets = self.player.pool.reset_async([
          (slots.start + row, self.trajectories[i].task_id) for row, i in starts
      ])
      for (row, i), result in zip(starts, self.timeline.env(resets).result()):
        prompt = self._prompt(self.trajectories[i], result)
        if prompt is None:
          self._count_ended(1)
          rows.append(row)
          continue
        held[row], last[row], turn[row] = i, i, 0
        prompts[row] = prompt
    return prompts

  def _prompt(self, trajectory: Trajectory, result: StepResult) -> list[int] | None:
    """Records an episode's first observation; returns its prompt, or None if the episode ended
    there (its environment failed to start it, or the prompt does not fit the context)."""
    if result.done:  # The environment failed to start the episode.
      _end(trajectory, result.info.get("termination", ENV_ERROR), result.info)
      return None
    pool, chat = self.environments[trajectory.task_id].pool, self.player.chat
    trajectory.messages.append(
        {"role": "user", "content": f"{pool.instruction}\n\n{result.observation}"})
    trajectory.tools = pool.tools
    prompt = chat.render(trajectory.messages, add_generation_prompt=True, tools=pool.tools)
    if len(prompt) + self.player.sampling.max_new_tokens > self.player.max_context:
      _end(trajectory, CONTEXT, {"reason": f"prompt of {len(prompt)} tokens"})
      return None
    trajectory.observe(prompt)
    return prompt

  def _count_ended(self, count: int) -> None:
    if count:
      self.ended += count
      if self.progress is not None:
        self.progress(self.ended)

  def _context(self, index: int) -> list[int]:
    """What the row playing trajectory `index` holds: its tokens since its context started."""
    trajectory = self.trajectories[index]
    return trajectory.tokens[trajectory.context_start:]

  def _lengths(self, last: np.ndarray) -> np.ndarray:
    """The tokens each sampler row holds: the context of the trajectory it last took, kept token
    for token (0 for a row that never took one). Passed to `generate` so that it does not wait for
    this group's prefill, queued behind another group's decode, before it can queue its own
    decode."""
    lengths = np.zeros(len(last), np.int32)
    for row in np.flatnonzero(last >= 0):
      trajectory = self.trajectories[last[row]]
      lengths[row] = len(trajectory.tokens) - trajectory.context_start
    return lengths


def _round_robin(players: list[Iterator[None]]) -> None:
  """Advances each generator by one step in turn until every one is exhausted."""
  finished = object()
  while players:
    players = [player for player in players if next(player, finished) is not finished]


class _Timeline:
  """When the device generated and the env pool worked during one rollout (host clock).

  A decode's interval runs from its call to its outputs being ready, which a watcher thread
  per group waits for; an env batch's from its submission to its future's completion. Time
  queued behind other work of the same kind counts as busy: that work was running.
  """

  def __init__(self, groups: int):
    self._watcher = concurrent.futures.ThreadPoolExecutor(max_workers=groups,
                                                          thread_name_prefix="rollout-timeline")
    self._device: list[concurrent.futures.Future[tuple[float, float]]] = []
    self._env: list[tuple[float, float]] = []

  def __enter__(self) -> _Timeline:
    return self

  def __exit__(self, *exc_info) -> None:
    self._watcher.shutdown(wait=True)

  def device(self, started: float, output: Any) -> None:
    self._device.append(self._watcher.submit(_ready_interval, started, output))

  def env(self, future: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
    """Watches a pool call; wait on the returned future, which resolves once it is timed."""
    started = time.perf_counter()
    timed: concurrent.futures.Future[T] = concurrent.futures.Future()

    def finished(done: concurrent.futures.Future[T]) -> None:
      self._env.append((started, time.perf_counter()))
      if done.exception() is not None:
        timed.set_exception(done.exception())
      else:
        timed.set_result(done.result())

    future.add_done_callback(finished)
    return timed

  def stats(self, rows: RolloutStats) -> RolloutStats:
    """`rows`' row-step counts with the busy times; call after every future it watches has
    resolved."""
    device = _union([future.result() for future in self._device])
    env = _union(self._env)
    return dataclasses.replace(rows, generate_s=_length(device), env_s=_length(env),
                               env_hidden_s=_length(_intersection(device, env)))


def _ready_interval(started: float, arrays: Any) -> tuple[float, float]:
  jax.block_until_ready(arrays)
  return started, time.perf_counter()


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  """Sorted disjoint intervals covering the same time."""
  merged: list[tuple[float, float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float,
                                                              float]]) -> list[tuple[float, float]]:
  """The time in both of two sorted disjoint interval lists."""
  return [(max(s, t), min(e, f)) for s, e in a for t, f in b if max(s, t) < min(e, f)]


def _length(intervals: list[tuple[float, float]]) -> float:
  return sum(end - start for start, end in intervals)


def _category(pool: EnvPool | MixturePool, task_id: int) -> str:
  try:
    return str(pool.task_info(task_id).get("category", ""))
  except EnvError:  # The env is down: the episode's reset fails too and records why.
    return ""


def _end(trajectory: Trajectory, termination: str, info: dict[str, Any]) -> None:
  trajectory.termination = termination
  trajectory.success = bool(info.get("success", False))
  trajectory.error = str(info.get("error", ""))


@dataclasses.dataclass(frozen=True)
class OverlongBuffer:
  """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per reply: with L_max the turn's
  max_new_tokens, L_cache the buffer's `length` and f its `penalty_factor`,

    R(y) = 0                                  |y| <= L_max - L_cache
    R(y) = f ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max

  so a reply that fills its whole budget loses f, and one that stops L_cache tokens short
  loses nothing (as verl's overlong_buffer: len, penalty_factor). A reply never exceeds L_max:
  the sampler stops there."""

  length: int
  penalty_factor: float
  max_new_tokens: int

  def __post_init__(self):
    if not 0 < self.length <= self.max_new_tokens or self.penalty_factor < 0:
      raise ValueError(f"an overlong buffer of {self.length} tokens (penalty factor "
                       f"{self.penalty_factor}) must be in (0, {self.max_new_tokens}], its "
                       "factor >= 0")

  def penalty(self, reply_length: int) -> float:
    expected = self.max_new_tokens - self.length
    return self.penalty_factor * min((expected - reply_length) / self.length, 0.0)


@dataclasses.dataclass(frozen=True)
class EpisodeScoring:
  """How a rollout's episodes enter the loss: which are left out of it, and each turn's reward.

  Attributes:
    failed_episodes: an episode whose environment failed (an error or a step timeout) is left
      out ("exclude") or kept with reward 0 ("zero_reward", every turn's reward 0 too).
    truncated_episodes: an episode cut short (`TRUNCATIONS`: the turn cap, the context limit or
      a step timeout) keeps the rewards it earned, 0 for an unfinished task ("fail"), or is
      left out ("mask", rLLM's compact filtering): it neither trains nor moves its group's
      baseline, so a short horizon does not teach that long plans fail. Under "fail" a timeout
      is an environment failure, as `failed_episodes` says.
    overlong: DAPO's soft penalty of each reply, added to its turn's reward; None: none.

  An episode left out keeps its tokens in the batch with loss mask 0 and a group of its own.
  """

  failed_episodes: str = "exclude"
  truncated_episodes: str = "fail"
  overlong: OverlongBuffer | None = None

  def __post_init__(self):
    if self.failed_episodes not in ("exclude", "zero_reward"):
      raise ValueError(f"failed_episodes={self.failed_episodes!r} is not 'exclude' or "
                       "'zero_reward'")
    if self.truncated_episodes not in ("fail", "mask"):
      raise ValueError(f"truncated_episodes={self.truncated_episodes!r} is not 'fail' or 'mask'")

  def excluded(self, trajectory: Trajectory) -> bool:
    """Whether the episode is left out of the loss."""
    return ((trajectory.env_failed and self.failed_episodes == "exclude")
            or (trajectory.truncated and self.truncated_episodes == "mask"))

  def turn_rewards(self, trajectory: Trajectory) -> list[float]:
    """Each turn's reward as the loss sees it: the environment's (0 if it failed), plus the
    overlong penalty of the turn's reply."""
    rewards = [0.0] * trajectory.num_turns if trajectory.env_failed else trajectory.turn_rewards
    if self.overlong is None:
      return list(rewards)
    return [
        reward + self.overlong.penalty(length)
        for reward, length in zip(rewards, trajectory.reply_lengths())
    ]

  def reward(self, trajectory: Trajectory) -> float:
    """The episode's reward as the loss sees it: the sum of its `turn_rewards`."""
    return float(sum(self.turn_rewards(trajectory)))

  def metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The share of episodes cut short (rollout/truncated_fraction, and per reason), the share
    left out of the loss (rollout/excluded_fraction) and, with an overlong buffer, the mean
    penalty of an episode and the share of replies penalised."""
    count = max(len(trajectories), 1)
    share = lambda condition: sum(map(condition, trajectories)) / count
    out = {
        "rollout/truncated_fraction": share(lambda t: t.truncated),
        "rollout/excluded_fraction": share(self.excluded),
        **{
            f"rollout/truncated_fraction/{reason}": share(lambda t, r=reason: t.termination == r)
            for reason in TRUNCATIONS
        },
    }
    if self.overlong is not None:
      penalties = [self.overlong.penalty(n) for t in trajectories for n in t.reply_lengths()]
      out["rollout/overlong_penalty"] = sum(penalties) / count
      out["rollout/overlong_replies"] = sum(p < 0 for p in penalties) / max(len(penalties), 1)
    return out


def context_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """The contexts the rows held: the longest of any episode (context/peak_tokens), and per
  episode the rewrites (context/rewrites) and the tokens they left out of the rows
  (context/tokens_saved)."""
  count = max(len(trajectories), 1)
  return {
      "context/peak_tokens": max((max(t.context_lengths()) for t in trajectories), default=0),
      "context/rewrites": sum(len(t.rewrites) for t in trajectories) / count,
      "context/tokens_saved": sum(saved for t in trajectories for _, saved in t.rewrites) / count,
  }


def environment_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """Per environment (Trajectory.env) of a mixture's episodes, means over its own: the share
  that succeeded (env/<name>/success), the reward (env/<name>/reward), the turns
  (env/<name>/turns) and the share cut short (env/<name>/truncated_fraction), with the episodes
  played (env/<name>/episodes); an environment without episodes has none."""
  by_env: dict[str, list[Trajectory]] = collections.defaultdict(list)
  for trajectory in trajectories:
    by_env[trajectory.env].append(trajectory)
  out = {}
  for name, episodes in sorted(by_env.items()):
    out.update({
        f"env/{name}/success": float(np.mean([t.success for t in episodes])),
        f"env/{name}/reward": float(np.mean([t.reward for t in episodes])),
        f"env/{name}/turns": float(np.mean([t.num_turns for t in episodes])),
        f"env/{name}/truncated_fraction": float(np.mean([t.truncated for t in episodes])),
        f"env/{name}/episodes": float(len(episodes)),
    })
  return out


def pack(trajectories: Sequence[Trajectory], *, length: int | None = None, turns: int | None = None,
         scoring: EpisodeScoring = EpisodeScoring(), shared_prompts: bool = False,
         packed_rows_multiple: int = 1, contexts: bool = False) -> Batch:
  """Right-pads trajectories into a Batch of len(trajectories) rows with `turns` turn slots (at
  least the most turns of any trajectory; by default exactly that).

  With `contexts` (needed by a trajectory with context rewrites) the batch carries each token's
  context and the windows its contexts are packed into (Batch.contexts, Batch.context_spans):
  a row holds its episode's contexts one after another, each read by the learner as its own
  sequence.

  With `shared_prompts` the batch also carries the shared-prompt layout (batch.share_prompts):
  the trajectories of one task (one `Trajectory.group`, failed ones included) packed as one row
  of their common prompt and their continuations, padded to a multiple of
  `packed_rows_multiple` packed rows.

  `scoring` says which trajectories the loss leaves out (their loss mask is zeroed, they have
  no turns, and each moves to a group of its own, so it does not shift its task's GRPO/RLOO
  baseline) and the rewards of the others. Group ids stay below 2 * len(trajectories), the
  static `num_groups` of the advantage estimators.

  Turn k of a row is its k-th run of generated tokens. Its anchor is the step group of GiGPO:
  the turns of one task whose observations (`Trajectory.observation_spans`) are the same token
  ids get the same id, numbered from 0 in order of first appearance.
  """
  num_rows = len(trajectories)
  longest = max((len(t.tokens) for t in trajectories), default=1)
  length = length or packed_length(longest)
  if longest > length:
    raise ValueError(f"a trajectory has {longest} tokens, more than the packed length {length}")
  most_turns = max((t.num_turns for t in trajectories), default=0)
  turns = most_turns if turns is None else turns
  if most_turns > turns:
    raise ValueError(f"a trajectory has {most_turns} turns, more than the {turns} turn slots")
  tokens = np.zeros((num_rows, length), np.int32)
  loss_mask = np.zeros((num_rows, length), np.float32)
  logprobs = np.zeros((num_rows, length), np.float32)
  rewards = np.zeros((num_rows,), np.float32)
  groups = np.zeros((num_rows,), np.int32)
  turn_index = np.full((num_rows, length), -1, np.int32)
  turn_rewards = np.zeros((num_rows, turns), np.float32)
  turn_anchors = np.full((num_rows, turns), -1, np.int32)
  if not contexts and any(t.rewrites for t in trajectories):
    raise ValueError("a trajectory was played in several contexts: pack it with contexts=True")
  context_ids = np.full((num_rows, length), -1, np.int32) if contexts else None
  sizes = [t.context_lengths() for t in trajectories] if contexts else None
  anchors: dict[tuple[int, tuple[int, ...]], int] = {}
  for i, t in enumerate(trajectories):
    n = len(t.tokens)
    excluded = scoring.excluded(t)
    tokens[i, :n] = t.tokens
    if contexts:
      context_ids[i, :n] = np.repeat(np.arange(len(sizes[i])), sizes[i])
    logprobs[i, :n] = t.sampler_logprobs
    rewards[i] = scoring.reward(t)
    groups[i] = num_rows + i if excluded else t.group
    if excluded:
      continue
    loss_mask[i, :n] = t.loss_mask
    turn_index[i, :n] = _turn_index(t, i)
    turn_rewards[i, :t.num_turns] = scoring.turn_rewards(t)
    for k, (start, end) in enumerate(t.observation_spans):
      key = (t.group, tuple(t.tokens[start:end]))
      turn_anchors[i, k] = anchors.setdefault(key, len(anchors))
  shared = None
  if shared_prompts:
    if contexts:
      raise ValueError("shared prompts and context rewrites do not combine")
    lengths = np.asarray([len(t.tokens) for t in trajectories])
    # Where each row's first reply starts: its prompt (all of it for a row without a reply).
    prompt_ends = np.asarray(
        [t.observation_spans[0][1] if t.observation_spans else len(t.tokens) for t in trajectories])
    shared = share_prompts(tokens, lengths, prompt_ends, [t.group for t in trajectories],
                           rows_multiple=packed_rows_multiple)
  return Batch(tokens=tokens, loss_mask=loss_mask, sampler_logprobs=logprobs, rewards=rewards,
               group_ids=groups, turn_index=turn_index, turn_rewards=turn_rewards,
               turn_anchors=turn_anchors, shared=shared, contexts=context_ids,
               **(context_windows(sizes, length) if contexts else {}))


def _turn_index(trajectory: Trajectory, row: int) -> np.ndarray:
  """k on the tokens of the trajectory's k-th run of generated tokens, -1 elsewhere; checks
  that it has one observation, one reply and one reward a turn."""
  trained = np.asarray(trajectory.loss_mask, bool)
  starts = trained & ~np.concatenate([[False], trained[:-1]])
  replies = int(starts.sum())
  if not replies == trajectory.num_turns == len(trajectory.observation_spans):
    raise ValueError(f"trajectory {row} has {replies} replies, {trajectory.num_turns} turn "
                     f"rewards and {len(trajectory.observation_spans)} observations; a rollout "
                     "records one of each a turn")
  return np.where(trained, np.cumsum(starts) - 1, -1)

"""Multi-turn rollouts: the sampler and the environment pool taking turns, token in, token out.

For B tasks x n samples, every trajectory is one row of the sampler's KV cache and one slot of
the env pool. Each turn:
  1. the sampler generates the assistant turn of every live row (stopping at the turn end);
  2. the replies (decoded once, for the environment only) go to the pool, concurrently;
  3. each observation is rendered as the next user turn plus the assistant header and appended
     to that row's live cache; finished rows drop out.
The trajectory keeps exactly the token ids the sampler saw, so the learner never re-tokenizes
text and sampler and learner agree token for token (the reference re-tokenizes every turn).

A trajectory ends when the environment says done, at the horizon cap (ScalingInter-RL), when
the next turn would not fit the context, or when the environment fails (recorded, never fatal).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.learner import Batch
from agentgym_jax.models.tokenizer import ChatTemplate
from agentgym_jax.sampling import Sampler
from environments.base import EnvError
from environments.pool import EnvPool

# Why a trajectory ended.
DONE, HORIZON, CONTEXT, ENV_ERROR, ENV_TIMEOUT = (
    "done", "horizon", "context", "env_error", "env_timeout")


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
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  success: bool = False
  termination: str = ""
  error: str = ""
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

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

  def extend(self, tokens: Sequence[int], trained: bool,
             logprobs: Sequence[float] | None = None) -> None:
    self.tokens.extend(int(t) for t in tokens)
    self.loss_mask.extend([int(trained)] * len(tokens))
    self.sampler_logprobs.extend(
        [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(tokens))

  def to_json(self) -> dict[str, Any]:
    return {"task_id": self.task_id, "group": self.group, "env": self.env,
            "category": self.category, "reward": self.reward,
            "success": self.success, "num_turns": self.num_turns,
            "termination": self.termination, "error": self.error,
            "turn_rewards": self.turn_rewards, "messages": self.messages,
            "num_tokens": len(self.tokens), "num_trained_tokens": int(sum(self.loss_mask)),
            "info": _jsonable(self.info)}


def _jsonable(value: Any) -> Any:
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)


@dataclasses.dataclass(frozen=True)
class TurnSampling:
  """How each assistant turn is sampled."""

  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0


@dataclasses.dataclass
class RolloutStats:
  generate_s: float = 0.0
  env_s: float = 0.0
  generated_tokens: int = 0


def collect(sampler: Sampler, params: Any, pool: EnvPool, chat: ChatTemplate,
            tasks: Sequence[tuple[int, int]], *, horizon: int, sampling: TurnSampling,
            max_context: int, key: jax.Array, first_row: int = 0
            ) -> tuple[list[Trajectory], RolloutStats]:
  """Plays one episode per (task_id, group) in `tasks`, all at once, up to `horizon` turns.

  Row i of the sampler and slot i of the pool belong to trajectory i. The recorded log-probs
  are the sampler's log q(token) under the distribution it actually drew from. Turn t of
  trajectory i draws from fold_in(fold_in(key, t), first_row + i): a process playing rows
  from `first_row` of a larger batch samples what one sampler holding every row would.
  """
  if len(tasks) > min(pool.num_slots, sampler.max_batch):
    raise ValueError(f"{len(tasks)} trajectories need as many env slots and sampler rows; "
                     f"the pool has {pool.num_slots}, the sampler {sampler.max_batch}")
  stats = RolloutStats()
  categories = {t: _category(pool, t) for t in {t for t, _ in tasks}}
  trajectories = [Trajectory(task_id=t, group=g, env=pool.env_name, category=categories[t])
                  for t, g in tasks]
  tokenizer = chat.tokenizer
  start = time.perf_counter()
  first = pool.reset([(i, t.task_id) for i, t in enumerate(trajectories)])
  stats.env_s += time.perf_counter() - start
  instruction = pool.instruction
  live = np.zeros(len(tasks), bool)
  prompts: list[list[int]] = []
  prompts: dict[int, list[int]] = {}
  for i, (trajectory, result) in enumerate(zip(trajectories, first)):
    if result.done:  # The environment failed to start the episode.
      _end(trajectory, result.info.get("termination", ENV_ERROR), result.info)
      continue
    trajectory.messages.append({"role": "user",
                                "content": f"{instruction}\n\n{result.observation}"})
    prompt = chat.render(trajectory.messages, add_generation_prompt=True)
    if len(prompt) + sampling.max_new_tokens > max_context:
      _end(trajectory, CONTEXT, {"reason": f"prompt of {len(prompt)} tokens"})
      continue
    trajectory.extend(prompt, trained=False)
    prompts[i] = prompt
    live[i] = True

  state = sampler.append(sampler.empty(), prompts, params=params)
  for turn in range(horizon):
    if not live.any():
      break
    start = time.perf_counter()
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.fold_in(key, turn), first_row + jnp.arange(sampler.max_batch))
    state, output = sampler.generate(
        state, row_keys, max_new_tokens=sampling.max_new_tokens,
        stop_ids=chat.turn_end_ids, rows=np.flatnonzero(live).tolist(),
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        params=params)
    tokens = output.token_lists()
    logprobs = np.asarray(jax.device_get(output.sampling_logprobs))
    stats.generate_s += time.perf_counter() - start
    requests = []
    for i in np.flatnonzero(live):
      generated = tokens[i]
      stats.generated_tokens += len(generated)
      trajectories[i].extend(generated, trained=True, logprobs=logprobs[i, :len(generated)])
      reply = [t for t in generated if t not in chat.turn_end_ids]
      text = tokenizer.decode(reply, skip_special_tokens=True)
      trajectories[i].messages.append({"role": "assistant", "content": text})
      requests.append((int(i), text))
    start = time.perf_counter()
    results = pool.step(requests)
    stats.env_s += time.perf_counter() - start

    appends: dict[int, list[int]] = {}
    for (i, _), result in zip(requests, results):
      trajectory = trajectories[i]
      trajectory.turn_rewards.append(float(result.reward))
      trajectory.info = dict(result.info)
      if result.done:
        termination = result.info.get("termination", DONE)
        _end(trajectory, termination if termination in (ENV_ERROR, ENV_TIMEOUT) else DONE,
             result.info)
        live[i] = False
        continue
      if turn + 1 == horizon:
        _end(trajectory, HORIZON, result.info)
        live[i] = False
        continue
      trajectory.messages.append({"role": "user", "content": result.observation})
      # A reply cut by the token limit has no turn end yet: close it (untrained) first.
      closing = [] if tokens[i][-1:] == [chat.im_end_id] else [chat.im_end_id]
      continuation = closing + chat.continuation_ids("user", result.observation)
      if len(trajectory.tokens) + len(continuation) + sampling.max_new_tokens > max_context:
        _end(trajectory, CONTEXT, result.info)
        live[i] = False
        continue
      trajectory.extend(continuation, trained=False)
      appends[i] = continuation
    if appends:
      state = sampler.append(state, appends, params=params)
  return trajectories, stats


def _category(pool: EnvPool, task_id: int) -> str:
  try:
    return str(pool.task_info(task_id).get("category", ""))
  except EnvError:  # The env is down: the episode's reset fails too and records why.
    return ""


def _end(trajectory: Trajectory, termination: str, info: dict[str, Any]) -> None:
  trajectory.termination = termination
  trajectory.success = bool(info.get("success", False))
  trajectory.error = str(info.get("error", ""))


def bucket(length: int, minimum: int = 128) -> int:
  """Rounds a length up to a power of two (at least `minimum`): few distinct shapes to compile."""
  return max(minimum, 1 << math.ceil(math.log2(max(length, 1))))


def pack(trajectories: Sequence[Trajectory], *, length: int | None = None,
         failed_episodes: str = "exclude") -> Batch:
  """Right-pads trajectories into a Batch of len(trajectories) rows.

  A trajectory whose environment failed is dropped from the loss ("exclude": its loss mask is
  zeroed and it moves to a group of its own, so it does not shift its task's GRPO/RLOO
  baseline) or kept with reward 0 ("zero_reward"). Group ids stay below 2 * len(trajectories),
  the static `num_groups` of the advantage estimators.
  """
  if failed_episodes not in ("exclude", "zero_reward"):
    raise ValueError(f"failed_episodes={failed_episodes!r} is not 'exclude' or 'zero_reward'")
  num_rows = len(trajectories)
  longest = max((len(t.tokens) for t in trajectories), default=1)
  length = length or bucket(longest)
  if longest > length:
    raise ValueError(f"a trajectory has {longest} tokens, more than the packed length {length}")
  tokens = np.zeros((num_rows, length), np.int32)
  loss_mask = np.zeros((num_rows, length), np.float32)
  logprobs = np.zeros((num_rows, length), np.float32)
  rewards = np.zeros((num_rows,), np.float32)
  groups = np.zeros((num_rows,), np.int32)
  for i, t in enumerate(trajectories):
    n = len(t.tokens)
    excluded = t.env_failed and failed_episodes == "exclude"
    tokens[i, :n] = t.tokens
    if not excluded:
      loss_mask[i, :n] = t.loss_mask
    logprobs[i, :n] = t.sampler_logprobs
    rewards[i] = 0.0 if t.env_failed else t.reward
    groups[i] = num_rows + i if excluded else t.group
  return Batch(tokens=tokens, loss_mask=loss_mask, sampler_logprobs=logprobs, rewards=rewards,
               group_ids=groups)

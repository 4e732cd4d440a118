"""GiGPO: step groups of turns from the same state, worked by hand on TextCraft- and BabyAI-like
episodes; the anchors and turns rollout.pack computes; the observation spans a rollout records;
and the estimator inside the learner."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from agentgym_jax import config as config_lib
from agentgym_jax import learner, rollout
from agentgym_jax.models import load_model
from agentgym_jax.rl import advantages as adv
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool
from rl_helpers import check_config

gigpo = jax.jit(adv.gigpo_advantages, static_argnames=("num_groups",))

# Three samples of one TextCraft task ("craft a stick"), three turns each; observations:
#   P  the prompt (goal and crafting commands), which every sample starts from
#   X  "Got 1 oak log"            Y  "Crafted 4 oak planks"
#   Z  "Inventory: [empty]"       W  "Could not find enough items to craft a stick"
# A: P -get log-> X -craft planks-> Y -craft stick-> success      turn rewards [0, 0, 1]
# B: P -inventory-> Z -get log-> X -craft stick-> horizon         turn rewards [0, 0, 0]
# C: P -get log-> X -craft stick-> W -get log-> horizon            turn rewards [0, 0, 0]
# X is one inventory reached along two paths (A and C at turn 1, B at turn 2).
# Tokens: observation (-1) and turn k (k) per position, as rollout.pack lays them out.
TEXTCRAFT_TURN_INDEX = np.array([[-1, -1, 0, 0, -1, 1, -1, 2, 2], [-1, -1, 0, -1, 1, 1, -1, 2, -1],
                                 [-1, -1, 0, -1, 1, -1, 2, 2, 2]], np.int32)
P, X, Y, Z, W = range(5)
TEXTCRAFT_ANCHORS = np.array([[P, X, Y], [P, Z, X], [P, X, W]], np.int32)
TEXTCRAFT_TURN_REWARDS = np.array([[0, 0, 1], [0, 0, 0], [0, 0, 0]], np.float32)


def textcraft(**options):
  mask = (TEXTCRAFT_TURN_INDEX >= 0).astype(np.float32)
  turns = adv.Turns(TEXTCRAFT_TURN_INDEX, TEXTCRAFT_TURN_REWARDS, TEXTCRAFT_ANCHORS)
  return gigpo(jnp.array([1.0, 0.0, 0.0]), mask, jnp.zeros(3, jnp.int32), turns, num_groups=1,
               **options)


def per_turn(token_values):
  """[row][turn] values read off the tokens of each turn (all equal within a turn)."""
  token_values = np.asarray(token_values)
  out = []
  for row, index in zip(token_values, TEXTCRAFT_TURN_INDEX):
    turns = [row[index == k] for k in range(index.max() + 1)]
    assert all(np.ptp(values) == 0 for values in turns)  # One value a turn.
    out.append([values[0] for values in turns])
  return np.array(out)


def test_textcraft_worked_example_without_std():
  # gamma 0.5: returns A [0.25, 0.5, 1], B and C [0, 0, 0].
  # Episode level: rewards [1, 0, 0], mean 1/3 -> A^E = [2/3, -1/3, -1/3].
  # Step groups: P = {A0, B0, C0}: returns [0.25, 0, 0], mean 1/12 -> [1/6, -1/12, -1/12];
  # X = {A1, B2, C1}: [0.5, 0, 0], mean 1/6 -> [1/3, -1/6, -1/6]; Y, Z, W singletons -> 0.
  # A = A^E + A^S: A [5/6, 1, 2/3], B [-5/12, -1/3, -1/2], C [-5/12, -1/2, -1/3]: B's move
  # at X (crafting a stick without planks) is worse than its inventory check.
  out = textcraft(gamma=0.5, scoring=adv.GroupScoring(normalize_by_std=False))
  np.testing.assert_allclose(per_turn(
      out.advantages), [[5 / 6, 1, 2 / 3], [-5 / 12, -1 / 3, -1 / 2], [-5 / 12, -1 / 2, -1 / 3]],
                             atol=1e-6)
  np.testing.assert_allclose(per_turn(out.returns), [[0.25, 0.5, 1], [0, 0, 0], [0, 0, 0]])
  assert np.all(np.asarray(out.advantages)[TEXTCRAFT_TURN_INDEX < 0] == 0)


def test_textcraft_worked_example_with_std_and_step_weight():
  # Population std: every group above holds one value v > 0 and two zeros, whose scores are
  # (2v/3, -v/3, -v/3) / (sqrt(2) v / 3) = [sqrt(2), -1/sqrt(2), -1/sqrt(2)]: the episode level,
  # P and X alike. omega = 0.5: A = [s2 + s2/2, s2 + s2/2, s2] for A, ...
  s2, h = np.sqrt(2), 1 / np.sqrt(2)
  out = textcraft(gamma=0.5, step_weight=0.5, scoring=adv.GroupScoring(eps=0.0))
  np.testing.assert_allclose(
      per_turn(out.advantages),
      [[1.5 * s2, 1.5 * s2, s2], [-1.5 * h, -h, -1.5 * h], [-1.5 * h, -1.5 * h, -h]], rtol=1e-5)
  # torch.std (Bessel) divides by sqrt(3/2) more at both levels: scores times sqrt(2/3).
  unbiased = textcraft(gamma=0.5, step_weight=0.5,
                       scoring=adv.GroupScoring(std="unbiased", eps=0.0))
  np.testing.assert_allclose(unbiased.advantages,
                             np.asarray(out.advantages) * np.sqrt(2 / 3), rtol=1e-5)


def test_step_weight_zero_is_grpo():
  mask = (TEXTCRAFT_TURN_INDEX >= 0).astype(np.float32)
  out = textcraft(gamma=0.9, step_weight=0.0)
  grpo = adv.grpo_advantages(jnp.array([1.0, 0.0, 0.0]), mask, jnp.zeros(3, jnp.int32),
                             num_groups=1)
  np.testing.assert_allclose(out.advantages, grpo, atol=1e-6)


def test_babyai_state_revisited_within_an_episode_and_across_tasks():
  # BabyAI: two samples of task 0 and one of task 1, two turns each, gamma 1, no std.
  # Task 0, row 0: "toggle" at view V -> "Nothing happens" N (reward 0) -> "pickup" at N -> 1.
  #         row 1: "forward" at V -> V again (a wall: the same view) -> "toggle" at V -> 0.
  # Task 1, row 2: the same view V's tokens, but another task: its own groups.
  # Step groups: task 0's V = {row 0 turn 0, row 1 turn 0, row 1 turn 1} with returns
  # [1, 0, 0] -> mean 1/3 -> [2/3, -1/3, -1/3]; N = {row 0 turn 1}: 0; task 1's V: 0.
  # Episode level: task 0 rewards [1, 0], mean 1/2 -> [1/2, -1/2]; task 1 alone -> 0.
  turn_index = np.array([[-1, 0, -1, 1], [-1, 0, -1, 1], [-1, 0, -1, 1]], np.int32)
  mask = (turn_index >= 0).astype(np.float32)
  anchors = np.array([[0, 1], [0, 0], [2, 3]], np.int32)
  turn_rewards = np.array([[0, 1], [0, 0], [0, 1]], np.float32)
  out = gigpo(jnp.array([1.0, 0.0, 1.0]), mask, jnp.array([0, 0, 1]),
              adv.Turns(turn_index, turn_rewards, anchors), num_groups=2,
              scoring=adv.GroupScoring(normalize_by_std=False))
  np.testing.assert_allclose(
      np.asarray(out.advantages)[:, [1, 3]],
      [[1 / 2 + 2 / 3, 1 / 2], [-1 / 2 - 1 / 3, -1 / 2 - 1 / 3], [0, 0]], atol=1e-6)


def test_slots_without_a_turn_do_not_enter_any_group():
  # Row 1 played one turn of two slots; its empty slot (anchor -1, reward 0) must not join the
  # group of row 0's second turn, nor lower its mean. Row 0 turn 1 is alone -> 0.
  turn_index = np.array([[0, -1, 1], [0, -1, -1]], np.int32)
  mask = (turn_index >= 0).astype(np.float32)
  turns = adv.Turns(turn_index, jnp.array([[0.0, 1.0], [0.0, 0.0]]), jnp.array([[0, 1], [0, -1]]))
  out = gigpo(jnp.array([1.0, 0.0]), mask, jnp.zeros(2, jnp.int32), turns, num_groups=1,
              scoring=adv.GroupScoring(normalize_by_std=False))
  # Episode: [1/2, -1/2]. Step group 0: returns [1, 0] -> [1/2, -1/2].
  np.testing.assert_allclose(out.advantages, [[1, 0, 1 / 2], [-1, 0, 0]], atol=1e-6)


def test_step_group_metrics_count_the_turns_that_share_a_state():
  # TextCraft example: P = {A0, B0, C0} and X = {A1, B2, C1} hold 3 turns, Y, Z, W 1 each.
  # Sizes [[3, 3, 1], [3, 1, 3], [3, 3, 1]]: mean 21 / 9; turns after the first in a group of
  # more than one: A1, B2, C1 of the six -> 1/2.
  metrics = adv.step_group_metrics(jnp.asarray(TEXTCRAFT_ANCHORS))
  np.testing.assert_allclose(metrics["step_group_size"], 7 / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["anchored_turns"], 0.5)
  # Empty slots (-1) count nowhere: sizes [[2, 1], [2, -]] -> 5/3; the one later turn is alone.
  metrics = adv.step_group_metrics(jnp.array([[0, 1], [0, -1]]))
  np.testing.assert_allclose(metrics["step_group_size"], 5 / 3, rtol=1e-6)
  assert metrics["anchored_turns"] == 0.0
  # One-turn episodes have no later turns: 0, not NaN.
  assert adv.step_group_metrics(jnp.array([[0], [0]]))["anchored_turns"] == 0.0


def _trajectory(group, turns, *, termination=rollout.DONE):
  """A trajectory of (observation tokens, reply tokens, reward) turns; a reply that does not
  end with token 1 (the turn end) is closed by an untrained 1, as the rollout does."""
  t = rollout.Trajectory(task_id=group, group=group, termination=termination)
  for observation, reply, reward in turns:
    if t.tokens and t.tokens[-1] != 1:
      t.extend([1], trained=False)
    t.observe(observation)
    t.extend(reply, trained=True, logprobs=[-0.5] * len(reply))
    t.turn_rewards.append(reward)
  return t


def test_pack_numbers_anchor_states_per_task_and_marks_turns():
  prompt, seen, other = [7, 8, 9], [5, 6], [5, 5]
  batch = rollout.pack(
      [
          _trajectory(0, [(prompt, [2, 1], 0.0), (seen, [3, 4], 0.0), (seen, [2, 1], 1.0)]),
          _trajectory(0, [(prompt, [3, 1], 0.0), (other, [4, 1], 0.0)]),
          # The same prompt and observation tokens in another task: other anchors.
          _trajectory(1, [(prompt, [2, 1], 0.0), (seen, [2, 1], 0.0)])
      ],
      length=16,
      turns=4)
  # Row 0's second reply [3, 4] was cut (no turn end): the untrained closing 1 before the next
  # observation is not part of that observation, so its third turn is in `seen`'s group too.
  np.testing.assert_array_equal(batch.turn_anchors, [[0, 1, 1, -1], [0, 2, -1, -1], [3, 4, -1, -1]])
  np.testing.assert_array_equal(batch.turn_rewards[0], [0, 0, 1, 0])
  np.testing.assert_array_equal(batch.turn_index[0],
                                [-1, -1, -1, 0, 0, -1, -1, 1, 1, -1, -1, -1, 2, 2, -1, -1])
  np.testing.assert_array_equal(batch.turn_index >= 0, batch.loss_mask > 0)


@pytest.mark.parametrize("failed_episodes", ["exclude", "zero_reward"])
def test_pack_gives_a_failed_episode_no_turns_or_no_reward(failed_episodes):
  turns = [([7, 8], [2, 1], 0.0), ([5], [3, 1], 1.0)]
  batch = rollout.pack(
      [_trajectory(0, turns), _trajectory(0, turns, termination="env_error")],
      scoring=rollout.EpisodeScoring(failed_episodes))
  assert batch.turn_rewards.shape == (2, 2)
  if failed_episodes == "exclude":
    np.testing.assert_array_equal(batch.turn_anchors[1], [-1, -1])
    assert np.all(batch.turn_index[1] == -1)
  else:
    np.testing.assert_array_equal(batch.turn_anchors[1], batch.turn_anchors[0])
    np.testing.assert_array_equal(batch.turn_rewards, [[0, 1], [0, 0]])


def test_pack_refuses_too_few_turn_slots_and_trajectories_without_observations():
  turns = [([7, 8], [2, 1], 0.0), ([5], [3, 1], 1.0)]
  with pytest.raises(ValueError, match="2 turns, more than the 1 turn slots"):
    rollout.pack([_trajectory(0, turns)], turns=1)
  bare = rollout.Trajectory(task_id=0, group=0)
  bare.extend([7, 8], trained=False)
  bare.extend([2, 1], trained=True)
  bare.turn_rewards.append(1.0)
  with pytest.raises(ValueError, match="1 replies, 1 turn rewards and 0 observations"):
    rollout.pack([bare])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
  return load_model(str(tiny.make_checkpoint(tmp_path_factory.mktemp("tiny"))), dtype=jnp.float32)


def test_rollout_records_each_observation_the_turns_answer(policy):
  model, tokenizer = policy
  chat = tokenizer.chat
  tasks = [(100 + row // 8, row // 8) for row in range(16)]  # 2 echo tasks x 8 samples.
  sampler = Sampler(model, cache_slots=96, max_batch=len(tasks))
  with EnvPool("echo", len(tasks), options={"turns": 3}) as pool:
    player = rollout.Player(sampler, sampler.params, pool, chat,
                            rollout.TurnSampling(max_new_tokens=2), max_context=96)
    played, _ = rollout.collect(player, tasks, horizon=3, key=jax.random.key(3))
  cut = 0
  for t in played:
    users = [m["content"] for m in t.messages if m["role"] == "user"]
    assert len(t.observation_spans) == len(users) == t.num_turns
    start, end = t.observation_spans[0]
    assert t.tokens[start:end] == chat.render(t.messages[:1], add_generation_prompt=True)
    for (start, end), observation in zip(t.observation_spans[1:], users[1:]):
      assert t.tokens[start:end] == chat.continuation_ids("user", observation)
      cut += t.tokens[start - 1] == chat.reply_end_id and t.loss_mask[start - 1] == 0
  assert cut  # Some two-token replies were cut and closed outside the observation.
  batch = rollout.pack(played, turns=3)
  # Echo shows a task's samples the same symbols: the second turns of one task share an anchor,
  # and those of the other task have another, whatever the symbols.
  second = batch.turn_anchors[:, 1].reshape(2, 8)
  reached = [set(row[row >= 0].tolist()) for row in second]
  assert [len(anchors) for anchors in reached] == [1, 1]
  assert reached[0] != reached[1]


def test_learner_computes_gigpo_from_the_packed_turns(policy):
  model, _ = policy
  from flax import nnx

  graphdef, params = nnx.split(model)
  turns = [([7, 8, 6], [2, 1], 0.0), ([5, 6], [3, 1], 1.0)]  # Ids of the tiny vocabulary.
  trajectories = [_trajectory(0, turns), _trajectory(0, turns[:1] + [([5, 5], [4, 1], 0.0)])]
  batch = rollout.pack(trajectories, length=16, turns=3)
  loss = learner.LossConfig(
      advantage_estimator="gigpo",
      advantage_options=(("eps", 0.0), ("gamma", 1.0), ("normalize_by_std", False),
                         ("std", "population"), ("step_weight", 2.0)))
  experience, metrics = learner.compute_experience(learner.Networks(graphdef), (params, None), None,
                                                   batch, loss=loss, num_groups=4)
  # Episode: rewards [1, 0] -> [1/2, -1/2]. Turn 0 (one prompt): returns [1, 0] -> [1/2, -1/2];
  # turn 1 answers different observations: singletons, 0. omega = 2.
  targets = batch.turn_index[:, 1:]
  expected = np.where(targets == 0, [[1.5], [-1.5]], np.where(targets == 1, [[0.5], [-0.5]], 0))
  np.testing.assert_allclose(experience.advantages, expected, atol=1e-6)
  # Step groups: the prompt's of 2 turns, two singletons; no later turn shares its state.
  np.testing.assert_allclose(metrics["gigpo/step_group_size"], 1.5)
  assert metrics["gigpo/anchored_turns"] == 0.0


def test_config_validates_the_step_weight():
  c = config_lib.base_config()
  c.algorithm.advantage = "gigpo"
  c.algorithm.gigpo_step_weight = -1.0
  check_config(c, "gigpo_step_weight=-1.0 must be >= 0")

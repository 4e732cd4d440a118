"""ScalingInter-RL horizon schedules: caps and stages per step, config building and validation."""

import dataclasses

import ml_collections
import pytest

from agentgym_jax import horizon


@pytest.mark.parametrize(
    "caps, every, expected",
    [
        # The paper's scripts. TextCraft [10, 20, 30] every 100: steps 0-99 -> 10,
        # 100-199 -> 20, 200 onwards -> 30 (the last cap holds).
        ([10, 20, 30], 100, {0: 10, 99: 10, 100: 20, 199: 20, 200: 30, 10_000: 30}),
        ([6, 13, 20], 100, {0: 6, 150: 13, 250: 20}),  # BabyAI
        ([5, 8, 10], 100, {99: 5, 100: 8, 300: 10}),  # SearchQA
        ([8, 12, 15], 80, {79: 8, 80: 12, 159: 12, 160: 15}),  # WebArena
    ])
def test_stepwise_caps_follow_the_papers_scripts(caps, every, expected):
  schedule = horizon.make_horizon_schedule({"kind": "stepwise", "caps": caps, "every": every})
  assert {step: schedule.cap(step) for step in expected} == expected
  assert schedule.max_turns == caps[-1]


def test_stepwise_stage_is_step_over_every_capped_at_last():
  schedule = horizon.StepwiseHorizon(caps=(10, 20, 30), every=100)
  assert [schedule.stage(step) for step in (0, 99, 100, 250, 5000)] == [0, 0, 1, 2, 2]


def test_linear_schedule_adds_increment_and_saturates():
  # 10 + 8k every 50 steps, max 30: stages 0..3 -> caps 10, 18, 26, 30 (34 capped to 30).
  # The stage stops at 3 = ceil((30 - 10) / 8), where the cap stops changing.
  schedule = horizon.make_horizon_schedule(
      {"kind": "linear", "initial": 10, "increment": 8, "every": 50, "maximum": 30})
  steps = (0, 49, 50, 100, 150, 200, 10_000)
  assert [schedule.cap(step) for step in steps] == [10, 10, 18, 26, 30, 30, 30]
  assert [schedule.stage(step) for step in steps] == [0, 0, 1, 2, 3, 3, 3]
  assert schedule.num_stages == 4 and schedule.max_turns == 30


def test_linear_schedule_that_hits_maximum_exactly():
  # 10, 20, 30 with increment 10: three stages, as stepwise [10, 20, 30] would give.
  linear = horizon.LinearHorizon(initial=10, increment=10, every=100, maximum=30)
  stepwise = horizon.StepwiseHorizon(caps=(10, 20, 30), every=100)
  for step in (0, 99, 100, 199, 200, 999):
    assert (linear.cap(step), linear.stage(step)) == (stepwise.cap(step), stepwise.stage(step))


def test_fixed_schedule():
  schedule = horizon.make_horizon_schedule({"kind": "fixed", "turns": 30})
  assert [schedule.cap(step) for step in (0, 1, 10**6)] == [30, 30, 30]
  assert schedule.stage(12345) == 0 and schedule.max_turns == 30


def test_schedule_from_config_dict_is_pure_so_resume_recovers_the_stage():
  config = ml_collections.ConfigDict({"kind": "stepwise", "caps": [10, 20, 30], "every": 100})
  before_restart = horizon.make_horizon_schedule(config)
  after_restart = horizon.make_horizon_schedule(config)
  assert before_restart == after_restart
  assert after_restart.caps == (10, 20, 30)
  # Resuming at step 150 needs nothing but the step.
  assert (after_restart.stage(150), after_restart.cap(150)) == (1, 20)
  with pytest.raises(dataclasses.FrozenInstanceError):
    after_restart.every = 5


_BAD_CONFIGS = [
    ({"kind": "cosine", "turns": 3},
     "Unknown horizon schedule kind 'cosine'; expected one of: 'fixed', 'stepwise', 'linear'"),
    ({"turns": 3}, "Unknown horizon schedule kind None"),
    ({"kind": "stepwise", "caps": [], "every": 100}, "`caps` must not be empty"),
    ({"kind": "stepwise", "caps": [10, 10, 20],
      "every": 100}, r"strictly increasing, got \[10, 10, 20\]"),
    ({"kind": "stepwise", "caps": [20, 10], "every": 100}, "strictly increasing"),
    ({"kind": "stepwise", "caps": "10,20", "every": 100}, "`caps` must be a list of integers"),
    ({"kind": "stepwise", "caps": [10, 0], "every": 100}, "`caps` must be a positive integer"),
    ({"kind": "stepwise", "caps": [10, 20], "every": 0}, "`every` must be a positive integer"),
    ({"kind": "fixed", "turns": -3}, "`turns` must be a positive integer, got -3"),
    ({"kind": "fixed", "turns": 2.5}, "`turns` must be a positive integer, got 2.5"),
    ({"kind": "fixed", "turns": True}, "`turns` must be a positive integer, got True"),
    ({"kind": "fixed", "turns": 5, "every": 10}, r"missing \[\], unknown \['every'\]"),
    ({"kind": "stepwise", "caps": [10]}, r"missing \['every'\]"),
    ({"kind": "linear", "initial": 20, "increment": 5, "every": 10,
      "maximum": 10}, r"`maximum` \(10\) must be >= `initial` \(20\)"),
    ({"kind": "linear", "initial": 10, "increment": 0, "every": 10,
      "maximum": 30}, "`increment` must be a positive integer"),
]


@pytest.mark.parametrize("config, message", _BAD_CONFIGS)
def test_bad_configs_fail_with_clear_messages(config, message):
  with pytest.raises(ValueError, match=message):
    horizon.make_horizon_schedule(config)


def test_bad_steps_are_rejected():
  schedule = horizon.FixedHorizon(turns=5)
  with pytest.raises(ValueError, match="Training step must be >= 0, got -1"):
    schedule.cap(-1)
  with pytest.raises(TypeError, match="Training step must be an integer"):
    horizon.StepwiseHorizon(caps=(1, 2), every=3).cap(1.5)

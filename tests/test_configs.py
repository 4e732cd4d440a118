"""Every experiment config builds and validates, and its variants change what they say."""

import functools
import importlib.util
import pathlib

import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax.models import MODELS
from agentgym_jax.config import set_key
from rl_helpers import check_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
RL_CONFIGS = [
    "grpo_textcraft", "grpo_babyai", "grpo_sciworld", "ppo_textcraft", "rloo_textcraft",
    "reinforce_pp_textcraft", "mixed_agentgym"
]


def load(name: str):
  spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config


def test_the_first_command_runs_asynchronously_with_one_key():
  # rollout.max_staleness = 1 alone: the correction's default (auto) is then decoupled PPO's,
  # and rows are refilled and decoded in chunks as configured.
  c = load("grpo_textcraft")("local")
  c.rollout.max_staleness = 1
  settings = settings_lib.Settings.from_config(c)
  assert settings.update.loss.rollout_correction == "decoupled"
  assert settings.rollout.max_staleness == 1 and settings.rollout.refill


@pytest.mark.parametrize("name", RL_CONFIGS)
@pytest.mark.parametrize("variant", ["", "local", "short", "long", "short,local"])
def test_rl_config_and_variants_validate(name, variant):
  c = load(name)(variant)
  settings_lib.Settings.from_config(c)
  if "local" in variant:
    assert c.model.name == "smollm2-135m-instruct"
    assert max(c.horizon.caps) == 8
  if variant.startswith(("short", "long")):
    assert c.horizon.kind == "fixed"
  else:
    assert c.horizon.kind == "stepwise"


def test_paper_settings_per_environment():
  textcraft, babyai, sciworld = (load(n)("") for n in RL_CONFIGS[:3])
  assert (textcraft.rollout.tasks_per_step, textcraft.rollout.samples_per_task) == (32, 8)
  assert tuple(textcraft.horizon.caps) == (10, 20, 30) and textcraft.horizon.every == 100
  assert (babyai.rollout.tasks_per_step, tuple(babyai.horizon.caps)) == (16, (6, 13, 20))
  assert (sciworld.rollout.max_new_tokens, sciworld.rollout.tasks_per_step) == (200, 16)
  assert textcraft.optim.learning_rate == 1e-6 and textcraft.algorithm.kl_coef == 1e-3
  assert textcraft.algorithm.kl_estimator == "low_var_kl"
  assert load("ppo_textcraft")("").algorithm.advantage == "gae"


def test_unknown_variant_is_refused():
  with pytest.raises(ValueError, match="unknown config variant 'tiny'"):
    load("grpo_textcraft")("tiny")


def test_experiment_sets_its_keys_and_refuses_unknown_ones():
  c = config_lib.experiment("babyai", {"algorithm.gamma": 0.9, "horizon.caps": (2, 4)}, short=2,
                            long=4)("local,short")
  assert (c.env.name, c.algorithm.gamma, c.horizon.kind, c.horizon.turns) == ("babyai", 0.9,
                                                                              "fixed", 2)
  assert c.model.name == "smollm2-135m-instruct"
  for key, message in [("algorithm.gama", "unknown config key 'algorithm.gama'"),
                       ("algo.gamma", "no section 'algo'"),
                       ("algorithm.gamma.x", "no section 'gamma'")]:
    with pytest.raises(config_lib.ConfigError, match=message):
      config_lib.experiment("babyai", {key: 1.0})("")


@pytest.mark.parametrize("key, value, message", [
    ("pipeline_groups", 0, r"rollout.pipeline_groups=0 must be >= 1"),
    ("pipeline_groups", 3, r"rollout.pipeline_groups=3 does not divide the 256 trajectories"),
    ("cache_dtype", "float16", r"rollout.cache_dtype='float16' is not one of"),
])
def test_rollout_pipeline_and_cache_keys_are_validated(key, value, message):
  c = load("grpo_textcraft")("")
  c.rollout.pipeline_groups = 4
  c.rollout.cache_dtype = "bfloat16"
  settings_lib.Settings.from_config(c)
  c.rollout[key] = value
  check_config(c, message)


@pytest.mark.parametrize("advantage, kl_in_reward_coef, samples_per_task, message", [
    ("grpo", 0.01, 8, r"kl_in_reward_coef=0.01 needs a token-level estimator, one of "
     r"\['gae', 'reinforce_plus_plus'\]; 'grpo' takes one reward"),
    ("rloo", 0.0, 1, r"algorithm.advantage='rloo' compares samples of a task"),
    ("reinforce_plus_plus", 0.01, 1, None),
    ("gae", 0.01, 1, None),
])
def test_what_an_estimator_reads_is_checked_at_start_up(advantage, kl_in_reward_coef,
                                                        samples_per_task, message):
  # The registry entry declares its inputs; the config checks a run can give them.
  c = load("grpo_textcraft")("")
  c.algorithm.advantage = advantage
  c.algorithm.kl_in_reward_coef = kl_in_reward_coef
  c.rollout.samples_per_task = samples_per_task
  check_config(c, message)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("grpo_std", "sample", r"algorithm.grpo_std='sample' is not 'population' or 'unbiased'"),
        ("grpo_eps", -1e-6, r"algorithm.grpo_eps=-1e-06 must be >= 0"),
        ("kl_in_reward_estimator", "k4", r"algorithm.kl_in_reward_estimator='k4' is not one of"),
        ("kl_estimator", "kl", None),  # verl's name for k1
        ("negative_advantage_weight", -0.5,
         r"algorithm.negative_advantage_weight=-0.5 must be >= 0"),
    ])
def test_verl_compatible_algorithm_keys_are_validated(key, value, message):
  c = load("grpo_textcraft")("")
  c.algorithm[key] = value
  check_config(c, message)


# The methods beyond the paper, one config each, and the key that makes it that method.
METHOD_CONFIGS = {
    "gspo_textcraft": ("algorithm", "policy_loss", "gspo"),
    "cispo_textcraft": ("algorithm", "policy_loss", "cispo"),
    "dapo_textcraft": ("rollout", "dynamic_sampling", True),
    "drgrpo_textcraft": ("algorithm", "aggregation", "seq-mean-token-sum-norm"),
    "tis_textcraft": ("algorithm", "rollout_correction", "token_tis"),
    "lora_textcraft": ("checkpoint", "export_format", "peft"),
    "gigpo_textcraft": ("algorithm", "advantage", "gigpo"),
    "clip_cov_textcraft": ("algorithm", "policy_loss", "clip_cov"),
    "kl_cov_textcraft": ("algorithm", "policy_loss", "kl_cov"),
    "masked_truncation_textcraft": ("algorithm", "truncated_episodes", "mask"),
    "turn_rewards_sciworld": ("algorithm", "reward_placement", "turn"),
    "context_textcraft": ("rollout", "context", "mask_observations"),
    "judged_searchqa": ("reward.judge", "mode", "reference"),
}


@pytest.mark.parametrize("name", sorted(METHOD_CONFIGS))
@pytest.mark.parametrize("variant", ["", "local", "short,local"])
def test_method_configs_and_variants_validate_and_select_their_method(name, variant):
  c = load(name)(variant)
  block, key, value = METHOD_CONFIGS[name]
  assert functools.reduce(getattr, block.split("."), c)[key] == value
  assert c.env.name == name.rpartition("_")[2]
  settings = settings_lib.Settings.from_config(c)
  assert settings.rollout.dynamic_sampling == (name == "dapo_textcraft")
  assert settings.update.loss.policy_loss == c.algorithm.policy_loss
  assert settings.update.loss.rollout_correction == (
      "none" if c.algorithm.rollout_correction == "auto" else c.algorithm.rollout_correction)
  assert (settings.model.lora is not None) == (name == "lora_textcraft")
  assert settings.update.loss.advantage_estimator == c.algorithm.advantage
  assert settings.update.scoring.truncated_episodes == c.algorithm.truncated_episodes
  # DAPO's overlong buffer: a quarter of the reply budget, locally too.
  overlong = settings.update.scoring.overlong
  assert (overlong is not None) == (name == "dapo_textcraft")
  if overlong is not None:
    assert overlong.length * 4 == overlong.max_new_tokens == c.rollout.max_new_tokens
  assert (settings.judge is not None) == (name == "judged_searchqa")


@pytest.mark.parametrize("key, value, message", [
    ("remat", "some", r"model.remat='some' is not one of \['none', 'full', 'dots', 'auto'\]"),
    ("attention", "flashy", r"model.attention='flashy' is not one of \('auto', 'dense', "),
])
def test_model_remat_and_attention_are_validated(key, value, message):
  c = load("grpo_textcraft")("local")
  assert (c.model.remat, c.model.attention) == ("auto", "auto")
  c.model[key] = value
  check_config(c, message)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_grpo_textcraft_takes_any_registry_model_in_either_action_format(name):
  c = load("grpo_textcraft")("")
  c.model.name = name
  settings_lib.Settings.from_config(c)
  c.env.action_format = "tool_call"
  assert settings_lib.Settings.from_config(c).env.options == {"action_format": "tool_call"}


@pytest.mark.parametrize("key, value, message", [
    ("model.thinking", "maybe", r"model.thinking='maybe' is not 'on' or 'off'"),
    ("env.action_format", "json", r"env.action_format='json' is not one of \('react', "
     r"'tool_call'\)"),
    ("env.name", "echo", r"env.action_format='tool_call': env 'echo' publishes no tools"),
    ("env.options.action_format", "tool_call",
     r"set env.action_format, not env.options.action_format"),
])
def test_chat_keys_are_validated(key, value, message):
  c = load("grpo_textcraft")("")
  c.env.action_format = "tool_call"
  c.model.thinking = "off"
  settings_lib.Settings.from_config(c)
  set_key(c, key, value)
  check_config(c, message)
  assert settings_lib.Settings.from_config(load("grpo_textcraft")("")).env.options == {
  }  # react: the options only.


def test_textcraft_goal_set_variant_and_its_validation():
  c = load("grpo_textcraft")("local,agentgym")
  assert settings_lib.Settings.from_config(c).env.options == {"max_depth": 2, "goals": "agentgym"}
  c.env.options.goals = "original"
  check_config(c, r"env.options.goals='original' is not one of \('default', 'agentgym'\)")


def test_gigpo_echo_variants_differ_only_in_the_advantage_estimator():
  grpo, gigpo = (load("gigpo_echo")(variant) for variant in ("grpo", "gigpo"))
  for c in (grpo, gigpo):
    c.model.name = "tiny"  # The caller's checkpoint (notebooks/gigpo_ablation.ipynb).
    settings_lib.Settings.from_config(c)
  assert (grpo.algorithm.advantage, gigpo.algorithm.advantage) == ("grpo", "gigpo")
  gigpo.algorithm.advantage = "grpo"
  assert gigpo.to_dict() == grpo.to_dict()
  assert grpo.env.options.turns == grpo.horizon.turns == 3
  with pytest.raises(ValueError, match="unknown variant 'ppo'"):
    load("gigpo_echo")("ppo")


def test_the_loss_settings_carry_what_the_estimator_reads_from_the_config():
  c = config_lib.base_config()
  c.algorithm.grpo_std = "unbiased"
  c.algorithm.grpo_eps = 1e-4
  loss = settings_lib.Settings.from_config(c).update.loss
  assert loss.advantage_options == (("eps", 1e-4), ("normalize_by_std", True), ("std", "unbiased"))
  # The in-reward penalty's estimator is its own key, k1 by default, whatever the loss's is.
  assert (loss.kl_estimator, loss.kl_in_reward_estimator) == ("low_var_kl", "k1")
  c.algorithm.advantage = "gae"
  c.algorithm.reward_placement = "turn"
  assert settings_lib.Settings.from_config(c).update.loss.advantage_options == (("gamma",
                                                                                 1.0), ("lam", 1.0),
                                                                                ("reward_placement",
                                                                                 "turn"))
  c.algorithm.policy_loss = "clip_cov"
  c.algorithm.clip_cov_ub = 4.0
  assert settings_lib.Settings.from_config(c).update.loss.policy_loss_options == (("clip_cov_ratio",
                                                                                   2e-4),
                                                                                  ("clip_cov_lb",
                                                                                   1.0),
                                                                                  ("clip_cov_ub",
                                                                                   4.0))

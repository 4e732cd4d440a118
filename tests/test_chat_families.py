"""Every chat family in a real run: a rollout and an RL training step on tiny random Llama 3-
and Qwen3-layout checkpoints (Qwen3 in each thinking mode), and TextCraft and SearchQA episodes
in the tool_call format, tokens checked against the chat template turn by turn."""

import datetime
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import rollout, trainer
from agentgym_jax.models import load_model
from agentgym_jax.models.tokenizer import Tokenizer
from agentgym_jax.sampling import Sampler
from environments import base
from environments.pool import EnvPool


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """chat family -> the directory of a tiny checkpoint with that template, made once."""
  return functools.cache(
      lambda chat: str(tiny.make_checkpoint(tmp_path_factory.mktemp(chat), chat=chat)))


def _runs(trajectory):
  """The trajectory's tokens as alternating runs: untrained (prompt), trained (reply), ..."""
  runs, start = [], 0
  for i in range(1, len(trajectory.tokens) + 1):
    if i == len(trajectory.tokens) or trajectory.loss_mask[i] != trajectory.loss_mask[start]:
      runs.append(trajectory.tokens[start:i])
      start = i
  return runs


def _check_turns(trajectory, chat, tools=None):
  """The prompt is the template's render of the first message; after each reply come its
  closing and the next observation's turn with the generation prompt, nothing else."""
  runs = _runs(trajectory)
  assert runs[0] == chat.render(trajectory.messages[:1], tools=tools)
  assert trajectory.loss_mask[0] == 0 and len(runs) % 2 == 0
  observations = [m["content"] for m in trajectory.messages[2::2]]
  assert len(runs) == 2 * len(observations) + 2
  for reply, following, observation in zip(runs[1::2], runs[2::2], observations):
    assert following == chat.closing_ids(reply) + chat.continuation_ids("user", observation)


def _echo_config(checkpoint_dir, thinking):
  c = config_lib.base_config()
  c.steps = 1
  c.model.name = checkpoint_dir
  c.model.thinking = thinking
  config_lib.tiny_echo(c)
  c.env.options.turns = 2
  c.rollout.tasks_per_step = 2
  c.rollout.samples_per_task = 2
  c.rollout.max_context = 128
  c.horizon.kind = "fixed"
  c.horizon.turns = 2
  # A random policy's episodes all fail, so GRPO's advantages are 0; the entropy bonus still
  # moves the policy.
  c.algorithm.entropy_coef = 1e-2
  return c


# Qwen3 with thinking on lays out turns as plain ChatML does (covered by every other tiny-model
# test), so it runs with the slow tests; each case compiles a sampler and an update (~30 s).
@pytest.mark.parametrize("chat,thinking", [("llama3", "on"),
                                           pytest.param("qwen3", "on", marks=pytest.mark.slow),
                                           ("qwen3", "off")])
def test_rollout_and_training_step_on_each_chat_family(checkpoint, chat, thinking, tmp_path,
                                                       monkeypatch):
  c = _echo_config(checkpoint(chat), thinking)
  settings = settings_lib.Settings.from_config(c)
  model, tokenizer = load_model(c.model.name, dtype=jnp.float32)
  template = settings.model.chat(tokenizer)
  sampler = Sampler(model, cache_slots=128, max_batch=4)
  with EnvPool("echo", 4, options={"turns": 2}) as pool:
    player = rollout.Player(sampler, sampler.params, pool, template,
                            rollout.TurnSampling(max_new_tokens=3), max_context=128)
    trajectories, _ = rollout.collect(player, [(0, 0), (0, 0), (1, 1), (1, 1)], horizon=2,
                                      key=jax.random.key(0))
  # The text of the prompt each trajectory starts with (_check_turns: token for token).
  prompt = template.render_text(trajectories[0].messages[:1])
  if chat == "llama3":
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                             f"Cutting Knowledge Date: December 2023\nToday Date: {today}\n\n"
                             "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n")
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
  else:
    assert prompt.startswith("<|im_start|>user\n")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if thinking ==
                           "off" else "<|im_end|>\n<|im_start|>assistant\n")
  for trajectory in trajectories:
    _check_turns(trajectory, template)

  # One RL step of the whole loop on the same checkpoint.
  tiny.one_device(monkeypatch)
  (metrics,) = trainer.train(c, tmp_path)
  assert metrics["step"] == 1 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("env_name,chat",
                         [("textcraft", "qwen3"), ("searchqa", "llama3"),
                          pytest.param("textcraft", "chatml", marks=pytest.mark.slow)])
def test_tool_call_episodes_play_on_the_tiny_model(checkpoint, env_name, chat):
  model, tokenizer = load_model(checkpoint(chat), dtype=jnp.float32)
  sampler = Sampler(model, cache_slots=4096, max_batch=2)
  with EnvPool(env_name, 2, options={"action_format": "tool_call"}) as pool:
    tools = pool.tools
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                            rollout.TurnSampling(max_new_tokens=8), max_context=4096)
    trajectories, _ = rollout.collect(player, [(0, 0), (1, 1)], horizon=3, key=jax.random.key(0))
  assert tools == base.tools_of(base.make(env_name, action_format="tool_call"))
  for trajectory in trajectories:
    assert trajectory.tools == tools and trajectory.to_json()["tools"] == tools
    assert trajectory.termination == "horizon" and trajectory.num_turns == 3
    # A random policy calls no tool: each observation says so, and the episode goes on.
    assert all(m["content"].startswith("Invalid tool call: ") for m in trajectory.messages[2::2])
    _check_turns(trajectory, tokenizer.chat, tools)
  # The tools are shown where the family's template shows them: Qwen3 in the system turn,
  # Llama 3.x in the first user turn, a template without tools in our system text.
  text = tokenizer.chat.render_text(trajectories[0].messages[:1], False, tools=tools)
  turns = tokenizer.chat.parse_text(text.removeprefix("<|begin_of_text|>"))
  shown_in = {"qwen3": "system", "llama3": "user", "chatml": "system"}[chat]
  assert [role for role, content in turns if '"type": "function"' in content] == [shown_in]


def test_a_chat_the_model_cannot_have_is_a_config_error(checkpoint):
  c = _echo_config(checkpoint("llama3"), "off")
  tokenizer = Tokenizer.from_pretrained(c.model.name)
  with pytest.raises(
      config_lib.ConfigError, match=r"^invalid config: model.name='.*', model.thinking='off': "
      r"thinking off needs a chat template with a thinking switch"):
    settings_lib.Settings.from_config(c).model.chat(tokenizer)

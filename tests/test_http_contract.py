"""The wire contract of environments/http/PROTOCOL.md, played as AgentGym's own clients play it.

Each player below does what the protocol description says an original client does: the same
routes and bodies, `assert status == 200` on every answer, the reply's action taken from its
"Action:" line with every character but ASCII letters, digits, commas and spaces removed, and the
answer fields it reads. They use `requests`, as the original clients do.
"""

import re

import requests

from environments.babyai import expert as babyai_expert
from environments.http import AgentGymServer
from environments.http.served import serve_in_subprocess
from environments.textcraft import TextCraftEnv, solve
import environments
import toy_env

toy_env.register()

_TIMEOUT_S = 30


def _action(reply):
  """The original clients' action parsing: the text after the one "Action:" of the reply."""
  matches = re.findall(r"Action:\s*(.*?)(?=\n|$)", reply, re.DOTALL)
  action = re.sub(r"[^A-Za-z0-9, ]+", "", matches[-1] if matches else "")
  return " ".join(action.split())


class _Player:
  """An original AgentGym client: the env id goes into every body under `id_field`."""

  def __init__(self, url, id_field="id", create_body=None):
    self.url, self.id_field = url, id_field
    created = requests.post(f"{url}/create", json=create_body, timeout=_TIMEOUT_S)
    assert created.status_code == 200
    self.created = created.json()
    self.env_id = self.created if isinstance(self.created, int) else self.created[id_field]

  def post(self, route, data):
    data[self.id_field] = self.env_id
    answer = requests.post(f"{self.url}/{route}", json=data, timeout=_TIMEOUT_S)
    assert answer.status_code == 200
    return answer.json()

  def get(self, route):
    answer = requests.get(f"{self.url}/{route}?{self.id_field}={self.env_id}", timeout=_TIMEOUT_S)
    assert answer.status_code == 200
    return answer.json()


def test_textcraft_plays_as_the_original_client_plays_it():
  with AgentGymServer("textcraft") as server:
    player = _Player(
        server.url,
        create_body={"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None})
    # /create starts an episode: {id, observation, done, reward}.
    assert set(player.created) == {"id", "observation", "done", "reward"}
    assert player.created["observation"].startswith("Crafting commands:\n")
    assert player.get("commands") in player.created["observation"]
    for data_idx in (20, 105):  # barrel and composter: recipes with generic wooden slabs
      reset = player.post("reset", {"data_idx": data_idx})
      assert set(reset) >= {"id", "observation", "done", "reward"} and reset["id"] == player.env_id
      goal = TextCraftEnv().task_info(data_idx)["goal"]
      assert player.get("goal") == f"minecraft:{goal}"
      total = 0
      for action in solve(reset["observation"]):
        response = player.post("step", {"action": _action(f"Thought:\nnext.\n\nAction:\n{action}")})
        total += response["reward"]
        if response["done"]:
          break
      assert (total, response["done"]) == (1, True)
      # After the goal the game goes on, as in the original.
      assert player.post("step", {"action": "inventory"})["observation"].startswith("Inventory:")
      assert player.get("detail")["observation"].startswith("Inventory:")
      assert player.get("observation").startswith("Inventory:")
    # A data_idx out of range is an error in a 200 answer.
    assert "error" in player.post("reset", {"data_idx": 10**6})
    assert player.post("close", {}) is True
    assert player.post("close", {}) is False  # Already closed.
    assert "is not valid" in player.post("step", {"action": "inventory"})["error"]


def test_serve_env_serves_the_agentgym_goal_set():
  """`launch/serve_env.py --option=goals=agentgym`: the original's 544 goals, ids as in
  environments/textcraft/env.py; the last 11 are the original's depth-4 goals."""
  local = TextCraftEnv(goals="agentgym")
  with serve_in_subprocess("textcraft", option="goals=agentgym") as served:
    served_ids = [
        requests.get(f"{served.url}/task_ids?split={split}", timeout=_TIMEOUT_S).json()["task_ids"]
        for split in ("train", "test")
    ]
    assert served_ids == [list(local.task_ids(split)) for split in ("train", "test")]
    player = _Player(served.url, create_body={})
    reset = player.post("reset", {"data_idx": 538})
    assert player.get("goal") == "minecraft:lodestone"
    assert reset["observation"] == local.reset(538)
    for action in solve(reset["observation"]):
      response = player.post("step", {"action": action})
    assert (response["reward"], response["done"]) == (1, True)
    assert "error" in player.post("reset", {"data_idx": 544})
    assert player.post("close", {}) is True


def test_babyai_plays_as_the_original_client_plays_it():
  local = environments.make("babyai")
  task_id = local.task_ids("test")[0]
  replies = babyai_expert.replies(local, task_id)
  with AgentGymServer("babyai") as server:
    player = _Player(server.url)
    assert set(player.created) == {"id"}
    reset = player.post("reset", {"data_idx": task_id})
    assert set(reset) >= {"observation", "reward", "score", "done"} and reset["score"] == 0
    for reply in replies:
      response = player.post("step", {"action": _action(reply)})
      if response["done"]:
        break
    assert response["done"] and response["score"] > 0  # The original client trains on score.
    observed = player.get("observation")
    assert set(observed) == {"observation", "reward", "score", "done", "deleted"}
    assert observed["done"] and observed["score"] == response["score"]
    # A step after the end is an error in a 200 answer.
    assert "has finished" in player.post("step", {"action": "turn left"})["error"]
    assert player.post("close", {}) is True


def test_sciworld_style_reset_carries_the_task_description():
  with AgentGymServer("toy", style="sciworld") as server:
    player = _Player(server.url)
    reset = player.post("reset", {"data_idx": 3})
    observation = reset["task_description"] + "\n" + reset["observation"]
    assert "Task 3" in observation
    for guess in (1, 9, 4):  # Task 3 hides 4 (toy_env).
      response = player.post("step", {"action": _action(f"Action: guess {guess}")})
    assert (response["score"], response["done"]) == (100.0, True)
    assert player.get("observation") == response["observation"]
    assert player.post("close", {}) is True


def test_searchqa_style_uses_env_idx_and_bare_answers():
  with AgentGymServer("toy", style="searchqa") as server:
    player = _Player(server.url, id_field="env_idx", create_body={"id": 0})
    assert isinstance(player.created, int)
    observation = player.post("reset", {"id": 3})
    assert isinstance(observation, str) and observation.startswith("Task 3")
    assert player.get("observation") == observation
    response = player.post("step", {"action": "Action: guess 4"})
    assert (response["reward"], response["done"]) == (1.0, True)
    assert player.post("close", {}) is True


def test_webarena_style_answers_terminated_and_closed():
  with AgentGymServer("toy", style="webarena") as server:
    player = _Player(server.url, id_field="env_idx")
    assert set(player.created) == {"env_idx"}
    reset = player.post("reset", {"seed": 0, "idx": 3})
    assert set(reset) >= {"observation", "sites", "object"}
    response = player.post("step", {"action": "Action: guess 4"})
    assert response["terminated"] and not response["truncated"] and response["reward"] == 1.0
    assert player.post("close", {}) == {"closed": "closed"}

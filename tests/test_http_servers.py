"""Env servers on several hosts: clients spread over them, and a dead one costs only its episodes."""

import pytest

import environments
from environments import EnvError
from environments.http import AgentGymServer
import toy_env

toy_env.register()


def test_slots_spread_over_servers_and_leave_a_dead_one():
  servers = [AgentGymServer("toy").start() for _ in range(3)]
  try:
    urls = [server.url for server in servers]
    slots = [
        environments.make("http", base_urls=urls, env="toy", retries=1, backoff_s=0.01)
        for _ in range(6)
    ]
    for slot in slots:
      slot.reset(3)  # Task 3 hides 4 (toy_env).
    assert [server.num_envs() for server in servers] == [2, 2, 2]  # Round robin.
    for slot in slots:
      assert not slot.step("Action: guess 1").done
    dead = servers[1]
    dead.shutdown()  # Mid-rollout.
    lost = [slot for slot in slots if slot.base_url == dead.url]
    assert len(lost) == 2
    for slot in slots:
      if slot in lost:
        with pytest.raises(EnvError):  # Only the dead server's episodes end.
          slot.step("Action: guess 4")
      else:
        result = slot.step("Action: guess 4")
        assert result.done and result.reward == 1.0
    # The next reset moves the dead server's slots to a live one; every slot plays again.
    for slot in slots:
      assert slot.reset(3).startswith("Task 3")
      assert slot.step("Action: guess 4").reward == 1.0
      assert slot.base_url != dead.url
    assert servers[0].num_envs() + servers[2].num_envs() == 6
    for slot in slots:
      slot.close()
  finally:
    for server in servers:
      server.shutdown()

"""Helpers shared by the env server and env pool tests: polling, and playing a scripted episode."""

import time


def wait_until(condition, timeout_s=10.0):
  """Polls `condition` until it holds; returns whether it did within `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.02)
  return True


def play(env, task_id, replies):
  """What `env` answers to `replies` after a reset to `task_id`: [first observation, StepResult,
  ...], up to the step that ends the episode."""
  results = [env.reset(task_id)]
  for reply in replies:
    results.append(env.step(reply))
    if results[-1].done:
      break
  return results

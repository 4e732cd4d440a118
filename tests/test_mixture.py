"""Mixed-environment runs (env.mixture): run-wide task ids and one pool of every environment's
adapters."""

import pytest

from environments import base, mixture
from environments.pool import EnvPool, Environment

ECHO_INSTRUCTION = "Repeat each symbol you are shown. Symbols: 0 1."


def _mixture_pool(slots=2, **echo_options):
  """Echo (2 turns) and echo with symbols "ab" (3 turns, capped at 1), as one pool."""
  return mixture.MixturePool([
      Environment("echo", EnvPool("echo", slots, options={"turns": 2, **echo_options})),
      Environment("letters", EnvPool("echo", slots, options={"turns": 3, "symbols": "ab"}), 1),
  ])


# --- task ids and the pool -----------------------------------------------------------------


def test_run_wide_task_ids_name_the_environment_and_its_own_task():
  with _mixture_pool(num_train=3, num_test=2) as pool:
    letters = base.make("echo", turns=3, symbols="ab")
    assert pool.task_ids("test") == [0, 1] + [mixture.STRIDE + t for t in range(100)]
    assert pool.task_ids("train")[:3] == [2, 3, 4]
    assert pool.environment(4).name == "echo"
    assert pool.environment(mixture.STRIDE + 7).name == "letters"
    assert pool.environment(mixture.STRIDE + 7).cap(5) == 1
    assert pool.environment(4).cap(5) == 5
    # Each environment's instruction, asked of its own adapters.
    assert pool.environment(4).pool.instruction == ECHO_INSTRUCTION
    assert pool.environment(mixture.STRIDE).pool.instruction == letters.instruction
    assert letters.instruction != ECHO_INSTRUCTION
    # A task's info is its environment's, the category under the environment's label.
    info = pool.task_info(mixture.STRIDE + 107)
    assert info == {**letters.task_info(107), "category": "letters/echo"}
    with pytest.raises(ValueError, match="task 2000000000 is of component 2; the mixture has 2"):
      pool.task_info(2 * mixture.STRIDE)
  with pytest.raises(ValueError, match=r"ids in \[0, 1000000000\)"):
    mixture.task_id(1, mixture.STRIDE)


def test_each_slot_plays_its_tasks_environment_and_keeps_the_order_of_requests():
  with _mixture_pool(slots=3) as pool:
    letters = base.make("echo", turns=3, symbols="ab")
    task = mixture.STRIDE + 150
    first = pool.reset_async([(0, task), (1, 150), (2, task + 1)]).result()
    assert [r.observation for r in first
           ] == [letters.reset(150),
                 base.make("echo", turns=2).reset(150),
                 letters.reset(151)]
    sequence = letters.task_info(150)["sequence"]
    results = pool.step_async([(1, "0"), (0, sequence[0])]).result()
    assert results[1].observation == sequence[1] and not results[1].done
    # Slot 0 now plays echo: its next step is echo's, on its own adapter.
    pool.reset_async([(0, 150)]).result()
    assert pool.step_async([(0, "x")]).result()[0].observation == "Wrong."
    with pytest.raises(ValueError, match="slot 5 has no episode in progress"):
      pool.step_async([(5, "0")]).result()
    with pytest.raises(ValueError, match="non-negative ints"):
      pool.reset_async([(0, -1)]).result()


def test_a_mixture_refuses_twin_names_and_pools_of_unequal_width():
  echo = lambda slots: EnvPool("echo", slots)
  with pytest.raises(ValueError, match="distinct names"):
    mixture.MixturePool([Environment("echo", echo(2)), Environment("echo", echo(2))])
  with pytest.raises(ValueError, match="the same number of slots"):
    mixture.MixturePool([Environment("a", echo(2)), Environment("b", echo(3))])

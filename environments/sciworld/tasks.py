"""SciWorld's tasks: which (task, variation) an integer task id names, and the splits.

ScienceWorld has 30 tasks (the paper numbers them 1-1 ... 10-2), each with many variations
(the substance, the animal, the room it starts in, ...). The package splits every task's
variations into three contiguous ranges,

  train [0, dev_start),  dev [dev_start, test_start),  test [test_start, num_variations),

and `TASKS` records those bounds so that ids and splits are known without starting a JVM.
tests/test_sciworld.py checks the table against the installed package.

Task id = VARIATION_STRIDE * (index of the task in TASKS) + variation. For example 140225 is
task 14 of TASKS (find-animal), variation 225. The ids are sparse but say what they are, and
they depend only on the order of TASKS: never on a filesystem, a hash seed, or how many
variations another task has.

Splits:
  train: every train variation of every task (3592 ids).
  test:  TEST_SIZE = 200 test variations spread over all 30 tasks, as AgentGym's test set is.
         Quotas are dealt round-robin in TASKS order, one variation per task per round, to the
         tasks that still have test variations left, until 200 are dealt: 25 tasks get 7, one
         gets 6, three (with 5 test variations) get 5 and one (with 4) gets 4. A task with
         quota k and m test variations takes the middle variation of each of k equal strata,
         test_start + floor((2i + 1) m / 2k) for i < k, so the picks spread over the range.
Dev variations are valid task ids (reset, task_info) in neither split.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from environments import base

VARIATION_STRIDE = 10_000
TEST_SIZE = 200


@dataclasses.dataclass(frozen=True)
class Task:
  """One ScienceWorld task and the package's split of its variations."""

  number: str  # the paper's task number, e.g. "1-1"
  name: str  # the package's task name, e.g. "boil"
  dev_start: int
  test_start: int
  num_variations: int

  def variations(self, split: str) -> range:
    """The variations of `split` ("train", "dev" or "test")."""
    bounds = {
        "train": (0, self.dev_start), "dev": (self.dev_start, self.test_start),
        "test": (self.test_start, self.num_variations)
    }
    if split not in bounds:
      raise ValueError(f"unknown variation split {split!r}; expected one of {tuple(bounds)}")
    return range(*bounds[split])

  def split_of(self, variation: int) -> str:
    return ("train"
            if variation < self.dev_start else "dev" if variation < self.test_start else "test")


# In the package's order (scienceworld/tasks.json). Appending keeps every existing id.
TASKS: tuple[Task,
             ...] = (Task("1-1", "boil", 14, 21, 30), Task("1-2", "melt", 14, 21,
                                                           30), Task("1-3", "freeze", 14, 21, 30),
                     Task("1-4", "change-the-state-of-matter-of", 14, 21,
                          30), Task("2-1", "use-thermometer", 270, 405, 540),
                     Task("2-2", "measure-melting-point-known-substance", 218, 327,
                          436), Task("2-3", "measure-melting-point-unknown-substance", 150, 225,
                                     300), Task("3-1", "power-component", 10, 15, 20),
                     Task("3-2", "power-component-renewable-vs-nonrenewable-energy", 10, 15,
                          20), Task("3-3", "test-conductivity", 450, 675, 900),
                     Task("3-4", "test-conductivity-of-unknown-substances", 300, 450,
                          600), Task("4-1", "find-living-thing", 150, 225,
                                     300), Task("4-2", "find-non-living-thing", 150, 225,
                                                300), Task("4-3", "find-plant", 150, 225, 300),
                     Task("4-4", "find-animal", 150, 225,
                          300), Task("5-1", "grow-plant", 62, 93,
                                     126), Task("5-2", "grow-fruit", 62, 93,
                                                126), Task("6-1", "chemistry-mix", 16, 24, 32),
                     Task("6-2", "chemistry-mix-paint-secondary-color", 18, 27,
                          36), Task("6-3", "chemistry-mix-paint-tertiary-color", 18, 27,
                                    36), Task("7-1", "lifespan-longest-lived", 62, 93, 125),
                     Task("7-2", "lifespan-shortest-lived", 62, 93, 125),
                     Task("7-3", "lifespan-longest-lived-then-shortest-lived", 62, 93,
                          125), Task("8-1", "identify-life-stages-1", 6, 9,
                                     14), Task("8-2", "identify-life-stages-2", 4, 6, 10),
                     Task("9-1", "inclined-plane-determine-angle", 84, 126, 168),
                     Task("9-2", "inclined-plane-friction-named-surfaces", 692, 1038, 1386),
                     Task("9-3", "inclined-plane-friction-unnamed-surfaces", 80, 120,
                          162), Task("10-1", "mendelian-genetics-known-plant", 60, 90, 120),
                     Task("10-2", "mendelian-genetics-unknown-plant", 240, 360, 480))


def task_id(task_index: int, variation: int) -> int:
  return VARIATION_STRIDE * task_index + variation


def lookup(task_id_: int) -> tuple[Task, int]:
  """(task, variation) of a task id; ValueError for ids that name no variation."""
  if isinstance(task_id_, bool) or not isinstance(task_id_, int) or task_id_ < 0:
    raise ValueError(f"SciWorld task ids are non-negative ints, got {task_id_!r}")
  index, variation = divmod(task_id_, VARIATION_STRIDE)
  if index >= len(TASKS) or variation >= TASKS[index].num_variations:
    raise ValueError(
        f"unknown SciWorld task id {task_id_}: an id is {VARIATION_STRIDE} * task index "
        f"(0..{len(TASKS) - 1}) + variation (below the task's number of variations)")
  return TASKS[index], variation


def task_info(task_id_: int) -> dict[str, Any]:
  task, variation = lookup(task_id_)
  return {
      "category": task.name, "task": task.number, "variation": variation,
      "split": task.split_of(variation)
  }


def quotas_for_test_split() -> tuple[int, ...]:
  """How many test variations each task contributes to the test split (module docstring)."""
  quotas = [0] * len(TASKS)
  dealt = 0
  while dealt < TEST_SIZE:
    open_tasks = [i for i, task in enumerate(TASKS) if quotas[i] < len(task.variations("test"))]
    if not open_tasks:
      raise ValueError(f"only {dealt} test variations exist, the test split needs {TEST_SIZE}")
    for i in open_tasks[:TEST_SIZE - dealt]:
      quotas[i] += 1
      dealt += 1
  return tuple(quotas)


@functools.cache
def splits() -> dict[str, tuple[int, ...]]:
  """Task ids of each split, ascending."""
  train = tuple(task_id(i, v) for i, task in enumerate(TASKS) for v in task.variations("train"))
  test = []
  for i, (task, quota) in enumerate(zip(TASKS, quotas_for_test_split())):
    variations = task.variations("test")
    m = len(variations)
    test.extend(task_id(i, variations[(2 * k + 1) * m // (2 * quota)]) for k in range(quota))
  return {"train": train, "test": tuple(test)}


def split_ids(split: str) -> tuple[int, ...]:
  return splits()[base.check_split(split)]

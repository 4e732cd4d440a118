"""The BabyAI level set and the task id -> (level, seed) mapping.

A task id t names level LEVELS[t % 40] generated with seed t // 40 -- the same mapping as
AgentGym's BabyAI server (its `data_idx`), so a task id means the same episode there and here
when both run the same minigrid version. The mapping is plain integer arithmetic: stable across
machines, processes and PYTHONHASHSEED.

Splits: the test split is ids 0..89 (every level twice, the first ten levels a third time: the
90 test tasks of the paper over AgentGym's 40 levels); the train split is the `train_size` ids
that follow. Each id names one (level, seed) pair, so disjoint id ranges are disjoint tasks.

AgentGym's list names "BabyAI-GoToObjS6-v0"; minigrid 3 registers that level (GoToObj in a
6x6 room) as "BabyAI-GoToObjS6-v1", which we use. The other 39 names exist as they are.
"""

from __future__ import annotations

from environments import base

# (gymnasium id, family). Families follow minigrid's grouping of the level classes into
# goto/open/pickup/putnext/unlock/other/synth modules; they are the evaluation categories.
LEVELS: tuple[tuple[str, str], ...] = (
    ("BabyAI-GoToRedBallGrey-v0", "GoTo"),
    ("BabyAI-GoToRedBall-v0", "GoTo"),
    ("BabyAI-GoToRedBallNoDists-v0", "GoTo"),
    ("BabyAI-GoToObjS6-v1", "GoTo"),
    ("BabyAI-GoToLocalS8N7-v0", "GoTo"),
    ("BabyAI-GoToObjMazeS7-v0", "GoTo"),
    ("BabyAI-GoToImpUnlock-v0", "GoTo"),
    ("BabyAI-GoToSeqS5R2-v0", "GoTo"),
    ("BabyAI-GoToRedBlueBall-v0", "GoTo"),
    ("BabyAI-GoToDoor-v0", "GoTo"),
    ("BabyAI-GoToObjDoor-v0", "GoTo"),
    ("BabyAI-Open-v0", "Open"),
    ("BabyAI-OpenRedDoor-v0", "Open"),
    ("BabyAI-OpenDoorLoc-v0", "Open"),
    ("BabyAI-OpenRedBlueDoorsDebug-v0", "Open"),
    ("BabyAI-OpenDoorsOrderN4Debug-v0", "Open"),
    ("BabyAI-Pickup-v0", "Pickup"),
    ("BabyAI-UnblockPickup-v0", "Pickup"),
    ("BabyAI-PickupLoc-v0", "Pickup"),
    ("BabyAI-PickupDistDebug-v0", "Pickup"),
    ("BabyAI-PickupAbove-v0", "Pickup"),
    ("BabyAI-PutNextLocalS6N4-v0", "PutNext"),
    ("BabyAI-PutNextS7N4Carrying-v0", "PutNext"),
    ("BabyAI-Unlock-v0", "Unlock"),
    ("BabyAI-UnlockLocalDist-v0", "Unlock"),
    ("BabyAI-KeyInBox-v0", "Unlock"),
    ("BabyAI-UnlockPickupDist-v0", "Unlock"),
    ("BabyAI-BlockedUnlockPickup-v0", "Unlock"),
    ("BabyAI-UnlockToUnlock-v0", "Unlock"),
    ("BabyAI-ActionObjDoor-v0", "Other"),
    ("BabyAI-FindObjS7-v0", "Other"),
    ("BabyAI-KeyCorridorS6R3-v0", "Other"),
    ("BabyAI-OneRoomS20-v0", "Other"),
    ("BabyAI-MoveTwoAcrossS8N9-v0", "Other"),
    ("BabyAI-SynthS5R2-v0", "Synth"),
    ("BabyAI-SynthLoc-v0", "Synth"),
    ("BabyAI-SynthSeq-v0", "Synth"),
    ("BabyAI-MiniBossLevel-v0", "Synth"),
    ("BabyAI-BossLevel-v0", "Synth"),
    ("BabyAI-BossLevelNoUnlock-v0", "Synth"),
)

TEST_SIZE = 90


def check_task_id(task_id: int) -> int:
  # bool is an int subclass; True as a task id is always a caller's mistake.
  if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
    raise ValueError(f"BabyAI task ids are non-negative ints, got {task_id!r}")
  return task_id


def task_info(task_id: int) -> dict[str, str | int]:
  """{"category": family, "level": gymnasium id, "seed": reset seed} of a task."""
  check_task_id(task_id)
  level, family = LEVELS[task_id % len(LEVELS)]
  return {"category": family, "level": level, "seed": task_id // len(LEVELS)}


def task_ids(split: str, train_size: int) -> range:
  """Ids of a split: test = [0, 90), train = [90, 90 + train_size)."""
  if base.check_split(split) == "test":
    return range(TEST_SIZE)
  return range(TEST_SIZE, TEST_SIZE + train_size)

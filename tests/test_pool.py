"""EnvPool: concurrent batches, faults that end one episode only, timeouts, kills, no leaks."""

import functools
import multiprocessing
import os
import threading
import time

import pytest

from environments import StepResult, base
from environments.pool import EnvPool
from http_helpers import play, wait_until
import toy_env

toy_env.register()

# Task t hides (7t + 3) mod 10: task 0 -> 3, task 1 -> 0, task 2 -> 7, task 3 -> 4.
_SCRIPT = [
    "Thought: start low.\n\nAction: guess 0", "Action: guess 4", "Action: guess 7", "Action: dance",
    "Action: guess 3", "Action: guess 9", "Action: guess 8"
]


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_pool_episodes_match_one_adapter_played_alone(backend):
  tasks = [0, 1, 2, 3]
  # What one in-process adapter played alone answers.
  expected = {task: play(toy_env.ToyEnv(), task, _SCRIPT) for task in tasks}
  factory = functools.partial(toy_env.ToyEnv)
  with EnvPool(factory, num_slots=len(tasks), backend=backend) as pool:
    first = pool.reset(list(enumerate(tasks)))
    got = {task: [result.observation] for task, result in zip(tasks, first)}
    live = dict(enumerate(tasks))
    for reply in _SCRIPT:
      if not live:
        break
      results = pool.step([(slot, reply) for slot in live])
      for (slot, task), result in zip(list(live.items()), results):
        got[task].append(result)
        if result.done:
          del live[slot]
  assert got == expected
  # Task 1 (secret 0) is solved by the first guess; task 2 (secret 7) by the third.
  assert got[1][1] == StepResult("Guess 1: 0 is correct.", 1.0, True, {"success": True})
  assert got[2][3].reward == 1.0 and len(got[2]) == 4


def test_steps_of_slow_adapters_overlap():
  with EnvPool("toy", num_slots=8, options={"sleep_s": 0.2}) as pool:
    pool.reset([(slot, slot) for slot in range(8)])
    start = time.monotonic()
    results = pool.step([(slot, "Action: guess 5") for slot in range(8)])
    elapsed = time.monotonic() - start
  assert all(result.observation.startswith("Guess 1: 5") for result in results)
  # One after another the 8 steps would take 8 x 0.2 = 1.6 s; together about 0.2 s.
  assert elapsed < 0.8, elapsed


def test_a_raising_adapter_ends_only_its_episode_and_is_replaced():
  with EnvPool("toy", num_slots=3) as pool:
    pool.reset([(0, 0), (1, 1), (2, 2)])
    created, closed = toy_env.ToyEnv.created, toy_env.ToyEnv.closed
    crashed, solved, wrong = pool.step([(0, "Action: crash"), (1, "Action: guess 0"),
                                        (2, "Action: guess 1")])

    assert crashed.done and crashed.reward == 0.0 and crashed.observation == ""
    assert crashed.info["termination"] == "env_error"
    assert "slot 0" in crashed.info["error"]
    assert "RuntimeError: the toy env crashed on purpose" in crashed.info["error"]
    assert solved == StepResult("Guess 1: 0 is correct.", 1.0, True, {"success": True})
    assert wrong == StepResult("Guess 1: 1 is too low.", 0.0, False, {})
    assert wait_until(lambda: toy_env.ToyEnv.closed == closed + 1)  # The broken one.

    with pytest.raises(ValueError, match="slot 0 has no episode in progress"):
      pool.step([(0, "Action: guess 1")])
    [again] = pool.reset([(0, 4)])
    assert again == StepResult("Task 4: guess the secret digit in at most 5 guesses.", 0.0, False,
                               {})
    assert toy_env.ToyEnv.created == created + 1
    # The other slots kept their adapters and episodes.
    assert pool.step([(2, "Action: guess 7")])[0].reward == 1.0


def test_a_hanging_adapter_times_out_without_holding_up_the_batch():
  with EnvPool("toy", num_slots=2, options={"hang_s": 1.0}, step_timeout_s=0.3) as pool:
    pool.reset([(0, 0), (1, 1)])
    start = time.monotonic()
    hung, fine = pool.step([(0, "Action: hang"), (1, "Action: guess 5")])
    elapsed = time.monotonic() - start
    assert hung.done and hung.info["termination"] == "env_timeout"
    assert "took over 0.3 s" in hung.info["error"]
    assert fine == StepResult("Guess 1: 5 is too high.", 0.0, False, {})
    assert elapsed < 0.9, elapsed  # The timeout, not the 1 s hang.
    # The slot gets a fresh adapter at once, while the abandoned thread still sleeps.
    [first] = pool.reset([(0, 3)])
    assert not first.done
    assert pool.step([(0, "Action: guess 4")])[0].reward == 1.0


def test_an_adapter_that_outlasts_the_reset_timeout_ends_that_episode():

  class SlowToBuild(toy_env.ToyEnv):

    def __init__(self):
      time.sleep(0.5)
      super().__init__()

  with EnvPool(SlowToBuild, num_slots=1, reset_timeout_s=0.2) as pool:
    [result] = pool.reset([(0, 0)])
  assert result.done and result.info["termination"] == "env_timeout"


def _child_pids():
  return {process.pid for process in multiprocessing.active_children()}


def test_the_process_backend_kills_a_hung_adapter_process():
  factory = functools.partial(toy_env.ToyEnv, hang_s=60.0)
  with EnvPool(factory, num_slots=2, backend="process", step_timeout_s=0.5) as pool:
    pool.reset([(0, 0), (1, 1)])
    before = _child_pids()
    assert len(before) == 2
    start = time.monotonic()
    hung, fine = pool.step([(0, "Action: hang"), (1, "Action: guess 0")])
    assert time.monotonic() - start < 5.0  # Not the 60 s hang.
    assert hung.info["termination"] == "env_timeout"
    assert fine.reward == 1.0
    # The hung child is killed and reaped, not left sleeping.
    assert wait_until(lambda: len(_child_pids()) == 1)
    survivor = _child_pids()
    assert survivor < before
    [first] = pool.reset([(0, 2)])
    assert not first.done
    replacement = _child_pids() - survivor
    assert len(replacement) == 1 and not replacement & before
    assert pool.step([(0, "Action: guess 7")])[0].reward == 1.0


def test_a_process_still_starting_when_its_reset_times_out_never_runs_the_reset():
  threads = set(threading.enumerate())
  factory = functools.partial(toy_env.ToyEnv, reset_sleep_s=60.0)
  with EnvPool(factory, num_slots=1, backend="process", reset_timeout_s=0.01) as pool:
    [result] = pool.reset([(0, 0)])  # Starting Python alone takes longer than 10 ms.
    assert result.info["termination"] == "env_timeout"
  # The discarded worker finishes starting its process, then closes it instead of sending it
  # the 60 s reset.
  assert wait_until(lambda: set(threading.enumerate()) == threads)
  assert not multiprocessing.active_children()


def _is_running(pid):
  """Whether process `pid` exists and is not a zombie (a container's init may not reap)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_killing_a_hung_adapter_process_also_kills_its_helper_processes():
  factory = functools.partial(toy_env.ToyEnv, hang_s=60.0, helper=True)
  with EnvPool(factory, num_slots=1, backend="process", step_timeout_s=0.5) as pool:
    helper_pid = pool.task_info(0)["helper_pid"]  # Asked of slot 0's adapter.
    pool.reset([(0, 0)])
    assert _is_running(helper_pid)
    [hung] = pool.step([(0, "Action: hang")])
    assert hung.info["termination"] == "env_timeout"
    assert wait_until(lambda: not _is_running(helper_pid))


def test_the_process_backend_reports_adapter_errors_by_name():
  with EnvPool(toy_env.ToyEnv, num_slots=1, backend="process") as pool:
    pool.reset([(0, 0)])
    [crashed] = pool.step([(0, "Action: crash")])
  assert crashed.info["termination"] == "env_error"
  assert "RuntimeError: the toy env crashed on purpose" in crashed.info["error"]


def test_step_async_overlaps_the_callers_work_and_keeps_call_order():
  with EnvPool("toy", num_slots=2, options={"sleep_s": 0.4}) as pool:
    pool.reset([(0, 0), (1, 1)])
    first = pool.step_async([(0, "Action: guess 9"), (1, "Action: guess 9")])
    second = pool.step_async([(0, "Action: guess 8")])
    assert not first.done()  # Returned at once; the steps run meanwhile.
    assert [r.observation for r in first.result(timeout=5)
           ] == ["Guess 1: 9 is too high.", "Guess 1: 9 is too high."]
    assert second.result(timeout=5)[0].observation == "Guess 2: 8 is too high."


def test_batches_on_disjoint_slots_run_at_once_and_a_shared_slot_waits():
  with EnvPool("toy", num_slots=3, options={"sleep_s": 0.5}) as pool:
    pool.reset([(0, 0), (1, 1), (2, 2)])
    start = time.monotonic()
    first = pool.step_async([(0, "Action: guess 9")])
    second = pool.step_async([(1, "Action: guess 9"), (2, "Action: guess 9")])
    third = pool.step_async([(0, "Action: guess 8")])  # Slot 0 again: after `first`.
    second.result(timeout=5)
    disjoint = time.monotonic() - start
    assert third.result(timeout=5)[0].observation == "Guess 2: 8 is too high."
    shared = time.monotonic() - start
    assert first.result(timeout=0)[0].observation == "Guess 1: 9 is too high."
  # One batch after another, `second` would end after 2 x 0.5 s; beside `first`, after 0.5 s.
  assert disjoint < 0.9, disjoint
  assert shared >= 1.0, shared


def test_bad_requests_raise_value_errors():
  with EnvPool("toy", num_slots=2) as pool:
    pool.reset([(0, 0)])
    with pytest.raises(ValueError, match=r"slot 2 is not in \[0, 2\)"):
      pool.step([(2, "Action: guess 1")])
    with pytest.raises(ValueError, match="at most once"):
      pool.step([(0, "Action: guess 1"), (0, "Action: guess 2")])
    with pytest.raises(ValueError, match="slot 1 has no episode"):
      pool.step([(1, "Action: guess 1")])
    with pytest.raises(ValueError, match="replies are str"):
      pool.step([(0, 5)])
    with pytest.raises(ValueError, match="non-negative ints"):
      pool.reset([(1, -1)])
    # A task id the adapter rejects is the adapter's error: that episode ends, nothing raises.
    [unknown] = pool.reset([(1, 55)])
    assert unknown.info["termination"] == "env_error"
    assert "unknown toy task 55" in unknown.info["error"]
  with pytest.raises(ValueError, match="unknown backend"):
    EnvPool("toy", num_slots=1, backend="fiber")
  with pytest.raises(ValueError, match="picklable"):
    EnvPool(lambda: toy_env.ToyEnv(), num_slots=1, backend="process")


def test_the_pool_answers_what_its_adapters_know():
  with EnvPool("toy", num_slots=2) as pool:
    assert pool.instruction == toy_env.ToyEnv().instruction
    assert tuple(pool.task_ids("test")) == toy_env.TEST_IDS
    assert pool.task_info(1) == {"category": "even"}  # secret(1) = 0
    with pytest.raises(ValueError, match="unknown split"):
      pool.task_ids("dev")


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_the_pool_answers_the_tools_of_its_adapters(backend):
  schemas = base.make("textcraft", action_format="tool_call").action_format.schemas
  with EnvPool("textcraft", num_slots=1, options={"action_format": "tool_call"},
               backend=backend) as pool:
    assert pool.tools == schemas
  # An adapter in the react format, or without an action format at all, has no tools.
  for factory in ("textcraft", toy_env.ToyEnv):
    with EnvPool(factory, num_slots=1, backend=backend) as pool:
      assert pool.tools is None


def test_a_closed_pool_refuses_calls_and_closes_twice_quietly():
  pool = EnvPool("toy", num_slots=1)
  pool.reset([(0, 0)])
  pool.close()
  pool.close()
  with pytest.raises(RuntimeError, match="closed"):
    pool.reset([(0, 0)])


def _open_fds():
  return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_close_leaves_no_threads_processes_or_file_descriptors():
  # multiprocessing starts one resource-tracker process (and keeps its pipe) on first spawn;
  # that is per interpreter, not per pool, so start it before taking the baseline.
  with EnvPool(toy_env.ToyEnv, num_slots=1, backend="process") as pool:
    pool.reset([(0, 0)])
  threads, fds = set(threading.enumerate()), _open_fds()
  assert not multiprocessing.active_children()

  with EnvPool("toy", num_slots=3, options={"hang_s": 0.5}, step_timeout_s=0.2) as pool:
    pool.reset([(0, 0), (1, 1), (2, 2)])
    pool.step([(0, "Action: hang"), (1, "Action: crash"), (2, "Action: guess 1")])
    pool.reset([(0, 0), (1, 1)])
  factory = functools.partial(toy_env.ToyEnv, hang_s=60.0)
  with EnvPool(factory, num_slots=2, backend="process", step_timeout_s=0.5) as pool:
    pool.reset([(0, 0), (1, 1)])
    pool.step([(0, "Action: hang"), (1, "Action: crash")])
    pool.reset([(0, 0), (1, 1)])

  # The abandoned thread exits when its 0.5 s hang ends.
  assert wait_until(lambda: set(threading.enumerate()) == threads), threading.enumerate()
  assert not multiprocessing.active_children()
  assert wait_until(lambda: _open_fds() == fds), (_open_fds() - fds, fds - _open_fds())

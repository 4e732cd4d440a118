"""Evaluation summaries keep every task's samples; two evaluations of the same tasks are compared
task by task with an exact sign test; an evaluation's model is identified by its files' bytes."""

import json
import shutil
from fractions import Fraction

import pytest

from agentgym_jax import evaluation, rollout
from agentgym_jax.models import gguf, lora


def played(successes: dict[int, list[bool]]) -> list[rollout.Trajectory]:
  """Trajectories of each task's samples in order: a success earns reward 1 in 1 turn, a
  failure 0 in 2 turns."""
  return [
      rollout.Trajectory(task_id=task_id, group=task_id, success=success,
                         turn_rewards=[1.0] if success else [0.0, 0.0], termination="done")
      for task_id, samples in successes.items() for success in samples
  ]


def summary(successes: dict[int, list[bool]], categories: dict[int, str] | None = None):
  return evaluation.summarize(played(successes), categories or {})


def test_a_summary_keeps_each_tasks_samples_in_task_order():
  s = summary({3: [True, False], 1: [False, False]}, {1: "depth1", 3: "depth2"})
  assert s["tasks"] == [
      {
          "task_id": 1, "category": "depth1", "success": [0.0, 0.0], "reward": [0.0, 0.0],
          "turns": [2, 2]
      },
      {
          "task_id": 3, "category": "depth2", "success": [1.0, 0.0], "reward": [1.0, 0.0],
          "turns": [1, 2]
      },
  ]
  # The keys other code reads are as they were: 1 of 4 samples, 1 of 2 tasks solved.
  assert (s["k"], s["num_tasks"], s["avg@k"], s["pass@k"], s["turns"]) == (2, 2, 0.25, 0.5, 1.75)
  assert set(s["categories"]) == {"depth1", "depth2"}
  text = evaluation.to_json(s)
  assert json.loads(text) == s
  # One line a task record, below the rest of the summary indented as before.
  assert text.splitlines()[-5:-1] == [
      '  "tasks": [', f'    {json.dumps(s["tasks"][0])},', f'    {json.dumps(s["tasks"][1])}', "  ]"
  ] and text.endswith("\n}")
  del s["tasks"]
  assert evaluation.to_json(s) == json.dumps(s, indent=2)


@pytest.mark.parametrize(
    "gained, lost, p",
    [
        (8, 1, Fraction(2 * (1 + 9), 2**9)),  # 20 / 512 = 0.0390625
        (1, 8, Fraction(20, 512)),
        (5, 5, Fraction(1)),  # 2 * (C(10,0..5) = 638) / 1024 > 1
        (0, 6, Fraction(2, 2**6)),  # 0.03125
        (9, 2, Fraction(2 * (1 + 11 + 55), 2**11)),  # 134 / 2048 = 0.0654296875
        (0, 0, Fraction(1)),
        (1, 0, Fraction(1)),
    ])
def test_sign_test_known_values(gained, lost, p):
  assert evaluation.sign_test(gained, lost) == p


def test_sign_test_is_twice_the_binomial_tail_summed_term_by_term():
  for n in range(16):
    # P(X = i) for X ~ Binomial(n, 1/2), each term from the one before: (n - i) / (i + 1).
    pmf = [Fraction(1, 2**n)]
    for i in range(n):
      pmf.append(pmf[-1] * (n - i) / (i + 1))
    for gained in range(n + 1):
      tail = sum(pmf[:min(gained, n - gained) + 1])
      assert evaluation.sign_test(gained, n - gained) == min(Fraction(1), 2 * tail)


def test_sign_test_matches_scipys_binomial_test():
  stats = pytest.importorskip("scipy.stats")
  for gained, lost in [(8, 1), (9, 2), (3, 14), (20, 31), (0, 6), (40, 40)]:
    expected = stats.binomtest(gained, gained + lost, 0.5).pvalue
    assert float(evaluation.sign_test(gained, lost)) == pytest.approx(expected, rel=1e-12)


def test_a_tiny_p_value_is_exact_not_zero():
  assert evaluation.sign_test(2000, 0) == Fraction(2, 2**2000)


def test_compare_counts_tasks_gained_and_lost_per_category_and_drops_ties():
  categories = {t: "depth1" if t < 5 else "depth2" for t in range(10)}
  before = summary({t: [t == 9] for t in range(10)}, categories)
  after = summary({t: [t < 8] for t in range(10)}, categories)
  paired = evaluation.compare(before, after)
  # Gained 0-7, lost 9, task 8 a tie (unsolved in both).
  assert (paired.gained, paired.lost, paired.num_tasks) == (8, 1, 10)
  assert paired.categories == {"depth1": (5, 0), "depth2": (3, 1)}
  assert paired.p_value == Fraction(20, 512)


def test_with_several_samples_compare_weighs_each_tasks_mean_success():
  before = summary({0: [True, False], 1: [True, False], 2: [True, True], 3: [False, False]})
  after = summary({0: [True, True], 1: [False, True], 2: [False, True], 3: [False, False]})
  paired = evaluation.compare(before, after)
  # Task 0: 1/2 -> 1 gained; 1: 1/2 -> 1/2 a tie; 2: 1 -> 1/2 lost; 3: 0 -> 0 a tie.
  assert (paired.gained, paired.lost, paired.p_value) == (1, 1, Fraction(1))


def test_compare_refuses_evaluations_of_different_tasks():
  with pytest.raises(
      ValueError, match=r"different tasks \(1 only in the first, e.g. \[2\]; "
      r"0 only in the second"):
    evaluation.compare(summary({1: [True], 2: [False]}), summary({1: [False]}))


def test_compare_refuses_a_summary_without_per_task_records():
  old = summary({1: [True]})
  del old["tasks"]
  with pytest.raises(ValueError, match="no per-task records"):
    evaluation.compare(old, summary({1: [True]}))


def test_a_models_fingerprint_is_its_files_bytes(checkpoint_dir, tmp_path):
  copy = shutil.copytree(checkpoint_dir, tmp_path / "copy")
  assert evaluation.model_fingerprint(str(copy)) == evaluation.model_fingerprint(checkpoint_dir)
  # A file that loading does not read changes nothing; one byte of the weights changes it.
  (copy / "README.md").write_text("notes")
  assert evaluation.model_fingerprint(str(copy)) == evaluation.model_fingerprint(checkpoint_dir)
  weights = copy / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[-1] ^= 1
  weights.write_bytes(bytes(data))
  assert evaluation.model_fingerprint(str(copy)) != evaluation.model_fingerprint(checkpoint_dir)


def test_each_file_is_hashed_once_while_it_is_unchanged(checkpoint_dir, tmp_path, monkeypatch):
  copy = shutil.copytree(checkpoint_dir, tmp_path / "copy")
  hashed, file_digest = [], evaluation.hashlib.file_digest
  monkeypatch.setattr(evaluation.hashlib, "file_digest",
                      lambda f, name: hashed.append(f.name) or file_digest(f, name))
  first = evaluation.model_fingerprint(str(copy))
  assert sorted(hashed) == sorted(str(f) for f in evaluation.model_files(str(copy)))
  assert evaluation.model_fingerprint(str(copy)) == first and len(hashed) == len(set(hashed))


def test_the_embedded_model_is_its_gguf_file():
  assert evaluation.model_files("smollm2-135m-instruct") == [gguf.smollm2_gguf_path()]


def test_a_peft_adapter_directorys_files_come_before_its_bases(checkpoint_dir, tmp_path):
  adapter = tmp_path / "adapter"
  adapter.mkdir()
  (adapter / lora.PEFT_CONFIG).write_text(json.dumps({"base_model_name_or_path": checkpoint_dir}))
  (adapter / "adapter_model.safetensors").write_bytes(b"adapters")
  assert evaluation.model_files(str(adapter)) == [
      adapter / lora.PEFT_CONFIG, adapter / "adapter_model.safetensors",
      *evaluation.model_files(checkpoint_dir)
  ]

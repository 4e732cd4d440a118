"""The ablation notebooks (notebooks/scalinginter_ablation.ipynb, notebooks/gigpo_ablation.ipynb)
run headless (QUICK mode) and show their curves and their measured summary tables."""

import json
import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "scalinginter_ablation.ipynb"
GIGPO_NOTEBOOK = REPO / "notebooks" / "gigpo_ablation.ipynb"


def _run_quick(path, monkeypatch):
  """The notebook at `path` executed in QUICK mode: no error output, one figure and one summary
  table marked as a QUICK run. Returns the table's rows and the printed text."""
  monkeypatch.setenv("ABLATION_QUICK", "1")  # The kernel inherits this process's environment.
  notebook = nbformat.read(path, as_version=4)
  # Raises CellExecutionError, naming the cell and the traceback, if any cell fails.
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
  outputs = [
      output for cell in notebook.cells if cell.cell_type == "code"
      for output in cell.get("outputs", [])
  ]
  assert not [o for o in outputs if o.output_type == "error"]
  assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 1
  (table,) = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert "QUICK smoke run" in table
  printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  return [line for line in table.splitlines() if line.startswith("| ")], printed


@pytest.mark.slow
def test_ablation_notebook_runs_quick_and_shows_plot_and_table(monkeypatch):
  table_rows, printed = _run_quick(NOTEBOOK, monkeypatch)  # The figure: 2 x 2 panels.
  # Header plus one row per variant, each with the caps its schedule used.
  assert [row.split(" | ")[0:2] for row in table_rows[1:]] == [["| short", "2"], ["| long", "4"],
                                                               ["| scaling", "2, 4"]]
  assert "success per step" in printed


@pytest.mark.slow
def test_gigpo_notebook_runs_quick_and_shows_curves_and_table(monkeypatch):
  # The figure: success, turns and GiGPO's step groups, side by side.
  table_rows, printed = _run_quick(GIGPO_NOTEBOOK, monkeypatch)
  # Header plus one row per algorithm; two steps reach no 3-step threshold and so cannot fall
  # back from one ("-" per seed).
  assert [row.split(" | ")[0] for row in table_rows[1:]] == ["| grpo", "| gigpo"]
  assert all(row.split(" | ")[4:7] == ["-", "-", "-"] for row in table_rows[1:])
  assert "grpo  seed 0" in printed and "gigpo seed 0" in printed


def test_textcraft_scalinginter_notebook_reports_the_recorded_trials():
  # The notebook reads the trials' records (docs/rl_trials/); every arm's row must agree with
  # the evaluations counted here goal by goal.
  path = REPO / "notebooks" / "scalinginter_textcraft.ipynb"
  notebook = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 1
  (table,) = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  per_seed = table.split("\n\n")[0]  # The pooled table follows the per-seed one.
  rows = {tuple(line.split(" | ")[:2]): line for line in per_seed.splitlines()[2:]}
  trials = {
      "staged": ("base", "staged_s1"), "short": ("fixed3", "short_s1"),
      "long": ("fixed8", "long_s1")
  }
  for arm, names in trials.items():
    for seed, name in enumerate(names):
      row = rows[(f"| {arm}", str(seed))]
      evaluations = REPO / "docs" / "rl_trials" / name / "evaluation"
      if not (evaluations / "rl.json").exists():
        assert "not run yet" in row
        continue
      warm, rl = (
          json.loads((evaluations / f"{stage}.json").read_text()) for stage in ("warm_start", "rl"))
      before = {t["task_id"]: t["success"][0] for t in warm["tasks"]}
      after = {t["task_id"]: t["success"][0] for t in rl["tasks"]}
      gained = sum(after[t] > before[t] for t in after)
      lost = sum(after[t] < before[t] for t in after)
      assert f"**{100 * sum(after.values()) / len(after):.1f}**" in row
      assert f"| +{gained} -{lost} |" in row

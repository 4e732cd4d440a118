"""The ablation notebooks (notebooks/scalinginter_ablation.ipynb, notebooks/gigpo_ablation.ipynb)
run headless (QUICK mode) and show their curves and their measured summary tables."""

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "scalinginter_ablation.ipynb"
GIGPO_NOTEBOOK = REPO / "notebooks" / "gigpo_ablation.ipynb"


def _outputs(notebook):
  return [
      output for cell in notebook.cells if cell.cell_type == "code"
      for output in cell.get("outputs", [])
  ]


def _run_quick(path, monkeypatch):
  """The notebook at `path` executed in QUICK mode; returns its code cells' outputs."""
  monkeypatch.setenv("ABLATION_QUICK", "1")  # The kernel inherits this process's environment.
  notebook = nbformat.read(path, as_version=4)
  # Raises CellExecutionError, naming the cell and the traceback, if any cell fails.
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
  return _outputs(notebook)


def test_ablation_notebook_runs_quick_and_shows_plot_and_table(monkeypatch):
  outputs = _run_quick(NOTEBOOK, monkeypatch)
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 1  # The 2 x 2 panel figure.
  tables = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert len(tables) == 1
  table_rows = [line for line in tables[0].splitlines() if line.startswith("| ")]
  # Header plus one row per variant, each with the caps its schedule used.
  assert [row.split(" | ")[0:2] for row in table_rows[1:]] == [["| short", "2"], ["| long", "4"],
                                                               ["| scaling", "2, 4"]]
  assert "QUICK smoke run" in tables[0]
  printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "success per step" in printed


def test_gigpo_notebook_runs_quick_and_shows_curves_and_table(monkeypatch):
  outputs = _run_quick(GIGPO_NOTEBOOK, monkeypatch)
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 1  # Success, turns and GiGPO's step groups, side by side.
  tables = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert len(tables) == 1
  table_rows = [line for line in tables[0].splitlines() if line.startswith("| ")]
  # Header plus one row per algorithm; two steps reach no 3-step threshold and so cannot fall
  # back from one ("-" per seed).
  assert [row.split(" | ")[0] for row in table_rows[1:]] == ["| grpo", "| gigpo"]
  assert all(row.split(" | ")[4:7] == ["-", "-", "-"] for row in table_rows[1:])
  assert "QUICK smoke run" in tables[0]
  printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "grpo  seed 0" in printed and "gigpo seed 0" in printed

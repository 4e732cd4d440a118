"""notebooks/scalinginter_ablation.ipynb runs headless (QUICK mode) and shows its curves and
its measured summary table."""

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "scalinginter_ablation.ipynb"


def _outputs(notebook):
  return [
      output for cell in notebook.cells if cell.cell_type == "code"
      for output in cell.get("outputs", [])
  ]


def test_ablation_notebook_runs_quick_and_shows_plot_and_table(monkeypatch):
  monkeypatch.setenv("ABLATION_QUICK", "1")  # The kernel inherits this process's environment.
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # Raises CellExecutionError, naming the cell and the traceback, if any cell fails.
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3", resources={
      "metadata": {
          "path": str(NOTEBOOK.parent)
      }
  }).execute()
  outputs = _outputs(notebook)
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

"""The HTML run viewer: the data it embeds, its escaping, and the page in a real browser; and
the example run shipped in docs/example_run (real records of an RL run and of an evaluation).

The browser tests drive Debian's chromium (/usr/bin/chromium) through playwright against the
file:// URL, as a user opens the page; they skip when either is missing.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from agentgym_jax import metrics, rollout
from agentgym_jax.tools import viewer
from fake_run import NEEDLE, NEEDLE_AT, SPECIAL_TEXT, read_fake_trajectories, write_fake_run

CHROMIUM = "/usr/bin/chromium"
# Headless, and nothing that reaches the network on its own.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"
]
NUM_TRAJECTORIES = 6 * 4 * 4  # write_fake_run's default steps x tasks x samples.
REPO = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE_RUN = os.path.join(REPO, "docs", "example_run")
EXAMPLE_EVALUATION = os.path.join(EXAMPLE_RUN, "evaluation")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return write_fake_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def records(run_dir):
  return read_fake_trajectories(run_dir)


def test_embed_json_round_trips_and_cannot_end_the_script_element():
  value = {"text": "</script><!-- <b>&amp; \u2028 日本 🚀", "numbers": [1, 2.5, None]}
  embedded = viewer.embed_json(value)
  assert not set("<>&") & set(embedded)
  assert json.loads(embedded) == value


def test_page_is_self_contained_and_run_text_stays_inside_its_json(run_dir):
  page = viewer.render_html(viewer.load_run(run_dir))
  # Two script elements (data, code) although the messages contain "</script>".
  assert len(re.findall(r"</script", page, re.IGNORECASE)) == 2
  data = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page,
                   re.DOTALL).group(1)
  assert "<" not in data
  assert any(
      SPECIAL_TEXT in m["content"] for t in json.loads(data)["trajectories"] for m in t["messages"])
  # Nothing fetched: no external scripts, styles, images or fonts.
  for pattern in (r"\bsrc=", r"<link\b", r"@import", r"url\(", r"https://"):
    assert not re.search(pattern, page), pattern
  assert set(re.findall(r"http://[^\"' ]+", page)) == {"http://www.w3.org/2000/svg"}


def test_load_run_fills_in_missing_fields_and_skips_the_cut_metrics_line(run_dir, records):
  run = viewer.load_run(run_dir)
  assert run["num_metric_rows"] == 6  # The 7th line was cut short by a "crash".
  assert run["logged_steps"] == run["shown_steps"] == list(range(6))
  views = run["trajectories"]
  assert len(views) == len(records) == NUM_TRAJECTORIES
  for view, record in zip(views, records):
    for key in ("step", "task_id", "group", "sample", "messages"):
      assert view[key] == record[key], key
    assert view["env"] == record.get("env", "")
    assert view["advantage"] == record.get("advantage")
  assert any(v["advantage"] is None for v in views) and any(v["env"] == "" for v in views)


def test_sparse_records_from_other_writers_still_render(tmp_path):
  os.makedirs(tmp_path / "trajectories")
  lines = [
      '{"task_id": 7}',  # Nothing but an id.
      '{"task_id": 8, "reward": NaN, "turn_rewards": [0.5, null], "num_turns": null, '
      '"messages": [{"role": "user"}], "info": {"score": Infinity}}'
  ]
  (tmp_path / "trajectories" / "step_000003.jsonl").write_text("\n".join(lines) + "\n")
  run = viewer.load_run(tmp_path)
  bare, odd = run["trajectories"]
  assert bare["step"] == 3 and bare["messages"] == [] and bare["termination"] == ""
  # A non-finite reward is rebuilt from the turn rewards: 0.5 + (null as 0) = 0.5.
  assert odd["reward"] == 0.5 and odd["num_turns"] == 2 and odd["info"] == {"score": None}
  assert odd["messages"] == [{"role": "user", "content": ""}]
  assert "NaN" not in viewer.render_html(run)


def test_charts_follow_metrics_and_evaluations_per_category(run_dir):
  rows = [
      json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))
      if line.endswith("\n")
  ]
  charts = {chart["title"]: chart for chart in viewer.load_run(run_dir)["charts"]}
  assert list(charts) == ["Success rate", "Reward", "Turns", "Horizon cap", "Evaluation success"]
  assert charts["Success rate"]["series"][0]["points"] == [[r["step"], r["success"]] for r in rows]
  assert charts["Horizon cap"]["step_function"]
  evaluation = charts["Evaluation success"]["series"]
  assert [s["name"] for s in evaluation
         ] == ["eval/success", "eval/success/depth1", "eval/success/depth2"]
  assert [p[0] for p in evaluation[0]["points"]] == [1, 3, 5]  # Logged every other step.


def test_charts_are_averaged_from_trajectories_when_metrics_are_missing(tmp_path):
  run_dir = write_fake_run(tmp_path)
  os.remove(os.path.join(run_dir, "metrics.jsonl"))
  records = read_fake_trajectories(run_dir)
  charts = {chart["title"]: chart for chart in viewer.load_run(run_dir)["charts"]}
  assert list(charts) == ["Success rate", "Reward", "Turns"]
  step_2 = [r for r in records if r["step"] == 2]
  assert charts["Turns"]["series"][0]["points"][2] == pytest.approx(
      [2, sum(r["num_turns"] for r in step_2) / len(step_2)])


def test_max_steps_keeps_the_latest_steps_of_trajectories(run_dir):
  run = viewer.load_run(run_dir, max_steps=2)
  assert run["shown_steps"] == [4, 5]
  assert sorted({t["step"] for t in run["trajectories"]}) == [4, 5]
  assert len(run["trajectories"]) == 2 * 16
  assert run["charts"][0]["series"][0]["points"][0][0] == 0  # Charts keep every step.


def test_columns_show_sample_and_advantage_only_where_records_have_them(run_dir, tmp_path):
  every = [header for _, header in viewer.COLUMNS]
  assert [header for _, header in viewer.load_run(run_dir)["columns"]] == every
  # What launch/evaluate.py --trajectories writes: Trajectory.to_json, no sample, no advantage.
  played = [
      rollout.Trajectory(task_id=task_id, group=task_id, env="textcraft", category=category,
                         messages=[{"role": "user", "content": "Goal: craft 1 stick."}],
                         turn_rewards=[0.0, 1.0], success=True, termination="done")
      for task_id, category in ((3, "depth1"), (4, "depth2"))
  ]
  metrics.TrajectoryWriter(tmp_path).write(0, [t.to_json() for t in played])
  run = viewer.load_run(tmp_path)
  assert [key for key, _ in run["columns"]] == [
      "step", "task_id", "env", "category", "success", "reward", "num_turns", "termination",
      "num_tokens"
  ]
  assert [t["category"] for t in run["trajectories"]] == ["depth1", "depth2"]
  # One record with a value brings its column back.
  assert ["sample",
          "Sample"] in viewer.columns([*run["trajectories"], {"sample": 0, "advantage": None}])


def test_load_run_explains_what_is_wrong(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    viewer.load_run(tmp_path / "absent")
  with pytest.raises(ValueError, match="neither metrics.jsonl nor trajectory files"):
    viewer.load_run(tmp_path)
  with pytest.raises(ValueError, match="max_steps"):
    viewer.load_run(write_fake_run(tmp_path), max_steps=-1)


def test_view_command_line(tmp_path, run_dir):
  out = tmp_path / "page" / "run.html"
  result = subprocess.run(
      [sys.executable, "launch/view.py", f"--workdir={run_dir}", f"--out={out}", "--max_steps=1"],
      cwd=os.path.join(os.path.dirname(__file__), ".."), capture_output=True, text=True, check=True)
  assert str(out) in result.stdout  # It says where the page is.
  data = re.search(r'id="run-data">(.*?)</script>', out.read_text(encoding="utf-8"), re.DOTALL)
  assert {t["step"] for t in json.loads(data.group(1))["trajectories"]} == {5}


# ---- In a browser ----


@pytest.fixture(scope="module")
def browser():
  if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install -y chromium); the viewer is "
                "tested in a real browser only")
  sync_api = pytest.importorskip("playwright.sync_api",
                                 reason="playwright is not installed (pip install playwright)")
  with sync_api.sync_playwright() as playwright:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


def _open(browser, workdir, out):
  """(context, page): the viewer of `workdir`, written to `out` and open in a new context;
  `page.problems` collects console errors and requests for anything but the page itself."""
  path = viewer.write_viewer(workdir, out)
  context = browser.new_context(viewport={"width": 1400, "height": 1000})
  page = context.new_page()
  page.problems = []
  page.on("console", lambda m: m.type == "error" and page.problems.append(m.text))
  page.on("pageerror", lambda error: page.problems.append(str(error)))
  url = "file://" + os.path.abspath(path)
  page.on("request", lambda r: r.url != url and page.problems.append("request " + r.url))
  page.goto(url)
  return context, page


@pytest.fixture
def page(browser, run_dir, tmp_path):
  """The viewer of the fake run, open; `page.problems` (`_open`) must be empty when the test
  ends."""
  context, page = _open(browser, run_dir, tmp_path / "viewer.html")
  yield page
  context.close()
  assert page.problems == []


def _count(page) -> int:
  return int(page.get_attribute("#count", "data-count"))


def _wait_for_count(page, expected: int) -> None:
  page.wait_for_function(f"document.getElementById('count').dataset.count === '{expected}'",
                         timeout=5000)


def test_page_loads_offline_without_errors(page):
  assert page.title().endswith("agentgym-jax")
  assert _count(page) == NUM_TRAJECTORIES
  assert page.locator("thead th").all_inner_texts() == [h for _, h in viewer.COLUMNS]
  assert page.locator("#rows tr").count() == 50  # The first page of rows only.
  assert page.locator("#charts .chart").count() == 5
  # The script tag inside a message stayed text.
  assert page.evaluate("window.__pwned") is None


def test_filters_change_the_visible_count(page, records):

  def expect(**conditions) -> int:
    count = sum(all(check(r) for check in conditions.values()) for r in records)
    assert 0 < count < len(records)  # Otherwise the filter would prove nothing.
    return count

  page.select_option("#f-step", "2")
  assert _count(page) == expect(step=lambda r: r["step"] == 2)
  page.select_option("#f-success", "1")
  assert _count(page) == expect(step=lambda r: r["step"] == 2, success=lambda r: r["success"])
  page.click("#f-reset")
  assert _count(page) == len(records)
  page.select_option("#f-env", label="babyai")
  assert _count(page) == expect(env=lambda r: r.get("env") == "babyai")
  page.select_option("#f-env", label="(not logged)")
  assert _count(page) == expect(env=lambda r: "env" not in r)
  page.click("#f-reset")
  page.select_option("#f-category", label="depth2")
  assert _count(page) == expect(category=lambda r: r.get("category") == "depth2")
  page.select_option("#f-success", "0")
  assert _count(page) == expect(category=lambda r: r.get("category") == "depth2",
                                success=lambda r: not r["success"])
  page.select_option("#f-category", label="(not logged)")
  assert _count(page) == expect(category=lambda r: "category" not in r,
                                success=lambda r: not r["success"])
  page.click("#f-reset")
  page.select_option("#f-termination", label="env_error")
  assert _count(page) == expect(end=lambda r: r["termination"] == "env_error")
  page.click("#f-reset")
  page.fill("#f-task", "1003, 1005")
  assert _count(page) == expect(task=lambda r: r["task_id"] in (1003, 1005))
  page.click("#f-reset")
  page.fill("#f-search", "CAFÉ")  # Case-blind over every message.
  _wait_for_count(page, expect(text=lambda r: any("café" in m["content"] for m in r["messages"])))


def test_pages_and_sorting(page, records):
  page.click("#next")
  assert page.locator("#rows tr").count() == NUM_TRAJECTORIES - 50
  assert page.inner_text("#page") == "page 2 / 2"
  page.click("th[data-sort=reward]")
  page.click("th[data-sort=reward]")  # A second click sorts descending.
  assert page.inner_text("#page") == "page 1 / 2"  # A new order starts on its first page.
  best = max(r["reward"] for r in records)
  assert page.inner_text("#rows tr:first-child td[data-col=reward]") == f"{best:g}"
  page.click("th[data-sort=category]")
  categories = page.locator("#rows td[data-col=category]").all_inner_texts()
  assert categories == sorted(categories, key=lambda c: (c == "\u2014", c))  # Missing: last.
  # j / k step through the list in its shown order.
  page.keyboard.press("j")
  page.keyboard.press("j")
  second = page.locator("#rows tr >> nth=1")
  assert second.get_attribute("class") == "selected"
  assert page.inner_text("#detail h2") == "Step {} · task {} · sample {}".format(*(
      second.locator(f"td[data-col={key}]").inner_text() for key in ("step", "task_id", "sample")))


def test_clicking_a_chart_filters_to_the_nearest_logged_step(page, records):
  chart = page.locator("#charts svg >> nth=0")
  box = chart.bounding_box()
  chart.click(position={"x": box["width"] - 2, "y": box["height"] / 2})  # The last step.
  assert page.input_value("#f-step") == "5"
  assert _count(page) == sum(r["step"] == 5 for r in records)


def test_search_finds_a_message_and_its_conversation_opens(page, tmp_path):
  page.fill("#f-search", NEEDLE)
  _wait_for_count(page, 1)
  page.click("#rows tr")
  step, task_id, sample = NEEDLE_AT
  assert page.inner_text("#detail h2") == f"Step {step} · task {task_id} · sample {sample}"
  assert page.inner_text("#detail mark") == NEEDLE.upper()
  page.screenshot(path=str(tmp_path / "viewer_search.png"))


def test_conversation_shows_special_characters_literally(page, records, tmp_path):
  # The first trajectory whose first agent turn carries the special text, with an error.
  wanted = next(r for r in records
                if r["sample"] == 0 and r["num_turns"] >= 2 and r["termination"] == "env_error")
  page.select_option("#f-step", str(wanted["step"]))
  page.fill("#f-task", str(wanted["task_id"]))
  page.click("#rows tr:has(td[data-col=sample]:text-is('0'))")
  detail = page.inner_text("#detail")
  assert SPECIAL_TEXT in detail
  assert wanted["error"] in detail  # "adapter crashed: <ConnectionError> & ..."
  assert "x <= y && y > z" in detail
  assert page.locator("#detail b, #detail script").count() == 0
  # One agent block per turn, each with its reward; observations between them.
  assert page.locator("#detail .msg.assistant").count() == wanted["num_turns"]
  assert page.locator("#detail .msg.user").count() == wanted["num_turns"]
  assert page.inner_text("#detail .msg.assistant .action >> nth=0") == (
      "Action: " + wanted["messages"][1]["content"].split("Action: ")[1])
  shot = tmp_path / "viewer_conversation.png"
  page.screenshot(path=str(shot), full_page=True)
  assert shot.stat().st_size > 10_000


def test_evaluation_records_show_no_sample_or_advantage(browser, tmp_path):
  context, page = _open(browser, EXAMPLE_EVALUATION, tmp_path / "viewer.html")
  records = metrics.read_trajectories(EXAMPLE_EVALUATION, 0)
  assert page.locator("thead th").all_inner_texts() == [
      "Step", "Task", "Env", "Category", "Outcome", "Reward", "Turns", "Ended by", "Tokens"
  ]
  assert page.locator("#rows td[data-col=sample], #rows td[data-col=advantage]").count() == 0
  assert _count(page) == len(records)
  page.select_option("#f-category", label="depth2")
  assert _count(page) == sum(r["category"] == "depth2" for r in records) > 0
  page.click("#rows tr >> nth=0")
  record = next(r for r in records if r["category"] == "depth2")
  assert page.inner_text("#detail h2") == f"Step 0 · task {record['task_id']}"
  assert page.locator("#detail dt").all_inner_texts() == [
      "reward", "turns", "turn rewards", "tokens"
  ]
  context.close()
  assert page.problems == []


# ---- The shipped example run ----


def test_example_run_holds_real_records_of_both_kinds():
  """A few steps of a real RL run (docs/example_run/README.md says which) and a real
  evaluation: the trainer's records carry sample and advantage, evaluation records neither;
  both carry the task's category. Small enough to keep in the repository."""
  size = sum(
      os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(EXAMPLE_RUN) for f in files
      if f != "viewer.html")  # The page view.py writes there by default (.gitignore).
  assert size < 200_000
  steps = metrics.trajectory_steps(EXAMPLE_RUN)
  assert len(steps) >= 2
  trained = [r for step in steps for r in metrics.read_trajectories(EXAMPLE_RUN, step)]
  assert all(r["env"] == "textcraft" and r["messages"] for r in trained)
  assert {r["category"] for r in trained} == {"depth1", "depth2"}
  assert all(isinstance(r["sample"], int) and "advantage" in r for r in trained)
  assert {r["success"] for r in trained} == {True, False}
  logged = [r["step"] for r in metrics.read_metrics(EXAMPLE_RUN)]  # Every step of the run.
  assert logged == list(range(1, len(logged) + 1)) and set(steps) < set(logged)
  evaluated = metrics.read_trajectories(EXAMPLE_EVALUATION, 0)
  assert evaluated and all("sample" not in r and "advantage" not in r for r in evaluated)
  assert {r["category"] for r in evaluated} == {"depth1", "depth2"}


@pytest.mark.parametrize("workdir", [EXAMPLE_RUN, EXAMPLE_EVALUATION])
def test_view_command_opens_the_example_run(tmp_path, workdir):
  out = tmp_path / "viewer.html"
  result = subprocess.run(
      [sys.executable, "launch/view.py", f"--workdir={workdir}", f"--out={out}"], cwd=REPO,
      capture_output=True, text=True, check=True)
  assert str(out) in result.stdout  # It says where the page is.
  data = json.loads(
      re.search(r'id="run-data">(.*?)</script>', out.read_text(encoding="utf-8"),
                re.DOTALL).group(1))
  steps = metrics.trajectory_steps(workdir)
  assert len(data["trajectories"]) == sum(
      len(metrics.read_trajectories(workdir, step)) for step in steps)
  assert data["charts"]


def test_example_run_in_the_browser(browser, tmp_path):
  context, page = _open(browser, EXAMPLE_RUN, tmp_path / "viewer.html")
  assert "Sample" in page.locator("thead th").all_inner_texts()
  assert page.locator("#charts .chart").count() >= 4
  page.select_option("#f-category", label="depth2")
  page.select_option("#f-success", "1")
  page.select_option("#f-category", label="depth1")
  assert _count(page) > 0
  page.click("#rows tr >> nth=0")
  assert page.locator("#detail .msg.assistant").count() >= 1
  assert "advantage" in page.locator("#detail dt").all_inner_texts()
  context.close()
  assert page.problems == []

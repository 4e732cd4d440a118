"""A self-contained HTML page for reading what the agents of a run did.

`write_viewer(workdir, out)` reads a run's metrics.jsonl and trajectories/ (the formats of
agentgym_jax/metrics.py) and writes one HTML file with its CSS, JavaScript and data inline, so
it opens offline from file:// and can be mailed or archived with the run:

  * charts of success, reward, turns, horizon cap and evaluation success over the steps
    (clicking a chart filters the list to the nearest step with logged trajectories);
  * the trajectories, filtered by step, task id, environment, outcome and termination, and by
    free text over the messages, in pages of 50 rows, sortable by column;
  * one trajectory's whole conversation: the instruction and first observation, each turn's
    thought, action and reward, the observations between turns, the advantage, how the
    episode ended and the environment's error.

Safety. The run's text is data, never markup: it travels as JSON inside
<script type="application/json"> with "<", ">" and "&" written as \\u escapes (so a message
containing "</script>" cannot end the tag), and the page builds every element with
textContent, never innerHTML.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax import metrics
from agentgym_jax import plots
from environments import jsonl

# (title, metric keys or key prefixes ending in "/", drawn as a step function).
CHARTS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("Success rate", ("success",), False),
    ("Reward", ("reward",), False),
    ("Turns", ("turns",), False),
    ("Horizon cap", ("horizon_cap",), True),
    ("Evaluation success", ("eval/success", "eval/success/"), False),
)
# Chart keys that can be recomputed from the trajectories of a step when metrics.jsonl lacks
# them (a run whose metrics file was lost, or a foreign run with only trajectories).
_FROM_TRAJECTORIES = {"success": "success", "reward": "reward", "turns": "num_turns"}
_SLOT = re.compile(r"__(TITLE|CSS|JS|DATA)__")


def _int_or(value: Any, default: int) -> int:
  number = jsonl.finite(value)
  return default if number is None else int(number)


def chart_series(rows: Sequence[Mapping[str, Any]],
                 trajectories: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The charts of the page: [{"title", "step_function", "series": [{"name", "points"}]}].

  A chart keeps the series that have points; a chart without any is left out. Success, reward
  and turns missing from metrics.jsonl are averaged from the trajectories of each step.
  """
  by_step: dict[int, list[Mapping[str, Any]]] = {}
  for trajectory in trajectories:
    by_step.setdefault(trajectory["step"], []).append(trajectory)
  charts = []
  for title, keys, step_function in CHARTS:
    series = []
    for name in plots.matching_keys(rows, keys):
      points = [list(point) for point in zip(*plots.metric_series(rows, name))]
      if not points and name in _FROM_TRAJECTORIES:
        field = _FROM_TRAJECTORIES[name]
        points = [[step, sum(float(t[field] or 0) for t in group) / len(group)]
                  for step, group in sorted(by_step.items())]
      if points:
        series.append({"name": name, "points": points})
    if series:
      charts.append({"title": title, "step_function": step_function, "series": series})
  return charts


def _trajectory_view(record: Mapping[str, Any], step: int) -> dict[str, Any]:
  """A logged trajectory with every field the page reads, defaults for missing ones."""
  info = record.get("info") if isinstance(record.get("info"), Mapping) else {}
  messages = [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
              for m in record.get("messages") or () if isinstance(m, Mapping)]
  turn_rewards = [jsonl.finite(r) for r in record.get("turn_rewards") or ()]
  reward = jsonl.finite(record.get("reward"))
  return {
      "step": int(record.get("step", step)),
      "task_id": record.get("task_id"),
      "group": record.get("group"),
      "sample": record.get("sample"),
      "env": str(record.get("env") or info.get("env") or ""),
      "category": str(record.get("category") or info.get("category") or ""),
      "reward": reward if reward is not None else sum(r or 0.0 for r in turn_rewards),
      "success": bool(record.get("success", info.get("success", False))),
      "num_turns": _int_or(record.get("num_turns"), len(turn_rewards)),
      "termination": str(record.get("termination") or ""),
      "error": str(record.get("error") or ""),
      "advantage": jsonl.finite(record.get("advantage")),
      "turn_rewards": turn_rewards,
      "num_tokens": record.get("num_tokens"),
      "num_trained_tokens": record.get("num_trained_tokens"),
      "messages": messages,
      "info": jsonl.json_safe(info),
  }


def load_run(workdir: str | os.PathLike[str], max_steps: int = 0) -> dict[str, Any]:
  """The page's data for the run in `workdir`.

  Args:
    workdir: a run directory with metrics.jsonl and/or trajectories/.
    max_steps: keep the trajectories of only the last `max_steps` logged steps (0: all), which
      bounds the size of the page for long runs; the charts always cover every step.
  """
  workdir = os.fspath(workdir)
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"Run directory {workdir!r} does not exist.")
  if max_steps < 0:
    raise ValueError(f"max_steps must be >= 0 (0 keeps every step), got {max_steps}.")
  rows = metrics.read_metrics(workdir)
  logged_steps = metrics.trajectory_steps(workdir)
  if not rows and not logged_steps:
    raise ValueError(f"{workdir!r} has neither {metrics.METRICS_FILE} nor trajectory files "
                     f"under {metrics.TRAJECTORY_DIR}/: is it a run directory?")
  shown_steps = logged_steps[-max_steps:] if max_steps else logged_steps
  trajectories = [_trajectory_view(record, step) for step in shown_steps
                  for record in metrics.read_trajectories(workdir, step)]
  return {
      "title": os.path.basename(os.path.abspath(workdir)),
      "workdir": os.path.abspath(workdir),
      "generated": datetime.datetime.now().isoformat(timespec="seconds"),
      "num_metric_rows": len(rows),
      "logged_steps": logged_steps,
      "shown_steps": shown_steps,
      "charts": jsonl.json_safe(chart_series(rows, trajectories)),
      "trajectories": trajectories,
  }


def embed_json(value: Any) -> str:
  """JSON for a <script type="application/json"> element.

  "<", ">" and "&" occur in JSON only inside strings, where \\u escapes mean the same
  characters to JSON.parse; escaping them means no "</script>" or "<!--" in the text.
  """
  text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
  return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(run: Mapping[str, Any]) -> str:
  """The whole page for `run` (from `load_run`)."""
  fills = {"TITLE": html.escape(f"{run['title']} · agentgym-jax"), "CSS": _CSS, "JS": _JS,
           "DATA": embed_json(run)}
  # One pass, so a slot name inside the run's text is never filled in turn.
  return _SLOT.sub(lambda match: fills[match.group(1)], _PAGE)


def write_viewer(workdir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 max_steps: int = 0) -> str:
  """Writes the page for the run in `workdir` to `out` (default workdir/viewer.html)."""
  out = os.fspath(out) if out else os.path.join(os.fspath(workdir), "viewer.html")
  page = render_html(load_run(workdir, max_steps=max_steps))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    f.write(page)
  return out


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__CSS__</style>
</head>
<body>
<header>
  <h1 id="run-title"></h1>
  <div id="run-summary" class="muted"></div>
</header>
<section id="charts" class="charts" aria-label="Training curves"></section>
<main>
  <section class="list-pane" aria-label="Trajectories">
    <div class="filters">
      <label>Step <select id="f-step"></select></label>
      <label>Task <input id="f-task" type="text" size="9" placeholder="ids, comma"></label>
      <label>Env <select id="f-env"></select></label>
      <label>Outcome <select id="f-success">
        <option value="">any</option><option value="1">success</option>
        <option value="0">failure</option></select></label>
      <label>Ended by <select id="f-termination"></select></label>
      <label class="grow">Search <input id="f-search" type="search"
        placeholder="text in messages or errors"></label>
      <button id="f-reset" type="button">Reset</button>
    </div>
    <div class="count-line"><span id="count"></span>
      <span class="pager"><button id="prev" type="button">&lsaquo; Prev</button>
      <span id="page"></span><button id="next" type="button">Next &rsaquo;</button></span></div>
    <table id="trajectories">
      <thead><tr>
        <th data-sort="step">Step</th><th data-sort="task_id">Task</th>
        <th data-sort="sample">Sample</th><th data-sort="env">Env</th>
        <th data-sort="success">Outcome</th><th data-sort="reward">Reward</th>
        <th data-sort="advantage">Adv.</th><th data-sort="num_turns">Turns</th>
        <th data-sort="termination">Ended by</th><th data-sort="num_tokens">Tokens</th>
      </tr></thead>
      <tbody id="rows"></tbody>
    </table>
    <p class="muted small">Keys: j / k for the next / previous trajectory.</p>
  </section>
  <section id="detail" class="detail" aria-live="polite">
    <p class="muted">Click a trajectory to read its conversation.</p>
  </section>
</main>
<script type="application/json" id="run-data">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""

_CSS = """
:root { --fg: #1f2328; --muted: #656d76; --line: #d0d7de; --bg: #ffffff; --panel: #f6f8fa;
  --ok: #1a7f37; --bad: #cf222e; --accent: #0969da; --agent: #eef6ff; --env: #f6f8fa;
  --mono: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: var(--fg); background: var(--bg); }
header { padding: 14px 20px 6px; border-bottom: 1px solid var(--line); }
h1 { font-size: 20px; margin: 0 0 2px; }
h2 { font-size: 16px; margin: 0 0 8px; }
.muted { color: var(--muted); }
.small { font-size: 12px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; padding: 12px 20px;
  border-bottom: 1px solid var(--line); }
.chart { border: 1px solid var(--line); border-radius: 6px; padding: 6px 8px 2px; }
.chart .head { display: flex; justify-content: space-between; gap: 12px; font-size: 12px; }
.chart .head b { font-weight: 600; }
.chart svg { display: block; cursor: crosshair; }
.chart text { font: 10px var(--mono); fill: var(--muted); }
.legend { font-size: 11px; color: var(--muted); }
.legend i { display: inline-block; width: 10px; height: 3px; margin: 0 3px 2px 8px;
  vertical-align: middle; }
main { display: grid; grid-template-columns: minmax(0, 11fr) minmax(0, 10fr); gap: 16px;
  padding: 12px 20px; align-items: start; }
@media (max-width: 1100px) { main { grid-template-columns: minmax(0, 1fr); } }
.filters { display: flex; flex-wrap: wrap; gap: 8px 12px; align-items: end; }
.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
.filters .grow { flex: 1 1 180px; }
input, select, button { font: inherit; font-size: 13px; height: 28px; padding: 3px 6px;
  border: 1px solid var(--line); border-radius: 5px; background: #fff; color: var(--fg); }
button { cursor: pointer; background: var(--panel); }
button:disabled { cursor: default; opacity: 0.5; }
.count-line { display: flex; justify-content: space-between; align-items: center;
  margin: 10px 0 6px; }
.pager { display: flex; gap: 8px; align-items: center; }
table { width: 100%; border-collapse: collapse; font-size: 13px; }
th { text-align: left; font-weight: 600; border-bottom: 2px solid var(--line); padding: 4px 6px;
  cursor: pointer; user-select: none; white-space: nowrap; }
th.sorted::after { content: " \\25B2"; font-size: 10px; }
th.sorted.desc::after { content: " \\25BC"; }
td { border-bottom: 1px solid var(--line); padding: 3px 6px; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tbody tr { cursor: pointer; }
tbody tr:hover { background: var(--panel); }
tbody tr.selected { background: #ddf4ff; }
.ok { color: var(--ok); font-weight: 600; }
.bad { color: var(--bad); font-weight: 600; }
.detail { position: sticky; top: 8px; max-height: calc(100vh - 16px); overflow: auto;
  border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px; }
.badges { display: flex; flex-wrap: wrap; gap: 6px; margin-bottom: 8px; }
.badge { border: 1px solid var(--line); border-radius: 10px; padding: 0 8px; font-size: 12px;
  background: var(--panel); }
.badge.ok { border-color: var(--ok); background: #dafbe1; }
.badge.bad { border-color: var(--bad); background: #ffebe9; }
dl.stats { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0 0 10px; }
dl.stats dt { color: var(--muted); }
dl.stats dd { margin: 0; font-variant-numeric: tabular-nums; }
.error { border: 1px solid var(--bad); background: #ffebe9; border-radius: 6px; padding: 6px 8px;
  margin-bottom: 10px; font-family: var(--mono); font-size: 12px; white-space: pre-wrap;
  overflow-wrap: anywhere; }
.msg { border: 1px solid var(--line); border-radius: 6px; margin: 8px 0; overflow: hidden; }
.msg .role { font-size: 12px; font-weight: 600; padding: 3px 8px;
  border-bottom: 1px solid var(--line); display: flex; justify-content: space-between; }
.msg.assistant { background: var(--agent); }
.msg.assistant .role { color: var(--accent); }
.msg.user { background: var(--env); }
.msg pre, .msg .thought { margin: 0; padding: 6px 8px; white-space: pre-wrap;
  overflow-wrap: anywhere; }
.msg pre { font: 12px/1.4 var(--mono); }
.msg.first pre { max-height: 16em; overflow: auto; }
.msg .action { font: 600 12px/1.4 var(--mono); background: #fff;
  border-top: 1px dashed var(--line); }
.label { color: var(--muted); font-weight: 400; font-family: system-ui, sans-serif; }
.reward { font-variant-numeric: tabular-nums; }
.reward.pos { color: var(--ok); }
.reward.neg { color: var(--bad); }
.end { font-size: 12px; color: var(--muted); margin: 8px 0; }
mark { background: #fff8c5; color: inherit; border-radius: 2px; }
details > summary { cursor: pointer; color: var(--muted); margin-top: 8px; }
details pre { font: 12px var(--mono); white-space: pre-wrap; overflow-wrap: anywhere; }
"""

_JS = r"""
"use strict";
(function () {
  const RUN = JSON.parse(document.getElementById("run-data").textContent);
  const TRAJ = RUN.trajectories;
  const PAGE_SIZE = 50;
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#6e7781"];
  const $ = (id) => document.getElementById(id);
  const state = { step: "", tasks: null, env: "", success: "", termination: "", search: "",
                  sortKey: "", sortDesc: false, page: 0, selected: -1, visible: [] };
  const haystacks = new Array(TRAJ.length);

  // Elements are built from text nodes only: run data never becomes markup.
  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    return node;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined || x === "") return "\u2014";
    if (typeof x !== "number") return String(x);
    // Rounded, without trailing zeros; tiny values (KL, log-prob gaps) in exponent form.
    if (x !== 0 && Math.abs(x) < 1e-3) return x.toExponential(2);
    return String(Number(x.toFixed(digits === undefined ? 3 : digits)));
  }
  function fmtSigned(x) {
    return x === null || x === undefined ? "\u2014" : (x > 0 ? "+" : "") + fmt(x);
  }
  function unique(values) {
    return Array.from(new Set(values)).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  }
  function fillSelect(select, values, label) {
    select.replaceChildren(new Option("any", ""));
    for (const value of values) select.append(new Option(label(value), String(value)));
  }

  // ---- Header and filters ----
  $("run-title").textContent = RUN.title;
  const shown = RUN.shown_steps, logged = RUN.logged_steps;
  $("run-summary").textContent = [RUN.workdir, RUN.num_metric_rows + " metric rows",
      TRAJ.length + " trajectories from " + shown.length + " of " + logged.length + " logged steps",
      "page written " + RUN.generated].join(" \u00b7 ");
  const ENVS = unique(TRAJ.map((t) => t.env));
  const TERMINATIONS = unique(TRAJ.map((t) => t.termination));
  fillSelect($("f-step"), shown, String);
  // Options carry list indices so that an empty ("not logged") value stays selectable.
  fillSelect($("f-env"), ENVS.map((_, i) => i), (i) => ENVS[i] || "(not logged)");
  fillSelect($("f-termination"), TERMINATIONS.map((_, i) => i),
             (i) => TERMINATIONS[i] || "(not logged)");

  function haystack(i) {
    if (haystacks[i] === undefined) {
      const t = TRAJ[i];
      haystacks[i] = (t.messages.map((m) => m.content).join("\n") + "\n" + t.error).toLowerCase();
    }
    return haystacks[i];
  }
  function matches(i) {
    const t = TRAJ[i];
    if (state.step !== "" && t.step !== Number(state.step)) return false;
    if (state.tasks && !state.tasks.has(String(t.task_id))) return false;
    if (state.env !== "" && t.env !== ENVS[Number(state.env)]) return false;
    if (state.success !== "" && t.success !== (state.success === "1")) return false;
    if (state.termination !== "" &&
        t.termination !== TERMINATIONS[Number(state.termination)]) return false;
    if (state.search && !haystack(i).includes(state.search)) return false;
    return true;
  }
  function compare(a, b) {
    const x = TRAJ[a][state.sortKey], y = TRAJ[b][state.sortKey];
    if (x === y) return a - b;
    if (x === null || x === undefined) return 1;  // Missing values last in either direction.
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * (state.sortDesc ? -1 : 1);
  }
  function update() {
    state.visible = [];
    for (let i = 0; i < TRAJ.length; i++) if (matches(i)) state.visible.push(i);
    if (state.sortKey) state.visible.sort(compare);
    state.page = 0;
    renderTable();
    renderCharts();
  }

  // ---- The list, one page at a time ----
  function renderTable() {
    const pages = Math.max(1, Math.ceil(state.visible.length / PAGE_SIZE));
    state.page = Math.min(state.page, pages - 1);
    const start = state.page * PAGE_SIZE;
    const rows = state.visible.slice(start, start + PAGE_SIZE).map((i) => {
      const t = TRAJ[i];
      const tr = el("tr", i === state.selected ? "selected" : "",
        el("td", "num", fmt(t.step)), el("td", "num", fmt(t.task_id)),
        el("td", "num", fmt(t.sample)),
        el("td", "", t.env || "\u2014"),
        el("td", t.success ? "ok" : "bad", t.success ? "\u2713 success" : "\u2717 failure"),
        el("td", "num", fmt(t.reward)), el("td", "num", fmt(t.advantage)),
        el("td", "num", fmt(t.num_turns)), el("td", "", t.termination || "\u2014"),
        el("td", "num", fmt(t.num_tokens)));
      tr.dataset.index = String(i);
      tr.addEventListener("click", () => select(i));
      return tr;
    });
    $("rows").replaceChildren(...rows);
    const count = $("count");
    count.dataset.count = String(state.visible.length);
    const range = state.visible.length ?
        (start + 1) + "\u2013" + (start + rows.length) + " of " : "";
    count.textContent = range + state.visible.length + " trajectories" +
        (state.visible.length < TRAJ.length ? " (filtered from " + TRAJ.length + ")" : "");
    $("page").textContent = "page " + (state.page + 1) + " / " + pages;
    $("prev").disabled = state.page === 0;
    $("next").disabled = state.page >= pages - 1;
    for (const th of document.querySelectorAll("th[data-sort]")) {
      th.classList.toggle("sorted", th.dataset.sort === state.sortKey);
      th.classList.toggle("desc", th.dataset.sort === state.sortKey && state.sortDesc);
    }
  }

  // ---- One trajectory ----
  function highlighted(text) {
    const term = state.search, lower = text.toLowerCase();
    // Lower-casing can change lengths (e.g. U+0130); then offsets would not line up.
    if (!term || lower.length !== text.length) return document.createTextNode(text);
    const fragment = document.createDocumentFragment();
    let at = 0, hit;
    while ((hit = lower.indexOf(term, at)) !== -1) {
      fragment.append(text.slice(at, hit), el("mark", "", text.slice(hit, hit + term.length)));
      at = hit + term.length;
    }
    fragment.append(text.slice(at));
    return fragment;
  }
  function rewardNode(reward) {
    if (reward === null || reward === undefined) return el("span", "reward", "reward \u2014");
    return el("span", "reward " + (reward > 0 ? "pos" : reward < 0 ? "neg" : ""),
              "reward " + fmtSigned(reward));
  }
  function agentMessage(content, turn, reward) {
    const role = el("div", "role", el("span", "", "Agent \u00b7 turn " + turn), rewardNode(reward));
    const box = el("div", "msg assistant", role);
    const parsed = /^\s*Thought:\s*([\s\S]*?)\n\s*Action:\s*([\s\S]*)$/.exec(content);
    if (parsed) {
      box.append(
          el("div", "thought", el("span", "label", "Thought: "), highlighted(parsed[1].trim())),
          el("pre", "action", el("span", "label", "Action: "), highlighted(parsed[2].trim())));
    } else {
      box.append(el("pre", "", highlighted(content)));
    }
    return box;
  }
  function select(i) {
    state.selected = i;
    for (const tr of $("rows").children) {
      tr.classList.toggle("selected", Number(tr.dataset.index) === i);
    }
    renderDetail(TRAJ[i]);
  }
  function renderDetail(t) {
    const outcome = el("span", "badge " + (t.success ? "ok" : "bad"),
                       t.success ? "success" : "failure");
    const badges = el("div", "badges", outcome,
                      el("span", "badge", "ended by " + (t.termination || "\u2014")));
    if (t.env) badges.append(el("span", "badge", t.env));
    if (t.category) badges.append(el("span", "badge", t.category));
    const stats = el("dl", "stats");
    const tokens = t.num_tokens === null || t.num_tokens === undefined ? "\u2014" :
        fmt(t.num_tokens) + " (" + fmt(t.num_trained_tokens) + " trained)";
    const turnRewards = t.turn_rewards.map((r) => fmt(r, 2)).join(" \u00b7 ") || "\u2014";
    for (const [name, value] of [["reward", fmt(t.reward)], ["advantage", fmtSigned(t.advantage)],
        ["turns", fmt(t.num_turns)], ["turn rewards", turnRewards], ["tokens", tokens]]) {
      stats.append(el("dt", "", name), el("dd", "", value));
    }
    const title = "Step " + fmt(t.step) + " \u00b7 task " + fmt(t.task_id) + " \u00b7 sample " +
        fmt(t.sample);
    const parts = [el("h2", "", title), badges, stats];
    if (t.error) parts.push(el("div", "error", highlighted(t.error)));
    if (!t.messages.length) {
      parts.push(el("p", "muted", "No messages: the episode ended before the first observation."));
    }
    let turn = 0;
    t.messages.forEach((m, k) => {
      if (m.role === "assistant") {
        turn += 1;
        parts.push(agentMessage(m.content, turn, t.turn_rewards[turn - 1]));
      } else {
        const role = k === 0 ? "Instruction and first observation" :
            "Environment \u00b7 observation after turn " + turn;
        parts.push(el("div", "msg user" + (k === 0 ? " first" : ""),
                      el("div", "role", el("span", "", role)),
                      el("pre", "", highlighted(m.content))));
      }
    });
    if (t.messages.length) {
      parts.push(el("p", "end", "Episode ended (" + (t.termination || "reason not logged") +
                    ") after " + fmt(t.num_turns) + " turns with reward " + fmt(t.reward) + "."));
    }
    const info = el("details", "", el("summary", "", "info from the environment's last step"),
                    el("pre", "", JSON.stringify(t.info, null, 2)));
    parts.push(info);
    $("detail").replaceChildren(...parts);
    $("detail").scrollTop = 0;
  }

  // ---- Charts ----
  const W = 300, H = 120, PAD = { left: 38, right: 8, top: 6, bottom: 18 };
  const allSteps = RUN.charts.flatMap((c) => c.series.flatMap((s) => s.points.map((p) => p[0])));
  const xMin = Math.min(...allSteps), xMax = Math.max(...allSteps);
  const xOf = (step) => PAD.left +
      (xMax === xMin ? 0.5 : (step - xMin) / (xMax - xMin)) * (W - PAD.left - PAD.right);
  function stepAt(x) {
    const fraction = (x - PAD.left) / (W - PAD.left - PAD.right);
    return xMin + Math.max(0, Math.min(1, fraction)) * (xMax - xMin);
  }
  function nearest(steps, step) {
    let best = null;
    for (const s of steps) {
      if (best === null || Math.abs(s - step) < Math.abs(best - step)) best = s;
    }
    return best;
  }
  function drawChart(chart) {
    const values = chart.series.flatMap((s) => s.points.map((p) => p[1]));
    let lo = Math.min(...values), hi = Math.max(...values);
    if (lo === hi) { lo -= 0.5; hi += 0.5; }
    const yOf = (v) => PAD.top + (1 - (v - lo) / (hi - lo)) * (H - PAD.top - PAD.bottom);
    const root = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
    const bottom = H - PAD.bottom;
    const axis = "#d0d7de";
    root.append(svg("line", { x1: PAD.left, x2: PAD.left, y1: PAD.top, y2: bottom, stroke: axis }),
                svg("line",
                    { x1: PAD.left, x2: W - PAD.right, y1: bottom, y2: bottom, stroke: axis }));
    const label = (x, y, text, anchor) => {
      const node = svg("text", { x: x, y: y, "text-anchor": anchor });
      node.textContent = text;
      root.append(node);
    };
    label(PAD.left - 4, PAD.top + 8, fmt(hi, 3), "end");
    label(PAD.left - 4, H - PAD.bottom, fmt(lo, 3), "end");
    label(PAD.left, H - 4, String(xMin), "start");
    label(W - PAD.right, H - 4, String(xMax), "end");
    if (state.step !== "") {
      const x = xOf(Number(state.step));
      root.append(svg("line", { x1: x, x2: x, y1: PAD.top, y2: bottom, stroke: "#bc4c00",
                                "stroke-dasharray": "3 2" }));
    }
    chart.series.forEach((series, k) => {
      const pts = series.points;
      let d = "M" + xOf(pts[0][0]) + "," + yOf(pts[0][1]);
      for (let j = 1; j < pts.length; j++) {
        const x = xOf(pts[j][0]), y = yOf(pts[j][1]);
        d += chart.step_function ? "H" + x + "V" + y : "L" + x + "," + y;
      }
      const color = COLORS[k % COLORS.length];
      root.append(svg("path", { d: d, fill: "none", stroke: color,
                                "stroke-width": k ? 1.2 : 1.8 }));
      if (pts.length <= 40) {
        for (const [s, v] of pts) {
          root.append(svg("circle", { cx: xOf(s), cy: yOf(v), r: 1.8, fill: color }));
        }
      }
    });
    const cursor = svg("line",
                       { y1: PAD.top, y2: bottom, stroke: "#656d76", visibility: "hidden" });
    root.append(cursor);
    const readout = el("span", "muted", "");
    const latest = chart.series[0].points[chart.series[0].points.length - 1];
    const head = el("div", "head", el("b", "", chart.title), readout);
    const showAt = (step) => {
      cursor.setAttribute("x1", xOf(step)); cursor.setAttribute("x2", xOf(step));
      readout.textContent = "step " + step + ": " + chart.series.map((s) => {
        const p = s.points.find((q) => q[0] === nearest(s.points.map((r) => r[0]), step));
        return (chart.series.length > 1 ? s.name + " " : "") + fmt(p[1]);
      }).join(", ");
    };
    readout.textContent = "last " + fmt(latest[1]) + " at step " + latest[0];
    root.addEventListener("mousemove", (e) => {
      const box = root.getBoundingClientRect();
      const steps = chart.series.flatMap((s) => s.points.map((p) => p[0]));
      cursor.setAttribute("visibility", "visible");
      showAt(nearest(steps, stepAt((e.clientX - box.left) * W / box.width)));
    });
    root.addEventListener("mouseleave", () => {
      cursor.setAttribute("visibility", "hidden");
      readout.textContent = "last " + fmt(latest[1]) + " at step " + latest[0];
    });
    root.addEventListener("click", (e) => {
      // Filter the list to the nearest step that has logged trajectories.
      const box = root.getBoundingClientRect();
      const step = nearest(shown, stepAt((e.clientX - box.left) * W / box.width));
      if (step === null) return;
      state.step = String(step);
      $("f-step").value = state.step;
      update();
    });
    const box = el("div", "chart", head, root);
    if (chart.series.length > 1) {
      const legend = el("div", "legend");
      chart.series.forEach((s, k) => {
        const swatch = el("i");
        swatch.style.background = COLORS[k % COLORS.length];
        legend.append(swatch, s.name);
      });
      box.append(legend);
    }
    return box;
  }
  function renderCharts() {
    $("charts").replaceChildren(...RUN.charts.map(drawChart));
    if (!RUN.charts.length) $("charts").append(el("p", "muted", "No metrics logged."));
  }

  // ---- Wiring ----
  let searchTimer = null;
  $("f-step").addEventListener("change", (e) => { state.step = e.target.value; update(); });
  $("f-env").addEventListener("change", (e) => { state.env = e.target.value; update(); });
  $("f-success").addEventListener("change", (e) => { state.success = e.target.value; update(); });
  $("f-termination").addEventListener("change", (e) => {
    state.termination = e.target.value;
    update();
  });
  $("f-task").addEventListener("input", (e) => {
    const ids = e.target.value.split(/[\s,]+/).filter((s) => s);
    state.tasks = ids.length ? new Set(ids) : null;
    update();
  });
  $("f-search").addEventListener("input", (e) => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => {
      state.search = e.target.value.trim().toLowerCase();
      update();
      if (state.selected >= 0) renderDetail(TRAJ[state.selected]);
    }, 120);
  });
  $("f-reset").addEventListener("click", () => {
    for (const id of ["f-step", "f-env", "f-success", "f-termination", "f-task", "f-search"]) {
      $(id).value = "";
    }
    Object.assign(state,
                  { step: "", tasks: null, env: "", success: "", termination: "", search: "" });
    update();
  });
  $("prev").addEventListener("click", () => { state.page -= 1; renderTable(); });
  $("next").addEventListener("click", () => { state.page += 1; renderTable(); });
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => {
      state.sortDesc = state.sortKey === th.dataset.sort ? !state.sortDesc : false;
      state.sortKey = th.dataset.sort;
      update();
    });
  }
  document.addEventListener("keydown", (e) => {
    if (e.target.closest("input, select, textarea") || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.key !== "j" && e.key !== "k" || !state.visible.length) return;
    const at = state.visible.indexOf(state.selected);
    const move = e.key === "j" ? 1 : -1;
    const next = at === -1 ? 0 : Math.max(0, Math.min(state.visible.length - 1, at + move));
    state.page = Math.floor(next / PAGE_SIZE);
    renderTable();
    select(state.visible[next]);
  });
  update();
})();
"""

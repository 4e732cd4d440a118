"use strict";
(function () {
  const RUN = JSON.parse(document.getElementById("run-data").textContent);
  const TRAJ = RUN.trajectories;
  const COLUMNS = RUN.columns.map(([key, header]) => ({ key: key, header: header }));
  const HAS = new Set(RUN.columns.map(([key]) => key));
  const PAGE_SIZE = 50;
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#6e7781"];
  const $ = (id) => document.getElementById(id);
  const FILTERS = { step: "", tasks: null, env: "", category: "", success: "", termination: "",
                    search: "" };
  const state = { ...FILTERS, sortKey: "", sortDesc: false, page: 0, selected: -1, visible: [] };
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
  const CATEGORIES = unique(TRAJ.map((t) => t.category));
  const TERMINATIONS = unique(TRAJ.map((t) => t.termination));
  fillSelect($("f-step"), shown, String);
  // Options carry list indices so that an empty ("not logged") value stays selectable.
  const notLogged = (values) => (i) => values[i] || "(not logged)";
  fillSelect($("f-env"), ENVS.map((_, i) => i), notLogged(ENVS));
  fillSelect($("f-category"), CATEGORIES.map((_, i) => i), notLogged(CATEGORIES));
  fillSelect($("f-termination"), TERMINATIONS.map((_, i) => i), notLogged(TERMINATIONS));
  $("columns").replaceChildren(...COLUMNS.map((column) => {
    const th = el("th", "", column.header);
    th.dataset.sort = column.key;
    return th;
  }));

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
    if (state.category !== "" && t.category !== CATEGORIES[Number(state.category)]) return false;
    if (state.success !== "" && t.success !== (state.success === "1")) return false;
    if (state.termination !== "" &&
        t.termination !== TERMINATIONS[Number(state.termination)]) return false;
    if (state.search && !haystack(i).includes(state.search)) return false;
    return true;
  }
  function compare(a, b) {
    const x = TRAJ[a][state.sortKey], y = TRAJ[b][state.sortKey];
    const missing = (v) => v === null || v === undefined || v === "";
    if (x === y) return a - b;
    if (missing(x)) return 1;  // Missing values (shown as a dash) last in either direction.
    if (missing(y)) return -1;
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
  function cell(t, key) {
    switch (key) {
      case "success":
        return el("td", t.success ? "ok" : "bad", t.success ? "\u2713 success" : "\u2717 failure");
      case "env": case "category": case "termination":
        return el("td", "", t[key] || "\u2014");
      default:
        return el("td", "num", fmt(t[key]));
    }
  }
  function renderTable() {
    const pages = Math.max(1, Math.ceil(state.visible.length / PAGE_SIZE));
    state.page = Math.min(state.page, pages - 1);
    const start = state.page * PAGE_SIZE;
    const rows = state.visible.slice(start, start + PAGE_SIZE).map((i) => {
      const t = TRAJ[i];
      const tr = el("tr", i === state.selected ? "selected" : "", ...COLUMNS.map((column) => {
        const td = cell(t, column.key);
        td.dataset.col = column.key;
        return td;
      }));
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
    const figures = [["reward", fmt(t.reward)], ["turns", fmt(t.num_turns)],
                     ["turn rewards", turnRewards], ["tokens", tokens]];
    if (HAS.has("advantage")) figures.splice(1, 0, ["advantage", fmtSigned(t.advantage)]);
    for (const [name, value] of figures) stats.append(el("dt", "", name), el("dd", "", value));
    let title = "Step " + fmt(t.step) + " \u00b7 task " + fmt(t.task_id);
    if (HAS.has("sample")) title += " \u00b7 sample " + fmt(t.sample);
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
  $("f-category").addEventListener("change", (e) => {
    state.category = e.target.value;
    update();
  });
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
    for (const id of ["f-step", "f-env", "f-category", "f-success", "f-termination", "f-task",
                      "f-search"]) {
      $(id).value = "";
    }
    Object.assign(state, FILTERS);
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

"""WebArena: the action grammar, the tree rendering, the evaluators, task configs, the remote
AgentGym client, and real Chromium episodes on a local shop and forum (tests/webarena_site)."""

import contextlib
import http.server
import importlib.util
import json
import os
import pathlib
import re
import socket
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

import environments
from environments import EnvError
from environments.pool import EnvPool
from environments.webarena import accessibility, actions, browser, evaluators, tasks
from environments.webarena import AgentGymWebArenaClient, WebArenaEnv
from environments.webarena.actions import Action, ActionParseError
import webarena_site

HAS_BROWSER = (os.access(browser.DEFAULT_EXECUTABLE, os.X_OK)
               and importlib.util.find_spec("playwright") is not None)
needs_browser = pytest.mark.skipif(
    not HAS_BROWSER, reason=f"needs Chromium at {browser.DEFAULT_EXECUTABLE} (apt-get install "
    "-y chromium) and the playwright package (pip install playwright)")
PROFILE_PREFIX = "agentgym-webarena-chromium-"

# The action grammar.


@pytest.mark.parametrize(
    "text, expected",
    [
        ("click [12]", Action("click", element_id="12")),
        ("CLICK[7]", Action("click", element_id="7")),
        ("hover [3]", Action("hover", element_id="3")),
        ("type [5] [hello world] [0]", Action("type", element_id="5", text="hello world")),
        # Enter is pressed unless the flag says 0, as in WebArena.
        ("type [5] [hello world]",
         Action("type", element_id="5", text="hello world", press_enter=True)),
        ("type [5] [x] [press_enter_after=0]", Action("type", element_id="5", text="x")),
        # The content runs to the last bracket pair before the flag, as WebArena's greedy regex.
        ("type [5] [a] [b] [1]", Action("type", element_id="5", text="a] [b", press_enter=True)),
        ("type [5] [line one\nline two] [0]",
         Action("type", element_id="5", text="line one\nline two")),
        ("press [ctrl+A]", Action("press", key_comb="Control+A")),
        ("press [Meta+v]", Action("press", key_comb="Control+v")),
        ("press [enter]", Action("press", key_comb="Enter")),
        ("scroll [down]", Action("scroll", direction="down")),
        ("scroll [direction=up]", Action("scroll", direction="up")),
        ("scroll down", Action("scroll", direction="down")),
        ("new_tab", Action("new_tab")),
        ("tab_focus [2]", Action("tab_focus", tab_index=2)),
        ("close_tab", Action("close_tab")),
        ("go_back", Action("go_back")),
        ("go_forward", Action("go_forward")),
        ("goto [http://x.test/a?b=[1]]", Action("goto", url="http://x.test/a?b=[1]")),
        ("stop [$279.49]", Action("stop", answer="$279.49")),
        ("stop [N/A]", Action("stop", answer="N/A")),
        ("stop []", Action("stop")),
        ("stop", Action("stop")),
    ])
def test_actions_parse_as_in_webarena(text, expected):
  assert actions.parse_action(text) == expected


def test_the_first_fenced_span_is_the_action():
  reply = ("Let's think step-by-step. The price is shown. In summary, the next action I will "
           "perform is ```\nstop [$24.99]\n``` and later ```click [3]```")
  assert actions.parse_reply(reply) == Action("stop", answer="$24.99")


@pytest.mark.parametrize("reply, reason", [
    ("click [12]", "no action found"),
    ("``````", "hold no action"),
    ("```jump [1]```", "unknown action 'jump'"),
    ("```click [abc]```", "click [id]"),
    ("```type [3]```", "type [id] [content]"),
    ("```type [3] [] [1]```", "needs something to type"),
    ("```tab_focus [x]```", "tab_focus [index]"),
    ("```scroll [left]```", "scroll [down]"),
    ("```press [Control+]```", "key combination"),
])
def test_malformed_replies_say_what_is_wrong(reply, reason):
  with pytest.raises(ActionParseError, match=re.escape(reason)):
    actions.parse_reply(reply)


_fragments = st.sampled_from(
    list(actions.KINDS) +
    ["", "[", "]", "```", " ", "\n", "[1]", "[press_enter_after=1]", "direction="])


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.text(max_size=80),
              st.lists(st.one_of(_fragments, st.text(max_size=8)), max_size=8).map("".join)))
def test_any_reply_parses_or_raises_action_parse_error(reply):
  try:
    action = actions.parse_reply(reply)
  except ActionParseError as e:
    assert str(e)
  else:
    assert action.kind in actions.KINDS


_stripped = st.text(min_size=1, max_size=30).filter(lambda s: s.strip() == s)
_actions = st.one_of(
    st.builds(Action, st.sampled_from(["click", "hover"]), element_id=st.integers(0,
                                                                                  10**9).map(str)),
    st.builds(Action, st.just("type"), element_id=st.integers(0, 10**9).map(str),
              text=st.text(min_size=1, max_size=30), press_enter=st.booleans()),
    st.builds(Action, st.just("scroll"), direction=st.sampled_from(["up", "down"])),
    st.builds(Action, st.just("tab_focus"), tab_index=st.integers(0, 99)),
    st.builds(Action, st.just("goto"), url=_stripped),
    st.builds(Action, st.just("stop"), answer=st.one_of(st.just(""), _stripped)),
    st.builds(Action, st.sampled_from(["new_tab", "close_tab", "go_back", "go_forward"])))


@settings(max_examples=200, deadline=None)
@given(_actions)
def test_actions_written_back_parse_to_themselves(action):
  assert actions.parse_action(str(action)) == action


# The accessibility tree.


def _node(node_id, role, name, backend=None, children=(), properties=(), ignored=False):
  node = {
      "nodeId": node_id, "ignored": ignored, "role": {"type": "role",
                                                      "value": role}, "childIds": list(children),
      "properties": [{"name": k, "value": {"type": "x", "value": v}} for k, v in properties]
  }
  if name is not None:
    node["name"] = {"type": "computedString", "value": name}
  if backend is not None:
    node["backendDOMNodeId"] = backend
  return node


_NODES = [
    _node("1", "RootWebArea", "Shop", 1, ["2", "3", "4", "5", "9", "10", "11"],
          [("focusable", True), ("focused", True), ("url", "http://shop.test/")]),
    _node("2", "link", "Forums", 2, ["6"], [("focusable", True)]),
    _node("6", "StaticText", "Forums", 6, ["-100"]),  # repeats its link: dropped
    _node("-100", "InlineTextBox", "Forums"),  # no DOM node: dropped
    _node("3", "generic", "", 3, ["7"]),  # unnamed generic: hidden, its child moves up
    _node("7", "StaticText", "$24.99", 7),
    _node("4", "textbox", "Search", 4, [], [("required", False), ("editable", "plaintext")]),
    _node("5", None, None, 5, ["8"], ignored=True),  # ignored: hidden, its child moves up
    _node("8", "button", "Go", 8),
    _node("9", "link", "Don't panic", 9),
    _node("2", "link", "Forums", 2, ["6"]),  # Chromium repeats nodes now and then
    # Builds differ in the whitespace they keep around a label ("Quantity " for
    # `<label>Quantity <input>`): names are stripped and their runs of whitespace collapsed.
    _node("10", "textbox", " Quantity \n\t per  item ", 10),
    _node("11", "generic", " \n ", 11)  # blank once normalised: hidden
]


def test_tree_renders_as_webarena_does():
  text, elements = accessibility.render(_NODES)
  assert text == (
      "[1] RootWebArea 'Shop' focused: True\n"
      "\t[2] link 'Forums'\n"
      "\t[7] StaticText '$24.99'\n"
      "\t[4] textbox 'Search' required: False\n"
      "\t[8] button 'Go'\n"
      "\t[9] link \"Don't panic\"\n"  # names are Python reprs
      "\t[10] textbox 'Quantity per item'")
  assert set(elements) == {"1", "2", "7", "4", "8", "9", "10"}
  assert elements["4"] == accessibility.Element(4, "textbox 'Search' required: False")


def test_viewport_keeps_elements_mostly_inside_the_window():
  bounds = {
      1: (0, 0, 1280, 720), 2: (8, 8, 50, 17), 3: (0, 30, 1280, 20), 7: (8, 30, 40, 17),
      4: (8, 60, 100, 20), 8: (110, 700, 30, 40), 9: (8, 2000, 50, 17)
  }
  # Button 8 shows 20 of its 40 pixel rows: a fraction of 0.5 < 0.6. (WebArena's formula,
  # overlap * height / width = 600 * 40 / 30 = 800, would keep it.)
  assert accessibility.visible_fraction(bounds[8], (1280, 720)) == 0.5
  text, elements = accessibility.render(_NODES, bounds, (1280, 720))
  assert text == ("[1] RootWebArea 'Shop' focused: True\n"
                  "\t[2] link 'Forums'\n"
                  "\t[7] StaticText '$24.99'\n"
                  "\t[4] textbox 'Search' required: False")
  assert set(elements) == {"1", "2", "7", "4"}


def test_layout_bounds_are_viewport_rectangles():
  snapshot = {
      "documents": [{
          "nodes": {"backendNodeId": [10, 11, 12]},
          "layout": {"nodeIndex": [0, 2], "bounds": [[0, 0, 1280, 2000], [8, 900, 50, 17]]},
          "scrollOffsetX": 0, "scrollOffsetY": 720
      }]
  }
  # Document y 900 less the 720 scrolled = viewport y 180; node 11 has no layout.
  assert accessibility.layout_bounds(snapshot) == {10: (0, -720, 1280, 2000), 12: (8, 180, 50, 17)}


# The evaluators.


def test_string_match_follows_webarena():
  match = evaluators.string_match
  assert match({"exact_match": "$24.99"}, " '$24.99' ") == 1.0  # quotes and case are cleaned
  assert match({"exact_match": "$24.99"}, "24.99") == 0.0
  assert match({"must_include": ["Ceramic Mug", "Travel Mug"]}, "travel mug, ceramic mug") == 1
  assert match({"must_include": ["Ceramic Mug", "Travel Mug"]}, "Ceramic Mug") == 0.0
  # A lone one-character reference must be a whole token: "0" is not in "10".
  assert match({"must_include": ["0"]}, "10 items") == 0.0
  assert match({"must_include": ["0"]}, "0 items") == 1.0
  assert match({"must_include": ["0", "1"]}, "10") == 1.0  # two phrases: plain substrings
  # fuzzy_match without an LLM judge: every reference included; N/A exactly.
  assert match({"fuzzy_match": ["blue kettle"]}, "It is the Blue Kettle.") == 1.0
  assert match({"fuzzy_match": ["blue kettle"]}, "the kettle") == 0.0
  assert match({"fuzzy_match": "N/A"}, "n/a") == 1.0
  assert match({"fuzzy_match": "N/A"}, "It is not sold") == 0.0
  assert match({"exact_match": "a", "must_include": ["b"]}, "a") == 0.0  # scores multiply


def test_url_match_follows_webarena():
  match = evaluators.url_match
  assert match("http://h/post/2", "http://h/post/2/") == 1.0
  assert match("http://h/post/2", "http://h/post/3") == 0.0
  assert match("http://h/post/2", "http://h/post/23") == 1.0  # WebArena's rule: a substring
  assert match("http://h/search?q=mug", "http://h/search?q=mug&page=2") == 1.0
  assert match("http://h/search?q=mug", "http://h/search?q=cup") == 0.0
  assert match("http://h/a |OR| http://h/b?x=1", "http://h/b?x=1") == 1.0
  assert match("http://h/a |OR| http://h/b?x=1", "http://h/a") == 0.0  # x=1 is required


class _FakePage:
  """The evaluators' Page over canned expression results."""

  def __init__(self, url, values, html_text=""):
    self.url, self.values, self.html_text, self.calls = url, values, html_text, []

  def goto(self, url):
    self.calls.append(("goto", url))
    self.url = url

  def evaluate(self, expression):
    self.calls.append(("evaluate", expression))
    value = self.values[expression]
    if isinstance(value, Exception):
      raise value
    return value

  def content(self):
    return self.html_text


def test_program_html_checks_the_located_contents():
  targets = [
      {
          "url": "last", "locator": "document.title", "prep_actions": ["document.x = 1"],
          "required_contents": {"exact_match": "Cart"}
      },
      {
          "url": "http://h/post/2", "locator": "document.body.outerText",
          "required_contents": {"must_include": ["count me in |OR| count me out", "A & B"]}
      },
  ]
  values = {
      "document.x = 1": None, "document.title": "Cart",
      "document.body.outerText": "Count me in! A &amp; B"
  }
  page = _FakePage("http://h/cart", values)
  assert evaluators.program_html(targets, page) == (1.0, [])
  assert page.calls == [("evaluate", "document.x = 1"), ("evaluate", "document.title"),
                        ("goto", "http://h/post/2"), ("evaluate", "document.body.outerText")]
  page = _FakePage("http://h/cart", {**values, "document.title": TypeError("null")})
  assert evaluators.program_html(targets, page)[0] == 0.0  # a throwing locator selects ""
  whole_page = [{"url": "last", "locator": "", "required_contents": {"must_include": ["<b>"]}}]
  assert evaluators.program_html(whole_page, _FakePage("http://h", {}, "<b>hi</b>"))[0] == 1.0


def test_program_html_helpers_of_webarena():
  assert evaluators.reddit_post_url("http://r/f/books/12/some-title/comment/3") == (
      "http://r/f/books/12/")
  assert evaluators.reddit_post_url("http://r/forums") == "http://r/forums"
  target = {
      "url": "func:reddit_get_post_url('__last_url__')", "locator": "",
      "required_contents": {"must_include": ["x"]}
  }
  page = _FakePage("http://r/f/books/12/title", {}, "x")
  assert evaluators.program_html([target], page) == (1.0, [])
  assert page.calls == [("goto", "http://r/f/books/12/")]
  member = {
      "url": "last", "locator": "func:gitlab_get_project_memeber_role(__page__, 'koush')",
      "required_contents": {"must_include": ["Developer"]}
  }
  page = _FakePage("http://g/members", {})
  page.evaluate = lambda expression: "Developer" if '"@koush"' in expression else ""
  assert evaluators.program_html([member], page)[0] == 1.0


def test_evaluation_multiplies_the_evaluators():
  config = {
      "eval": {
          "eval_types": ["string_match", "url_match"], "reference_answers": {"must_include": ["2"]},
          "reference_url": "http://h/cart"
      }
  }
  passed = evaluators.evaluate(config, "2 kettles", _FakePage("http://h/cart", {}))
  assert (passed.score, passed.scores) == (1.0, {"string_match": 1.0, "url_match": 1.0})
  failed = evaluators.evaluate(config, "2 kettles", _FakePage("http://h/", {}))
  assert (failed.score, failed.scores) == (0.0, {"string_match": 1.0, "url_match": 0.0})


# Task configs.


def test_bundled_tasks_load_sorted_with_site_placeholders():
  loaded = tasks.load_tasks(webarena_site.CONFIG_DIR)
  assert list(loaded) == [0, 1, 2, 3, 4, 5]
  assert loaded[3].placeholders() == {"REDDIT"}
  config = loaded[3].resolve({"REDDIT": "http://127.0.0.1:9/", "SHOPPING": "http://s"})
  assert config["start_url"] == "http://127.0.0.1:9"
  assert config["eval"]["program_html"][0]["url"] == "http://127.0.0.1:9/post/2"
  with pytest.raises(tasks.TaskConfigError, match="REDDIT"):
    loaded[3].resolve({"SHOPPING": "http://s"})
  assert loaded[0].info()["category"] == "shopping"


def _config(task_id, **eval_fields):
  evaluation = {"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}}
  evaluation.update(eval_fields)
  return {"task_id": task_id, "intent": "do it", "start_url": "http://h", "eval": evaluation}


def _html_config(task_id, url, locator, required_contents):
  """A config judged by program_html with one target."""
  target = {"url": url, "locator": locator, "required_contents": required_contents}
  return _config(task_id, eval_types=["program_html"], program_html=[target])


def test_configs_load_from_list_files_or_per_task_files(tmp_path):
  (tmp_path / "test.raw.json").write_text(json.dumps([_config(7), _config(2)]))
  (tmp_path / "extra.json").write_text(json.dumps(_config(4)))
  assert list(tasks.load_tasks(tmp_path)) == [2, 4, 7]
  (tmp_path / "more.json").write_text(json.dumps(_config(4)))
  with pytest.raises(tasks.TaskConfigError, match="task_id 4 is in both"):
    tasks.load_tasks(tmp_path)
  # WebArena's config_files/ after generate_test_data.py: <id>.json beside the list files.
  (tmp_path / "10.json").write_text(json.dumps(_config(10)))
  (tmp_path / "9.json").write_text(json.dumps(_config(9)))
  assert list(tasks.load_tasks(tmp_path)) == [9, 10]


def test_tasks_needing_webarenas_site_credentials_are_skipped(tmp_path):
  order = _html_config(1, "func:shopping_get_latest_order_url()", "", {"must_include": ["x"]})
  (tmp_path / "t.json").write_text(json.dumps([order, _config(2)]))
  assert list(tasks.load_tasks(tmp_path)) == [2]


@pytest.mark.parametrize("config, message", [
    (_config(-1), "task_id must be a non-negative integer"),
    ({**_config(1), "intent": ""}, "'intent' must be a non-empty string"),
    (_config(1, eval_types=["llm_judge"]), "unknown eval type"),
    (_config(1, reference_answers=None), "string_match needs"),
    (_config(1, reference_answers={"exact_match": ["x"]}), "malformed reference_answers"),
    (_config(1, eval_types=["url_match"]), "needs a non-empty eval.reference_url"),
    (_html_config(1, "last", "window.x", {"must_include": ["x"]}), "unknown program_html locator"),
    (_html_config(1, "last", "", {"exact_match": 2}), "required_contents must be"),
])
def test_malformed_configs_are_rejected_with_the_reason(config, message):
  with pytest.raises(tasks.TaskConfigError, match=re.escape(message)):
    tasks.validate(config, "test.json")


def test_splits_are_stable_disjoint_and_complete():
  ids = range(100)
  first, again = tasks.split(ids, 10), tasks.split(reversed(ids), 10)
  assert first == again and len(first["test"]) == 10
  assert set(first["test"]).isdisjoint(first["train"])
  assert sorted(first["test"] + first["train"]) == list(ids)
  assert tasks.split(ids, 10, test_task_ids=[5, 3])["test"] == (3, 5)
  with pytest.raises(ValueError, match="not among the loaded tasks"):
    tasks.split(ids, 10, test_task_ids=[100])


def test_registry_builds_the_env_without_starting_a_browser():
  with contextlib.closing(
      environments.make("webarena", config_dir=str(webarena_site.CONFIG_DIR), num_test=2)) as env:
    assert env.task_ids("test") + env.task_ids("train") == (0, 5, 1, 2, 3, 4)
    assert env.browser.profile_dir == ""  # Chromium starts with the first episode
    assert "```click [1234]```" in env.instruction and "stop [answer]" in env.instruction


@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright")
def test_a_missing_chromium_is_reported_at_reset():
  with contextlib.closing(
      WebArenaEnv(str(webarena_site.CONFIG_DIR), site_urls={"SHOPPING": "http://s"},
                  executable="/nonexistent/chromium")) as env:
    with pytest.raises(EnvError, match="Chromium is not installed at /nonexistent/chromium"):
      env.reset(0)


# The remote AgentGym WebArena client.


class _AgentGymWebArenaServer(http.server.ThreadingHTTPServer):
  """AgentGym's WebArena server routes (env_idx), scripted; `faults` maps a route to the HTTP
  statuses its next requests get."""

  def __init__(self):
    super().__init__(("127.0.0.1", 0), _AgentGymHandler)
    self.requests, self.faults, self.steps = [], {}, 0
    threading.Thread(target=self.serve_forever, daemon=True).start()

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_port}"


class _AgentGymHandler(http.server.BaseHTTPRequestHandler):

  def log_message(self, *args):
    pass

  def _answer(self, status, payload, text=False):
    body = payload.encode() if text else json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def do_GET(self):
    self.server.requests.append(("GET", self.path, None))
    self._answer(
        200, "OBSERVATION:\n[1] RootWebArea 'Forums'\nURL: http://r/\nOBJECTIVE: "
        "find it\nPREVIOUS ACTION: None")

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.server.requests.append(("POST", self.path, body))
    faults = self.server.faults.get(self.path)
    if faults:
      self._answer(faults.pop(0), {"detail": "scripted fault"})
      return
    if self.path == "/create":
      self._answer(200, {"env_idx": 3})
    elif self.path == "/reset":
      self._answer(200, {"observation": "[1] RootWebArea 'Forums'"})
    elif self.path == "/step":
      self.server.steps += 1
      final = "stop" in body["action"]
      # As the real server: reward 1.0 whenever the browser ran the action, the evaluator's
      # score when the episode ends.
      self._answer(
          200, {
              "observation": f"step {self.server.steps}", "reward": 1.0, "terminated": final,
              "truncated": False, "info": None
          })
    elif self.path == "/close":
      self._answer(200, "closed", text=True)


@pytest.fixture
def agentgym_server():
  server = _AgentGymWebArenaServer()
  yield server
  server.shutdown()
  server.server_close()


def test_remote_client_speaks_agentgyms_webarena_protocol(agentgym_server):
  env = environments.make("webarena_remote", base_url=agentgym_server.url,
                          config_dir=str(webarena_site.CONFIG_DIR), num_test=2)
  assert env.task_ids("test") == (0, 5) and env.task_info(3)["category"] == "reddit"
  first = env.reset(3)
  assert first.startswith("OBSERVATION:\n[1] RootWebArea 'Forums'")  # from GET /observation
  middle = env.step("In summary, the next action I will perform is ```click [1]```")
  assert (middle.reward, middle.done, middle.info["success"]) == (0.0, False, False)
  last = env.step("```stop [done]```")
  assert (last.observation, last.reward, last.done, last.info["success"]) == ("step 2", 1.0, True,
                                                                              True)
  env.close()
  env.close()
  assert agentgym_server.requests == [
      ("POST", "/create", {}),
      ("POST", "/reset", {"env_idx": 3, "seed": 0, "idx": 3}),
      ("GET", "/observation?env_idx=3", None),
      ("POST", "/step",
       {"env_idx": 3, "action": "In summary, the next action I will perform "
                                "is ```click [1]```"}),
      ("POST", "/step", {"env_idx": 3, "action": "```stop [done]```"}),
      ("POST", "/close", {"env_idx": 3}),
  ]


def test_remote_client_retries_what_is_safe_to_retry(agentgym_server):
  env = AgentGymWebArenaClient(agentgym_server.url, task_ids={"train": [1], "test": [2]},
                               backoff_s=0.01)
  agentgym_server.faults = {"/reset": [500, 503], "/step": [500]}
  assert env.reset(2).startswith("OBSERVATION:")  # /reset is repeated past both faults
  assert sum(path == "/reset" for _, path, _ in agentgym_server.requests) == 3
  with pytest.raises(EnvError, match=r"POST /step failed after 1 attempt.*HTTP 500"):
    env.step("```click [1]```")  # a step that reached the server is never sent twice
  with pytest.raises(EnvError, match="reset"):
    env.step("```click [1]```")
  env.close()


def test_remote_client_reports_an_unreachable_server():
  with socket.socket() as probe:  # a port nobody listens on
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  env = AgentGymWebArenaClient(f"http://127.0.0.1:{port}", task_ids={"train": [], "test": []},
                               retries=2, backoff_s=0.01)
  with pytest.raises(EnvError, match=r"POST /create failed after 3 attempt"):
    env.reset(0)
  with pytest.raises(ValueError, match="exactly one of config_dir"):
    AgentGymWebArenaClient(f"http://127.0.0.1:{port}")


# Episodes in Chromium on the local sites.


@pytest.fixture(scope="module")
def sites():
  with webarena_site.serve() as urls:
    yield urls


@pytest.fixture(scope="module")
def env(sites):
  web = WebArenaEnv(str(webarena_site.CONFIG_DIR), site_urls=sites, num_test=2)
  yield web
  web.close()


def _act(env, observation, template):
  """Steps with `template`, its {role 'name'} parts replaced by the ids of the observation, in
  the env's action format."""

  def element_id(match):
    found = re.search(r"\[(\d+)\] " + re.escape(match.group(1)) + r"( |$)", observation, re.M)
    assert found, f"no {match.group(1)} in:\n{observation}"
    return found.group(1)

  action = re.sub(r"\{([^}]*)\}", element_id, template)
  return env.step(environments.base.reply_for(env, "Let's think step-by-step.", action))


def _run(env, task_id, plan):
  observation, results = env.reset(task_id), []
  for template in plan:
    results.append(_act(env, observation, template))
    observation = results[-1].observation
  return results


KETTLE, MEETUP = "{link 'Blue Kettle'}", "{link 'Weekend meetup at the park'}"
SEARCH, REPLY = "{searchbox 'Search products'}", "{textbox 'Reply'}"
ORACLES = {
    0: [f"click [{KETTLE}]", "stop [$24.99]"],
    1: [f"type [{SEARCH}] [mug] [1]", "stop [Ceramic Mug, Travel Mug]"],
    2: [f"click [{MEETUP}]", "stop []"],
    3: [
        f"click [{MEETUP}]", f"type [{REPLY}] [Count me in!] [0]", "click [{button 'Post reply'}]",
        "stop []"
    ],
    4: [
        f"click [{KETTLE}]", "type [{textbox 'Quantity'}] [2] [0]",
        "click [{button 'Add to Cart'}]", "stop []"
    ],
    5: [f"type [{SEARCH}] [golden teapot] [1]", "stop [N/A]"],
}
WRONG = {
    0: [f"click [{KETTLE}]", "stop [$19.99]"],
    1: [f"type [{SEARCH}] [mug] [1]", "stop [Ceramic Mug]"],
    2: ["click [{link 'Best hiking trails near town'}]", "stop []"],
    # Runs after the oracle replied "Count me in!": each episode is a new visitor, so that
    # reply must not count here.
    3: [
        f"click [{MEETUP}]", f"type [{REPLY}] [Maybe later] [0]", "click [{button 'Post reply'}]",
        "stop []"
    ],
    4: [f"click [{KETTLE}]", "click [{button 'Add to Cart'}]", "stop []"],  # adds one
    5: ["stop [$30.00]"],
}


def test_every_bundled_task_has_an_oracle():
  assert set(ORACLES) == set(WRONG) == set(tasks.load_tasks(webarena_site.CONFIG_DIR))


@needs_browser
@pytest.mark.parametrize("task_id", sorted(ORACLES))
def test_oracle_solves_the_task(env, task_id):
  results = _run(env, task_id, ORACLES[task_id])
  assert [r.reward for r in results] == [0.0] * (len(results) - 1) + [1.0]
  assert [r.done for r in results] == [False] * (len(results) - 1) + [True]
  assert results[-1].info["success"] and set(results[-1].info["scores"].values()) == {1.0}


@needs_browser
def test_oracle_solves_a_task_with_tool_calls(sites):
  with contextlib.closing(
      WebArenaEnv(str(webarena_site.CONFIG_DIR), site_urls=sites, num_test=2,
                  action_format="tool_call")) as web:
    assert environments.base.TOOL_CALL_INSTRUCTION in web.instruction
    results = _run(web, 3, ORACLES[3])  # click, type [..] [Count me in!] [0], click, stop []
    assert results[-1].done and results[-1].info["success"]
    assert re.fullmatch(r"type \[\d+\] \[Count me in!\] \[0\]", results[1].info["action"])
    web.reset(2)
    bad = web.step('<tool_call>{"name": "click", "arguments": {"element_id": "x"}}</tool_call>')
    assert bad.observation.startswith("Invalid tool call: click's argument 'element_id' must "
                                      "be an integer") and not bad.done and bad.reward == 0.0


@needs_browser
@pytest.mark.parametrize("task_id", sorted(WRONG))
def test_wrong_answer_scores_zero(env, task_id):
  results = _run(env, task_id, WRONG[task_id])
  assert results[-1].done and results[-1].reward == 0.0 and not results[-1].info["success"]


@needs_browser
def test_observation_follows_webarenas_prompt_template(env, sites):
  first = env.reset(0)
  assert first.startswith("OBSERVATION:\nTab 0 (current): One Stop Shop\n\n[")
  assert first.endswith(f"\nURL: {sites['SHOPPING']}/\nOBJECTIVE: What is the price of the "
                        "Blue Kettle?\nPREVIOUS ACTION: None")
  assert re.search(r"^\[\d+\] RootWebArea 'One Stop Shop' focused: True$", first, re.M)
  kettle = re.search(r"^\t+\[(\d+)\] link 'Blue Kettle'$", first, re.M).group(1)
  second = env.step(f"```click [{kettle}]```").observation
  assert f"\nURL: {sites['SHOPPING']}/product/blue-kettle\n" in second
  assert re.search(r"\[\d+\] StaticText '\$24.99'", second)
  assert second.endswith(f"PREVIOUS ACTION: click [{kettle}] where [{kettle}] is link "
                         "'Blue Kettle'")


@needs_browser
def test_scrolling_brings_the_rest_of_the_page_into_view(env):
  top = env.reset(0)
  assert "link 'Blue Kettle'" in top and "link 'Tea Towel Set'" not in top
  kettle = re.search(r"\[(\d+)\] link 'Blue Kettle'", top).group(1)
  bottom = env.step("```scroll [down]```").observation
  assert "link 'Tea Towel Set'" in bottom and "link 'Blue Kettle'" not in bottom
  # An id from an earlier observation is refused, not clicked blindly.
  refused = env.step(f"```click [{kettle}]```")
  assert refused.observation.endswith(f"PREVIOUS ACTION: click [{kettle}] (failed: there is no "
                                      f"element [{kettle}] in the current observation)")
  assert "link 'Blue Kettle'" in env.step("```scroll [up]```").observation


@needs_browser
def test_tabs_open_switch_and_close(env, sites):
  env.reset(2)
  blank = env.step("```new_tab```").observation
  assert blank.startswith("OBSERVATION:\nTab 0: Forums | Tab 1 (current): \n")
  shop = env.step(f"```goto [{sites['SHOPPING']}]```").observation
  assert shop.startswith("OBSERVATION:\nTab 0: Forums | Tab 1 (current): One Stop Shop\n")
  back = env.step("```tab_focus [0]```").observation
  assert back.startswith("OBSERVATION:\nTab 0 (current): Forums | Tab 1: One Stop Shop\n")
  assert "(failed: there is no tab 5; the tabs are numbered 0 to 1)" in env.step(
      "```tab_focus [5]```").observation
  closed = env.step("```close_tab```").observation
  assert closed.startswith("OBSERVATION:\nTab 0 (current): One Stop Shop\n\n")


@needs_browser
def test_hover_history_and_keys(env, sites):
  post = _act(env, env.reset(2), f"click [{MEETUP}]").observation
  assert "bob has 87 karma" not in post
  card = _act(env, post, "hover [{StaticText 'Posted by bob'}]").observation
  assert "bob has 87 karma" in card
  assert f"URL: {sites['REDDIT']}/\n" in env.step("```go_back```").observation
  assert f"URL: {sites['REDDIT']}/post/2\n" in env.step("```go_forward```").observation
  refused = env.step("```goto [file:///etc/passwd]```").observation
  assert "(failed: goto opens only http and https URLs" in refused
  assert f"URL: {sites['REDDIT']}/post/2\n" in refused
  # Typing without Enter stays on the page; pressing Enter then submits the form.
  typed = _act(env,
               _act(env, env.reset(0), f"click [{KETTLE}]").observation,
               "type [{textbox 'Quantity'}] [3] [0]").observation
  assert "/product/blue-kettle\n" in typed
  assert f"URL: {sites['SHOPPING']}/cart\n" in env.step("```press [Enter]```").observation


@needs_browser
def test_invalid_replies_get_an_error_observation(env):
  observation = env.reset(2)
  assert env.step("I would click the meetup post.") == environments.StepResult(
      "Invalid action: no action found between triple backticks. "
      f"{actions.FORMAT_HINT}", 0.0, False,
      {"success": False, "invalid_action": "no action found between triple backticks"})
  assert env.step("```click [999999]```").observation.endswith(
      "PREVIOUS ACTION: click [999999] (failed: there is no element [999999] in the current "
      "observation)")
  assert observation.startswith("OBSERVATION:")


_replies = st.one_of(
    st.text(max_size=40), st.builds("```{}```".format, st.text(max_size=30)),
    st.builds(
        "```{} [{}]```".format,
        st.sampled_from(["click", "hover", "type", "press", "scroll", "tab_focus", "goto", "stop"]),
        st.text(max_size=12)), st.builds("```click [{}]```".format, st.integers(0, 10**6)))

_fuzzing = {"in_episode": False}


@needs_browser
@settings(max_examples=15, deadline=None)
@given(reply=_replies)
def test_fuzzed_replies_never_raise(env, reply):
  if not _fuzzing["in_episode"]:  # the first example, or the last one ended the episode
    env.reset(2)
  result = env.step(reply)
  assert isinstance(result.observation, str) and result.reward in (0.0, 1.0)
  _fuzzing["in_episode"] = not result.done


@needs_browser
def test_the_step_limit_ends_and_judges_the_episode(env):
  env.max_steps = 2
  try:
    results = _run(env, 2, [f"click [{MEETUP}]", "scroll [down]"])
  finally:
    env.max_steps = 30
  # No stop, but the url_match task is judged at the limit: the meetup post is open.
  assert [(r.reward, r.done) for r in results] == [(0.0, False), (1.0, True)]
  assert results[-1].info["answer"] == ""


def _chromium_profiles():
  """The profile directories of our live Chromium processes."""
  profiles = set()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      arguments = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
      continue
    for argument in arguments:
      if argument.startswith(b"--user-data-dir=") and PROFILE_PREFIX.encode() in argument:
        profiles.add(argument.split(b"=", 1)[1].decode())
  return profiles


@needs_browser
def test_pool_episode_in_full_page_mode_and_close_leaves_no_chromium(sites):
  before = _chromium_profiles()
  options = {
      "config_dir": str(webarena_site.CONFIG_DIR), "site_urls": sites, "viewport_only": False
  }
  with EnvPool("webarena", num_slots=1, options=options) as pool:
    [first] = pool.reset([(0, 0)])
    assert "link 'Tea Towel Set'" in first.observation  # the whole page, not the window
    tea_towels = re.search(r"\[(\d+)\] link 'Tea Towel Set'", first.observation).group(1)
    [moved] = pool.step([(0, f"```click [{tea_towels}]```")])
    assert "/product/tea-towel-set\n" in moved.observation  # clicked below the fold
    started = _chromium_profiles() - before
    assert len(started) == 1
  deadline = time.monotonic() + 10
  while _chromium_profiles() & started and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _chromium_profiles() & started
  assert not any(os.path.exists(profile) for profile in started)

"""Fuzzing the env server: no input gets a 5xx, and a normal episode still plays afterwards."""

import http.client
import json
import socket
import urllib.parse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from environments.http import AgentGymClient, AgentGymServer
from environments.textcraft import solve

_ROUTES = ("/", "/create", "/reset", "/step", "/observation", "/close", "/instruction", "/task_ids",
           "/task_info", "/commands", "/goal", "/detail")
_FIELDS = ("id", "data_idx", "action", "env_idx", "commands", "goal", "split")

_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
            | st.text(max_size=20) | st.sampled_from([10**30, -1, 0, "²", "0", "1e9"]))
_json_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(_FIELDS) | st.text(max_size=5), inner, max_size=3), max_leaves=8)
_bodies = (st.dictionaries(st.sampled_from(_FIELDS), _json_values,
                           max_size=3).map(lambda d: json.dumps(d).encode())
           | _json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
           | st.integers(1, 200_000).map(lambda n: b"[" * n)
           | st.integers(1, 10_000).map(lambda n: b'{"id": ' + b"9" * n + b"}"))
_queries = st.dictionaries(
    st.sampled_from(_FIELDS) | st.text(max_size=5),
    st.text(max_size=10) | st.integers().map(str) | st.sampled_from(["²", "9" * 5000, "-1"]),
    max_size=2).map(urllib.parse.urlencode)


@pytest.fixture(scope="module")
def server():
  with AgentGymServer("textcraft") as server:
    yield server


def _send(port, method, target, body):
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    connection.request(method, target, body=body)
    response = connection.getresponse()
    response.read()
    return response.status
  finally:
    connection.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    route=st.sampled_from(_ROUTES) | st.text(max_size=8).map(lambda t: "/" + urllib.parse.quote(t)),
    query=_queries, body=_bodies)
def test_no_request_gets_a_5xx(server, method, route, query, body):
  status = _send(server.port, method, f"{route}?{query}" if query else route, body)
  assert 200 <= status < 500


@settings(max_examples=15, deadline=None)
@given(line=st.binary(min_size=1, max_size=60).filter(lambda b: b"\n" not in b))
def test_any_request_line_gets_a_status_line(server, line):
  with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
    raw.sendall(line + b"\r\n\r\n")
    answer = raw.makefile("rb").readline()
  # An empty line before any request is no request: the server may close without answering.
  if answer:
    assert answer.startswith(b"HTTP/1.1 ") and int(answer.split()[1]) < 500, answer


def test_after_the_fuzz_an_episode_still_plays(server):
  test_no_request_gets_a_5xx(server)
  test_any_request_line_gets_a_status_line(server)
  client = AgentGymClient(server.url, "textcraft")
  observation = client.reset(20)  # barrel
  for action in solve(observation):
    result = client.step(f"Thought: next.\n\nAction: {action}")
  assert result.done and result.reward == 1.0 and result.info["success"]
  client.close()

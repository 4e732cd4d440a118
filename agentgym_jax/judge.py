"""Model-judged rewards (config group reward.judge): a model scores the episodes of a step, for
environments without a programmatic verifier, or whose verifier asks for one (WebArena's
fuzzy_match, SearchQA's answers with `judge_answers`).

Modes:
  reference  pointwise, answer against reference. An environment that wants its answer judged
             puts a request in the final step's info["judge"] (`Request`): the question, the
             reference answers, whether the answer must match all of them (WebArena's
             fuzzy_match list) or any (SearchQA's gold answers), the answer, and `scale`, what
             the rest of the episode's checks scored. Each reference is one prompt; the judge
             ends with "Verdict: correct | partially correct | incorrect" and, as in WebArena's
             llm_fuzzy_match, only "correct" counts: the episode's last turn reward becomes
             scale x (1 if the references match, else 0), its success whether that is 1.
             Episodes without a request keep their environment's reward.
  rubric     pointwise, against `rubric`: the judge reads the whole episode and ends with
             "Score: N", N in 0..10; the episode's reward becomes N / 10, on its last turn.
  group      group-relative (as ART's RULER): the episodes of one group (one task, one step)
             in one prompt, scored together against `rubric` ("Attempt i: N" each); the
             scores are normalised within the group, the best 1 and the worst 0 (min-max),
             and a group scored all alike keeps N / 10. The reward, on the last turn, becomes
             the normalised score.
In the rubric and group modes the environment's success flag stays as it was: the judge sets
the reward that trains, not the task's outcome.

The judge is a model this project's sampler runs (`SamplerBackend`: a registry name, an HF
directory such as a run's export, or a Hub id in the local cache), or the base URL of an
OpenAI-compatible server (`HTTPBackend`: a vLLM server, a hosted API, or this project's own
policy server). Judging is batched over the step: every prompt of a step is sent at once
(concurrent requests, or one decode batch of the sampler). Replies are cached by the sha256 of
(judge, prompt, token budget); a prompt holds the episode's text, so that is (trajectory, judge,
prompt). With a path the cache persists (a run's workdir/judge_cache.jsonl), so a resumed run
asks nothing twice.

A judge that fails (an HTTP error, a timeout, a reply without a verdict, a prompt too long for
the judge's context) fails the episodes it was judging as an environment failure does
(termination env_error, error "judge: ..."), which env.failed_episodes then leaves out of the
loss or zeroes; the step goes on. Failures are not cached: the next step asks again.

An episode judged records info["judged"]: its score, the judge's replies (or its error), and
whether they came from the cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp

from agentgym_jax import evaluation, rollout
from agentgym_jax.models import load_model
from agentgym_jax.sampling import Sampler, SamplingParams
from environments import jsonl
from environments.base import ENV_ERROR

MODES = ("reference", "rubric", "group")
MATCHES = ("all", "any")
# Times a request to a judge server is made while it fails in a way that may pass (HTTPBackend).
ATTEMPTS = 3
# The judge's replies an episode's info keeps, each cut to this many characters.
REPLY_CHARS = 2000

_VERDICT = re.compile(r"verdict\s*:\s*\**\s*(partially correct|incorrect|correct)", re.IGNORECASE)
_SCORE = re.compile(r"score\s*:\s*\**\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_ATTEMPT = re.compile(r"attempt\s*(\d+)\s*:\s*\**\s*(\d+(?:\.\d+)?)", re.IGNORECASE)

SYSTEM = "You are a careful, impartial grader of AI agents' work."

REFERENCE_PROMPT = """\
Grade an answer to a question against the reference answer. The answer may be worded \
differently from the reference: what counts is whether it means the same. The reference "N/A" \
stands for "this task cannot be done".

Question: {question}
Reference answer: {reference}
Answer to grade: {answer}

Explain briefly, then end with exactly one of these lines:
Verdict: correct
Verdict: partially correct
Verdict: incorrect"""

RUBRIC_PROMPT = """\
Score an AI agent's episode against the rubric below. The episode shows the environment's \
messages as [environment] and the agent's replies as [agent].

Rubric:
{rubric}

Episode:
{episode}

Explain briefly, then end with one line "Score: N", where N is an integer from 0 (fails the \
rubric) to 10 (meets it fully)."""

GROUP_PROMPT = """\
Several attempts by AI agents at the same task follow. Score each against the rubric below, \
comparing them with one another: a better attempt gets a higher score. Each attempt shows the \
environment's messages as [environment] and the agent's replies as [agent].

Rubric:
{rubric}

{attempts}

Explain briefly, then end with one line per attempt, "Attempt i: N", where N is an integer \
from 0 (fails the rubric) to 10 (meets it fully), for i = 1 to {count}."""


class JudgeError(RuntimeError):
  """The judge could not score a prompt; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Request:
  """What an environment asks the judge in reference mode (module docstring): is `answer` to
  `question` the same as `all` / `any` of the `references`; the episode then scores `scale` x
  that (the product of the task's other checks)."""

  question: str
  references: tuple[str, ...]
  answer: str
  match: str = "all"
  scale: float = 1.0

  @classmethod
  def from_info(cls, value: Any) -> Request:
    """The request an environment put in info["judge"]; JudgeError if it is malformed."""
    try:
      request = cls(question=str(value["question"]),
                    references=tuple(str(r) for r in value["references"]),
                    answer=str(value["answer"]), match=str(value.get("match", "all")),
                    scale=float(value.get("scale", 1.0)))
    except (TypeError, KeyError, ValueError) as error:
      raise JudgeError(f"the environment's judge request is malformed: {error!r}") from None
    if not request.references or request.match not in MATCHES:
      raise JudgeError(f"the environment's judge request needs references and match in "
                       f"{MATCHES}, got {len(request.references)} and {request.match!r}")
    return request


# --- prompts and replies -------------------------------------------------------------------


def chat(prompt: str) -> list[dict[str, str]]:
  return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def episode_text(messages: Sequence[Mapping[str, str]], max_chars: int) -> str:
  """An episode's conversation as the judge reads it, at most `max_chars` characters: the first
  message (the task) and as many of the last as fit, the others left out with a note; a
  message longer than its share is cut in the middle."""
  shown = [
      f"[{'agent' if m['role'] == 'assistant' else 'environment'}]\n{m['content']}"
      for m in messages if m["role"] != "system"
  ]
  if not shown:
    return ""
  note = "[... {} messages left out ...]"
  first, rest = _cut(shown[0], max_chars // 2), shown[1:]
  # What is left after the task, the note and the separators ("\n\n") around it.
  budget, tail = max_chars - len(first) - len(note.format(len(rest))) - 4, []
  for text in reversed(rest):
    if not tail:
      text = _cut(text, budget)
    if len(text) + 2 > budget:
      break
    tail.append(text)
    budget -= len(text) + 2
  left_out = len(rest) - len(tail)
  return "\n\n".join([first, *([note.format(left_out)] if left_out else []), *reversed(tail)])


def _cut(text: str, chars: int) -> str:
  if len(text) <= chars:
    return text
  half = max(chars // 2 - 20, 0)
  return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[len(text) - half:]}"


def parse_verdict(reply: str) -> float:
  """1 for a last verdict "correct", 0 for "incorrect" or "partially correct"; JudgeError for
  a reply without one."""
  verdicts = _VERDICT.findall(reply)
  if not verdicts:
    raise JudgeError(f"the judge's reply has no verdict line: {_tail(reply)}")
  return float(verdicts[-1].lower() == "correct")


def parse_score(reply: str) -> float:
  """N / 10 for the reply's last "Score: N" (N in 0..10); JudgeError without one."""
  scores = _SCORE.findall(reply)
  if not scores:
    raise JudgeError(f"the judge's reply has no 'Score: N' line: {_tail(reply)}")
  return _tenths(scores[-1])


def parse_group_scores(reply: str, count: int) -> list[float]:
  """The N / 10 of each attempt 1..count (its last "Attempt i: N"); JudgeError if one is
  missing."""
  scores = {int(i): value for i, value in _ATTEMPT.findall(reply)}
  missing = [i for i in range(1, count + 1) if i not in scores]
  if missing:
    raise JudgeError(f"the judge's reply scores no attempt {missing[0]} of {count}: "
                     f"{_tail(reply)}")
  return [_tenths(scores[i]) for i in range(1, count + 1)]


def _tenths(text: str) -> float:
  value = float(text)
  if not 0 <= value <= 10:
    raise JudgeError(f"the judge's score {text} is not in 0..10")
  return value / 10


def normalise(scores: Sequence[float]) -> list[float]:
  """A group's scores min-max normalised (the best 1, the worst 0); all alike: as they are."""
  low, high = min(scores), max(scores)
  if high == low:
    return list(scores)
  return [(s - low) / (high - low) for s in scores]


def _tail(reply: str) -> str:
  text = " ".join(reply.split())
  return repr(text if len(text) <= 120 else "..." + text[-117:])


# --- backends ------------------------------------------------------------------------------


class Backend(Protocol):
  """Completes chats: `identity` names the judge in the cache key."""

  identity: str

  def complete(self, chats: Sequence[list[dict[str, str]]]) -> list[str | JudgeError]:
    """Each chat's reply text, or the JudgeError that kept it from one."""


class HTTPBackend:
  """An OpenAI-compatible server's /chat/completions at `base_url` (e.g.
  http://host:8000/v1), `model` named in each request, greedy, up to `max_new_tokens` a reply;
  `concurrency` requests in flight, each given `timeout_s` and asked again on a transient
  failure (`_one`); the bearer key from the environment variable `api_key_env`, when set."""

  def __init__(self, base_url: str, model: str, *, max_new_tokens: int, timeout_s: float,
               concurrency: int, api_key_env: str = ""):
    self.url = base_url.rstrip("/") + "/chat/completions"
    self.model, self.max_new_tokens = model, max_new_tokens
    self.timeout_s, self.concurrency = timeout_s, concurrency
    self.api_key_env = api_key_env
    self.identity = f"{self.url}#{model}"

  def complete(self, chats: Sequence[list[dict[str, str]]]) -> list[str | JudgeError]:
    if not chats:
      return []
    with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(chats))) as pool:
      return list(pool.map(self._one, chats))

  def _one(self, messages: list[dict[str, str]]) -> str | JudgeError:
    """The reply to `messages`, asked up to `ATTEMPTS` times while the server is unreachable or
    answers 429 or 5xx, waiting 1, 2, ... seconds between."""
    for attempt in itertools.count(1):
      reply, transient = self._ask(messages)
      if not transient or attempt == ATTEMPTS:
        return reply
      time.sleep(attempt)

  def _ask(self, messages: list[dict[str, str]]) -> tuple[str | JudgeError, bool]:
    """(the reply or error, whether asking again may help)."""
    body = json.dumps({
        "model": self.model, "messages": messages, "temperature": 0.0,
        "max_tokens": self.max_new_tokens
    }).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
    if key:
      headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
    try:
      with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
        payload = json.loads(response.read())
      content = payload["choices"][0]["message"]["content"]
      if not isinstance(content, str):
        raise TypeError(f"content is {type(content).__name__}")
      return content, False
    except urllib.error.HTTPError as error:
      detail = " ".join(error.read(300).decode("utf-8", "replace").split())
      return (JudgeError(f"{self.url} answered HTTP {error.code}: {detail}"), error.code == 429
              or error.code >= 500)
    except (urllib.error.URLError, TimeoutError, OSError) as error:
      reason = getattr(error, "reason", error)
      return JudgeError(f"cannot reach {self.url}: {reason}"), True
    except (ValueError, KeyError, IndexError, TypeError) as error:
      return JudgeError(f"{self.url} sent no chat completion: {error!r}"), False


class SamplerBackend:
  """A model run by this project's sampler: `rows` prompts at a time, greedy, in a KV cache of
  `max_context` tokens a row (prompt and reply); a longer prompt is a JudgeError."""

  def __init__(self, model: Any, chat_template: Any, *, identity: str, rows: int, max_context: int,
               max_new_tokens: int, cache_dtype: Any = None):
    if max_context <= max_new_tokens:
      raise ValueError(f"the judge's context ({max_context}) must exceed its reply budget "
                       f"({max_new_tokens})")
    self.chat, self.identity = chat_template, identity
    self.rows, self.max_context, self.max_new_tokens = rows, max_context, max_new_tokens
    self.sampler = Sampler(model, cache_slots=max_context, max_batch=rows, cache_dtype=cache_dtype)
    self._lock = threading.Lock()  # One batch at a time on the sampler's cache.

  @classmethod
  def load(cls, spec: str, *, dtype: str, rows: int, max_context: int,
           max_new_tokens: int) -> SamplerBackend:
    """The judge `spec` (a registry name, HF directory or Hub id) with `dtype` matmuls and bf16
    weights and KV cache, named in the cache by the sha256 of its files."""
    model, tokenizer = load_model(spec, dtype=getattr(jnp, dtype), param_dtype=jnp.bfloat16)
    return cls(model, tokenizer.chat_template(), identity=evaluation.model_fingerprint(spec),
               rows=rows, max_context=max_context, max_new_tokens=max_new_tokens,
               cache_dtype=jnp.bfloat16)

  def complete(self, chats: Sequence[list[dict[str, str]]]) -> list[str | JudgeError]:
    prompts = [self.chat.render(messages, add_generation_prompt=True) for messages in chats]
    out: list[str | JudgeError] = [
        JudgeError(f"the judge prompt has {len(p)} tokens; with {self.max_new_tokens} for the "
                   f"reply that passes reward.judge.max_context={self.max_context}")
        for p in prompts
    ]
    fitting = [i for i, p in enumerate(prompts) if len(p) + self.max_new_tokens <= self.max_context]
    with self._lock:
      for start in range(0, len(fitting), self.rows):
        batch = fitting[start:start + self.rows]
        state = self.sampler.start([prompts[i] for i in batch])
        _, generated = self.sampler.generate(state, jax.random.key(0),
                                             max_new_tokens=self.max_new_tokens,
                                             stop_ids=self.chat.turn_end_ids,
                                             sampling=SamplingParams(temperature=0.0))
        for i, ids in zip(batch, generated.token_lists()):
          out[i] = self.chat.reply_text(ids)
    return out


# --- the cache -----------------------------------------------------------------------------


class ReplyCache:
  """The judge's replies by the sha256 of (judge, chat, token budget); kept in memory, and
  appended to the JSONL file `path` when given (read back when it exists)."""

  def __init__(self, path: pathlib.Path | None = None):
    self.path, self.replies = path, {}
    if path is not None and path.exists():
      # A run killed mid-append leaves its last line cut short: that reply is asked again.
      for record in jsonl.iterate(path, allow_truncated_tail=True):
        self.replies[record["key"]] = record["reply"]

  @staticmethod
  def key(identity: str, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    text = json.dumps([identity, messages, max_new_tokens], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()

  def get(self, key: str) -> str | None:
    return self.replies.get(key)

  def put(self, entries: Mapping[str, str]) -> None:
    self.replies.update(entries)
    if self.path is not None and entries:
      with self.path.open("a") as f:
        for key, reply in entries.items():
          f.write(jsonl.to_line({"key": key, "reply": reply}))


# --- the judge -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
  """One prompt, and what to do with its reply (or error)."""

  messages: list[dict[str, str]]
  apply: Callable[[str | JudgeError, bool], None]


class Judge:
  """Scores episodes in place with `backend` in `mode` (module docstring); episode texts cut
  to `episode_chars` characters each."""

  def __init__(self, backend: Backend, mode: str, *, rubric: str = "", max_new_tokens: int,
               episode_chars: int = 12000, cache: ReplyCache | None = None):
    if mode not in MODES:
      raise ValueError(f"judge mode {mode!r} is not one of {MODES}")
    if mode != "reference" and not rubric.strip():
      raise ValueError(f"judge mode {mode!r} needs a rubric")
    self.backend, self.mode, self.rubric = backend, mode, rubric
    self.max_new_tokens, self.episode_chars = max_new_tokens, episode_chars
    self.cache = cache or ReplyCache()

  def __call__(self, trajectories: Sequence[rollout.Trajectory]) -> float:
    """Judges the episodes of `trajectories` the mode covers (not those whose environment
    failed), setting their rewards, success (reference mode) and info["judged"]; returns the
    seconds it took."""
    started = time.monotonic()
    live = [t for t in trajectories if not t.env_failed and t.num_turns]
    jobs = {
        "reference": self._reference_jobs, "rubric": self._rubric_jobs, "group": self._group_jobs
    }[self.mode](live)
    keys = [
        ReplyCache.key(self.backend.identity, job.messages, self.max_new_tokens) for job in jobs
    ]
    cached = [self.cache.get(key) for key in keys]
    asked = [i for i, reply in enumerate(cached) if reply is None]
    replies = self.backend.complete([jobs[i].messages for i in asked])
    self.cache.put({keys[i]: reply for i, reply in zip(asked, replies) if isinstance(reply, str)})
    for i, reply in zip(asked, replies):
      cached[i] = reply
    fresh = set(asked)
    for i, (job, reply) in enumerate(zip(jobs, cached)):
      job.apply(reply, i not in fresh)
    return time.monotonic() - started

  def _reference_jobs(self, trajectories: Sequence[rollout.Trajectory]) -> list[_Job]:
    jobs = []
    for t in trajectories:
      if "judge" not in t.info:
        continue
      try:
        request = Request.from_info(t.info["judge"])
      except JudgeError as error:
        _fail([t], error, [])
        continue
      verdicts: list[tuple[float, str, bool]] = []

      def apply(reply, cached, t=t, request=request, verdicts=verdicts):
        if t.env_failed:  # An earlier reference of the episode failed it.
          return
        verdict = _parsed(reply, parse_verdict)
        if isinstance(verdict, JudgeError):
          _fail([t], verdict, [v[1] for v in verdicts] + [reply])
          return
        verdicts.append((verdict, reply, cached))
        if len(verdicts) == len(request.references):
          matched = (all if request.match == "all" else any)(v[0] == 1.0 for v in verdicts)
          score = request.scale * float(matched)
          t.turn_rewards[-1] = score
          t.success = score >= 1.0
          _record(t, score, [v[1] for v in verdicts], all(v[2] for v in verdicts))

      for reference in request.references:
        prompt = REFERENCE_PROMPT.format(question=request.question, reference=reference,
                                         answer=request.answer)
        jobs.append(_Job(chat(prompt), apply))
    return jobs

  def _rubric_jobs(self, trajectories: Sequence[rollout.Trajectory]) -> list[_Job]:
    jobs = []
    for t in trajectories:

      def apply(reply, cached, t=t):
        score = _parsed(reply, parse_score)
        if isinstance(score, JudgeError):
          _fail([t], score, [reply])
          return
        _set_outcome(t, score)
        _record(t, score, [reply], cached)

      prompt = RUBRIC_PROMPT.format(rubric=self.rubric,
                                    episode=episode_text(t.messages, self.episode_chars))
      jobs.append(_Job(chat(prompt), apply))
    return jobs

  def _group_jobs(self, trajectories: Sequence[rollout.Trajectory]) -> list[_Job]:
    groups: dict[int, list[rollout.Trajectory]] = {}
    for t in trajectories:
      groups.setdefault(t.group, []).append(t)
    jobs = []
    for members in groups.values():

      def apply(reply, cached, members=members):
        scores = _parsed(reply, lambda text: normalise(parse_group_scores(text, len(members))))
        if isinstance(scores, JudgeError):
          _fail(members, scores, [reply])
          return
        for t, score in zip(members, scores):
          _set_outcome(t, score)
          _record(t, score, [reply], cached)

      attempts = "\n\n".join(f"Attempt {i}:\n{episode_text(t.messages, self.episode_chars)}"
                             for i, t in enumerate(members, 1))
      prompt = GROUP_PROMPT.format(rubric=self.rubric, attempts=attempts, count=len(members))
      jobs.append(_Job(chat(prompt), apply))
    return jobs


def _parsed(reply: str | JudgeError, parse: Callable[[str], Any]) -> Any:
  """`parse(reply)`, or the JudgeError of a request that failed or of a reply it cannot read."""
  if isinstance(reply, JudgeError):
    return reply
  try:
    return parse(reply)
  except JudgeError as error:
    return error


def _set_outcome(trajectory: rollout.Trajectory, score: float) -> None:
  """The episode's reward becomes `score`, on its last turn."""
  trajectory.turn_rewards = [0.0] * (trajectory.num_turns - 1) + [score]


def _record(trajectory: rollout.Trajectory, score: float, replies: list[str], cached: bool) -> None:
  trajectory.info["judged"] = {
      "score": score, "replies": [r[-REPLY_CHARS:] for r in replies], "cached": cached
  }


def _fail(trajectories: Sequence[rollout.Trajectory], error: JudgeError,
          replies: Sequence[str | JudgeError]) -> None:
  """The episodes fail as an environment failure does (module docstring); `replies` are the
  judge's (a failed request's error among them is left out)."""
  kept = [r[-REPLY_CHARS:] for r in replies if isinstance(r, str)]
  for t in trajectories:
    t.termination, t.error = ENV_ERROR, f"judge: {error}"
    t.info["judged"] = {"error": str(error), "replies": kept}


def metrics(trajectories: Sequence[rollout.Trajectory], seconds: float) -> dict[str, float]:
  """judge/episodes (judged, or failed by the judge), judge/score (their mean score),
  judge/failures and judge/cached (shares of the judged), and time/judge."""
  judged = [t.info["judged"] for t in trajectories if "judged" in t.info]
  scored = [j for j in judged if "score" in j]
  count = max(len(judged), 1)
  return {
      "judge/episodes": float(len(judged)),
      "judge/score": sum(j["score"] for j in scored) / max(len(scored), 1),
      "judge/failures": (len(judged) - len(scored)) / count,
      "judge/cached": sum(bool(j.get("cached")) for j in scored) / count,
      "time/judge": seconds,
  }

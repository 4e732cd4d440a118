"""WebArena's evaluators: the outcome of an episode from the answer and the final page.

A task lists its evaluators in eval.eval_types; the episode's score is the product of theirs,
each 0 or 1 (WebArena's EvaluatorComb):

string_match, on the stop answer (`clean_answer`: strip, drop one pair of enclosing quotes,
  lower-case):
    exact_match   clean(answer) == clean(reference).
    must_include  every reference phrase is a substring of the answer; a one-character
                  reference, when it is the only phrase, must be a whole token instead (so "0"
                  is not found in "10"; WebArena tokenises with nltk, we with a regex that keeps
                  numbers such as 0.50 whole).
    fuzzy_match   WebArena asks an LLM (GPT-4) whether the answer means each reference. The
                  episode asks that of the run's judge (agentgym_jax/judge.py, reward.judge
                  mode "reference"): `Evaluation.judge` is the request, with the other checks'
                  product as its scale. Without a judge each reference must be included as in
                  must_include. The reference "N/A" (an unachievable task) needs the answer
                  "N/A" exactly, judge or not; the LLM check of the reason an agent gives for
                  N/A is not done.
url_match, on the active tab's URL (WebArena's "GOLD in PRED" rule): some reference's host+path
  (trailing "/" dropped) is a substring of the page's host+path, and for every query parameter
  of the references, the page's URL has one of the references' values for it. References are
  separated by " |OR| ".
program_html, per target: open the target URL ("last": stay on the current page), evaluate the
  locator (a JS expression; empty: the page's HTML) after any prep_actions, HTML-unescape the
  result and check required_contents: exact_match as above, or every must_include entry
  (alternatives separated by " |OR| ") a substring. A locator that throws yields "".

The page is reached through the small `Page` protocol, so the evaluators are tested without a
browser and the browser session stays in one module.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import json
import math
import re
import urllib.parse
from typing import Any, Mapping, Protocol

from environments.webarena import tasks

_OR = " |OR| "
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|\w+|[^\w\s]")


class Page(Protocol):
  """What the evaluators need of the browser's active tab."""

  @property
  def url(self) -> str:
    """The tab's current URL."""

  def goto(self, url: str) -> None:
    """Navigates the tab and waits for the page to load."""

  def evaluate(self, expression: str) -> Any:
    """The value of `() => <expression>` run on the page, as WebArena runs locators; raises if
    the expression throws."""

  def content(self) -> str:
    """The page's HTML."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The outcome of an episode.

  Attributes:
    score: the product of the evaluators' scores, 0 or 1.
    scores: each evaluator's score, by eval type.
    errors: what went wrong while evaluating (a page that did not load), for the logs.
    judge: the request to a judge (judge.Request's fields) when fuzzy_match has references a
      judge decides; `score` is then the must_include stand-in.
  """

  score: float
  scores: dict[str, float]
  errors: tuple[str, ...] = ()
  judge: dict[str, Any] | None = None


def clean_answer(answer: str) -> str:
  answer = answer.strip()
  if len(answer) >= 2 and answer[0] == answer[-1] and answer[0] in "'\"":
    answer = answer[1:-1]
  return answer.lower()


def exact_match(reference: str, prediction: str) -> float:
  return float(clean_answer(prediction) == clean_answer(reference))


def must_include(reference: str, prediction: str, tokenize: bool = False) -> float:
  reference, prediction = clean_answer(reference), clean_answer(prediction)
  if tokenize and len(reference) == 1:
    return float(reference in _TOKEN.findall(prediction))
  return float(reference in prediction)


def string_match(reference_answers: Mapping[str, Any], answer: str, judged: bool = False) -> float:
  """string_match's score for a stop answer (module docstring); `judged`: without the fuzzy
  references a judge decides (`judged_references`)."""
  prediction = clean_answer(answer)
  score = 1.0
  for kind, reference in reference_answers.items():
    match kind:
      case "exact_match":
        score *= exact_match(reference, prediction)
      case "must_include":
        for phrase in reference:
          score *= must_include(phrase, prediction, tokenize=len(reference) == 1)
      case "fuzzy_match":
        if reference == "N/A":
          score *= exact_match("N/A", prediction)
        elif not judged:
          for phrase in reference:
            score *= must_include(phrase, prediction)
  return score


def judged_references(reference_answers: Mapping[str, Any]) -> list[str]:
  """The fuzzy_match references a judge decides: all but the unachievable task's "N/A"."""
  fuzzy = reference_answers.get("fuzzy_match", "N/A")
  return [] if fuzzy == "N/A" else [str(phrase) for phrase in fuzzy]


def url_match(reference_url: str, page_url: str) -> float:
  """url_match's score for the active tab's URL (module docstring)."""
  references = [_clean_url(url) for url in reference_url.split(_OR)]
  reference_paths = []
  reference_queries: dict[str, set[str]] = collections.defaultdict(set)
  for reference in references:
    path, query = _split_url(reference)
    reference_paths.append(path)
    for key, values in query.items():
      reference_queries[key].update(values)
  page_path, page_query = _split_url(_clean_url(page_url))
  if not any(path in page_path for path in reference_paths):
    return 0.0
  return float(
      all(
          any(value in page_query.get(key, ()) for value in values)
          for key, values in reference_queries.items()))


def program_html(targets: list[Mapping[str, Any]], page: Page) -> tuple[float, list[str]]:
  """program_html's score, and any errors met (module docstring)."""
  score, errors = 1.0, []
  for target in targets:
    url = target["url"]
    if tasks.SUPPORTED_URL_FUNCS.fullmatch(url):
      url = reddit_post_url(page.url)
    if url != "last":
      try:
        page.goto(url)
      except Exception as e:  # An evaluation page that fails to load is a failed check.
        errors.append(f"program_html: cannot open {url}: {_first_line(e)}")
        return 0.0, errors
    selected = html.unescape(_select(target, page))
    required = target["required_contents"]
    if "exact_match" in required:
      score *= exact_match(required["exact_match"], selected)
    else:
      for content in required["must_include"]:
        score *= float(any(must_include(option, selected) for option in content.split(_OR)))
  return score, errors


def evaluate(config: Mapping[str, Any], answer: str, page: Page) -> Evaluation:
  """Scores an episode of the task `config` (placeholders resolved) ending with `answer`."""
  spec = config["eval"]
  scores: dict[str, float] = {}
  errors: list[str] = []
  for eval_type in spec["eval_types"]:
    match eval_type:
      case "string_match":
        scores[eval_type] = string_match(spec["reference_answers"], answer)
      case "url_match":
        scores[eval_type] = url_match(spec["reference_url"], page.url)
      case "program_html":
        scores[eval_type], found = program_html(spec["program_html"], page)
        errors.extend(found)
  score = math.prod(scores.values())
  request = None
  references = judged_references(spec.get("reference_answers") or {})
  if "string_match" in scores and references:
    scale = string_match(spec["reference_answers"], answer, judged=True) * math.prod(
        value for kind, value in scores.items() if kind != "string_match")
    request = {
        "question": config.get("intent", ""), "references": references, "answer": answer,
        "match": "all", "scale": scale
    }
  return Evaluation(score, scores, tuple(errors), request)


def reddit_post_url(url: str) -> str:
  """WebArena's reddit_get_post_url: a Postmill post or comment URL cut to the post's."""
  parts = urllib.parse.urlparse(url)
  segments = parts.path.split("/")
  if len(segments) < 4 or segments[1] != "f":
    return url
  return f"{parts.scheme}://{parts.netloc}/f/{segments[2]}/{segments[3]}/"


def _select(target: Mapping[str, Any], page: Page) -> str:
  locator = target.get("locator", "")
  if not locator.strip():
    return page.content()
  member = tasks.SUPPORTED_LOCATOR_FUNCS.fullmatch(locator)
  if member is not None:
    return _gitlab_member_role(page, member.group(1))
  for prep in target.get("prep_actions", ()):
    try:
      page.evaluate(prep)
    except Exception:  # As WebArena: a failing preparation leaves the check to the locator.
      break
  try:
    return str(page.evaluate(locator))
  except Exception:  # The element is missing: the page is not in the required state.
    return ""


def _gitlab_member_role(page: Page, account: str) -> str:
  """WebArena's gitlab_get_project_memeber_role: the role shown for @account on a members page."""
  handle = json.dumps("@" + account)
  expression = ("(() => { const names = [...document.querySelectorAll("
                "\"td[data-label='Account'] span.gl-avatar-labeled-sublabel\")]"
                f".map(e => e.outerText); const i = names.indexOf({handle});"
                " const roles = document.querySelectorAll('td.col-max-role span');"
                " return i >= 0 && i < roles.length ? roles[i].outerText : ''; })()")
  try:
    return str(page.evaluate(expression))
  except Exception:
    return ""


def _clean_url(url: str) -> str:
  return str(url).rstrip("/")


def _split_url(url: str) -> tuple[str, dict[str, list[str]]]:
  parts = urllib.parse.urlparse(url)
  return parts.netloc + parts.path, urllib.parse.parse_qs(parts.query)


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return (text[0] if text else type(error).__name__)[:300]

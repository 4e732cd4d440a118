"""What a SearchQA reply may contain, and how answers are scored (the Search-R1 format).

A reply holds one action between tags; everything else in it (reasoning, usually inside
<think>...</think>) is ignored:

  <search> query </search>    look something up; the env answers <information>...</information>
  <answer> text </answer>     the final answer; it ends the episode

Parsing, as AgentGym's SearchQA server where it is well defined: a block is a tag pair with
anything in between (newlines too), its content stripped of surrounding whitespace. The query
is the first <search> block, the answer the last <answer> block (the server searches with the
first match; its scorer reads the last answer). A reply is invalid, and the env answers with
`INVALID_OBSERVATION`, when it has no complete block, when it has both a <search> and an
<answer> block (the server would act on whichever comes first, so a reply that both asks and
answers would be scored on the order of its tags), or when its query is empty (the server
would search for the empty string). An empty answer is a valid, wrong answer.

Scoring is exact match after normalisation (SQuAD's `normalize_answer`, used by FlashRAG and
Search-R1): lowercase, delete ASCII punctuation, delete the articles "a", "an", "the" as whole
words, collapse whitespace. The answer is correct when it equals any gold answer after both are
normalised: EM(pred, golds) = max over g in golds of [normalize(pred) == normalize(g)].
"""

from __future__ import annotations

import dataclasses
import re
import string
from typing import Iterable, Literal

INVALID_OBSERVATION = (
    "Your previous action is invalid. If you want to search, you should put the query between "
    "<search> and </search>. If you want to give the final answer, you should put the answer "
    "between <answer> and </answer>. Please try again.")

_BLOCK = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ARTICLE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclasses.dataclass(frozen=True)
class Action:
  """One parsed action: a search query or a final answer, stripped."""

  kind: Literal["search", "answer"]
  text: str


def parse_reply(reply: str) -> Action | None:
  """The action of a model reply, or None when the reply is invalid (module docstring)."""
  blocks = [(m.group(1), m.group(2).strip()) for m in _BLOCK.finditer(reply)]
  queries = [text for kind, text in blocks if kind == "search"]
  answers = [text for kind, text in blocks if kind == "answer"]
  if queries and answers:
    return None
  if queries:
    return Action("search", queries[0]) if queries[0] else None
  if answers:
    return Action("answer", answers[-1])
  return None


def normalize_answer(text: str) -> str:
  """Lowercase, drop punctuation, drop articles, collapse whitespace ("The  U.S.A." -> "usa")."""
  text = text.lower().translate(_PUNCTUATION)
  return " ".join(_ARTICLE.sub(" ", text).split())


def exact_match(prediction: str, golden_answers: Iterable[str]) -> bool:
  """Whether `prediction` equals any of `golden_answers` after normalisation."""
  normalized = normalize_answer(prediction)
  return any(normalize_answer(gold) == normalized for gold in golden_answers)

"""Question sets for SearchQA: the `Question` record and FlashRAG-format loading.

FlashRAG's datasets (RUC-NLPIR/FlashRAG_datasets, the ones Search-R1 and AgentGym use) hold one
question per record with the fields
  id              a string
  question        the question text
  golden_answers  a list of acceptable answers (a single string is taken as a list of one)
  metadata        anything else (kept in `Question.metadata`)
and are laid out one folder per source, one file per split, JSONL or parquet:

  <data_dir>/nq/train.jsonl  <data_dir>/nq/test.jsonl  <data_dir>/hotpotqa/dev.jsonl  ...

The question sets of the paper's Deep Search benchmark are AgentGym's: the test split is the
test file of each of nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle (the
dev file where a source has no test file), and the train split is the train files of nq and
hotpotqa. Task ids follow AgentGym's numbering: test questions first, source after source in
that order and file order within a source, then the train questions; so with the same files a
task id here is the `data_idx` of AgentGym's SearchQA server. As AgentGym's preprocessing does,
question texts are stripped and get a final "?" when they lack one.

Each question's category is its source under the paper's name (NQ, TriviaQA, PopQA, HotpotQA,
2Wiki, Musique, Bamboogle); a record's own "data_source" field, when present, names its source.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from environments import jsonl

TEST_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
TRAIN_SOURCES = ("nq", "hotpotqa")
PAPER_CATEGORIES = {
    "nq": "NQ",
    "triviaqa": "TriviaQA",
    "popqa": "PopQA",
    "hotpotqa": "HotpotQA",
    "2wikimultihopqa": "2Wiki",
    "musique": "Musique",
    "bamboogle": "Bamboogle",
}
# The files a split reads from a source's folder, first existing one wins (AgentGym's rule).
SPLIT_FILES = {"test": ("test", "dev"), "train": ("train",)}
FILE_FORMATS = ("jsonl", "parquet")


@dataclasses.dataclass(frozen=True)
class Question:
  """One question with its accepted answers."""

  id: str
  question: str
  golden_answers: tuple[str, ...]
  category: str
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a JSONL or parquet file, in file order."""
  path = os.fspath(path)
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError(f"reading {path} needs pyarrow (pip install 'agentgym-jax[searchqa]'), "
                        "or convert it to JSONL") from None
    return pyarrow.parquet.read_table(path).to_pylist()
  return jsonl.read(path)


def question_from_record(record: Mapping[str, Any], source: str, where: str) -> Question:
  """A FlashRAG record as a Question of `source` (`where` names it in error messages)."""
  missing = [key for key in ("question", "golden_answers") if key not in record]
  if missing:
    raise ValueError(f"{where}: missing field(s) {missing}; FlashRAG records have id, question, "
                     "golden_answers, metadata")
  answers = record["golden_answers"]
  if isinstance(answers, str):
    answers = [answers]
  if (not isinstance(answers, Sequence) or not answers
      or not all(isinstance(answer, str) for answer in answers)):
    raise ValueError(f"{where}: golden_answers must be a non-empty list of strings, got "
                     f"{answers!r}")
  text = str(record["question"]).strip()
  if not text:
    raise ValueError(f"{where}: empty question")
  if not text.endswith("?"):
    text += "?"
  source = str(record.get("data_source", source))
  metadata = record.get("metadata")
  if not isinstance(metadata, Mapping):
    metadata = {} if metadata is None else {"metadata": metadata}
  return Question(id=str(record.get("id", where)), question=text, golden_answers=tuple(answers),
                  category=PAPER_CATEGORIES.get(source, source), metadata=dict(metadata))


def source_file(data_dir: str | os.PathLike, source: str, split: str) -> str:
  """The file a split reads for `source` (see SPLIT_FILES), or a clear error."""
  candidates = [
      os.path.join(data_dir, source, f"{name}.{ext}") for name in SPLIT_FILES[split]
      for ext in FILE_FORMATS
  ]
  for path in candidates:
    if os.path.exists(path):
      return path
  raise FileNotFoundError(f"no {split} file for source {source!r}; looked for "
                          f"{', '.join(candidates)}")


def load_flashrag(data_dir: str | os.PathLike, test_sources: Sequence[str] = TEST_SOURCES,
                  train_sources: Sequence[str] = TRAIN_SOURCES) -> dict[str, list[Question]]:
  """The test and train questions under `data_dir`, in task id order (module docstring)."""
  splits = {}
  for split, sources in (("test", test_sources), ("train", train_sources)):
    questions = []
    for source in sources:
      path = source_file(data_dir, source, split)
      questions.extend(
          question_from_record(record, source, f"{path}: record {index}")
          for index, record in enumerate(read_records(path)))
    splits[split] = questions
  return splits

"""JSON-lines files: one JSON object a line, read with the line of any fault, written atomically.

Shared by the environments' data (SearchQA questions and corpora) and the trainer's files
(demonstrations, metrics, trajectory logs). Reading takes a path object's own `open` when it has
one, so an `etils.epath.Path` of a bucket (agentgym_jax/paths.py) reads as a local file does.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
from absl import logging


def parse_line(line: bytes | str, where: str) -> dict[str, Any]:
  """One line's JSON object; a ValueError names `where` (e.g. "path:line") otherwise."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as error:
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    raise ValueError(f"{where} is not valid JSON ({error}): {text[:200]!r}") from None
  if not isinstance(record, dict):
    raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object")
  return record


def iterate(path: str | os.PathLike[str], *,
            allow_truncated_tail: bool = False) -> Iterator[dict[str, Any]]:
  """The JSON objects of a JSONL file, streamed in order; blank lines are skipped.

  A line that is not a JSON object raises ValueError naming `path:line`. With
  `allow_truncated_tail`, an unparsable last line without a newline after it (an append cut
  short by a killed process) is skipped instead.
  """
  with (path.open("rb") if hasattr(path, "open") else open(path, "rb")) as lines:
    for number, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      try:
        yield parse_line(line, f"{os.fspath(path)}:{number}")
      except ValueError:
        if allow_truncated_tail and not line.endswith(b"\n"):
          logging.warning("Skipping the truncated last line of %s: %r", os.fspath(path), line[:80])
          return
        raise


def read(path: str | os.PathLike[str], *,
         allow_truncated_tail: bool = False) -> list[dict[str, Any]]:
  """`iterate` as a list."""
  return list(iterate(path, allow_truncated_tail=allow_truncated_tail))


def to_line(record: Mapping[str, Any]) -> str:
  """`record` as one line of a JSONL file, its newline included."""
  return json.dumps(record, ensure_ascii=False) + "\n"


def write(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> int:
  """Writes one JSON object per line through a temporary file and a rename; returns the count."""
  path = os.fspath(path)
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  temporary = path + ".tmp"
  count = 0
  with open(temporary, "w", encoding="utf-8") as f:
    for record in records:
      f.write(to_line(record))
      count += 1
  os.replace(temporary, path)
  return count


def json_safe(value: Any) -> Any:
  """`value` as strict JSON values: mappings with string keys, lists, arrays (anything with
  `__array__`) as lists, NaN and infinities as None, and objects JSON has no type for as their
  repr."""
  if isinstance(value, Mapping):
    return {str(k): json_safe(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [json_safe(v) for v in value]
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, str | int | bool) or value is None:
    return value
  if hasattr(value, "__array__"):
    return json_safe(np.asarray(value).tolist())
  return repr(value)


def finite(value: Any) -> float | None:
  """`value` as a float if it is a finite real number (bools excluded), else None."""
  if isinstance(value, bool) or not isinstance(value, int | float):
    return None
  return float(value) if math.isfinite(value) else None

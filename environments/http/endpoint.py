"""What the HTTP client adapters share: the server's address, the request timeout, the retry
schedule, the check of a field of an answer, and task ids given to a client.

  endpoint = Endpoint("http://127.0.0.1:36001", timeout_s=120.0, retries=5, backoff_s=0.1,
                      max_backoff_s=5.0)
  for attempt in endpoint.attempts():   # 0, then (after sleeping 0.1, 0.2, 0.4, ...) 1, 2, ...
    ...                                 # `continue` retries; `return` or `break` stops

Attempt k > 0 starts after sleeping min(backoff_s * 2^(k-1), max_backoff_s). Which failures
deserve another attempt is each client's decision (it knows which requests are safe to repeat);
the endpoint only paces them.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.parse
from typing import Any, Iterator, Mapping, Sequence

from environments.base import SPLITS, EnvError

# Answers meaning that the request did not reach the env (a proxy, or an overloaded server), so
# that even a request that is not safe to repeat (a step) may be sent again.
NOT_DELIVERED = frozenset({502, 503, 504})


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """A server's base URL (a path prefix is kept), a socket timeout and a retry schedule."""

  base_url: str
  timeout_s: float
  retries: int
  backoff_s: float
  max_backoff_s: float

  def __post_init__(self):
    url = urllib.parse.urlsplit(self.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
      raise ValueError(f"base_url must look like http://host:port, got {self.base_url!r}")
    if self.timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
    if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
      raise ValueError(f"need retries >= 0, backoff_s >= 0 and max_backoff_s >= 0; got "
                       f"{self.retries}, {self.backoff_s}, {self.max_backoff_s}")
    object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

  @property
  def url(self) -> urllib.parse.SplitResult:
    return urllib.parse.urlsplit(self.base_url)

  def delays(self, retries: int | None = None) -> Iterator[float]:
    """The sleep before each attempt: 0 before the first, then each retry's backoff."""
    delay = self.backoff_s
    yield 0.0
    for _ in range(self.retries if retries is None else retries):
      yield delay
      delay = min(2 * delay, self.max_backoff_s)

  def attempts(self, retries: int | None = None) -> Iterator[int]:
    """Attempt numbers 0, 1, ..., retries (default `self.retries`), sleeping before retries."""
    for attempt, delay in enumerate(self.delays(retries)):
      if delay:
        time.sleep(delay)
      yield attempt


def answer_field(payload: Any, name: str, kind: type | tuple[type, ...], what: str) -> Any:
  """payload[name], checked to be a `kind`; a malformed answer to `what` raises EnvError."""
  if not isinstance(payload, dict):
    raise EnvError(f"{what} answered {payload!r}, not a JSON object")
  if name not in payload:
    raise EnvError(f"{what} answered without {name!r}: {payload!r}")
  value = payload[name]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise EnvError(f"{what} answered {name}={value!r}, expected {kind}")
  return value


def split_task_ids(task_ids: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
  """A client's `task_ids` option (the ids of each split) as tuples; ValueError if it misses a
  split."""
  missing = set(SPLITS) - set(task_ids)
  if missing:
    raise ValueError(f"task_ids must give every split {SPLITS}; missing {missing}")
  return {split: tuple(ids) for split, ids in task_ids.items()}

"""Name lookup shared by the RL registries (advantage estimators, losses).

Configs name an estimator or a loss by string; a typo must fail at start-up with the list of
valid names rather than deep inside a jitted step.
"""

from collections.abc import Mapping
from typing import TypeVar

Entry = TypeVar("Entry")


def lookup(table: Mapping[str, Entry], name: str, kind: str) -> Entry:
  """Returns `table[name]`, or raises ValueError naming `kind` and every known name."""
  try:
    return table[name]
  except (KeyError, TypeError):
    known = ", ".join(repr(key) for key in sorted(table))
    raise ValueError(f"Unknown {kind} {name!r}; expected one of: {known}.") from None

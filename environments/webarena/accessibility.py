"""The text observation: Chromium's accessibility tree rendered as WebArena renders it.

Input is what Chromium's DevTools protocol returns: the nodes of Accessibility.getFullAXTree
and, for the geometry, one DOMSnapshot.captureSnapshot (one call for the whole page instead of
WebArena's one getBoundingClientRect round trip per node; `layout_bounds` turns it into
viewport rectangles). Output is WebArena's "accessibility_tree" observation, one element a line,
indented by depth with tabs:

  [1] RootWebArea 'One Stop Shop' focused: True
  	[12] link 'Blue Kettle'
  	[15] StaticText '$24.99'
  	[20] textbox 'Search products' required: False

Each line is `[id] role 'name'` (the name as a Python repr, its whitespace normalised: stripped,
runs collapsed to one space, so that browser builds that differ only in the spaces they keep
around a label give the same observation) and the node's properties other than
IGNORED_PROPERTIES as `name: value`. The id is Chromium's accessibility node id, which the
action grammar refers to. A node is left out, its children moving up a level, when

  * it has no DOM node (inline text boxes) or is ignored by Chromium's accessibility tree;
  * its name is blank and it has no shown property while its role is one of UNNAMED_HIDDEN_ROLES,
    or its name is blank and it is a list item;
  * in viewport-only mode (WebArena's current_viewport_only, AgentGym's setting), less than
    VIEWPORT_FRACTION of its box is inside the viewport. The root is always kept.

Then, as WebArena's clean-up does, a StaticText line is dropped when its text already appears
in one of the three lines kept before it (a link's label repeated by its text child).

One deliberate difference: WebArena's in-viewport "ratio" is overlap * height / width, a typo
for overlap / (width * height) that keeps almost any element touching the viewport. We use the
true fraction of the element's area, so half-visible elements at the edges are left out.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

# WebArena's list, plus "url": newer Chromium reports every link's address, which WebArena's
# Chromium did not, and which would double the length of link-heavy pages.
IGNORED_PROPERTIES = frozenset(
    {"focusable", "editable", "readonly", "level", "settable", "multiline", "invalid", "url"})
UNNAMED_HIDDEN_ROLES = frozenset({
    "generic", "img", "list", "strong", "paragraph", "banner", "navigation", "Section", "LabelText",
    "Legend", "listitem"
})
VIEWPORT_FRACTION = 0.6
# A StaticText line is dropped if its text is in one of this many lines kept before it.
_STATIC_TEXT_LOOKBACK = 3
_STATIC_TEXT = re.compile(r"\[\d+\] StaticText (.+)", re.DOTALL)

Box = tuple[float, float, float, float]  # x, y, width, height in viewport CSS pixels


@dataclasses.dataclass(frozen=True)
class Element:
  """An element shown in an observation, for the actions that name its id.

  Attributes:
    backend_node_id: Chromium's DOM node id (DOM.* commands take it).
    description: its line without the id and indent, e.g. "link 'Forums'".
  """

  backend_node_id: int
  description: str


def layout_bounds(snapshot: Mapping[str, Any]) -> dict[int, Box]:
  """Viewport rectangles of the main document's laid-out nodes, by DOM backend node id.

  `snapshot` is a DOMSnapshot.captureSnapshot result (with includeDOMRects). Its layout
  bounds are in document coordinates; subtracting the scroll offsets gives what
  getBoundingClientRect would say.
  """
  document = snapshot["documents"][0]
  backend_ids = document["nodes"]["backendNodeId"]
  layout = document["layout"]
  scroll_x = document.get("scrollOffsetX", 0.0)
  scroll_y = document.get("scrollOffsetY", 0.0)
  return {
      backend_ids[index]: (x - scroll_x, y - scroll_y, width, height)
      for index, (x, y, width, height) in zip(layout["nodeIndex"], layout["bounds"])
  }


def visible_fraction(box: Box, viewport: tuple[int, int]) -> float:
  """The fraction of the box's area inside the viewport (0 for an empty box)."""
  x, y, width, height = box
  if width <= 0 or height <= 0:
    return 0.0
  overlap_x = max(0.0, min(x + width, viewport[0]) - max(x, 0.0))
  overlap_y = max(0.0, min(y + height, viewport[1]) - max(y, 0.0))
  return overlap_x * overlap_y / (width * height)


def render(nodes: Sequence[Mapping[str, Any]], bounds: Mapping[int, Box] | None = None,
           viewport: tuple[int, int] | None = None) -> tuple[str, dict[str, Element]]:
  """Renders getFullAXTree nodes as WebArena's observation text (module docstring).

  Args:
    nodes: the "nodes" of Accessibility.getFullAXTree; the first is the root.
    bounds: viewport rectangles by backend node id (`layout_bounds`); with `viewport`, the
      tree keeps only the nodes mostly inside the viewport.
    viewport: (width, height) of the viewport, or None to keep the whole page.

  Returns:
    The text, and the elements it shows by id.
  """
  by_id: dict[str, Mapping[str, Any]] = {}
  for node in nodes:  # Chromium repeats a few nodes.
    by_id.setdefault(node["nodeId"], node)
  if not by_id:
    return "", {}
  root_id = nodes[0]["nodeId"]
  lines: list[tuple[str, str]] = []  # (node id, line)
  elements: dict[str, Element] = {}
  # Depth-first in document order, without recursion: pages can be deeper than Python's stack.
  stack: list[tuple[str, int]] = [(root_id, 0)]
  while stack:
    node_id, depth = stack.pop()
    node = by_id[node_id]
    description = _describe(node)
    shown = description is not None and (viewport is None or node_id == root_id
                                         or _in_viewport(node, bounds or {}, viewport))
    if shown:
      lines.append((node_id, "\t" * depth + f"[{node_id}] {description}"))
      elements[node_id] = Element(int(node["backendDOMNodeId"]), description)
    child_depth = depth + 1 if shown else depth
    stack.extend(
        (child, child_depth) for child in reversed(node.get("childIds", ())) if child in by_id)
  kept = _drop_repeated_static_text(lines)
  return "\n".join(line for _, line in kept), {node_id: elements[node_id] for node_id, _ in kept}


def _describe(node: Mapping[str, Any]) -> str | None:
  """`role 'name' properties` of a node, or None if the observation leaves it out."""
  if node.get("ignored") or "backendDOMNodeId" not in node:
    return None
  try:
    role = node["role"]["value"]
    name = " ".join(str(node["name"]["value"]).split())
  except (KeyError, TypeError):
    return None
  properties = []
  for prop in node.get("properties", ()):
    value = prop.get("value", {})
    if prop.get("name") in IGNORED_PROPERTIES or "value" not in value:
      continue
    properties.append(f"{prop['name']}: {value['value']}")
  if not name:
    if (not properties and role in UNNAMED_HIDDEN_ROLES) or role == "listitem":
      return None
  description = f"{role} {name!r}"
  return description + " " + " ".join(properties) if properties else description


def _in_viewport(node: Mapping[str, Any], bounds: Mapping[int, Box], viewport: tuple[int,
                                                                                     int]) -> bool:
  box = bounds.get(node["backendDOMNodeId"])
  return box is not None and visible_fraction(box, viewport) >= VIEWPORT_FRACTION


def _drop_repeated_static_text(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
  kept: list[tuple[str, str]] = []
  for node_id, line in lines:
    match = _STATIC_TEXT.search(line)
    if match is not None:
      text = match.group(1)[1:-1]  # Strip the repr's quotes.
      if not text or any(text in previous for _, previous in kept[-_STATIC_TEXT_LOOKBACK:]):
        continue
    kept.append((node_id, line))
  return kept

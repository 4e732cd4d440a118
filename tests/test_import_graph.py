"""agentgym_jax's modules import each other without a cycle, counting imports made inside
functions: the package reads as layers, each importing only those below it."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "agentgym_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The package's modules that `path` imports anywhere in its body: `from a.b import c` is
  a.b.c when that is a module, else a.b."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found |= {
          f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
          for alias in node.names
      }
  return {name for name in found if name in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Tarjan's strongly connected components with more than one module, or a module that
  imports itself."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in graph[node]:
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1 or node in graph[node]:
        components.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return components


def test_the_package_has_no_import_cycle():
  modules = _modules()
  graph = {name: _imports(path, modules) for name, path in modules.items()}
  assert "agentgym_jax.memory" in graph["agentgym_jax.state"]  # The graph sees real imports.
  assert _cycles(graph) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"a"}}, [["a"]]),
])
def test_the_cycle_finder_on_small_graphs(graph, expected):
  assert _cycles(graph) == expected

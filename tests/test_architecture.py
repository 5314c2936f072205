"""Rules of design for src/ (issue 30), scripts/ and tests/ (issue 43), each a checker over a source
root so a test can run it on a fake package too:

- no import cycles, counting function-local and `if TYPE_CHECKING:` imports (a cycle the reader
  must follow is a cycle, whether or not it runs);
- no circle between folders: of two folders neither of which holds the other (node/ and master/), at
  most one imports the other, directly or through other folders (a folder may use its parent's
  shared modules, and its parent's entry points may compose it);
- no module reads or writes another module's private names: `from x import _y` of a project module,
  and `obj._z` where obj is not `self`/`cls`, unless a class of the same module defines `_z` (one
  module's own business); a library's private names count too, unless LIBRARY_PRIVATE_USES names the
  expression with its reason;
- no `getattr`/`setattr`/`delattr`/`hasattr` with a computed attribute name (the name a reader greps
  for must be written out), except inside a `__getattr__` that forwards to what it wraps;
- scripts never import a test helper nor put tests/ on `sys.path`;
- no `# fmt: skip` / `# fmt: off`: `ruff format` lays every line out;
- functions of at most MAX_FUNCTION_LINES lines;
- a module over WARN_MODULE_LINES lines is named as a warning, not a failure (one long idea is fine).

    python tests/test_architecture.py     # prints module sizes, then every rule's findings
"""

from __future__ import annotations

import ast
import io
import tokenize
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC, SCRIPTS, TESTS = ROOT / "src", ROOT / "scripts", ROOT / "tests"
TREES = {"src": SRC, "scripts": SCRIPTS, "tests": TESTS}  # every rule runs on each of them
MAX_FUNCTION_LINES = 80
WARN_MODULE_LINES = 600
DYNAMIC_ATTRIBUTE_CALLS = ("getattr", "setattr", "delattr", "hasattr")


# --------------------------------------------------------------------------- the source tree


def modules(root: Path) -> dict[str, Path]:
    """Every module below `root` (a directory holding packages) by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _in_order(found: list[str]) -> list[str]:
    """Findings ("path:line: ...") by file, then line."""
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def _where(root: Path, path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(root)}:{node.lineno}"


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imported_modules(
    node: ast.Import | ast.ImportFrom, name: str, path: Path, known: set[str]
) -> Iterator[str]:
    """The project modules one import statement of module `name` names (`from pkg import mod` imports
    pkg.mod; `from pkg.mod import name` imports pkg.mod)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = _package(name, path).split(".")
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for t in targets:
        while t and t not in known:  # `from diloco.x import name`: the module is diloco.x
            t = t.rpartition(".")[0]
        if t:
            yield t


# --------------------------------------------------------------------------- rule: no import cycles


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file: top level, inside functions, and
    under `if TYPE_CHECKING:`."""
    mods = modules(root)
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        top = _package(name, path).split(".")[0]
        found = set()
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found |= {t for t in _imported_modules(node, name, path, known) if t not in (name, top)}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def folder_graph(root: Path) -> dict[str, set[str]]:
    """Folder (package) -> the folders its modules import, leaving out a folder's ancestors and
    descendants (a parent's shared modules and entry points are not a circle between siblings)."""
    mods = modules(root)

    def folder(name: str) -> str:
        return name if mods[name].name == "__init__.py" else name.rpartition(".")[0]

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    graph: dict[str, set[str]] = {folder(m): set() for m in mods}
    for name, targets in import_graph(root).items():
        here = folder(name)
        graph[here] |= {folder(t) for t in targets if not related(here, folder(t))}
    return graph


# --------------------------------------------------------------------------- rule: no private access


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.Module) -> set[str]:
    """The private attribute names the module's own classes define: methods, class-level names and
    fields, `__slots__` entries, and `self._x = ...` assignments in their methods."""
    own = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in ast.walk(cls):
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(item.name)
            elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                own.add(item.id)
            elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                own.add(item.attr)
            elif isinstance(item, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets
            ):
                own |= {
                    c.value
                    for c in ast.walk(item.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    return {n for n in own if _is_private(n)}


# A library's private names that the project uses on purpose: the expression as written, and why.
LIBRARY_PRIVATE_USES = {
    "torch._foreach_add_": "torch's multi-tensor kernel (torch.optim's fast path): the benchmarks time it",
    "torch._foreach_copy_": "torch's multi-tensor kernel: the boundary benchmark times it",
    "os._exit": "documented: ends the process without cleanup (scripts/launch_ranks.py says why)",
    "api._terminate_process_handler": "torchrun has no hook to quiet a routine stop (launch_ranks.py)",
    "cls.started[-1]._pcontext": "torchrun's agent keeps its ranks' exit codes only here (launch_ranks.py)",
    "t._base": "the only way to tell a view from its own storage (a test of the streaming buffers)",
    "dist.distributed_c10d._get_default_store": "the process group's store (a test's rendezvous)",
}


def private_access(root: Path) -> list[str]:
    """`from x import _y` of a project module, and `obj._z` (obj not self/cls) where no class of the
    same module defines `_z`: another module's (or a library's) private name."""
    mods = modules(root)
    known = set(mods)
    found = []
    for name, path in mods.items():
        tree = _parse(path)
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(
                True for _ in _imported_modules(node, name, path, known)
            ):
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(f"{_where(root, path, node)}: imports private {alias.name}")
            elif (
                isinstance(node, ast.Attribute)
                and _is_private(node.attr)
                and node.attr not in own
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and ast.unparse(node) not in LIBRARY_PRIVATE_USES
            ):
                found.append(f"{_where(root, path, node)}: reads another's private {ast.unparse(node)}")
    return _in_order(found)


# --------------------------------------------------------------------------- rule: attribute names written out


def _delegations(tree: ast.Module) -> set[ast.AST]:
    """The calls inside `__getattr__` methods: a proxy forwarding the name its caller wrote out."""
    methods = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
    return {c for m in methods for c in ast.walk(m) if isinstance(c, ast.Call)}


def dynamic_attributes(root: Path) -> list[str]:
    """getattr/setattr/delattr/hasattr whose attribute name is not a string literal, outside a
    `__getattr__` that forwards to the object it wraps."""
    found = []
    for path in modules(root).values():
        tree = _parse(path)
        forwarding = _delegations(tree)
        for node in ast.walk(tree):
            if (
                node not in forwarding
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in DYNAMIC_ATTRIBUTE_CALLS
                and len(node.args) >= 2
                and not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))
            ):
                found.append(f"{_where(root, path, node)}: computed attribute name in {ast.unparse(node)}")
    return _in_order(found)


# --------------------------------------------------------------------------- rule: the formatter decides


def format_skips(root: Path) -> list[str]:
    """Comments that take lines away from the formatter (`# fmt: skip`, `# fmt: off`)."""
    found = []
    for path in modules(root).values():
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.COMMENT and ("fmt: skip" in tok.string or "fmt: off" in tok.string):
                found.append(f"{path.relative_to(root)}:{tok.start[0]}: {tok.string}")
    return _in_order(found)


# --------------------------------------------------------------------------- rule: short functions, sizes


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions and methods longer than `limit` lines, decorators and docstring included."""
    found = []
    for path in modules(root).values():
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - start + 1
                if length > limit:
                    found.append(
                        f"{_where(root, path, node)}: {node.name} is {length} lines (at most {limit})"
                    )
    return _in_order(found)


def long_modules(root: Path, limit: int = WARN_MODULE_LINES) -> list[str]:
    return [
        f"{path.relative_to(root)}: {n} lines (over {limit}: still one idea?)"
        for path in modules(root).values()
        if (n := len(path.read_text().splitlines())) > limit
    ]


# --------------------------------------------------------------------------- the rules on every tree

trees = pytest.mark.parametrize("tree", sorted(TREES))


@trees
def test_no_import_cycles(tree):
    assert cycles(import_graph(TREES[tree])) == []


@trees
def test_no_folder_imports_a_folder_that_imports_it(tree):
    assert cycles(folder_graph(TREES[tree])) == []


@trees
def test_no_module_touches_another_modules_private_names(tree):
    assert private_access(TREES[tree]) == []


@trees
def test_no_attribute_name_is_computed(tree):
    assert dynamic_attributes(TREES[tree]) == []


@trees
def test_no_fmt_skip(tree):
    assert format_skips(TREES[tree]) == []


@trees
def test_functions_are_short(tree):
    assert long_functions(TREES[tree]) == []


def test_scripts_never_import_tests():
    """What a script needs from a test helper belongs in the library (diloco.testing holds the loopback Hub)."""
    helpers = set(modules(TESTS))
    found = [
        f"{path.relative_to(SCRIPTS)}: {'imports ' + ', '.join(sorted(names)) if names else 'puts tests/ on sys.path'}"
        for path in modules(SCRIPTS).values()
        if (names := _top_level_imports(path) & helpers) or _adds_tests_to_path(path)
    ]
    assert found == []


def _top_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def _adds_tests_to_path(path: Path) -> bool:
    """A `sys.path` change whose argument names the tests folder."""
    calls = (
        n for n in ast.walk(_parse(path)) if isinstance(n, ast.Call) and "sys.path" in ast.unparse(n.func)
    )
    return any(isinstance(c, ast.Constant) and c.value == "tests" for n in calls for c in ast.walk(n))


def test_long_modules_in_src_are_named():
    """A warning, not a failure: a long module that is one idea is fine (STYLE.md, "No file-size cap")."""
    for line in long_modules(SRC):
        warnings.warn(line, stacklevel=1)


# --------------------------------------------------------------------------- a test of the test


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """`tmp_path/pkg/<name>.py` for each entry; returns the source root (tmp_path)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / f"{name}.py").write_text(text)
    return tmp_path


def test_the_cycle_finder_counts_function_local_and_type_checking_imports(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "a": "from pkg.b import f\n",
            "b": "def f():\n    from . import a\n",
            "c": "import pkg.a\n",
            "d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n",
            "e": "from pkg import d\nclass E: ...\n",
        },
    )
    g = import_graph(root)
    assert {m: g[m] for m in ("pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e")} == {
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg.e"},
        "pkg.e": {"pkg.d"},
    }
    assert cycles(g) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.e"]]


def test_the_folder_cycle_finder_sees_siblings_through_a_third_and_not_a_parent(tmp_path):
    root = _fake_package(tmp_path, {"app": "from pkg.node import run\n", "util": ""})
    for folder, text in {
        "node": "from pkg import util\nfrom pkg.master import m\n",
        "master": "from pkg.wire import w\n",
    }.items():
        (root / "pkg" / folder).mkdir()
        (root / "pkg" / folder / "__init__.py").write_text(text)
    (root / "pkg" / "wire").mkdir()
    (root / "pkg" / "wire" / "__init__.py").write_text("")
    assert cycles(folder_graph(root)) == []  # pkg.app -> node and node -> pkg.util: a parent's, not a circle
    (root / "pkg" / "wire" / "__init__.py").write_text("def w():\n    from pkg.node import run\n")
    assert cycles(folder_graph(root)) == [["pkg.master", "pkg.node", "pkg.wire"]]


def test_the_private_checker_finds_imports_and_reads_of_anothers_privates(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "owner": (
                "_COUNTERS = ('a',)\n"
                "class Node:\n"
                "    __slots__ = ('_slot',)\n"
                "    def _capture(self):\n"
                "        self._baseline = 1\n"
                "def helper(other: Node):\n"
                "    return other._baseline + other._slot\n"  # the module's own class: allowed
            ),
            "intruder": (
                "from pkg.owner import _COUNTERS, Node\n"
                "import torch\n"
                "def f(node: Node, p: torch.Tensor):\n"
                "    node._capture()\n"
                "    return p._base\n"
            ),
            "clean": "from pkg.owner import Node\ndef f(n: Node):\n    return n.__class__, type(n).__name__\n",
        },
    )
    assert private_access(root) == [
        "pkg/intruder.py:1: imports private _COUNTERS",
        "pkg/intruder.py:4: reads another's private node._capture",
        "pkg/intruder.py:5: reads another's private p._base",
    ]


def test_the_dynamic_attribute_checker_allows_only_literal_names(tmp_path):
    root = _fake_package(
        tmp_path,
        {
            "m": (
                "def f(obj, key):\n"
                "    getattr(obj, 'x', None)\n"
                "    setattr(obj, 'y', 1)\n"
                "    getattr(obj, key)\n"
                "    setattr(obj, f'n_{key}', 0)\n"
                "    hasattr(obj, key)\n"
            )
        },
    )
    assert [line.split(": computed")[0] for line in dynamic_attributes(root)] == [
        "pkg/m.py:4",
        "pkg/m.py:5",
        "pkg/m.py:6",
    ]


def test_the_format_checker_finds_fmt_skip_but_not_a_string_that_mentions_it(tmp_path):
    root = _fake_package(tmp_path, {"m": "X = [1,  2]  # fmt: skip\nY = '# fmt: skip'\n# fmt: off\nZ = 1\n"})
    assert format_skips(root) == ["pkg/m.py:1: # fmt: skip", "pkg/m.py:3: # fmt: off"]


def test_the_function_length_checker_counts_decorators_and_nested_functions(tmp_path):
    def body(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    source = (
        f"def ok():\n{body(79, '    ')}"  # 80 lines: allowed
        f"@staticmethod\ndef long():\n{body(79, '    ')}"  # 81 with its decorator
        f"def outer():\n    def inner():\n{body(80, '        ')}"  # inner 81, outer 82
    )
    found = long_functions(_fake_package(tmp_path, {"m": source}))
    assert found == [
        "pkg/m.py:82: long is 81 lines (at most 80)",
        "pkg/m.py:162: outer is 82 lines (at most 80)",
        "pkg/m.py:163: inner is 81 lines (at most 80)",
    ]


def test_the_module_size_check_names_a_long_module(tmp_path):
    root = _fake_package(tmp_path, {"short": "x = 1\n" * 600, "long": "x = 1\n" * 601})
    assert long_modules(root) == ["pkg/long.py: 601 lines (over 600: still one idea?)"]
    with pytest.warns(UserWarning, match="pkg/long.py: 601 lines"):
        for line in long_modules(root):
            warnings.warn(line, stacklevel=1)


if __name__ == "__main__":
    for name, path in modules(SRC).items():
        print(f"{len(path.read_text().splitlines()):5d}  {name}")
    print("import cycles:", cycles(import_graph(SRC)) or "none")
    for rule in (private_access, dynamic_attributes, format_skips, long_functions, long_modules):
        print(f"\n{rule.__name__}:")
        print("\n".join(f"  {line}" for line in rule(SRC)) or "  none")

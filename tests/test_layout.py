"""The package's layout shows its architecture: dependencies point one way, and nothing cycles.

The import graph is read from the source (every `import` and `from ... import`, at module level
and inside functions, except under `if TYPE_CHECKING:`), so a lazy import that hides a cycle
counts as one. The layers, lowest first (a module may import its own layer and those below):

    errors, version  <  config, tokenizer  <  model, adopt  <  device  <  engine
      <  memory, generate, prompt, formats  <  explain  <  training  <  cli, web

(memory.py sits above the engine because it counts what the engine allocates.)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "glassgpt"
LAYERS = [("errors", "version"), ("config", "tokenizer"), ("model", "adopt"), ("device",), ("engine",),
          ("memory", "generate", "prompt", "formats"), ("explain",), ("training",), ("cli", "web", "__main__")]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The glassgpt modules that module `name` imports (resolved to modules that exist)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from .x import name`: the module is .x
                target = target.rpartition(".")[0]
            # A package above `name` is imported before `name` whatever `name` says: not an edge.
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYER[parts[1]] if len(parts) > 1 else len(LAYERS)  # the package root: the public API, on top


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_a_cycle_is_found_when_there_is_one():
    # The check above can fail: a two-module and a three-module loop are both reported.
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_layer_imports_only_its_own_layer_and_those_below():
    wrong = []
    for module, targets in import_graph().items():
        if module == "glassgpt":
            continue  # the public API gathers every layer
        for target in targets:
            if target == "glassgpt" or layer_of(target) > layer_of(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_every_module_belongs_to_a_layer():
    assert {name.split(".")[1] for name in modules() if name != "glassgpt"} <= set(LAYER)


def test_the_model_imports_nothing_above_its_config():
    assert import_graph()["glassgpt.model"] <= {"glassgpt.config", "glassgpt.errors"}


def test_every_module_imports_on_its_own():
    # Each module in a fresh set of glassgpt modules (torch stays loaded: it is not ours), so an
    # import that works only after another module happened to be imported first fails here.
    names = [name for name in modules() if not name.endswith("__main__")]
    script = (
        "import importlib, sys, traceback\n"
        f"failed = []\nfor name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'glassgpt' or m.startswith('glassgpt.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception:\n        failed.append(name + ': ' + traceback.format_exc().splitlines()[-1])\n"
        "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("legacy", ["glassgpt.explain_diagram"])
def test_documented_import_paths_keep_working(legacy):
    proc = subprocess.run([sys.executable, "-c", f"import {legacy} as m; print(m.to_svg.__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "to_svg", proc.stderr[-2000:]


# --- the README's Layout section and the size of what a reader reads -------------------------------

README = PACKAGE.parents[1] / "README.md"


def readme_tree() -> list[str]:
    """The paths the README's Layout tree names, in its order: `engine/`, `engine/fused.py`, ..."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("\n## Layout\n"):]
    block = section[section.index("src/glassgpt/\n") + len("src/glassgpt/\n"):section.index("\ntests/")]
    names, folder = [], ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        words = re.split(r"\s{2,}", line.strip())[0].split()  # the names, then two spaces, then what they are
        if indent == 2:
            folder = words[0] if words and words[0].endswith("/") else ""
            names += words
        else:
            names += [folder + w for w in words]
    return names


def test_the_readme_layout_names_every_module_and_nothing_else():
    named = readme_tree()
    modules_on_disk = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if p.name != "__main__.py" and not (p.name == "__init__.py" and p.parent == PACKAGE)}
    folders = {str(p.relative_to(PACKAGE)) + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    listed = {n for n in named if not n.endswith("/")}
    package_inits = {f"{f}__init__.py" for f in folders}
    assert set(n for n in named if n.endswith("/")) == folders
    assert listed - modules_on_disk == set(), "the README names modules that do not exist"
    assert modules_on_disk - listed - package_inits == set(), "modules the README's Layout does not name"


def test_the_readme_layout_lists_the_layers_lowest_first():
    top = [n.removesuffix(".py").removesuffix("/") for n in readme_tree() if "/" not in n.rstrip("/")]
    layers = [LAYER[name] for name in top]
    assert layers == sorted(layers), list(zip(top, layers))


def test_no_function_a_reader_reads_is_much_over_a_screen():
    """The issue's rule: no function in training/ or explain/ much over 60 lines."""
    long = []
    for folder in ("training", "explain"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 65:
                    long.append(f"{folder}/{path.name}:{node.lineno} {node.name}")
    assert long == []


def test_the_readme_tree_parser_sees_a_missing_module(tmp_path, monkeypatch):
    fake = tmp_path / "README.md"
    fake.write_text(README.read_text(encoding="utf-8").replace("    fused.py ", "    fused_gone.py "), encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "README", fake)
    with pytest.raises(AssertionError, match="do not exist"):
        test_the_readme_layout_names_every_module_and_nothing_else()

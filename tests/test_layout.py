"""The package's layout, stated once: this file is the spec, and the package docstring and the README point here.

The import graph is read from the source (every `import` and `from ... import`, at module level
and inside functions, except under `if TYPE_CHECKING:`), so a lazy import that hides a cycle
counts as one. The layers, lowest first (a module may import its own layer and those below):

    errors, version  <  config, tokenizer  <  model, anatomy, kinds, adopt, families, variants  <  device  <  engine
      <  memory, generate, recall, prompt, formats  <  explain  <  training  <  cli, web

(memory.py sits above the engine because it counts what the engine allocates; recall.py, what a
model memorised, is text against text, beside generate.py, whose command reports it.)

Inside two folders the parts are layered too (`FOLDERS`), lowest first; a package's own
__init__.py is its public API and may gather every part:

    explain/    record (record, options, result, notation)  <  analyses (trace, head, check, passage,
                compare, diff, why, verify, formulas, pieces/, debugger, causes, loading, gallery)  <  views/ (text, pictures, notebook HTML; where
                each result type's views are registered)
    training/   loop/ (the loop and its machinery)  <  tasks/ (what glassgpt trains on)
                <  book/ (the book's chapters, as its code runs them)  <  recipes, finetuning, evaluation
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "glassgpt"
LAYERS = [("errors", "version"), ("config", "tokenizer"), ("model", "anatomy", "kinds", "adopt", "families", "variants"), ("device",), ("engine",),
          ("memory", "generate", "recall", "prompt", "formats"), ("explain",), ("training",), ("cli", "web", "__main__")]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
FOLDERS = {
    "glassgpt.explain": [("record", "options", "result", "notation"),
                         ("trace", "head", "check", "passage", "compare", "diff", "why", "why_result",
                          "verify", "formulas", "family", "pieces", "debugger", "causes", "loading", "gallery"),
                         ("views",)],
    "glassgpt.training": [("loop",), ("tasks",), ("book",), ("recipes", "finetuning", "evaluation")],
}


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


def part_of(module: str) -> tuple[str, int] | None:
    """(the folder, the index of its part) of a module inside a layered folder; None outside one or for
    the folder's own __init__ (its public API, above its parts)."""
    for folder, parts in FOLDERS.items():
        if module.startswith(folder + "."):
            first = module[len(folder) + 1:].split(".")[0]
            found = [i for i, names in enumerate(parts) if first in names]
            return folder, found[0] if found else -1  # -1: in no part (test_every_module_...belongs_to_a_part)
    return None


def wrong_part_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        here = part_of(module)
        for target in targets:
            there = part_of(target)
            if target in FOLDERS and here and here[0] == target:
                wrong.append(f"{module} imports its folder's API {target}")
            elif here and there and here[0] == there[0] and there[1] > here[1]:
                wrong.append(f"{module} imports {target}")
    return sorted(wrong)


def test_inside_explain_and_training_each_part_imports_only_its_own_and_those_below():
    # explain: the views sit above the analyses (an analysis never imports a view: each result
    # finds its views in result.py's registry); training: the book's replays may use the loop
    # and the tasks, the tasks the loop, and the loop neither.
    assert wrong_part_imports(import_graph()) == []


def test_the_part_check_sees_an_analysis_that_imports_a_view_and_a_loop_that_imports_a_task():
    graph = {"glassgpt.explain.trace": {"glassgpt.explain.views.text", "glassgpt.explain.record"},
             "glassgpt.training.loop.loop": {"glassgpt.training.tasks.data", "glassgpt.training.loop.run"},
             "glassgpt.training.book.ch05": {"glassgpt.training.loop.loop", "glassgpt.training.tasks.data"},
             "glassgpt.explain.views.text": {"glassgpt.explain.trace"}}
    assert wrong_part_imports(graph) == ["glassgpt.explain.trace imports glassgpt.explain.views.text",
                                         "glassgpt.training.loop.loop imports glassgpt.training.tasks.data"]


def test_every_module_of_a_layered_folder_belongs_to_a_part():
    assert [name for name in modules() if (part_of(name) or ("", 0))[1] < 0] == []


def test_every_module_belongs_to_a_layer():
    assert {name.split(".")[1] for name in modules() if name != "glassgpt"} <= set(LAYER)


def test_the_model_imports_nothing_above_its_config():
    # (and its description's vocabulary, anatomy.py: plain data)
    assert import_graph()["glassgpt.model"] <= {"glassgpt.config", "glassgpt.errors", "glassgpt.anatomy"}


def test_every_module_imports_on_its_own():
    # Each module in a fresh set of glassgpt modules (torch stays loaded: it is not ours), so an
    # import that works only after another module happened to be imported first fails here.
    names = [name for name in modules() if not name.endswith("__main__")]
    # in two processes side by side, half the modules each (one after the other: 22 s of the suite)
    procs = [subprocess.Popen([sys.executable, "-c", import_each(names[i::2])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    done = [(proc, *proc.communicate(timeout=300)) for proc in procs]
    for proc, out, err in done:
        assert proc.returncode == 0, out + err[-2000:]


def import_each(names: list[str]) -> str:
    return (
        "import importlib, sys, traceback\n"
        f"failed = []\nfor name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'glassgpt' or m.startswith('glassgpt.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception:\n        failed.append(name + ': ' + traceback.format_exc().splitlines()[-1])\n"
        "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")


@pytest.mark.parametrize("legacy", ["glassgpt.explain_diagram"])
def test_documented_import_paths_keep_working(legacy):
    proc = subprocess.run([sys.executable, "-c", f"import {legacy} as m; print(m.to_svg.__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "to_svg", proc.stderr[-2000:]


# --- the size of what a reader reads ------------------------------------------------------------


def test_no_function_a_reader_reads_is_much_over_a_screen():
    """The issue's rule: no function in training/ or explain/ much over 60 lines."""
    long = []
    for folder in ("training", "explain"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 65:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert long == []


# --- the tests: each module imports what it shares from conftest.py or helpers.py --------------------

TESTS = Path(__file__).resolve().parent


def imports_of_other_test_modules(path: Path) -> list[str]:
    """Where the test file at `path` imports another test module (`test_*`, or anything under `tests.`),
    in its own imports or in code it hands to another process as a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            targets = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            targets = re.findall(r"\b(?:from|import)\s+([\w.]+)", node.value)
        else:
            continue
        for target in targets:
            top = target.split(".")[0]
            if (top.startswith("test_") and top != path.stem) or top == "tests":
                found.append(f"{path.name}:{node.lineno} imports {target}")
    return found


def test_test_modules_import_shared_helpers_never_each_other():
    # What two test modules share lives in conftest.py (fixtures), helpers.py or readers.py (the
    # readers' own models); a module may run itself in another process (test_memory does).
    wrong = [line for path in sorted(TESTS.glob("*.py")) for line in imports_of_other_test_modules(path)]
    assert wrong == [], "\n".join(wrong)


def test_an_import_of_another_test_module_is_found(tmp_path):
    path = tmp_path / "test_mine.py"
    test = "test"  # (written in two parts, so that this file does not import them itself)
    path.write_text(f"from helpers import run\nimport {test}_mine\n"
                    f"from {test}_engine import copy_of\n"
                    f"code = 'import sys; import {test}_memory'\n", encoding="utf-8")
    assert imports_of_other_test_modules(path) == ["test_mine.py:3 imports test_engine",
                                                   "test_mine.py:4 imports test_memory"]


# --- one house for every model (issue 47): the count of what is still written once per model ---------
# All merged: the lists stay, empty, so that a new twin or import shows as a list to strike, not a surprise.

MODEL_FILES = {"glassgpt.model", "glassgpt.families", "glassgpt.families.qwen3", "glassgpt.families.llama3",
               "glassgpt.families.gemma3", "glassgpt.families.gemma4", "glassgpt.families.layers"}
FAMILY_TWINS: dict[str, str] = {}  # a module for the other models beside the one for GPT-2 (all merged now)
ANALYSES_NAMING_A_MODEL: list[str] = []  # analyses (explain/, its pieces/ apart: they hold a piece against its glass piece)


def family_twins(names) -> set[str]:
    return {n for n in names if n.rpartition(".")[2] == "family" or n.endswith("_family")}


def families_copies(names) -> set[str]:
    return {n for n in names if n.startswith("glassgpt.families.") and f"glassgpt.{n.rpartition('.')[2]}" in names}


def analyses_naming_a_model(graph: dict[str, set[str]]) -> set[str]:
    return {m for m, targets in graph.items() if m.startswith("glassgpt.explain.")
            and not m.startswith("glassgpt.explain.pieces") and targets & MODEL_FILES}


def test_no_new_twin_copy_or_analysis_naming_a_model_appears_beyond_those_counted():
    graph = import_graph()
    assert family_twins(graph) - set(FAMILY_TWINS) == set()
    assert families_copies(graph) == set()  # none left: memory, config and adopt are one module each
    assert analyses_naming_a_model(graph) - set(ANALYSES_NAMING_A_MODEL) == set()


def test_the_counts_see_a_twin_a_copy_and_an_analysis_that_imports_a_model_file():
    graph = {"glassgpt.explain.why_family": set(), "glassgpt.families.memory": set(), "glassgpt.memory": set(),
             "glassgpt.explain.trace": {"glassgpt.families.qwen3"}, "glassgpt.explain.pieces.layers": {"glassgpt.model"}}
    assert family_twins(graph) == {"glassgpt.explain.why_family"}
    assert families_copies(graph) == {"glassgpt.families.memory"}
    assert analyses_naming_a_model(graph) == {"glassgpt.explain.trace"}


def test_no_module_is_written_twice_once_for_gpt2_and_once_for_the_families():
    # trace, why, verify, the step and the views: one module each, for every model (FAMILY_TWINS is empty)
    assert FAMILY_TWINS == {} and family_twins(set(modules())) == set()


def test_families_holds_no_copy_of_a_top_level_module():
    # memory.py, config.py and adopt.py serve every model: families/ holds the glass files alone
    assert families_copies(set(modules())) == set()


def test_no_analysis_imports_a_model_file_by_name():
    # trace, why, check, compare, diff: each reads the model's description (anatomy.py), never a glass file
    assert ANALYSES_NAMING_A_MODEL == [] and analyses_naming_a_model(import_graph()) == set()



# The commands, the engine, generate, adopt and the page read a model's description (kinds.describe: where its
# positions enter, which layouts export writes it in, how generate decodes it; anatomy.own_description: whether it
# is one of glassgpt's glass modules), never its class: a branch on the class is the per-model switch that issue 47
# removes.
MODEL_CLASS_BRANCH = re.compile(r"is_family_model|is_bonus_model|"
                                r"isinstance\([^)]*(Qwen3Model|Qwen3_5Model|Llama3Model|Gemma3Model|"
                                r"Gemma4DenseModel|Olmo3Model|TinyAyaModel)")
DESCRIBED_READERS = ["cli/*.py", "engine/*.py", "generate.py", "adopt.py", "web/*.py"]


def model_class_branches(text: str, name: str) -> list[str]:
    return [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if MODEL_CLASS_BRANCH.search(line)]


def test_no_command_engine_generate_adopt_or_web_module_branches_on_a_model_class():
    found = [line for pattern in DESCRIBED_READERS for path in sorted(PACKAGE.glob(pattern))
             for line in model_class_branches(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))]
    assert found == [], "\n".join(found)


def test_the_branch_scan_reads_generate_adopt_and_the_web_folder():
    scanned = {str(path.relative_to(PACKAGE)) for pattern in DESCRIBED_READERS for path in PACKAGE.glob(pattern)}
    assert {"generate.py", "adopt.py", "web/service.py", "cli/explain.py", "engine/decode.py"} <= scanned


def test_the_branch_check_sees_a_family_test_and_an_isinstance_on_a_model_class():
    text = ("if is_family_model(model) or is_bonus_model(model):\n"
            "if describe(model).positions.kind != 'learned':\n"
            "if isinstance(model, (Qwen3Model, Llama3Model)):\n"
            "if isinstance(model, GPTModel):\n"
            "if own_description(model) is not None:\n"
            "if isinstance(glass, TinyAyaModel) or isinstance(ids, torch.Tensor):\n")
    assert model_class_branches(text, "generate.py") == [
        "generate.py:1: if is_family_model(model) or is_bonus_model(model):",
        "generate.py:3: if isinstance(model, (Qwen3Model, Llama3Model)):",
        "generate.py:6: if isinstance(glass, TinyAyaModel) or isinstance(ids, torch.Tensor):"]

"""The house rules of docs/architecture.md §2, read from the source (AST): a rule that breaks fails here, naming the file.

- Imports point downward only (docs/architecture.md): cli -> pipeline -> stages and apps (data, train, evaluate,
  export; serving, oracle; house) -> runtime -> models -> shared (core/: config, options, recipes, target, metrics,
  errors, logs, ...).
  Stages and apps use each other only as a DAG; the apps (`serving`, `oracle`) never import `train` or `data`;
  `runtime` imports no stage or app; `models` imports no runtime; shared modules import nothing above them.
- Every pipeline stage is a module `speculators.<room>.<stage>` with `enabled`, `is_complete` and `run`.
- No file over 450 lines, no function over 80 lines; no two modules share a file name (bar `__init__`);
  `os.replace` only in the one atomic writer (core/atomic.py).
- Names are unique by meaning: no two rooms define the same top-level function name (bar the stage contract and
  `main`); a name is imported from the room that defines it, never through another room's re-export
  (`speculators.serving` keeps the runtime's names importable for users, not for the package).
- Docstrings name only module files (`foo.py`, `room/foo.py`) and dotted `speculators.x.y` paths that exist.
- No import circle between files (every import counts: top level, inside functions, under TYPE_CHECKING).
- Every `speculators.*` import names a module that exists and, for `from X import name`, a name X defines.
- Nothing outside cli.py parses arguments (argparse, typer, click, sys.argv).
- Imports sit at the top of the file. Inside a function only the optional heavy extras (LAZY_EXTRAS: installed by an
  extra, or needed by one rarely used path), and anything in cli.py, which loads a command's stage only when that
  command runs (so `speculators --help` does not import torch).
- `import speculators` (and the CLI's own module, so `speculators --help` is quick) does not import deepspeed, wandb,
  datasets, vllm, torch or transformers.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "speculators"

SHARED = {"core", ""}
STAGES = {"data", "train", "evaluate", "export", "serving", "oracle", "house"}
RANK = {"cli": 5, "pipeline": 4, "adapt": 4, **{s: 3 for s in STAGES}, "runtime": 2, "models": 1, **{s: 0 for s in SHARED}}
FORBIDDEN_STAGE_EDGES = {(app, stage) for app in ("serving", "oracle") for stage in ("train", "data")}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80
STAGE_CONTRACT = ("enabled", "is_complete", "run")  # what every stage module defines (pipeline.py's docstring)
ENTRY_POINTS = ("main",)  # a process's entry (cli.py, data/vllm_side/capture_main.py)
REPO = Path(__file__).resolve().parents[1]
# folders (beside the package) and files whose modules a docstring may name
DOC_FILE_ROOTS = ("scripts", "tests", "serving", "setup.py")
# files of other projects that docstrings name, never ours
EXTERNAL_FILES = {
    "vllm/config/speculative.py",  # vLLM's SpeculativeConfig (export/launch_plan.py: the fields the launch sets)
}
ATOMIC_WRITER = "speculators.core.atomic"
VLLM_SIDE = "speculators.data.vllm_side."  # modules run by the vLLM environment's python, never importing the package
ARGUMENT_PARSERS = ("argparse", "typer", "click", "optparse")
LAZY_EXTRAS = {"deepspeed", "wandb", "torch.utils.tensorboard", "fastapi", "uvicorn", "starlette", "prometheus_client",
               "openai", "vllm", "datasets", "matplotlib", "peft", "huggingface_hub", "pydoc_data"}


def _module_name(path: Path) -> str:
    parts = ("speculators",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text(), filename=str(_modules()[module]))


def _group(module: str) -> str:
    """The room a module lives in: 'cli', 'pipeline', a stage, 'models', or a shared name ('' = the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of a `speculators` module."""
    out = []
    is_pkg = _modules()[module].name == "__init__.py"
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "speculators"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "speculators":
                out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _edges(module: str) -> set[str]:
    """Modules of the package that `module` imports (a `from pkg import sub` counts as importing pkg.sub)."""
    mods = _modules()
    out = set()
    for base, names, _ in _imports(module):
        targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods] or [base]
        out.update(t for t in targets if t in mods and t != module)
    return out


def _defined_names(module: str) -> set[str] | None:
    """Top-level names a module defines (None when it has a module `__getattr__`: anything may resolve)."""
    names: set[str] = set()
    for node in _tree(module).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
                elif isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    names.update(n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_every_module_is_in_a_known_room() -> None:
    unknown = sorted({_group(m) for m in _modules()} - set(RANK))
    assert not unknown, f"packages with no place in the layering of docs/architecture.md §2: {unknown} (add them to RANK here)"


def test_imports_point_downward_only() -> None:
    broken = []
    for module in _modules():
        me = _group(module)
        for dep in _edges(module):
            them = _group(dep)
            if me == them or not {me, them} <= RANK.keys():  # a room with no rank: test_every_module_is_in_a_known_room
                continue
            if RANK[them] > RANK[me] or (RANK[them] == RANK[me] and me not in STAGES and them not in SHARED):
                broken.append(f"{module} -> {dep} (an arrow back up: {me or 'speculators'} is below {them})")
            elif (me, them) in FORBIDDEN_STAGE_EDGES:
                broken.append(f"{module} -> {dep} (the apps never import train or data)")
    assert not broken, "\n".join(broken)


def test_stages_use_each_other_as_a_dag() -> None:
    graph: dict[str, set[str]] = {s: set() for s in STAGES}
    for module in _modules():
        me = _group(module)
        if me in STAGES:
            graph[me].update(_group(d) for d in _edges(module) if _group(d) in STAGES and _group(d) != me)
    assert not _cycles(graph), f"stages import each other in a circle: {_cycles(graph)}"


def test_no_import_circle_between_files() -> None:
    graph = {m: _edges(m) for m in _modules()}
    assert not _cycles(graph), "import circles:\n" + "\n".join(" -> ".join(c) for c in _cycles(graph))


def _package(module: str) -> str:
    """The folder a module's file sits in, as a dotted name (a package's `__init__` sits in its own)."""
    return module if _modules()[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_import_circle_between_folders() -> None:
    """Folders too import one way: the root holds only what sits above every room (cli, pipeline), never a module
    the rooms share (those live in core/), so no room and the root import each other."""
    graph: dict[str, set[str]] = {}
    for module in _modules():
        graph.setdefault(_package(module), set()).update(
            _package(dep) for dep in _edges(module) if _package(dep) != _package(module))
    assert not _cycles(graph), "folder circles:\n" + "\n".join(" -> ".join(c) for c in _cycles(graph))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_every_internal_import_resolves() -> None:
    """A moved or renamed module / name fails here, not when a rarely run function first imports it."""
    mods = _modules()
    missing = []
    for module in mods:
        for base, names, line in _imports(module):
            where = f"{_modules()[module].relative_to(PACKAGE.parent)}:{line}"
            if base not in mods:
                missing.append(f"{where}: no module {base}")
                continue
            defined = _defined_names(base)
            for name in names:
                if name != "*" and f"{base}.{name}" not in mods and defined is not None and name not in defined:
                    missing.append(f"{where}: {base} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_tests_import_what_exists() -> None:
    """The same check over tests/ (a test importing a moved name fails here with its line, not at collection)."""
    mods = _modules()
    missing = []
    for path in sorted(PACKAGE.parent.joinpath("tests").rglob("*.py")):
        if "vllm" in path.parts and "scripts" in path.parts:  # run in .venv-vllm, where `speculators` is vLLM's library
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "speculators":
                if node.module not in mods:
                    missing.append(f"{path.name}:{node.lineno}: no module {node.module}")
                    continue
                defined = _defined_names(node.module)
                missing += [f"{path.name}:{node.lineno}: {node.module} has no {a.name}" for a in node.names
                            if f"{node.module}.{a.name}" not in mods and defined is not None and a.name not in defined]
    assert not missing, "\n".join(missing)


def test_only_cli_parses_arguments() -> None:
    offenders = []
    for module, path in _modules().items():
        if module == "speculators.cli":
            continue
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names
                              if n.split(".")[0] in ARGUMENT_PARSERS]
            elif isinstance(node, ast.Attribute) and node.attr == "argv" and \
                    isinstance(node.value, ast.Name) and node.value.id == "sys":
                offenders.append(f"{path.name}:{node.lineno} reads sys.argv")
    assert not offenders, "argument parsing outside cli.py:\n" + "\n".join(offenders)


def _imports_inside_functions(module: str) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement inside a function of `module`."""
    out = []
    for fn in ast.walk(_tree(module)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(a.name, node.lineno) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    out.append(("." * node.level + (node.module or ""), node.lineno))
    return out


def test_imports_sit_at_the_top() -> None:
    late = []
    for module, path in _modules().items():
        if module == "speculators.cli":
            continue
        late += [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} inside a function"
                 for name, line in _imports_inside_functions(module)
                 if name not in LAZY_EXTRAS and name.split(".")[0] not in LAZY_EXTRAS]
    assert not late, "move these to the top of the file (or add a real optional extra to LAZY_EXTRAS):\n" + \
        "\n".join(late)


@pytest.mark.parametrize("heavy", ["deepspeed", "wandb", "datasets", "vllm", "torch", "transformers"])
def test_import_speculators_stays_light(heavy: str) -> None:
    code = f"import sys, speculators, speculators.cli, speculators.pipeline; print({heavy!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()
    assert out == "False", f"`import speculators` imported {heavy}"


def test_the_rules_catch_a_broken_house(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above are not vacuous: on a copy of the package with a model importing serving, a circle, a module the
    rooms share left at the root, an argparse import, a function name another room defines, a runtime name taken
    from serving and a docstring naming files that do not exist, each of them fails."""
    copy = tmp_path / "speculators"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "models" / "upward.py").write_text("from speculators.runtime.engine import Engine\n")
    (copy / "core" / "ring_a.py").write_text("from speculators.core import ring_b\n")
    (copy / "core" / "ring_b.py").write_text("from speculators.core import ring_a\nimport argparse\n")
    (copy / "core" / "stale.py").write_text("from speculators.core.atomic import no_such_writer\n")
    (copy / "core" / "late.py").write_text("def f():\n    import json\n    return json\n")
    (copy / "core" / "own_writer.py").write_text("def put(tmp, final):\n    tmp.replace(final)\n")
    (copy / "shared_at_root.py").write_text("LIMIT = 1\n")
    (copy / "core" / "reads_root.py").write_text("from speculators.shared_at_root import LIMIT\n")
    (copy / "core" / "twin.py").write_text("def enabled():\n    return True\n\n\ndef load_speculator():\n    pass\n")
    (copy / "core" / "via_serving.py").write_text("from speculators.serving import Engine\n")
    (copy / "core" / "stale_doc.py").write_text('"""Not here: the model (oracle.py), `speculators.core.gone`."""\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    for fn in (_modules, _tree):
        fn.cache_clear()
    try:
        for check in (test_imports_point_downward_only, test_no_import_circle_between_files,
                      test_every_module_is_in_a_known_room, test_no_import_circle_between_folders,
                      test_only_cli_parses_arguments, test_every_internal_import_resolves, test_imports_sit_at_the_top,
                      test_one_atomic_writer, test_no_two_rooms_share_a_function_name,
                      test_names_are_imported_from_their_own_room, test_docstrings_name_files_that_exist):
            with pytest.raises(AssertionError):
                check()
    finally:
        for fn in (_modules, _tree):
            fn.cache_clear()


def test_every_stage_keeps_the_contract() -> None:
    from speculators.pipeline import STAGES as PIPELINE

    broken = []
    for stage in PIPELINE:
        if stage.module not in _modules():
            broken.append(f"{stage.name}: no module {stage.module}")
            continue
        defined = _defined_names(stage.module) or set()
        broken += [f"{stage.module} has no {fn}()" for fn in STAGE_CONTRACT if fn not in defined]
    assert not broken, "\n".join(broken)


def test_files_and_functions_stay_small() -> None:
    big = []
    for module, path in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            big.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines (> {MAX_FILE_LINES})")
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name}() {length} lines")
    assert not big, "\n".join(big)


def test_file_names_are_unique() -> None:
    seen: dict[str, list[str]] = {}
    for path in _modules().values():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"modules sharing a file name: {twins}"


def test_one_atomic_writer() -> None:
    """Files are put in place by core/atomic.py only: no other module calls os.replace / os.rename / Path.replace
    (but the modules that run inside the vLLM environment, which cannot import the package: VLLM_SIDE)."""
    calls = []
    for module, path in _modules().items():
        if module == ATOMIC_WRITER or module.startswith(VLLM_SIDE):
            continue
        for node in ast.walk(_tree(module)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in ("replace", "rename") and isinstance(node.func.value, ast.Name) and \
                    node.func.value.id == "os":
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: os.{node.func.attr}")
            elif node.func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords:
                # Path.replace(target) / Path.rename(target) take one argument (str.replace takes two)
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: Path.{node.func.attr}")
    assert not calls, "\n".join(calls)


def _room(module: str) -> str:
    """The room a module lives in: its top-level subpackage (core, data, runtime, ...), 'speculators' for the modules
    at the package root (cli, pipeline)."""
    parts = _package(module).split(".")
    return parts[1] if len(parts) > 1 else "speculators"


def test_no_two_rooms_share_a_function_name() -> None:
    """A top-level function name (public or `_private`) means one thing: two rooms defining the same name either
    duplicate a helper (merge it into its owner) or mean different things (rename one to say what it computes).
    Exempt: the stage contract every stage module implements, and a process's `main`."""
    where: dict[str, set[tuple[str, str]]] = {}
    for module, path in _modules().items():
        for node in _tree(module).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    node.name not in STAGE_CONTRACT + ENTRY_POINTS:
                where.setdefault(node.name, set()).add((_room(module), str(path.relative_to(PACKAGE.parent))))
    shared = {name: sorted(f for _, f in places) for name, places in where.items()
              if len({room for room, _ in places}) > 1}
    assert not shared, "function names defined in more than one room:\n" + \
        "\n".join(f"{name}: {', '.join(files)}" for name, files in sorted(shared.items()))


def _reexports(package: str) -> set[str]:
    """The names a package's `__init__` takes from another room (it re-exports them; it does not own them)."""
    return {name for base, names, _ in _imports(package) if base in _modules() and _room(base) != _room(package)
            for name in names if f"{base}.{name}" not in _modules()}


def test_names_are_imported_from_their_own_room() -> None:
    """`from speculators.serving import Engine` works for users (the runtime's names used to live there), but a
    module of the package imports a name from the room that defines it (`speculators.runtime...`): a re-export is
    an edge between rooms that says nothing about who owns the name."""
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    foreign = {pkg: _reexports(pkg) for pkg in packages}
    offenders = []
    for module, path in _modules().items():
        for base, names, line in _imports(module):
            if base in foreign and base != module:
                offenders += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name} through {base} (import it from "
                              f"the room that defines it)" for name in names if name in foreign[base]]
    assert not offenders, "\n".join(offenders)


def _known_files() -> set[str]:
    """Every file a docstring may name, as a path relative to the repository: the package's and those under
    DOC_FILE_ROOTS."""
    roots = [PACKAGE] + [REPO / r for r in DOC_FILE_ROOTS]
    files = {p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py"))}
    files |= set(REPO.glob("*.py"))
    return {str(p.relative_to(PACKAGE.parent if p.is_relative_to(PACKAGE.parent) else REPO))
            for p in files if "__pycache__" not in p.parts}


# a file name (`oracle.py`, `export/launch_plan.py`); not the tail of a pattern (`<family>_format.py`, `*_model.py`)
_FILE_MENTION = re.compile(r"(?<![\w./<>*{}-])((?:[\w-]+/)*\w+\.py)\b")
# a dotted module path; not a format id (`speculators.features/v1`) nor part of another dotted name
_DOTTED_MENTION = re.compile(r"(?<![\w./-])(speculators(?:\.[A-Za-z_]\w*)+)(?![\w/])")


def _stale_dotted(mention: str) -> bool:
    """Whether `speculators.a.b[.Name[.attr]]` names no module, or a name its module does not define."""
    parts = mention.split(".")
    for i in range(len(parts), 1, -1):
        module = ".".join(parts[:i])
        if module in _modules():
            rest = parts[i:]
            defined = _defined_names(module)
            return bool(rest) and (len(rest) > 2 or (defined is not None and rest[0] not in defined))
    return True


def test_docstrings_name_files_that_exist() -> None:
    """A docstring that points at `oracle.py` after it became `cost_model.py`, or at `speculators.x.y` after it moved,
    sends the reader nowhere. A bare `name.py` must be some file of the repository with that name; `room/name.py` a
    file whose path ends so; names of other projects' files are listed in EXTERNAL_FILES."""
    known = _known_files()
    names = {Path(f).name for f in known}
    stale = []
    for module, path in _modules().items():
        for node in ast.walk(_tree(module)):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node, clean=False) or ""
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 1)}"
            for mention in _FILE_MENTION.findall(doc):
                if mention in EXTERNAL_FILES:
                    continue
                exists = any(f == mention or f.endswith("/" + mention) for f in known) if "/" in mention \
                    else mention in names
                if not exists:
                    stale.append(f"{where}: no file {mention}")
            stale += [f"{where}: no {m}" for m in _DOTTED_MENTION.findall(doc) if _stale_dotted(m)]
    assert not stale, "docstrings naming files or modules that do not exist:\n" + "\n".join(stale)

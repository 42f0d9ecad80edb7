"""The layer order of docs/architecture.md, held by reading every module's imports (AST).

Layers, lowest first: core (masenvs/) < engine (masenvs/engine/) < adapters (adapters/, imported
as masenvs.adapters) < trainer (trainer/, masenvs.trainer) < CLI (masenvs.cli, masenvs/ui/ and
every module that builds an argparse parser for a command). A module imports only its own layer
and the layers below; the core keeps torch and the upper layers out of its import time (a lazy
import inside a function is allowed there; a test imports every core module to check it). No
module (bench/, scripts/ and examples/ included) imports another module's private names or keeps
a deprecation layer (masenvs is unreleased: a move updates every user, the old name is deleted),
and no file of the package or examples/ is over 500 lines unless its docstring says why (data), nor
any function over 80 lines but an argparse builder. The default model and the API-key variables
are spelled in one module each. docs/architecture.md's '## Every module' table and the
tree agree, both ways. A self-test runs each rule on a small bad tree.

Each failure names file:line and the rule; the fix is to move the code to its layer (or the
shared piece down a layer), to make the private name public, or to split the file.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import path (pyproject's package-dir: the remap a plain file walk cannot see)
PACKAGE_ROOTS = {"masenvs": "masenvs", "adapters": "masenvs.adapters", "trainer": "masenvs.trainer"}
LAYERS = ("core", "engine", "adapters", "trainer", "CLI")
# Code that uses the package from outside it: held to the private-name and new-path rules.
USERS = ("bench", "scripts", "examples")
# what the core never imports at import time, beside the engine, adapters and trainer layers
HEAVY = ("torch", "transformers", "peft", "vllm")
# Modules that build an ArgumentParser only for a maintainer's `python -m` script, not a
# `masenvs` command: they stay in their layer. Say why for each.
NOT_A_COMMAND = {
    "masenvs.tasks.verilog_problems": "`--write` regenerates data/verilog_problems.json",
}
MAX_LINES = 500
LONG_FILE_REASON = "Longer than 500 lines because"
MAX_FUNCTION_LINES = 80


@dataclass
class Import:
    """One imported module, or one name imported from a module, where it appears."""

    module: str  # the module imported (for `from m import x`: m, or m.x when that is a module)
    name: str | None  # the name taken from `module`, None when the module itself is bound
    line: int
    at_import_time: bool  # runs when the importing module is imported (not in a function)
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)


@dataclass
class Module:
    name: str
    path: Path  # relative to the repository root
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)
    bindings: dict[str, str] = field(default_factory=dict)  # local name -> our module it binds
    private_uses: list[tuple[str, str, int]] = field(default_factory=list)  # (module, attr, line)

    @property
    def where(self) -> str:
        return str(self.path)

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def module_name(rel: Path) -> str:
    """`adapters/backends/pool.py` -> `masenvs.adapters.backends.pool`."""
    parts = list(rel.with_suffix("").parts)
    parts[0] = PACKAGE_ROOTS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportVisitor(ast.NodeVisitor):
    """Collects a module's imports, noting which run at import time."""

    def __init__(self, module: Module, known: set[str]) -> None:
        self.module, self.known = module, known
        self.depth = 0  # > 0 inside a function or lambda
        self.type_checking = 0

    def _visit_function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            return self.generic_visit(node)
        self.type_checking += 1
        for child in node.body:
            self.visit(child)
        self.type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def _add(self, module: str, name: str | None, line: int) -> None:
        self.module.imports.append(
            Import(module, name, line, self.depth == 0, self.type_checking > 0)
        )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, None, node.lineno)
            if alias.asname and alias.name in self.known:
                self.module.bindings[alias.asname] = alias.name
            elif alias.name.partition(".")[0] in self.known:  # `import a.b` binds `a`
                top = alias.name.partition(".")[0]
                self.module.bindings[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package, up level - 1
            package = self.module.package.split(".")
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([base] if base else [])])
        for alias in node.names:
            if f"{base}.{alias.name}" in self.known:  # `from pkg import submodule`
                self._add(f"{base}.{alias.name}", None, node.lineno)
                self.module.bindings[alias.asname or alias.name] = f"{base}.{alias.name}"
            else:
                self._add(base, alias.name, node.lineno)


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_attribute_uses(module: Module, known: set[str]) -> None:
    """`mod._name` where `mod` is one of our modules bound by an import."""
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        dotted = _dotted(node.value)
        head, _, rest = (dotted or "").partition(".")
        if head not in module.bindings:
            continue
        target = ".".join([module.bindings[head], *([rest] if rest else [])])
        if target in known and f"{target}.{node.attr}" not in known:
            module.private_uses.append((target, node.attr, node.lineno))


def _builds_a_parser(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "ArgumentParser":
                return True
    return False


def source_files(root: Path, folders: tuple[str, ...]) -> list[Path]:
    """Python files git tracks or would track (new, not ignored) under `folders`."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *folders],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        files = [Path(f) for f in out if f.endswith(".py")]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the folders
        files = [p.relative_to(root) for d in folders for p in (root / d).rglob("*.py")]
    return sorted(f for f in files if (root / f).is_file() and "__pycache__" not in f.parts)


@dataclass
class Tree:
    """Every module of the three package roots under `root`, parsed."""

    root: Path
    modules: dict[str, Module]
    cli: set[str]
    users: list[Module] = field(default_factory=list)  # bench/, scripts/, examples/

    def layer(self, name: str) -> str | None:
        """The layer of one of our modules (or a name inside one); None for a third party."""
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        if not name:
            return None
        if name in self.cli:
            return "CLI"
        for prefix, layer in (
            ("masenvs.engine", "engine"),
            ("masenvs.adapters", "adapters"),
            ("masenvs.trainer", "trainer"),
        ):
            if name == prefix or name.startswith(prefix + "."):
                return layer
        return "core"

    def owner(self, name: str) -> str | None:
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None


def load_tree(root: Path) -> Tree:
    paths = source_files(root, tuple(PACKAGE_ROOTS))
    names = {module_name(p): p for p in paths}
    modules = {}
    for name, path in names.items():
        tree = ast.parse((root / path).read_text(encoding="utf-8"), filename=str(path))
        modules[name] = Module(name, path, tree)
    known = set(modules)
    users = []
    for path in source_files(root, USERS):
        tree = ast.parse((root / path).read_text(encoding="utf-8"), filename=str(path))
        users.append(Module(".".join(path.with_suffix("").parts), path, tree))
    for module in [*modules.values(), *users]:
        _ImportVisitor(module, known).visit(module.tree)
        _private_attribute_uses(module, known)
    cli = {
        name
        for name, m in modules.items()
        if name in ("masenvs.cli", "masenvs.__main__")
        or name == "masenvs.ui"
        or name.startswith("masenvs.ui.")
        or (_builds_a_parser(m.tree) and name not in NOT_A_COMMAND)
    }
    return Tree(root, modules, cli, users)


# --- the rules: each returns "file:line: what is wrong" lines --------------------------------


def upward_imports(tree: Tree) -> list[str]:
    """A module imports only its own layer and those below; the core, lazily, may reach up."""
    found = []
    for m in tree.modules.values():
        mine = tree.layer(m.name)
        for imp in m.imports:
            theirs = tree.layer(imp.module)
            if theirs is None or theirs == "CLI":  # third party; CLI: see cli_imports
                continue
            if LAYERS.index(theirs) <= LAYERS.index(mine):
                continue
            if mine == "core" and not imp.at_import_time:
                continue  # a lazy import in a function (e.g. an optional backend)
            found.append(
                f"{m.where}:{imp.line}: {m.name} ({mine}) imports {imp.module} ({theirs}), "
                f"a higher layer"
            )
    return list(dict.fromkeys(found))  # one line per import statement


def heavy_imports_in_core(tree: Tree) -> list[str]:
    """The core imports without torch: `import masenvs` works with only the base deps."""
    found = []
    for m in tree.modules.values():
        if tree.layer(m.name) != "core":
            continue
        for imp in m.imports:
            top = imp.module.partition(".")[0]
            if top in HEAVY and imp.at_import_time and not imp.type_checking:
                found.append(
                    f"{m.where}:{imp.line}: {m.name} (core) imports {imp.module} at import "
                    f"time; import it inside the function that needs it, or move the code to "
                    f"masenvs/engine/"
                )
    return found


def cli_imports(tree: Tree) -> list[str]:
    """Nothing below the CLI imports a CLI module, and nothing imports the `masenvs` dispatcher
    (masenvs.cli runs the commands: a command that imports it closes a cycle)."""
    found = []
    for m in tree.modules.values():
        mine = tree.layer(m.name)
        for imp in m.imports:
            owner = tree.owner(imp.module)
            if owner is None or tree.layer(owner) != "CLI" or owner == m.name:
                continue
            if mine != "CLI":
                found.append(
                    f"{m.where}:{imp.line}: {m.name} ({mine}) imports the CLI module {owner}; "
                    f"move what it needs out of the CLI module, down to the layer that uses it"
                )
            elif owner == "masenvs.cli" and m.name != "masenvs.__main__":
                found.append(
                    f"{m.where}:{imp.line}: {m.name} imports masenvs.cli, which dispatches to "
                    f"the commands (a cycle); move the shared code below the CLI"
                )
    return list(dict.fromkeys(found))  # one line per import statement


def private_imports(tree: Tree) -> list[str]:
    """No module takes another module's private (_name) names; a private module is shared
    only inside its own package."""
    found = []
    for m in [*tree.modules.values(), *tree.users]:
        uses = [(i.module, i.name, i.line) for i in m.imports]
        uses += [(mod, attr, line) for mod, attr, line in m.private_uses]
        for module, name, line in uses:
            if tree.owner(module) is None:
                continue
            if name is not None and is_private(name) and module != m.name:
                found.append(
                    f"{m.where}:{line}: {m.name} uses the private name {name} of {module}; "
                    f"make it public (and documented) or keep the code that needs it there"
                )
            parts = module.split(".")
            private = [i for i, part in enumerate(parts) if is_private(part)]
            if private:
                package = ".".join(parts[: private[0]])
                if not m.name.startswith(package + "."):
                    found.append(
                        f"{m.where}:{line}: {m.name} imports the private module {module} from "
                        f"outside its package {package}"
                    )
    return found


DEPRECATION_CATEGORIES = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")


def _warns_deprecation(call: ast.Call) -> bool:
    """`warnings.warn(..., DeprecationWarning)` (or a FutureWarning), positional or keyword."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "warn":
        return False
    args = [*call.args, *(k.value for k in call.keywords)]
    return any(_dotted(a) in DEPRECATION_CATEGORIES for a in args)


def _replaces_itself(node: ast.Assign) -> bool:
    """`sys.modules[__name__] = other`: the module becomes an alias of another one."""
    return any(
        isinstance(t, ast.Subscript)
        and _dotted(t.value) == "sys.modules"
        and isinstance(t.slice, ast.Name)
        and t.slice.id == "__name__"
        for t in node.targets
    )


def deprecation_layers(tree: Tree) -> list[str]:
    """masenvs is unreleased, so a name that moves is renamed at every use and the old one
    deleted: no module is a deprecated path (a "Deprecated" docstring, an alias of its new
    home in sys.modules) and none warns that a name moved (a module-level `__getattr__` that
    forwards old names with a DeprecationWarning, an old keyword or flag kept with one)."""
    found = []
    for m in [*tree.modules.values(), *tree.users]:
        if (ast.get_docstring(m.tree) or "").lower().startswith("deprecated"):
            found.append(f"{m.where}:1: a deprecated module; delete it and import its new path")
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call) and _warns_deprecation(node):
                found.append(
                    f"{m.where}:{node.lineno}: warns that a name moved or is deprecated; delete "
                    f"the old name and update its users"
                )
            elif isinstance(node, ast.Assign) and _replaces_itself(node):
                found.append(
                    f"{m.where}:{node.lineno}: the module replaces itself in sys.modules (an old "
                    f"path of another module); delete it and import the other module"
                )
    return found


def _checked_files(root: Path) -> list[Path]:
    """The files held to the size rules: the package and the examples users copy (bench/ and
    scripts/ are maintainers' measurements, each a script read once)."""
    return source_files(root, (*PACKAGE_ROOTS, "examples"))


def long_files(root: Path) -> list[str]:
    """Package and example files over 500 lines, unless the module docstring says why (data)."""
    found = []
    for rel in _checked_files(root):
        text = (root / rel).read_text(encoding="utf-8")
        lines = text.count("\n") + (not text.endswith("\n") and bool(text))
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if LONG_FILE_REASON not in doc:
            found.append(
                f"{rel}:1: {lines} lines (max {MAX_LINES}); split it by responsibility or say "
                f'why in its docstring ("{LONG_FILE_REASON} ...")'
            )
    return found


def _is_parser_builder(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A `build_parser`-style function: named for the parser it builds, and adding arguments
    (one flag after another is long and reads straight through)."""
    calls = {
        n.func.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    return node.name.endswith("parser") and "add_argument" in calls


def long_functions(root: Path) -> list[str]:
    """Package and example functions over 80 lines (a nested function counts inside its
    parent too), except argparse builders."""
    found = []
    for rel in _checked_files(root):
        tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and not _is_parser_builder(node):
                found.append(
                    f"{rel}:{node.lineno}: {node.name} is {lines} lines (max "
                    f"{MAX_FUNCTION_LINES}); split it into steps, one function each"
                )
    return found


# --- the tests --------------------------------------------------------------------------------


@cache
def repo() -> Tree:
    return load_tree(ROOT)


RULES = {
    "upward imports": upward_imports,
    "torch in the core": heavy_imports_in_core,
    "CLI imports": cli_imports,
    "private names": private_imports,
    "deprecation layers": deprecation_layers,
}


def _report(rule: str, found: list[str]) -> str:
    return f"{len(found)} violation(s) of '{rule}':\n  " + "\n  ".join(found)


@pytest.mark.parametrize("rule", list(RULES))
def test_layer_rule_holds_over_the_tree(rule: str) -> None:
    found = RULES[rule](repo())
    assert not found, _report(rule, found)


def test_no_non_test_file_is_over_500_lines_without_a_reason() -> None:
    found = long_files(ROOT)
    assert not found, _report("file size", found)


def test_no_non_test_function_is_over_80_lines() -> None:
    found = long_functions(ROOT)
    assert not found, _report("function size", found)


# Names several layers share: each is spelled in one module, and the others import its constant.
DECLARED_ONCE = {
    "smollm2-135m": "masenvs/cache.py",  # SMOLLM2_135M, the DEFAULT_MODEL
    "MASENVS_API_KEY": "masenvs/listeners.py",  # API_KEY_ENV: masenvs's own servers
    "MASENVS_SEARCH_API_KEY": "masenvs/listeners.py",  # SEARCH_API_KEY_ENV: search-serve
    "MASENVS_ENGINES_API_KEY": "masenvs/listeners.py",  # ENGINES_API_KEY_ENV: engines by URL
}


def spelled_again(tree: Tree) -> list[str]:
    """Where a DECLARED_ONCE name is a string of its own outside its home (prose that names
    it, in a docstring or a help text, is not a declaration)."""
    found = []
    for m in [*tree.modules.values(), *tree.users]:
        for node in ast.walk(m.tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            home = DECLARED_ONCE.get(node.value)
            if home is not None and m.where != home:
                found.append(
                    f"{m.where}:{node.lineno}: spells {node.value!r} again; import its constant "
                    f"from {home}"
                )
    return found


def test_the_default_model_and_each_key_variable_are_declared_once() -> None:
    found = spelled_again(repo())
    assert not found, _report("one constant per name", found)


def test_importing_every_core_module_loads_no_torch_and_no_upper_layer() -> None:
    """What the AST rule says, run: each core module imported in a fresh interpreter pulls in
    neither torch (also through a third-party import) nor the engine, adapters or trainer."""
    tree = repo()
    core = sorted(n for n in tree.modules if tree.layer(n) == "core")
    probe = (
        "import importlib, json, sys\n"
        "banned = ('torch', 'transformers', 'peft', 'masenvs.engine', 'masenvs.adapters',"
        " 'masenvs.trainer')\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    new = sorted(m for m in set(sys.modules) - before if m.startswith(banned))\n"
        "    if new:\n"
        "        found[name] = new[:3]\n"
        "print(json.dumps(found))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *core], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert not found, "core modules that load a higher layer or torch when imported:\n  " + (
        "\n  ".join(f"{name} -> {', '.join(mods)}" for name, mods in found.items())
    )


def test_the_tree_has_every_layer_the_rules_speak_of() -> None:
    """The rules see the remapped packages (a walk that missed adapters/ would pass vacuously)."""
    tree = repo()
    layers = {tree.layer(name) for name in tree.modules}
    assert {"core", "adapters", "trainer", "CLI"} <= layers, layers
    assert "masenvs.adapters.endpoint" in tree.modules or any(
        n.startswith("masenvs.adapters.endpoint.") for n in tree.modules
    )
    assert {"masenvs.cli", "masenvs.trainer.commands.train", "masenvs.ui.server"} <= tree.cli


# --- the checker catches what it should, on a small tree written here ------------------------

BAD_TREE = {
    "masenvs/__init__.py": "",
    "masenvs/cli.py": "import argparse\n\ndef main():\n    argparse.ArgumentParser()\n",
    "masenvs/env.py": (
        '"""Core."""\nimport torch\nfrom masenvs.adapters import stack\n\n'
        "def lazy():\n    import torch\n    from masenvs.trainer import learner\n"
    ),
    "masenvs/uses_cli.py": "from masenvs.cli import main\n",
    "masenvs/listeners.py": 'API_KEY_ENV = "MASENVS_API_KEY"\n',  # its home
    "masenvs/uses_key.py": (
        '"""Reads MASENVS_API_KEY."""\nimport os\n\nKEY = os.environ.get("MASENVS_API_KEY")\n'
    ),
    "masenvs/engine/__init__.py": "",
    "masenvs/engine/forward.py": "def f():\n    from masenvs.adapters.stack import x\n",
    "masenvs/tasks/__init__.py": "",
    "masenvs/tasks/_harness.py": "",
    "masenvs/tasks/judge.py": "from masenvs.tasks import _harness\n",
    "adapters/__init__.py": "",
    "adapters/stack.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from masenvs.trainer.learner import L\n"
        "from masenvs.tasks import _harness\nfrom masenvs.env import _secret\n"
        "import masenvs.env as env\n\nx = env._hidden\n"
    ),
    "adapters/old.py": (
        '"""Deprecated: moved to masenvs.engine.forward."""\nimport warnings\n'
        'warnings.warn("moved", DeprecationWarning, stacklevel=2)\nfrom masenvs.env import _secret\n'
    ),
    "adapters/rollout.py": (
        "import warnings\nfrom masenvs.adapters import episodes\n\n"
        "def __getattr__(name):\n"
        '    warnings.warn(f"{name} moved to episodes", category=FutureWarning)\n'
        "    return getattr(episodes, name)\n"
    ),
    "adapters/lazy.py": (  # lazy exports and warning filters are no deprecation layer
        "import importlib, warnings\n"
        'warnings.filterwarnings("ignore", category=DeprecationWarning)\n'
        'warnings.warn("a plain warning", UserWarning)\n\n'
        "def __getattr__(name):\n"
        '    return getattr(importlib.import_module("masenvs.env"), name)\n'
    ),
    "masenvs/old_layout.py": "import sys\nfrom masenvs import env\n\nsys.modules[__name__] = env\n",
    "trainer/__init__.py": "",
    "trainer/learner.py": "from .. import adapters\nfrom masenvs.trainer.cli import main\n",
    "trainer/cli.py": "import argparse\nfrom masenvs.cli import main\nargparse.ArgumentParser()\n",
    "bench/speed.py": "from masenvs.env import _secret\nimport warnings\n"
    'warnings.warn("old", DeprecationWarning)\n',
    "examples/big.py": '"""Big."""\n' + "x = 1\n" * 501,
    "examples/big_ok.py": '"""Big. Longer than 500 lines because it must be."""\n'
    + "x = 1\n" * 501,
    "examples/long.py": "def step():\n" + "    x = 1\n" * 80,
    "examples/short.py": "def step():\n" + "    x = 1\n" * 79,
    "examples/flags.py": "def build_parser(p):\n" + "    p.add_argument('--x')\n" * 90,
    "scripts/measure.py": "def main():\n" + "    x = 1\n" * 90,  # a maintainer's script
}


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    root = tmp_path_factory.mktemp("bad")
    for rel, text in BAD_TREE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return load_tree(root)


def test_the_checker_flags_each_kind_of_violation(bad_tree: Tree) -> None:
    def lines(found: list[str]) -> list[str]:
        return sorted(f.split(": ", 1)[0] for f in found)

    assert lines(upward_imports(bad_tree)) == [
        "adapters/stack.py:3",  # adapters -> trainer, even only for type checking
        "masenvs/engine/forward.py:2",  # engine -> adapters, even lazily
        "masenvs/env.py:3",  # core -> adapters at import time (the lazy one on line 7 is fine)
    ]
    assert lines(heavy_imports_in_core(bad_tree)) == ["masenvs/env.py:2"]
    assert lines(cli_imports(bad_tree)) == [
        "masenvs/uses_cli.py:1",
        "trainer/cli.py:2",  # a command importing the dispatcher
        "trainer/learner.py:2",
    ]
    assert lines(private_imports(bad_tree)) == [
        "adapters/old.py:4",  # an old path gets no exemption from the rules
        "adapters/stack.py:4",  # a private module from outside its package
        "adapters/stack.py:5",  # from m import _name
        "adapters/stack.py:8",  # m._name through an imported module
        "bench/speed.py:1",  # scripts that use the package are held to it too
    ]
    assert lines(deprecation_layers(bad_tree)) == [
        "adapters/old.py:1",  # a "Deprecated" docstring
        "adapters/old.py:3",  # a warning on import
        "adapters/rollout.py:5",  # a forwarding __getattr__ that warns
        "bench/speed.py:3",
        "masenvs/old_layout.py:4",  # an alias of another module
    ]
    assert lines(long_files(bad_tree.root)) == ["examples/big.py:1"]
    assert lines(long_functions(bad_tree.root)) == ["examples/long.py:1"]
    assert lines(spelled_again(bad_tree)) == ["masenvs/uses_key.py:4"]  # prose may name it
    assert bad_tree.layer("masenvs.adapters.old") == "adapters"
    assert bad_tree.layer("masenvs.trainer.cli.main") == "CLI"


def test_docs_architecture_names_only_files_that_exist() -> None:
    """docs/architecture.md follows the tree: every path it names is there (a bare file name
    is somewhere under the three package roots)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = set(re.findall(r"`([\w./<>-]+\.(?:py|md|toml))`", text))
    assert len(names) > 40, names  # the step trace names the modules it passes through
    everywhere = {p.name for d in PACKAGE_ROOTS for p in (ROOT / d).rglob("*.py")}
    missing = []
    for name in sorted(n for n in names if "<" not in n):  # <name>.py: a file to write
        found = (ROOT / name).exists() if "/" in name else name in everywhere
        if not found and not (ROOT / name).exists():
            missing.append(name)
    assert not missing, f"docs/architecture.md names files that are not in the tree: {missing}"


def test_readme_and_docs_name_only_repository_files_that_exist() -> None:
    """A file moved in a refactor leaves no stale path behind in the README or docs/."""
    top = "masenvs|adapters|trainer|tests|bench|scripts|examples"
    path = re.compile(rf"(?<![\w/.])((?:{top})/[\w/.-]*\.(?:py|c|json|jsonl|yaml|html|md))\b")
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for name in path.findall(line):
                if not (ROOT / name).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {name}")
    assert not missing, "paths in the docs that are not in the tree:\n  " + "\n  ".join(missing)


# --- docs/architecture.md lists every module ---------------------------------------------------

INDEX_HEADING = "## Every module"


def _holds_code(path: Path) -> bool:
    """An `__init__.py` with more than a docstring (re-exports, a loader) is a module of its own;
    an empty one is just the folder."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def module_index(text: str) -> tuple[dict[str, list[str]], list[str]]:
    """The table under '## Every module': folder -> the file names its row lists, and the rows
    that could not be read (each problem one line)."""
    lines = text.splitlines()
    if INDEX_HEADING not in lines:
        return {}, [f"no '{INDEX_HEADING}' section (a table: | folder | what | modules |)"]
    rows, problems = {}, []
    for line in lines[lines.index(INDEX_HEADING) + 1 :]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("folder", "---"):
            continue
        folder = re.fullmatch(r"`([\w./-]+/)`", cells[0])
        if folder is None:
            problems.append(f"index row {cells[0]!r}: the first cell is one `folder/`")
            continue
        names = re.findall(r"`([^`]+)`", cells[-1])
        if folder[1] in rows:
            problems.append(f"index row `{folder[1]}` appears twice; merge the rows")
        rows.setdefault(folder[1], []).extend(names)
    return rows, problems


def module_index_gaps(root: Path, doc: Path) -> list[str]:
    """Both directions: every module under the three package roots (an `__init__.py` only when it
    holds code) is listed in its folder's row of the index, and every name listed is a module."""
    rows, found = module_index(doc.read_text(encoding="utf-8"))
    listed = [folder + name for folder, names in rows.items() for name in names]
    modules = [
        p.as_posix()
        for p in source_files(root, tuple(PACKAGE_ROOTS))
        if p.name != "__init__.py" or _holds_code(root / p)
    ]
    for key in modules:
        if key not in listed:
            folder, _, name = key.rpartition("/")
            found.append(f"`{key}` is missing: add `{name}` to the `{folder}/` row")
    for key in sorted(set(listed) - set(modules)):
        if (root / key).is_file() and key.endswith("__init__.py"):
            found.append(f"`{key}` holds no code, so its folder's row stands for it; drop it")
        else:
            found.append(f"`{key}` is listed but is no module of the tree; drop it or fix it")
    found += [
        f"`{k}` is listed {listed.count(k)} times; keep one"
        for k in sorted(set(listed))
        if listed.count(k) > 1
    ]
    return found


def test_docs_architecture_lists_every_module() -> None:
    """docs/architecture.md's '## Every module' table and the tree agree, both ways."""
    found = module_index_gaps(ROOT, ROOT / "docs" / "architecture.md")
    assert not found, "docs/architecture.md's module index and the tree differ:\n  " + (
        "\n  ".join(found)
    )


def test_the_module_index_check_names_each_gap(tmp_path: Path) -> None:
    """A module left out, a name that is no module, an empty `__init__.py` listed, a module or
    a folder row twice: each is one line naming the fix."""
    files = {
        "masenvs/__init__.py": '"""Only a docstring."""\n',
        "masenvs/env.py": "",
        "masenvs/envs/__init__.py": "from masenvs.envs.say import Say\n",
        "masenvs/envs/say.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    doc = tmp_path / "architecture.md"
    doc.write_text(
        "# Architecture\n\n## Every module\n\n| folder | what | modules |\n| --- | --- | --- |\n"
        "| `masenvs/` | core | `__init__.py`, `env.py`, `gone.py` |\n"
        "| `masenvs/envs/` | envs | `say.py`, `say.py` |\n"
        "| `masenvs/envs/` | envs again | `__init__.py` |\n\n## After\n| `trainer/` | | `x.py` |\n"
    )
    assert module_index_gaps(tmp_path, doc) == [
        "index row `masenvs/envs/` appears twice; merge the rows",
        "`masenvs/__init__.py` holds no code, so its folder's row stands for it; drop it",
        "`masenvs/gone.py` is listed but is no module of the tree; drop it or fix it",
        "`masenvs/envs/say.py` is listed 2 times; keep one",
    ]
    doc.write_text("# Architecture\n")
    assert module_index_gaps(tmp_path, doc)[:2] == [
        "no '## Every module' section (a table: | folder | what | modules |)",
        "`masenvs/env.py` is missing: add `env.py` to the `masenvs/` row",
    ]

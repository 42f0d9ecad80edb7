"""How the sandbox server starts: its own source and the masenvs modules a preload needs,
staged read-only under the user's cache, and the bubblewrap command line that boots it from
there inside the allow-list root (layout.py)."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .wire import BIND_DIRS_MOUNT, CGROUP_MOUNT

# The server's own files: every module of this package, run from a staged copy.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Starts the server: `argv[1]` is a dir holding this package's modules, loaded as the
# package `_masenvs_sandbox_server` without running its __init__ (this client side).
SERVER_BOOT = (
    "import importlib,sys,types;"
    "p=types.ModuleType('_masenvs_sandbox_server');p.__path__=[sys.argv[1]];"
    "sys.modules[p.__name__]=p;"
    "importlib.import_module(p.__name__+'.supervisor').server_main(int(sys.argv[2]),sys.argv[3])"
)


# Never staged nor bound: masenvs' task data (hidden tests, golden modules and vectors).
NEVER_STAGED = ("masenvs.tasks",)


def masenvs_modules(preload: Sequence[str]) -> dict[str, str]:
    """masenvs module name -> source file, for the masenvs modules in `preload` and every
    masenvs module they import (found by reading their imports, never running them);
    `masenvs.tasks` is left out whatever imports it."""
    found: dict[str, str] = {}
    todo = [name for name in preload if name.split(".")[0] == "masenvs"]
    while todo:
        name = todo.pop()
        if name in found or any(name == n or name.startswith(n + ".") for n in NEVER_STAGED):
            continue
        parts = name.split(".")
        for i in range(1, len(parts)):  # parent packages run first on import
            todo.append(".".join(parts[:i]))
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        found[name] = spec.origin
        package = name if spec.submodule_search_locations else name.rpartition(".")[0]
        try:
            tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "masenvs"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if base.split(".")[0] == "masenvs":
                    todo.append(base)
                    todo += [f"{base}.{a.name}" for a in node.names]  # submodules, if any
    return found


def third_party_imports(files: Iterable[str]) -> set[str]:
    """Top-level names of the non-stdlib, non-masenvs modules that `files` import."""
    names: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "masenvs"}


def stage(server_sources: Mapping[str, str], modules: dict[str, str]) -> str:
    """A read-only dir holding `server/<the server's files>` (file name -> source) and
    `lib/<masenvs modules>`, content-addressed under the user's cache so that it is built
    once and never changes under a server."""
    files = {f"server/{name}": source.encode() for name, source in server_sources.items()}
    for name, origin in modules.items():
        rel = name.replace(".", "/")
        rel = f"{rel}/__init__.py" if origin.endswith("__init__.py") else f"{rel}.py"
        files[f"lib/{rel}"] = Path(origin).read_bytes()
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "masenvs"
    final = cache / "sandbox-stage" / digest.hexdigest()[:32]
    if final.is_dir():
        return str(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable cache (a read-only home): a private temp dir instead
        final = Path(tempfile.mkdtemp(prefix="masenvs-stage-")) / "stage"
    tmp = Path(tempfile.mkdtemp(prefix=".stage-", dir=final.parent))
    for rel, data in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o444)
    for dirpath, _, _ in os.walk(tmp):
        os.chmod(dirpath, 0o755)
    try:
        tmp.rename(final)
    except OSError:  # another process staged the same content first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def server_sources() -> dict[str, str]:
    """The server's files for staging: every module of this package, by file name."""
    sources = {}
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE_DIR, name), encoding="utf-8") as f:
                sources[name] = f.read()
    return sources


def bwrap_command(
    preload: Sequence[str], packages: Sequence[str], bind_dirs: Sequence[str], notes: list[str]
) -> tuple[list[str], dict] | None:
    """The server's command line inside a bubblewrap root of allow-listed paths, and its
    extra config; None (with a note) where bubblewrap is not installed.

    The server is root there (of a user namespace bubblewrap makes, when we are not root),
    so that it can still give each run its own namespaces and uid."""
    from . import layout

    bwrap = layout.bwrap_path()
    if bwrap is None:
        notes.append("bubblewrap (bwrap) is not installed, so runs get no allow-list")
        return None
    userns = os.geteuid() != 0
    modules = masenvs_modules(preload)
    needed = {*packages, *(name.split(".")[0] for name in preload)}
    needed |= third_party_imports(modules.values())
    staged = stage(server_sources(), modules)
    root = layout.build_layout(sorted(needed), staged)
    in_ram = layout.copy_to_ram(root, notes)
    # Hidden from runs, which get single files of them (Sandbox.run's binds).
    root.hidden = [(path, f"{BIND_DIRS_MOUNT}/{i}") for i, path in enumerate(bind_dirs)]
    # Not --die-with-parent: the parent death signal follows the thread that started bwrap,
    # which may be a worker thread. The server exits when our socket closes, and dies with
    # bwrap (its own death signal, see server_main).
    command = [bwrap, "--new-session", "--unshare-ipc", "--unshare-uts"]
    command += ["--unshare-cgroup-try"]
    if userns:
        command += ["--unshare-user", "--uid", "0", "--gid", "0"]
    from .cgroup import server_cgroup

    cgroup = server_cgroup(notes)
    if cgroup is not None:
        root.writable = [(cgroup[0], CGROUP_MOUNT)]
    command += ["--cap-add", "ALL", *root.bwrap_args(), "--chdir", "/", "--"]
    command += [sys.executable, "-I", "-c", SERVER_BOOT, f"{layout.STAGE_MOUNT}/server"]
    paths = [f"{layout.STAGE_MOUNT}/lib"] if modules else []
    extra = {"allow_list": True, "userns": userns, "path": paths, "in_ram": in_ram}
    if cgroup is not None:
        extra |= {"cgroup": cgroup[1], "cgroup_path": cgroup[0]}
    return command, extra

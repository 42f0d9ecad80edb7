"""What a sandboxed run may see: an allow-list of host paths, built as bubblewrap arguments.

A run sees the system's programs and libraries (`/usr` and its links), the few files of
`/etc` the dynamic linker needs, the Python interpreter with its standard library, the
packages the sandbox was given (and their dependencies), and a staged copy of the
sandbox server and of the masenvs modules it preloads. Every Python package directory
(`site-packages`, `dist-packages`) of those trees is covered by an empty tmpfs first, so
an installed copy of masenvs, its tasks or anything else installed stays out of sight.
Nothing else of the host exists: no home, no checkout, no `.git`, no datasets, no caches.
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Where the staged server and modules appear inside the sandbox.
STAGE_MOUNT = "/run/masenvs-sandbox"
SYSTEM_TREES = ("/usr",)
ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc a run needs: the dynamic linker's cache and the time zone.
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
# Never staged nor bound: masenvs' task data (hidden tests, golden modules and vectors).
NEVER_STAGED = ("masenvs.tasks",)


def bwrap_path() -> str | None:
    """The bubblewrap binary, or None where it is not installed."""
    return shutil.which("bwrap", path=os.environ.get("PATH", "") + ":/usr/bin:/bin")


@dataclass
class Layout:
    """The allow-list: host paths bound read-only at the same place, symlinks, masks."""

    binds: list[str] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)  # link path -> its target
    masks: list[str] = field(default_factory=list)  # package dirs covered by an empty tmpfs
    late_binds: list[str] = field(default_factory=list)  # allowed packages, inside the masks
    stage: str = ""  # host dir bound at STAGE_MOUNT
    hidden: list[tuple[str, str]] = field(default_factory=list)  # (host dir, where) for the
    # server only: each run covers them and gets single files of them (Sandbox.bind_dirs)

    def covered(self, path: str) -> bool:
        """`path` lies in a bound tree (so it is there already, read-only)."""
        return any(path == b or path.startswith(b.rstrip("/") + "/") for b in self.binds)

    def bwrap_args(self) -> list[str]:
        """Arguments that build this layout as a bubblewrap root (before `--`)."""
        args = ["--dev", "/dev", "--proc", "/proc", "--dir", "/tmp", "--dir", "/run/masenvs"]
        # bubblewrap makes a file's missing parents 0700: a run under its own uid could not
        # pass them, so every parent outside the bound trees is made 0755 first.
        parents = {
            str(parent)
            for path in [*self.binds, *self.links, *self.late_binds]
            for parent in Path(path).parents
            if str(parent) != "/" and not self.covered(str(parent))
        }
        for path in sorted(parents, key=lambda p: (p.count("/"), p)):
            if path not in self.links:
                args += ["--perms", "0755", "--dir", path]
        for path in self.binds:
            args += ["--ro-bind", path, path]
        for link, target in self.links.items():
            args += ["--symlink", target, link]
        for path in self.masks:
            args += ["--perms", "0755", "--tmpfs", path]
        for path in self.late_binds:
            args += ["--ro-bind", path, path]
        for path in self.masks:
            args += ["--remount-ro", path]
        for source, dest in self.hidden:
            args += ["--ro-bind", source, dest]
        args += ["--ro-bind", self.stage, STAGE_MOUNT, "--remount-ro", "/"]
        return args


def _resolve(path: str, layout: Layout, depth: int = 0) -> str:
    """The real path of `path`; every symlink on the way is recorded in `layout.links`
    (unless a bound tree already holds it), so the run resolves it the same way."""
    if depth > 16:
        return os.path.realpath(path)
    current = "/"
    for part in Path(path).parts[1:]:
        nxt = os.path.join(current, part)
        if os.path.islink(nxt):
            target = os.readlink(nxt)
            if not layout.covered(nxt):
                layout.links[nxt] = target
            nxt = _resolve(os.path.normpath(os.path.join(current, target)), layout, depth + 1)
        current = nxt
    return current


def _bind(path: str, layout: Layout, late: bool = False) -> None:
    if not os.path.exists(path):
        return
    real = _resolve(os.path.abspath(path), layout)
    if not os.path.exists(real) or (not late and layout.covered(real)):
        return
    target = layout.late_binds if late else layout.binds
    if real not in target:
        target.append(real)


def _package_dirs_under(roots: Iterable[str]) -> list[str]:
    found = []
    for root in roots:
        for pattern in (
            "lib*/python*/*-packages",
            "local/lib*/python*/*-packages",
            "python*/*-packages",
        ):
            found += glob.glob(os.path.join(root, pattern))
    return found


def build_layout(packages: Sequence[str], stage: str) -> Layout:
    """The allow-list for a sandbox whose runs may import `packages` (top-level names)."""
    layout = Layout(stage=stage)
    for tree in SYSTEM_TREES:
        _bind(tree, layout)
    for link in ROOT_LINKS:
        if os.path.islink(link):
            layout.links[link] = os.readlink(link)
        elif os.path.isdir(link):
            _bind(link, layout)
    for path in ETC_FILES:
        _bind(path, layout)
    # The interpreter: its binary (through the venv's link, as sys.executable names it),
    # the venv's pyvenv.cfg, and the library dir that holds the stdlib and libpython.
    _bind(sys.executable, layout)
    venv_cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    _bind(venv_cfg, layout)
    stdlib = os.path.dirname(os.__file__)
    libdirs = {os.path.dirname(stdlib), sysconfig.get_config_var("LIBDIR") or ""}
    for lib in sorted(d for d in libdirs if d):
        _bind(lib, layout)
    _bind(sysconfig.get_config_var("DESTSHARED") or os.path.join(stdlib, "lib-dynload"), layout)
    # Every Python package dir inside what is bound is covered, then the allowed ones return.
    candidates = _package_dirs_under([*layout.binds, *(os.path.dirname(d) for d in layout.binds)])
    candidates += [p for p in sys.path if p.endswith(("-packages", "-packages/"))]
    for path in sorted({os.path.realpath(c) for c in candidates}):
        if os.path.isdir(path) and layout.covered(path) and path not in layout.masks:
            layout.masks.append(path)
    for path in package_paths(packages):
        _bind(path, layout, late=True)
    return layout


@functools.cache
def _top_level_distributions() -> dict[str, tuple[str, ...]]:
    from importlib import metadata

    return {k: tuple(v) for k, v in metadata.packages_distributions().items()}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _distribution_paths(names: tuple[str, ...]) -> tuple[str, ...]:
    from importlib import metadata

    todo = list(names)
    seen: set[str] = set()
    paths: set[str] = set()
    while todo:
        name = todo.pop()
        if _normal(name) in seen or _normal(name) == "masenvs":
            continue  # masenvs itself is staged module by module, never bound whole
        seen.add(_normal(name))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for file in dist.files or ():
            if file.parts and file.parts[0] not in ("..", "__pycache__"):
                paths.add(os.path.normpath(str(dist.locate_file(file.parts[0]))))
        for req in dist.requires or ():
            if "extra ==" not in req and (m := re.match(r"[A-Za-z0-9._-]+", req)):
                todo.append(m.group(0))
    return tuple(sorted(paths))


def package_paths(packages: Sequence[str]) -> list[str]:
    """Files and dirs of the distributions that provide `packages`, dependencies included."""
    from importlib import metadata

    dists: list[str] = []
    for name in packages:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names:
            continue
        try:  # most distributions are named as their package: no scan of all of them
            metadata.distribution(top)
            dists.append(top)
        except metadata.PackageNotFoundError:
            dists += _top_level_distributions().get(top, ())
    return list(_distribution_paths(tuple(sorted(set(dists)))))


# --- staging: the server's own source and the masenvs modules a preload needs ----------------


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

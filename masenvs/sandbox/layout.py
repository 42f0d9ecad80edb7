"""What a sandboxed run may see: an allow-list of host paths, built as bubblewrap arguments.

A run sees the Python interpreter with its standard library, the shared libraries they link
(read from their ELF headers, never by running them), the packages the sandbox was given
(and their dependencies), the few programs judges call (`sh`, Icarus Verilog) with their
libraries, the few files of `/etc` the dynamic linker needs, and a staged copy of the
sandbox server and of the masenvs modules it preloads. Not `/usr`: a checkout under
`/usr/src` or an interpreter under `/usr/local` or `/usr/lib` brings nothing else with it.
Python package dirs (`site-packages`, `dist-packages`) inside what is bound are covered by an
empty tmpfs first, so an installed copy of masenvs, its tasks or anything else installed
stays out of sight. Nothing else of the host exists: no home, no checkout, no `.git`, no
datasets, no caches. The server checks what it can see anyway (pagecache.py) and judges
refuse to score where a copy of masenvs' task data is among it.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from masenvs.sandbox.elf import find_libraries, multiarch, shared_libraries

# Where the staged server and modules appear inside the sandbox.
STAGE_MOUNT = "/run/masenvs-sandbox"
ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc a run needs: the dynamic linker's cache and the time zone.
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
# Programs a run may start where installed (the Verilog judge's harness calls Icarus
# Verilog, whose driver runs its stages through `sh`), with the dirs of helpers and plugins
# they load, relative to the prefix of the program's bin dir ({multiarch}: x86_64-linux-gnu).
DEFAULT_PROGRAMS = ("sh", "iverilog", "vvp")
PROGRAM_DIRS = {"iverilog": ("lib/{multiarch}/ivl",), "vvp": ("lib/{multiarch}/ivl",)}
# Loaded by name at run time, not linked: glibc's unwinder (thread exit) and the C.UTF-8 locale.
RUNTIME_LIBS = ("libgcc_s.so.1",)
LOCALE_DIRS = ("/usr/lib/locale/C.utf8", "/usr/lib/locale/C.UTF-8")
# Standard-library dirs no program needs, left out: CPython's own test suite and static lib.
STDLIB_LEFT_OUT = ("test", "config-*")
# Where the copies in RAM of what runs see live (a tmpfs: no page to evict, no negative
# dentry kept), one per bound path and content, shared by every sandbox of this machine.
RAM_COPIES = f"/dev/shm/masenvs-sandbox-root-{os.geteuid()}"


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
    writable: list[tuple[str, str]] = field(default_factory=list)  # (host dir, where), for
    # the server only: its memory cgroup, which each run covers
    sources: dict[str, str] = field(default_factory=dict)  # bound path -> its copy in RAM

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
        for path in sorted(self.binds, key=lambda p: p.count("/")):  # outer mounts first
            args += ["--ro-bind", self.sources.get(path, path), path]
        for link, target in self.links.items():
            args += ["--symlink", target, link]
        for path in self.masks:
            args += ["--perms", "0755", "--tmpfs", path]
        for path in self.late_binds:
            args += ["--ro-bind", self.sources.get(path, path), path]
        for path in self.masks:
            args += ["--remount-ro", path]
        for source, dest in self.hidden:
            args += ["--ro-bind", source, dest]
        for source, dest in self.writable:
            args += ["--bind", source, dest]
        args += ["--ro-bind", self.sources.get(self.stage, self.stage), STAGE_MOUNT]
        args += ["--remount-ro", "/"]
        return args


def copy_to_ram(layout: Layout, notes: list[str]) -> bool:
    """Serve every path of `layout` from a copy in RAM (RAM_COPIES, a tmpfs), so that runs
    share no page cache and no dentry cache with the host's file systems: a page a run
    reads is always resident, a name it looks up and misses leaves nothing behind. False,
    with a note, where there is no such tmpfs or no room in it."""
    if not _is_tmpfs(os.path.dirname(RAM_COPIES)):
        notes.append(f"{os.path.dirname(RAM_COPIES)} is not a tmpfs: runs read the host's files")
        return False
    try:
        os.makedirs(RAM_COPIES, 0o755, exist_ok=True)
        st = os.stat(RAM_COPIES)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(f"{RAM_COPIES} is not ours alone")  # someone could plant files
        for path in [*layout.binds, *layout.late_binds, layout.stage]:
            if not os.path.isdir(path) and path not in layout.late_binds:
                continue  # files bound alone: their dirs are bundled below
            left_out = tuple(sorted(m for m in layout.masks if _under(m, path) and m != path))
            layout.sources[path] = _ram_copy(path, left_out)
            if not os.path.exists(layout.sources[path]):  # removed since: copy again
                _ram_copy.cache_clear()
                _ram_bundle.cache_clear()
                layout.sources[path] = _ram_copy(path, left_out)
        _bundle_files(layout)
    except OSError as exc:
        layout.sources.clear()
        notes.append(f"could not copy what runs see to {RAM_COPIES} ({exc}): they read the host's")
        return False
    return True


def _bundle_files(layout: Layout) -> None:
    """Replace the files bound one by one in a dir (the libraries, `/etc`'s few files) by one
    bind of a RAM dir that holds them, their symlinks and the mount points of what is bound
    below: a run's mount namespace, copied at every run, keeps a few mounts instead of 80,
    and every file a run reads is in RAM.
    All bundles are made before the layout changes, so a failure leaves it as it was."""
    groups: dict[str, list[str]] = {}
    for path in layout.binds:
        if not os.path.isdir(path):
            groups.setdefault(os.path.dirname(path), []).append(path)
    bound_dirs = [p for p in layout.binds if os.path.isdir(p)]
    chosen = sorted(
        parent for parent, files in groups.items() if not any(_under(parent, d) for d in bound_dirs)
    )
    chosen = [p for p in chosen if not any(_under(p, q) and p != q for q in chosen)]  # outermost
    bundles = []
    for parent in chosen:
        below = lambda paths, top=parent: [p for p in paths if _under(p, top) and p != top]  # noqa: E731
        files = groups[parent]
        links = {link: layout.links[link] for link in below(layout.links)}
        points = below([b for b in layout.binds if b not in files] + layout.masks)
        points += below(layout.late_binds)
        spec = (parent, tuple(sorted(files)), tuple(sorted(links.items())), tuple(sorted(points)))
        stamp = tuple(os.stat(f).st_mtime_ns for f in files)
        source = _ram_bundle(spec, stamp)
        if not os.path.isdir(source):  # removed since: make it again
            _ram_bundle.cache_clear()
            source = _ram_bundle(spec, stamp)
        bundles.append((parent, files, links, source))
    for parent, files, links, source in bundles:
        layout.sources[parent] = source
        layout.binds = [b for b in layout.binds if b not in files] + [parent]
        for link in links:
            del layout.links[link]


@functools.cache
def _ram_bundle(spec: tuple, stamp: tuple[int, ...]) -> str:
    """A RAM dir for `_bundle_files`, made once per content."""
    parent, files, links, mount_points = spec
    digest = hashlib.sha256(repr((spec, stamp)).encode()).hexdigest()[:32]
    final = os.path.join(RAM_COPIES, f"bundle-{digest}")
    if not os.path.isdir(final):
        tmp = tempfile.mkdtemp(prefix=".bundle-", dir=RAM_COPIES)
        try:
            for path in files:
                shutil.copy2(path, tmp + "/" + os.path.relpath(path, parent))
            for point in mount_points:
                rel = tmp + "/" + os.path.relpath(point, parent)
                if os.path.isdir(point):
                    os.makedirs(rel, 0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(rel), 0o755, exist_ok=True)
                    open(rel, "a").close()  # noqa: SIM115
            for link, target in links:
                rel = tmp + "/" + os.path.relpath(link, parent)
                os.makedirs(os.path.dirname(rel), 0o755, exist_ok=True)
                os.symlink(target, rel)
            os.chmod(tmp, 0o755)
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(final):
                raise
    return final


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/self/mountinfo") as f:
            return any(
                line.split()[4] == path and line.split(" - ")[1].split()[0] == "tmpfs" for line in f
            )
    except (OSError, IndexError):
        return False


@functools.cache
def _ram_copy(path: str, left_out: tuple[str, ...]) -> str:
    """The copy of `path` (a file or a tree, without the dirs `left_out`, which stay as
    empty dirs for their covers) under RAM_COPIES, made once per content."""
    digest = hashlib.sha256(f"{path}\0{left_out}".encode())
    entries = [(path, os.stat(path))]
    if os.path.isdir(path):
        for d, dirs, files in os.walk(path):
            dirs[:] = sorted(x for x in dirs if os.path.join(d, x) not in left_out)
            entries += [
                (os.path.join(d, x), os.lstat(os.path.join(d, x))) for x in dirs + sorted(files)
            ]
    for name, st in entries:
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n".encode())
    final = os.path.join(RAM_COPIES, digest.hexdigest()[:32])
    if not os.path.isdir(final):
        tmp = tempfile.mkdtemp(prefix=".copy-", dir=RAM_COPIES)
        dest = tmp + path
        os.makedirs(os.path.dirname(dest), 0o755)
        try:
            if os.path.isdir(path):
                skip = lambda d, names: [n for n in names if os.path.join(d, n) in left_out]  # noqa: E731
                shutil.copytree(path, dest, symlinks=True, ignore=skip)
                for mask in left_out:
                    os.makedirs(tmp + mask, 0o755, exist_ok=True)
            else:
                shutil.copy2(path, dest)
            parent = os.path.dirname(dest)
            while _under(parent, tmp):  # the copy's parents (mkdtemp made tmp 0700)
                os.chmod(parent, 0o755)
                parent = os.path.dirname(parent)
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(final):  # not another process's copy of the same content
                raise
    return final + path


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
        for pattern in ("*-packages", "lib*/python*/*-packages", "python*/*-packages"):
            found += glob.glob(os.path.join(root, pattern))
    return found


def build_layout(
    packages: Sequence[str], stage: str, programs: Sequence[str] = DEFAULT_PROGRAMS
) -> Layout:
    """The allow-list for a sandbox whose runs may import `packages` (top-level names) and
    start `programs` (names on PATH, where installed)."""
    layout = Layout(stage=stage)
    for link in ROOT_LINKS:
        if os.path.islink(link):
            layout.links[link] = os.readlink(link)
    for path in ETC_FILES:
        _bind(path, layout)
    # The interpreter: its binary (through the venv's link, as sys.executable names it), the
    # venv's pyvenv.cfg, the standard library (its C modules included).
    _bind(sys.executable, layout)
    _bind(os.path.join(sys.prefix, "pyvenv.cfg"), layout)
    stdlib = os.path.dirname(os.__file__)
    _bind(stdlib, layout)
    dynload = sysconfig.get_config_var("DESTSHARED") or os.path.join(stdlib, "lib-dynload")
    _bind(dynload, layout)
    elves = [os.path.realpath(sys.executable), *_files_under(dynload)]
    for path in LOCALE_DIRS:
        _bind(path, layout)
    # Every Python package dir inside what is bound is covered, then the allowed ones return.
    candidates = _package_dirs_under([*layout.binds, *(os.path.dirname(d) for d in layout.binds)])
    candidates += [p for p in sys.path if p.endswith(("-packages", "-packages/"))]
    for pattern in STDLIB_LEFT_OUT:
        candidates += glob.glob(os.path.join(os.path.realpath(stdlib), pattern))
    for path in sorted({os.path.realpath(c) for c in candidates}):
        if os.path.isdir(path) and layout.covered(path) and path not in layout.masks:
            layout.masks.append(path)
    for path in package_paths(packages):
        _bind(path, layout, late=True)
        elves += _files_under(path)
    for name in programs:
        found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if found is None:
            continue
        _bind(found, layout)
        elves.append(os.path.realpath(found))
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(found)))
        for rel in PROGRAM_DIRS.get(name, ()):
            extra = os.path.join(prefix, rel.format(multiarch=multiarch()))
            _bind(extra, layout)
            elves += _files_under(extra) + glob.glob(os.path.join(extra, "ivl*"))
    for lib in sorted(shared_libraries(elves) | find_libraries(RUNTIME_LIBS, ())):
        real = os.path.realpath(lib)
        if any(_under(real, d) for d in layout.late_binds):
            continue  # a library an allowed package ships (numpy.libs): bound with it
        _bind(lib, layout, late=any(_under(real, m) for m in layout.masks))
    return layout


def _under(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


@functools.cache
def _files_under(path: str) -> list[str]:
    """The shared objects in `path` (a file or a tree), by name: `*.so`, `*.so.N`, plugins."""
    libs = re.compile(r".*\.(so(\.[0-9.]+)?|vpi|tgt)$")
    if os.path.isfile(path):
        return [path] if libs.match(path) else []
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files if libs.match(f)]


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

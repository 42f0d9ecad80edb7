"""Which shared libraries a program needs, read from its ELF headers as the dynamic linker
would resolve them (RPATH/RUNPATH, ld.so.conf, the defaults), never by running it: the sandbox
binds exactly these (layout.py)."""

from __future__ import annotations

import functools
import glob
import mmap
import os
import struct
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path


def multiarch() -> str:
    return sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where the dynamic linker looks for a library by name: ld.so.conf, then the defaults."""
    dirs: list[str] = []

    def read(conf: str, depth: int = 0) -> None:
        try:
            lines = Path(conf).read_text().splitlines()
        except OSError:
            return
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if line.startswith("include ") and depth < 4:
                for inc in sorted(glob.glob(line.split(None, 1)[1])):
                    read(inc, depth + 1)
            elif line.startswith("/"):
                dirs.append(line)

    read("/etc/ld.so.conf")
    arch = multiarch()
    dirs += [f"/lib/{arch}", f"/usr/lib/{arch}", "/lib64", "/usr/lib64", "/lib", "/usr/lib"]
    return tuple(dict.fromkeys(dirs))


@functools.cache
def _elf_dependencies(path: str) -> tuple[str | None, list[str], list[str]]:
    """(program interpreter, DT_NEEDED names, DT_RPATH + DT_RUNPATH dirs) of a 64-bit
    little-endian ELF file; nothing for anything else."""

    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x7fELF\x02\x01":
                return None, [], []
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # reads only the headers
    except (OSError, ValueError):
        return None, [], []
    with data:
        return _parse_elf(path, data)


def _parse_elf(path: str, data: mmap.mmap) -> tuple[str | None, list[str], list[str]]:

    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    interp = None
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == 3:  # PT_INTERP
            interp = data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode()
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    paths: list[str] = []
    for _, sh_type, _, _, offset, size, link, _ in sections:
        if sh_type != 6 or link >= len(sections):  # SHT_DYNAMIC, its string table at sh_link
            continue
        strtab = sections[link][4]
        for j in range(0, size, 16):
            tag, value = struct.unpack_from("<qQ", data, offset + j)
            if tag not in (1, 15, 29):  # DT_NEEDED, DT_RPATH, DT_RUNPATH
                continue
            end = data.find(b"\0", strtab + value)
            text = data[strtab + value : end].decode()
            origin = os.path.dirname(path)
            if tag == 1:
                needed.append(text)
            else:
                paths += [
                    d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
                    for d in text.split(":")
                ]
    return interp, needed, paths


def find_libraries(names: Iterable[str], search: Sequence[str]) -> set[str]:
    found = set()
    for name in names:
        if "/" in name:
            found.add(name)
            continue
        for d in (*search, *_library_dirs()):
            if os.path.exists(os.path.join(d, name)):
                found.add(os.path.join(d, name))
                break
    return found


def shared_libraries(files: Iterable[str]) -> set[str]:
    """Every shared library the ELF files among `files` link, transitively, with the
    dynamic linker itself (found as ld.so would: RPATH/RUNPATH, ld.so.conf, defaults)."""
    todo = [f for f in files if os.path.isfile(f)]
    seen: set[str] = set()
    libs: set[str] = set()
    while todo:
        path = os.path.realpath(todo.pop())
        if path in seen:
            continue
        seen.add(path)
        interp, needed, search = _elf_dependencies(path)
        found = find_libraries(needed, search) | ({interp} if interp else set())
        libs |= found
        todo += found
    return libs

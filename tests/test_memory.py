"""What keeps the main job's resident set small: the allocator's settings (large blocks get
their own mapping and go back to the system when freed) and the engine keeping no dense copy
that its packed weights make unused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_models import small_model

from masenvs.engine.forward import LlamaForward, Prefill

_PROBE = r"""
import ctypes, sys
from masenvs.memory import tune_allocator, release_free_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tuned = tune_allocator()
# glibc's default: freeing a 4 MiB mapped block raises the threshold above 1 MiB blocks
big = libc.malloc(4 << 20); libc.free(big)
mapped = libc.mallinfo2().hblkhd
blocks = [libc.malloc(1 << 20) for _ in range(8)]
grew = libc.mallinfo2().hblkhd - mapped
for b in blocks:
    libc.free(b)
release_free_memory()
print(int(tuned), grew >> 20, libc.mallinfo2().hblkhd - mapped)
"""


def _probe(**env: str) -> tuple[int, int, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("MASENVS_MALLOC", None)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    tuned, grew, left = (int(v) for v in out.stdout.split())
    return tuned, grew, left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_blocks_get_their_own_mapping_and_are_returned() -> None:
    tuned, grew, left = _probe()
    assert tuned == 1
    assert grew == 8  # eight 1 MiB blocks, each mapped on its own ...
    assert left == 0  # ... and unmapped when freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibc_defaults_when_asked_or_when_the_user_set_them() -> None:
    for env in ({"MASENVS_MALLOC": "default"}, {"MALLOC_ARENA_MAX": "4"}):
        tuned, grew, _ = _probe(**env)
        assert tuned == 0
        assert grew == 0  # glibc's dynamic threshold: the 1 MiB blocks came from the heap


@pytest.mark.parametrize("invariant", [True, False])
def test_the_engine_keeps_no_concatenated_copy_it_never_reads(
    kernels: str, invariant: bool
) -> None:
    model = small_model("llama", vocab_size=320).to(torch.bfloat16)
    forward = LlamaForward(model, 2, 64, "int8", batch_invariant=invariant)
    prompt = torch.tensor([5, 7, 11, 13, 2, 9])
    logits = forward.prefill([Prefill(0, prompt)])
    decoded = forward.decode(torch.tensor([3]), torch.tensor([6]), None)
    assert torch.isfinite(logits).all() and torch.isfinite(decoded).all()
    # projections are packed at their first use
    every_size = invariant or kernels == "avx2"  # AVX2 packs serve prefills too
    for layer in forward.layers:
        assert layer.qkv.serves_every_size() is every_size
        assert (layer.qkv.weight is None) is every_size
        assert (layer.gate_up.weight is None) is every_size
    # a dense matmul, if one is ever asked for, builds the copy on demand from the modules
    qkv = forward.layers[0].qkv
    qkv.invariant = False
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    names = ("q_proj", "k_proj", "v_proj")
    expected = torch.cat([F.linear(x, forward.layers[0].linears[n].weight) for n in names], -1)
    assert torch.equal(qkv(x, quantized=False), expected)


_HOLES = """
import ctypes, re, sys
from masenvs.memory import tune_allocator, release_free_memory
size = int(sys.argv[1]) << 10
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def anon():
    text = open("/proc/self/status").read()
    return int(re.search(r"RssAnon:\\s+(\\d+)", text)[1]) >> 10
tune_allocator()
blocks = [libc.malloc(size) for _ in range((64 << 20) // size)]  # 64 MiB
for b in blocks:
    libc.memset(b, 1, size)
for b in blocks[:-1]:
    libc.free(b)  # the last block pins the heap's top: the rest is a hole, not trimmed
held = anon()
release_free_memory()
print(held, anon())
"""


def test_an_unknown_malloc_mode_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from masenvs.memory import tune_allocator

    monkeypatch.setenv("MASENVS_MALLOC", "speedy")
    with pytest.raises(ValueError, match="lean .*fast .*default"):
        tune_allocator()


def _holes(kib: int, **env: str) -> tuple[int, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("MASENVS_MALLOC", None)
    out = subprocess.run(
        [sys.executable, "-c", _HOLES, str(kib)], env={**clean, **env}, capture_output=True,
        text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    held, after = (int(v) for v in out.stdout.split())
    return held, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_release_free_memory_returns_the_holes_inside_the_heap() -> None:
    # Blocks below the threshold come from the heap and stay resident when freed (fast
    # to reuse); the trainer calls release_free_memory() between the rollout and the update.
    held, after = _holes(128)
    assert held - after >= 48, (held, after)  # MiB: most of the 63 MiB hole went back


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_fast_mode_keeps_blocks_under_1_mib_in_the_heap() -> None:
    lean_held, _ = _holes(512)  # 512 KiB blocks are mapped: freed ones are gone at once
    fast_held, fast_after = _holes(512, MASENVS_MALLOC="fast")  # in the heap until trimmed
    assert fast_held - lean_held >= 48, (lean_held, fast_held)
    assert fast_held - fast_after >= 48


# Run as a file named `masenvs` (as the console script is): auto mode restarts only the
# masenvs command, never a Python program that imports masenvs.
_COMMAND = """
import ctypes, os, subprocess, sys
from masenvs.memory import allocator, restart_with_jemalloc
restart_with_jemalloc()
child = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD'), os.environ.get('MALLOC_CONF'))"],
    capture_output=True, text=True, check=True,
).stdout.split()
background = ctypes.c_bool(False)
size = ctypes.c_size_t(ctypes.sizeof(background))
try:  # jemalloc's own view of its options: the MALLOC_CONF of the restart took effect
    ctypes.CDLL(None).mallctl(b"opt.background_thread", ctypes.byref(background), ctypes.byref(size), None, 0)
except AttributeError:  # glibc has no mallctl
    pass
print(allocator(), os.environ.get("LD_PRELOAD"), os.environ.get("MALLOC_CONF"), *child, background.value)
"""


def _command(tmp_path: Path, name: str = "masenvs", **env: str) -> list[str]:
    script = tmp_path / name
    script.write_text(_COMMAND)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MASENVS_"))}
    clean.pop("LD_PRELOAD", None)
    out = subprocess.run(
        [sys.executable, str(script)], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _need_jemalloc() -> None:
    import ctypes.util

    if ctypes.util.find_library("jemalloc") is None:
        assert not os.environ.get("CI"), ".ci/run installs libjemalloc2"
        pytest.skip("libjemalloc is not installed (apt-get install libjemalloc2)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc")
def test_the_masenvs_command_restarts_with_jemalloc_by_default_and_its_children_do_not(
    tmp_path: Path,
) -> None:
    _need_jemalloc()
    # auto (unset): jemalloc with the restart's MALLOC_CONF in effect (background thread),
    # and the preload and the conf gone from the environment the command's children get.
    assert _command(tmp_path) == ["jemalloc", "None", "None", "None", "None", "True"]
    # The same with MASENVS_MALLOC=jemalloc, and from any Python program (explicit request).
    assert _command(tmp_path, MASENVS_MALLOC="jemalloc")[0] == "jemalloc"
    assert _command(tmp_path, "program.py", MASENVS_MALLOC="jemalloc")[0] == "jemalloc"
    # A user's own MALLOC_CONF is theirs: kept, and handed on.
    mine = _command(tmp_path, MALLOC_CONF="narenas:2")
    assert mine[:5] == ["jemalloc", "None", "narenas:2", "None", "narenas:2"], mine
    # A program that only imports masenvs (pytest, a notebook calling main()) is never
    # restarted in auto mode, and MASENVS_MALLOC=lean keeps glibc in the command too.
    assert _command(tmp_path, "program.py")[0] == "lean"
    assert _command(tmp_path, MASENVS_MALLOC="lean")[0] == "lean"


def test_auto_mode_without_the_library_or_off_the_command_tunes_glibc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ctypes.util

    from masenvs import memory

    def no_restart(*args: object) -> None:
        raise AssertionError("restarted")

    monkeypatch.delenv("MASENVS_MALLOC", raising=False)
    monkeypatch.setattr(memory.os, "execve", no_restart)
    monkeypatch.setattr(memory, "jemalloc_loaded", lambda: False)
    monkeypatch.setattr(memory, "_is_masenvs_command", lambda: True)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    memory.restart_with_jemalloc()  # no library: no restart, no error
    assert memory.allocator() == "lean"
    if sys.platform.startswith("linux"):  # the run's log says how to get the faster one
        assert "apt-get install libjemalloc2" in memory.allocator_note()
    monkeypatch.setenv("MASENVS_MALLOC", "lean")  # chosen: no advice
    assert memory.allocator_note() == "lean"
    monkeypatch.delenv("MASENVS_MALLOC")
    # Preloaded but not loaded (a broken library): a warning, glibc tuned, no restart loop.
    # The restarted command is told by its -X option (python -X masenvs_jemalloc=LIBRARY).
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libjemalloc.so.2")
    monkeypatch.setitem(sys._xoptions, "masenvs_jemalloc", "libjemalloc.so.2")
    monkeypatch.setenv("LD_PRELOAD", "libjemalloc.so.2")
    memory.restart_with_jemalloc()
    assert "LD_PRELOAD" not in os.environ and "masenvs_jemalloc" not in sys._xoptions
    monkeypatch.setitem(sys._xoptions, "masenvs_jemalloc", "libjemalloc.so.2")
    monkeypatch.setenv("MASENVS_MALLOC", "jemalloc")  # asked for explicitly: an error
    with pytest.raises(ValueError, match="preloaded but did not load"):
        memory.restart_with_jemalloc()


def test_jemalloc_mode_without_the_library_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ctypes.util

    from masenvs import memory

    monkeypatch.setenv("MASENVS_MALLOC", "jemalloc")
    monkeypatch.setattr(memory, "jemalloc_loaded", lambda: False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with pytest.raises(ValueError, match="apt-get install libjemalloc2"):
        memory.restart_with_jemalloc()
    monkeypatch.setenv("MASENVS_MALLOC", "jemaloc")  # a typo is not a silent default
    with pytest.raises(ValueError, match="jemalloc .*default"):
        memory.restart_with_jemalloc()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc")
def test_an_inherited_variable_cannot_forge_the_restart(tmp_path: Path) -> None:
    _need_jemalloc()
    # The restart's state travels in the restarted command's own argv, never in a variable
    # that a parent could set: a forged one preloads nothing into children and does not turn
    # jemalloc off.
    forged = {"MASENVS_JEMALLOC_RESTARTED": "/tmp/evil.so", "MASENVS_JEMALLOC_SET_CONF": "1"}
    assert _command(tmp_path, **forged) == ["jemalloc", "None", "None", "None", "None", "True"]
    # jemalloc preloaded by the user: their preload and their MALLOC_CONF stay as they are.
    mine = {"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": "narenas:2"}
    out = _command(tmp_path, **forged, **mine)
    assert out[:5] == ["jemalloc", "libjemalloc.so.2", "narenas:2", "libjemalloc.so.2", "narenas:2"]
    # What the restart adds is all it takes away: a user's own preload reaches the children.
    out = _command(tmp_path, LD_PRELOAD="libm.so.6")
    assert out == ["jemalloc", "libm.so.6", "None", "libm.so.6", "None", "True"], out


def test_the_restart_hands_on_no_forged_state(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes.util

    from masenvs import memory

    restarts = []
    monkeypatch.setattr(memory.os, "execve", lambda *args: restarts.append(args))
    monkeypatch.setattr(memory, "jemalloc_loaded", lambda: False)
    monkeypatch.setattr(memory, "_is_masenvs_command", lambda: True)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libjemalloc.so.2")
    monkeypatch.delenv("MASENVS_MALLOC", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "libm.so.6")
    # What older versions took as the parent's LD_PRELOAD, set by whoever started us.
    monkeypatch.setenv("MASENVS_JEMALLOC_RESTARTED", "/tmp/evil.so")
    monkeypatch.setenv("MASENVS_JEMALLOC_SET_CONF", "1")
    memory.restart_with_jemalloc()
    ((executable, argv, env),) = restarts  # restarted, jemalloc not turned off
    assert executable == sys.executable
    assert argv[1:3] == ["-X", "masenvs_jemalloc=+libjemalloc.so.2"]  # state in argv only
    assert argv[3:] == sys.orig_argv[1:]
    assert env["LD_PRELOAD"] == "libm.so.6 libjemalloc.so.2"
    assert env["MALLOC_CONF"] == memory.JEMALLOC_CONF
    assert not any("evil" in value for value in env.values())
    assert not any(name.startswith("MASENVS_JEMALLOC") for name in [*env, *os.environ])

"""Memory is bounded per run, not per process: a run's children share its `memory_mb`."""

from __future__ import annotations

import textwrap

import pytest

from masenvs.sandbox import Sandbox, SandboxLimits

CHILDREN = textwrap.dedent(
    """
    import os, sys, time
    mb = int(sys.argv[1])
    pids = []
    for _ in range(6):
        pid = os.fork()
        if pid == 0:
            try:
                block = b"x" * (mb << 20)  # written, so resident
                time.sleep(1.0)
                os._exit(0)
            except MemoryError:
                os._exit(3)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    print(codes)
    sys.exit(0 if codes == [0] * 6 else 1)
    """
)


def test_six_children_share_one_memory_budget() -> None:
    limits = SandboxLimits(cpu_seconds=10, wall_seconds=10, memory_mb=256)
    with Sandbox(limits) as sb:
        # One child alone fits the budget; six at once (6 x 120 MB) do not.
        alone = sb.run(
            CHILDREN.replace("range(6)", "range(1)").replace("[0] * 6", "[0]"), args=["120"]
        )
        assert alone.ok, alone.stderr
        res = sb.run(CHILDREN, args=["120"])
        assert res.verdict == "memory", (res.verdict, res.stdout, res.stderr)
        assert any(word in " ".join(sb.isolation.notes) for word in ("cgroup", "memory"))


def test_a_run_within_its_budget_is_ok_whatever_the_runs_before_it() -> None:
    with Sandbox(SandboxLimits(cpu_seconds=10, wall_seconds=10, memory_mb=128)) as sb:
        for memory_mb in (128, 512, 128, 512):  # one uid slot's cgroup, lowered and raised
            limits = SandboxLimits(cpu_seconds=10, wall_seconds=10, memory_mb=memory_mb)
            res = sb.run(CHILDREN, args=[str(memory_mb // 16)], limits=limits)
            assert res.ok, (memory_mb, res.verdict, res.stdout, res.stderr)


def test_without_a_cgroup_the_rlimits_split_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no memory cgroup can be made, the six children cannot hold 6 x 120 MB either:
    memory_mb is split between fewer processes, and the notes say so."""
    from masenvs.sandbox import cgroup

    monkeypatch.setattr(cgroup, "server_cgroup", lambda notes: None)
    limits = SandboxLimits(cpu_seconds=10, wall_seconds=10, memory_mb=256)
    with Sandbox(limits) as sb:
        assert not sb.isolation.memory_cgroup
        assert any("NO CGROUP" in note for note in sb.isolation.notes)
        res = sb.run(CHILDREN, args=["120"])
        assert not res.ok, (res.verdict, res.stdout, res.stderr)
        numpy = sb.run("import numpy\nprint(numpy.ones(1000).sum())")  # still fits a process
        assert numpy.ok and numpy.stdout == "1000.0\n", numpy.stderr

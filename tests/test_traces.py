"""The trace store: records round-trip, survive a killed writer, export as a dataset."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from masenvs.traces import CallRecord, ChoiceRecord, EpisodeRecord, TraceStore, new_call_id


def make_call(rollout_id: str | None, agent: str, index: int, text: str = "hi") -> CallRecord:
    return CallRecord(
        id=new_call_id(),
        rollout_id=rollout_id,
        agent=agent,
        model=f"{agent}_lora",
        call_index=index,
        kind="chat",
        prompt_token_ids=[1, 2, 3],
        choices=[
            ChoiceRecord(
                index=0,
                text=text,
                token_ids=[7, 8],
                logprobs=[-0.5, -1.25],
                finish_reason="stop",
                top_logprobs=[{7: -0.5, 9: -2.0}, {8: -1.25}],
            )
        ],
        messages=[{"role": "user", "content": "hello"}],
        params={"temperature": 1.0, "max_tokens": 16},
        backend="embedded",
        tokenizer_id="tok",
        policy_version=3,
        started_at=100.0,
        finished_at=100.5,
        metadata={"task": "t1"},
    )


def test_records_round_trip_with_int_token_ids_in_top_logprobs(tmp_path: Path) -> None:
    store = TraceStore(tmp_path / "traces")
    call = make_call("r1", "planner", 0)
    store.append(call)
    store.append(EpisodeRecord("r1", "task-1", "sudoku", {"planner": 1.0}, success=True))
    (read,) = store.calls()
    assert read == call
    assert read.choices[0].top_logprobs == [{7: -0.5, 9: -2.0}, {8: -1.25}]
    assert read.latency_s == pytest.approx(0.5)
    (episode,) = store.episodes()
    assert episode.rewards == {"planner": 1.0} and episode.success


def test_filters_by_rollout_and_agent_and_orders_a_rollout(tmp_path: Path) -> None:
    store = TraceStore(tmp_path)
    store.append(make_call("r1", "tool", 1))
    store.append(make_call("r2", "tool", 0))
    store.append(make_call("r1", "plan", 0))
    store.append(make_call("r1", "tool", 0))
    assert [(c.agent, c.call_index) for c in store.rollout("r1")] == [
        ("plan", 0),
        ("tool", 0),
        ("tool", 1),
    ]
    assert {c.rollout_id for c in store.calls(agent="tool")} == {"r1", "r2"}
    assert len(list(store.calls(rollout_id="r2"))) == 1


def test_reader_skips_a_torn_last_line(tmp_path: Path) -> None:
    store = TraceStore(tmp_path)
    store.append(make_call("r1", "a", 0))
    store.append(make_call("r1", "a", 1))
    store.close()
    (segment,) = store.segments()
    whole = segment.read_bytes()
    segment.write_bytes(whole[: len(whole) - 40])  # cut the second record mid-line
    assert [c.call_index for c in TraceStore(tmp_path).calls()] == [0]


def test_segments_roll_over_and_keep_order(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, segment_bytes=2000)
    for i in range(20):
        store.append(make_call("r", "a", i))
    assert len(store.segments()) > 3
    assert [c.call_index for c in store.calls()] == list(range(20))


@pytest.mark.parametrize("durability", ["flush", "fsync"])
def test_concurrent_writers_never_interleave_lines(tmp_path: Path, durability: str) -> None:
    store = TraceStore(tmp_path, durability=durability, segment_bytes=50_000)

    def write(agent: str) -> None:
        for i in range(50):
            store.append(make_call("r", agent, i, text=agent * 200))

    threads = [threading.Thread(target=write, args=(f"agent{k}",)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    calls = list(store.calls())
    assert len(calls) == 400
    for agent in (f"agent{k}" for k in range(8)):
        mine = [c for c in calls if c.agent == agent]
        assert [c.call_index for c in mine] == list(range(50))
        assert all(c.choices[0].text == agent * 200 for c in mine)


def test_append_async_from_many_tasks(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, durability="fsync")

    async def main() -> None:
        await asyncio.gather(*(store.append_async(make_call("r", "a", i)) for i in range(32)))

    asyncio.run(main())
    assert sorted(c.call_index for c in store.calls()) == list(range(32))


def test_records_survive_kill_9_of_the_writer(tmp_path: Path) -> None:
    # The child appends records and says so after each; we kill it without warning.
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_traces import make_call
        from masenvs.traces import TraceStore
        store = TraceStore({str(tmp_path)!r})
        for i in range(25):
            store.append(make_call("r", "a", i))
            print(i, flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    acknowledged = [int(child.stdout.readline()) for _ in range(25)]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert [c.call_index for c in TraceStore(tmp_path).calls()] == acknowledged


def test_two_processes_write_separate_segments(tmp_path: Path) -> None:
    first, second = TraceStore(tmp_path), TraceStore(tmp_path)
    first.append(make_call("r", "a", 0))
    second.append(make_call("r", "b", 0))
    assert len(first.segments()) == 2
    assert {c.agent for c in TraceStore(tmp_path).calls()} == {"a", "b"}


def test_to_dataset_has_one_row_per_choice_joined_with_episode_rewards(tmp_path: Path) -> None:
    store = TraceStore(tmp_path)
    call = make_call("r1", "planner", 0)
    call.choices.append(
        ChoiceRecord(index=1, text="yo", token_ids=[5], logprobs=[-0.1], finish_reason="length")
    )
    store.append(call)
    store.append(make_call(None, "planner", 0))  # a served call outside any rollout
    store.append(EpisodeRecord("r1", "task-9", "math", {"planner": 0.75}, success=False))
    ds = store.to_dataset()
    assert len(ds) == 3
    first, second, served = ds[0], ds[1], ds[2]
    assert first["completion_token_ids"] == [7, 8] and second["completion_token_ids"] == [5]
    assert first["prompt_token_ids"] == [1, 2, 3]
    assert first["reward"] == 0.75 and first["task_id"] == "task-9" and first["success"] is False
    assert served["rollout_id"] is None and served["reward"] is None
    assert json.loads(first["messages"]) == [{"role": "user", "content": "hello"}]


def test_a_file_path_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(NotADirectoryError, match="give a directory"):
        TraceStore(target)


def test_reading_a_missing_store_yields_nothing_and_creates_nothing(tmp_path: Path) -> None:
    store = TraceStore(tmp_path / "none")
    assert list(store.calls()) == [] and list(store.episodes()) == []
    assert not (tmp_path / "none").exists()

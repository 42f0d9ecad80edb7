"""Task sources: each Hugging Face format from local fixtures, JSONL round trips, clear errors.

The fixtures in tests/data/hf/ copy the real datasets' columns (two or three rows each) and
go through the same `datasets` loading and conversion as a download would.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest

import masenvs
from masenvs.tasks import (
    HF_DATASETS,
    CodeTask,
    MathTask,
    TaskSourceError,
    TestCase,
    load_hf,
    open_source,
    read_jsonl,
    write_jsonl,
)
from masenvs.tasks.code_judge import CodeJudge, Suite
from masenvs.tasks.hf_rows import decode_lcb_tests

FIXTURES = Path(__file__).parent / "data" / "hf"


def fixture(key: str) -> list:
    return load_hf(key, data_path=FIXTURES / f"{key}.jsonl")


# --- each dataset's format ------------------------------------------------------------------


def test_every_dataset_has_a_fixture_in_its_own_format() -> None:
    assert {p.stem for p in FIXTURES.glob("*.jsonl")} == set(HF_DATASETS)


def test_aime_math500_olympiad_gsm8k() -> None:
    aime24 = fixture("aime2024")
    assert [(t.id, t.answer) for t in aime24] == [
        ("aime2024/2024-I-1", "24"),
        ("aime2024/2024-II-4", "30"),
    ]
    assert aime24[0].source == "aime2024" and "1024" in aime24[0].solution
    assert [t.answer for t in fixture("aime2025")] == ["28", "120"]
    math500 = fixture("math500")
    assert math500[0].id == "test/precalculus/807.json"
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math500[0].meta == {"subject": "Precalculus", "level": 2}
    olympiad = fixture("olympiadbench")  # the row without a final answer is dropped
    assert [(t.id, t.answer) for t in olympiad] == [
        ("olympiadbench/1606", "10"),
        ("olympiadbench/1700", "-2, 2"),
    ]
    gsm = fixture("gsm8k")
    assert [t.answer for t in gsm] == ["72", "5000"]  # after "####", thousands separator gone
    assert "<<48/2=24>>" in gsm[0].solution and "####" not in gsm[0].solution


def test_dapo_prompt_template_is_stripped_and_duplicates_dropped() -> None:
    tasks = fixture("dapo17k")
    assert len(tasks) == 2
    assert tasks[0].question.startswith("In triangle $ABC$") and tasks[0].question.endswith("$AC$.")
    assert tasks[0].answer == "5" and tasks[0].id == "dapo17k/9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"


def test_apps_stdin_and_call_based_rows() -> None:
    tasks = {t.id: t for t in fixture("apps")}
    assert set(tasks) == {"apps/4000", "apps/4001", "apps/4003"}  # 4002 has no tests
    stdin = tasks["apps/4000"]
    assert stdin.fn_name is None and stdin.tests[1] == TestCase("-5 5\n", "0\n")
    assert stdin.reference_solution.startswith("a, b = map(int")
    call = tasks["apps/4001"]
    assert call.fn_name == "largest" and call.tests[0] == TestCase([[1, 5, 3]], [5])
    assert call.starter_code.startswith("def largest(xs):")
    assert tasks["apps/4003"].tests[0] == TestCase("2\n1 2", "2\n4")  # lists of lines joined


def test_code_contests_tests_and_python3_reference() -> None:
    first, second = fixture("code_contests")
    assert first.id == "code_contests/1_A. Max of Three"
    assert first.tests == (TestCase("5 1 2\n", "5\n"), TestCase("-1 -2 -3\n", "-1\n"))
    assert first.public_tests == (TestCase("1 2 3\n", "3\n"),)
    assert first.reference_solution == "print(max(map(int, input().split())))\n"
    assert second.tests[0] == TestCase("1\n", "0.500000\n")  # no private tests: generated ones
    assert second.reference_solution is None  # only C++


def test_livecodebench_compressed_tests_and_functional_rows() -> None:
    stdin, functional = fixture("livecodebench")
    assert stdin.fn_name is None and [t.output for t in stdin.tests] == ["2\n", "42\n", "0\n"]
    assert stdin.public_tests == (TestCase("1\n", "2\n"),)
    assert functional.fn_name == "countPairs" and "class Solution" in functional.starter_code
    assert functional.tests[1] == TestCase([[-6, 2, 5, -2, -7, -1, 3], -2], 10)


def test_converted_code_tasks_run_in_the_judge() -> None:
    apps = {t.id: t for t in fixture("apps")}
    lcb = fixture("livecodebench")[1]
    suites = [Suite(t.reference_solution, t.tests, t.fn_name) for t in apps.values()]
    suites.append(
        Suite(
            "class Solution:\n    def countPairs(self, nums: List[int], target: int) -> int:\n"
            "        return sum(a + b < target for i, a in enumerate(nums) for b in nums[i + 1:])",
            lcb.tests,
            lcb.fn_name,
        )
    )
    assert [r.pass_rate for r in CodeJudge().run_many(suites)] == [1.0] * 4


def test_lcb_decoding_refuses_pickles_that_import_code() -> None:
    import base64
    import zlib

    evil = base64.b64encode(zlib.compress(pickle.dumps(os.getcwd))).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_lcb_tests(evil)
    plain = base64.b64encode(zlib.compress(pickle.dumps('[{"input": "1", "output": "2"}]')))
    assert decode_lcb_tests(plain.decode()) == [{"input": "1", "output": "2"}]


# --- the local copies a user points to ------------------------------------------------------


def test_parquet_file_and_save_to_disk_directory(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in (FIXTURES / "math500.jsonl").read_text().splitlines()]
    dataset = datasets.Dataset.from_list(rows)
    dataset.to_parquet(tmp_path / "test-00000-of-00001.parquet")
    datasets.DatasetDict({"test": dataset}).save_to_disk(tmp_path / "saved")
    expected = fixture("math500")
    assert load_hf("math500", data_path=tmp_path / "test-00000-of-00001.parquet") == expected
    assert load_hf("math500", data_path=tmp_path / "saved") == expected
    with pytest.raises(TaskSourceError, match="not 'train'"):
        load_hf("math500", split="train", data_path=tmp_path / "saved")


def test_snapshot_of_a_script_only_repo_reads_its_raw_file(tmp_path: Path) -> None:
    # codeparrot/apps ships apps.py plus test.jsonl; datasets >= 4 refuses the script.
    (tmp_path / "apps.py").write_text("raise SystemExit('loading scripts are not run')\n")
    (tmp_path / "test.jsonl").write_text((FIXTURES / "apps.jsonl").read_text())
    assert [t.id for t in load_hf("apps", data_path=tmp_path)] == [t.id for t in fixture("apps")]


def test_env_config_reads_a_dataset_from_a_local_copy() -> None:
    env = masenvs.make(
        "code", source="hf:code_contests", data_path=str(FIXTURES / "code_contests.jsonl")
    )
    env.reset(seed=0)
    assert env.task.source == "code_contests"
    _, rewards, *_ = env.step(
        {"coder": f"```python\n{env.task.reference_solution or 'print(1)'}\n```", "tester": ""}
    )
    assert np.isfinite(rewards["coder"])


# --- JSONL in our format --------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path: Path) -> None:
    math_tasks = [MathTask("m1", "What is 1+1?", "2", meta={"level": 1}), *fixture("math500")]
    code_tasks = [*fixture("apps"), *fixture("livecodebench")]
    write_jsonl(math_tasks, tmp_path / "math.jsonl")
    write_jsonl(code_tasks, tmp_path / "code.jsonl")
    assert read_jsonl(tmp_path / "math.jsonl", "math") == math_tasks
    assert read_jsonl(tmp_path / "code.jsonl") == code_tasks  # kind guessed from the keys
    assert read_jsonl(tmp_path / "math.jsonl")[0].meta == {"level": 1}


def test_jsonl_source_in_an_env(tmp_path: Path) -> None:
    write_jsonl([MathTask("only", "What is 3*3?", "9")], tmp_path / "one.jsonl")
    env = masenvs.make("math", source=f"jsonl:{tmp_path / 'one.jsonl'}", single_agent=True)
    env.reset(seed=5)
    _, rewards, *_ = env.step({"reasoner": "\\boxed{9}"})
    assert env.task.id == "only" and rewards["reasoner"] == 2.0


def test_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok?", "answer": "1"}\n{"question": "no answer"}\n')
    with pytest.raises(TaskSourceError, match=r"bad\.jsonl:2: .*no answer"):
        read_jsonl(path, "math")
    code = CodeTask.from_dict({"prompt": "p", "tests": [{"input": "1", "output": "1"}]})
    write_jsonl([code], tmp_path / "code.jsonl")
    with pytest.raises(TaskSourceError, match="code.jsonl:1"):
        read_jsonl(tmp_path / "code.jsonl", "math")


# --- errors ---------------------------------------------------------------------------------


def test_missing_dataset_offline_is_one_clear_sentence(tmp_path: Path) -> None:
    # A real process with the Hub unreachable (offline mode; an empty cache).
    script = (
        "import masenvs\n"
        "from masenvs.tasks import TaskSourceError\n"
        "try:\n"
        "    masenvs.make('math', source='hf:aime2024')\n"
        "except TaskSourceError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    message = done.stdout.strip()
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "\n" not in message
    assert "Maxwell-Jia/AIME_2024" in message and "data_path" in message and "HF_HOME" in message


def test_source_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TaskSourceError, match="does not exist"):
        load_hf("gsm8k", data_path=tmp_path / "nowhere")
    with pytest.raises(TaskSourceError, match="holds code tasks"):
        masenvs.make("math", source="hf:apps")
    with pytest.raises(TaskSourceError, match="unknown dataset 'mmlu'"):
        masenvs.make("math", source="hf:mmlu")
    with pytest.raises(TaskSourceError, match="unknown task source"):
        masenvs.make("code", source="leetcode")
    with pytest.raises(TaskSourceError, match='"builtin"'):
        open_source("generated", "code")
    with pytest.raises(TaskSourceError, match="expected columns"):
        load_hf("aime2024", data_path=FIXTURES / "gsm8k.jsonl")

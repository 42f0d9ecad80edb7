"""Verilog env: goldens pass, wrong designs and fuzzed actions fail, hostile designs are
contained and reported, the verifier's models are graded, loaders read their layouts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masenvs
from masenvs.tasks.verilog_judge import Sim, VerilogJudge, VerilogTask, compare
from masenvs.tasks.verilog_loaders import load_verilog_tasks, parse_module
from masenvs.tasks.verilog_problems import PROBLEMS, build_task, builtin_tasks

DATA = Path(__file__).parent / "data"
TASKS = {t.id: t for t in builtin_tasks()}


def fenced(code: str, lang: str = "verilog") -> str:
    return f"Here it is.\n```{lang}\n{code}\n```\n"


def env_on(task_id: str, **config) -> masenvs.MASEnv:
    env = masenvs.make("verilog", **config)
    env.reset(seed=0, options={"task": TASKS[task_id]})
    return env


# Reference models in Python, as a verifier would write them.
MODELS = {
    "adder_8bit": """
class RefModel:
    def step(self, i):
        s = i["a"] + i["b"] + i["cin"]
        return {"sum": s & 255, "cout": s >> 8}

def stimulus():
    return [{"a": 255, "b": 1, "cin": 0}, {"a": 100, "b": 27, "cin": 1}, {"a": 0, "b": 0}]
""",
    "priority_encoder_8": """
class RefModel:
    def step(self, i):
        n = i["in"]
        return {"pos": n.bit_length() - 1 if n else 0, "valid": int(n != 0)}
""",
    "decade_counter": """
class RefModel:
    def __init__(self):
        self.q = 0
    def step(self, i):
        if i["reset"]:
            self.q = 0
        elif i["en"]:
            self.q = 0 if self.q == 9 else self.q + 1
        return {"q": self.q, "tc": int(self.q == 9)}

def stimulus():
    return [{"reset": 1}] + [{"en": 1}] * 12
""",
    "sequence_101": """
class RefModel:
    def __init__(self):
        self.bits = []
        self.found = 0
    def step(self, i):
        if i["reset"]:
            self.bits, self.found = [], 0
            return {"found": 0}
        self.bits = (self.bits + [i["in"]])[-3:]
        return {"found": int(self.bits == [1, 0, 1])}
""",
    "fifo_4x8": """
class RefModel:
    def __init__(self):
        self.q = []
    def step(self, i):
        if i["reset"]:
            self.q = []
        else:
            push = i["push"] and len(self.q) < 4
            pop = i["pop"] and len(self.q) > 0
            if pop:
                self.q.pop(0)
            if push:
                self.q.append(i["din"])
        return {"dout": self.q[0] if self.q else 0, "empty": int(not self.q),
                "full": int(len(self.q) == 4)}
""",
    "round_robin_arbiter": """
class RefModel:
    def __init__(self):
        self.next, self.grant = 0, 0
    def step(self, i):
        if i["reset"]:
            self.next, self.grant = 0, 0
            return {"grant": 0}
        self.grant = 0
        for k in range(4):
            j = (self.next + k) % 4
            if i["req"] >> j & 1:
                self.grant, self.next = 1 << j, (j + 1) % 4
                break
        return {"grant": self.grant}
""",
    # Written from the specs alone, so they check the spec as much as the golden.
    "rotate_right": """
class RefModel:
    def step(self, i):
        x, n = i["in"], i["shamt"]
        return {"out": ((x >> n) | (x << (8 - n))) & 255}
""",
    "absolute_value": """
class RefModel:
    def step(self, i):
        v = i["in"] - 256 if i["in"] >= 128 else i["in"]
        return {"out": abs(v)}
""",
    "leading_zeros": """
class RefModel:
    def step(self, i):
        return {"count": 8 - i["in"].bit_length()}
""",
    "bcd_add_digit": """
class RefModel:
    def step(self, i):
        r = i["a"] + i["b"] + i["cin"]
        return {"sum": (r + 6) % 16 if r > 9 else r, "cout": int(r > 9)}
""",
    "loadable_down_counter": """
class RefModel:
    q = 0
    def step(self, i):
        if i["reset"]:
            self.q = 0
        elif i["load"]:
            self.q = i["value"]
        elif self.q:
            self.q -= 1
        return {"q": self.q, "zero": int(self.q == 0)}
""",
    "shift_register_piso": """
class RefModel:
    r = 0
    def step(self, i):
        if i["reset"]:
            self.r = 0
        elif i["load"]:
            self.r = i["data"]
        else:
            self.r = (self.r << 1) & 255
        return {"dout": self.r >> 7}
""",
    "shift_register_bidir": """
class RefModel:
    q = 0
    def step(self, i):
        m, s = i["mode"], i["sin"]
        if i["reset"]:
            self.q = 0
        elif m == 1:
            self.q = ((self.q << 1) | s) & 15
        elif m == 2:
            self.q = (self.q >> 1) | (s << 3)
        elif m == 3:
            self.q = i["d"]
        return {"q": self.q}
""",
    "lfsr_8bit": """
class RefModel:
    q = 1
    def step(self, i):
        q = self.q
        b = lambda k: q >> k & 1
        self.q = 1 if i["reset"] else ((q << 1) & 255) | (b(7) ^ b(5) ^ b(4) ^ b(3))
        return {"q": self.q}
""",
    "rising_edge_detector": """
class RefModel:
    prev = rise = 0
    def step(self, i):
        if i["reset"]:
            self.prev = self.rise = 0
        else:
            self.rise, self.prev = int(i["in"] and not self.prev), i["in"]
        return {"rise": self.rise}
""",
    "sequence_1101": """
class RefModel:
    def __init__(self):
        self.seen = []
    def step(self, i):
        if i["reset"]:
            self.seen = []
            return {"found": 0}
        self.seen.append(i["in"])
        # the longest suffix that is a prefix of 1101 (no overlap after a match)
        for k in range(min(4, len(self.seen)), 0, -1):
            if self.seen[-k:] == [1, 1, 0, 1][:k]:
                self.seen = self.seen[-k:]
                break
        else:
            self.seen = []
        if self.seen == [1, 1, 0, 1]:
            self.seen = []
            return {"found": 1}
        return {"found": 0}
""",
    "traffic_light": """
class RefModel:
    light = timer = 0
    def step(self, i):
        if i["reset"]:
            self.light = self.timer = 0
        elif self.timer == (4, 2, 3)[self.light] - 1:
            self.light, self.timer = (self.light + 1) % 3, 0
        else:
            self.timer += 1
        return {"light": self.light, "timer": self.timer}
""",
    "moving_sum": """
class RefModel:
    def __init__(self):
        self.h = [0] * 4
    def step(self, i):
        self.h = [0] * 4 if i["reset"] else [i["in"]] + self.h[:3]
        return {"sum": sum(self.h)}
""",
    "clock_divider": """
class RefModel:
    c = out = 0
    def step(self, i):
        if i["reset"]:
            self.c = self.out = 0
        elif self.c == 2:
            self.c, self.out = 0, 1 - self.out
        else:
            self.c += 1
        return {"out": self.out}
""",
    "fifo_8x4_count": """
class RefModel:
    def __init__(self):
        self.q = []
    def step(self, i):
        if i["reset"]:
            self.q = []
        else:
            w = i["wr_en"] and len(self.q) < 8
            r = i["rd_en"] and self.q
            if r:
                self.q.pop(0)
            if w:
                self.q.append(i["wdata"])
        return {"rdata": self.q[0] if self.q else 0, "count": len(self.q)}
""",
    "stack_4x8": """
class RefModel:
    def __init__(self):
        self.s = []
    def step(self, i):
        if i["reset"]:
            self.s = []
        elif i["push"]:
            if len(self.s) < 4:
                self.s.append(i["din"])
        elif i["pop"] and self.s:
            self.s.pop()
        return {"top": self.s[-1] if self.s else 0, "empty": int(not self.s),
                "full": int(len(self.s) == 4)}
""",
    "serial_adder": """
class RefModel:
    c = s = 0
    def step(self, i):
        if i["reset"]:
            self.c = self.s = 0
        else:
            t = i["a"] + i["b"] + self.c
            self.s, self.c = t & 1, t >> 1
        return {"sum": self.s}
""",
    "debounce": """
class RefModel:
    out = c = 0
    def step(self, i):
        if i["reset"]:
            self.out = self.c = 0
        elif i["in"] == self.out:
            self.c = 0
        elif self.c == 2:
            self.out, self.c = i["in"], 0
        else:
            self.c += 1
        return {"out": self.out}
""",
    "vending_machine": """
class RefModel:
    credit = vend = 0
    def step(self, i):
        if i["reset"]:
            self.credit = self.vend = 0
        else:
            total = self.credit + {1: 5, 2: 10}.get(i["coin"], 0)
            self.vend = int(total >= 15)
            self.credit = total - 15 if self.vend else total
        return {"vend": self.vend, "credit": self.credit}
""",
}


# --- the problems -------------------------------------------------------------------------------


def test_problem_set_covers_the_kinds_of_design() -> None:
    assert len(TASKS) >= 40 and len(TASKS) == len(PROBLEMS)
    assert sum(t.sequential for t in TASKS.values()) >= 15
    assert sum(not t.sequential for t in TASKS.values()) >= 15
    for word in ("adder", "mux", "encoder", "counter", "shift_register", "sequence", "fifo"):
        assert any(word in name for name in TASKS), word
    # Every input of a small combinational design (a half adder has 4 vectors), else random.
    for t in TASKS.values():
        bits = sum(p.width for p in t.inputs)
        want = 120 if t.sequential else 2**bits if bits <= 8 else 130
        assert len(t.vectors) == len(t.expected) == want, t.id


def test_every_golden_passes_its_hidden_vectors_as_a_design() -> None:
    # The goldens go through the same rules and simulation as a designer's module.
    tasks = list(TASKS.values())
    results = VerilogJudge().simulate([Sim(t, t.golden, (t.vectors,)) for t in tasks])
    checks = {t.id: compare(r, 0, t.vectors, t.expected) for t, r in zip(tasks, results)}
    assert {i: c.status for i, c in checks.items() if c.status != "pass"} == {}


def test_stored_vectors_are_what_the_goldens_give() -> None:
    judge = VerilogJudge()
    for problem in PROBLEMS[::7]:
        assert build_task(problem, judge) == TASKS[problem.id]


@pytest.mark.parametrize("task_id", sorted(MODELS))
def test_golden_reference_models_agree_on_every_hidden_vector(task_id: str) -> None:
    run = VerilogJudge().run_models(TASKS[task_id], MODELS[task_id], [TASKS[task_id].vectors])
    assert run.status == "ok", run.message
    check = compare_model(TASKS[task_id], run.outputs[0])
    assert check == len(TASKS[task_id].vectors)


def compare_model(task: VerilogTask, rows: list) -> int:
    from masenvs.tasks.verilog_judge import bits_match

    return sum(all(map(bits_match, g, w)) for g, w in zip(rows, task.expected))


# --- one episode --------------------------------------------------------------------------------


def test_golden_design_and_model_solve_the_task_in_one_round() -> None:
    env = env_on("fifo_4x8")
    _, rewards, terms, _, infos = masenvs.play_round(
        env,
        {
            "designer": fenced(TASKS["fifo_4x8"].golden),
            "verifier": fenced(MODELS["fifo_4x8"], "python"),
        },
    )
    assert all(terms.values()) and infos["designer"]["success"]
    assert infos["designer"]["reward_parts"] == {"process": 0.0, "agent": 1.0, "team": 1.0}
    assert infos["verifier"]["reward_parts"] == {"process": 0.0, "agent": 1.0, "team": 1.0}
    assert infos["verifier"]["verifier_agreement"] == 1.0


def test_wrong_design_gets_its_pass_fraction_and_sees_the_models_disagreement() -> None:
    env = env_on("adder_8bit")
    wrong = TASKS["adder_8bit"].golden.replace("a + b + cin", "a + b")  # forgets the carry in
    env.step({"designer": fenced(wrong)})
    rate = env.state.pass_rate
    assert 0.3 < rate < 0.7 and env.state.hidden_check.status == "wrong"
    env.step({"verifier": fenced(MODELS["adder_8bit"], "python")})
    feedback = env.last_feedback["designer"]
    assert "first mismatch at vector 1: inputs a=100, b=27, cin=1" in feedback
    assert "expected sum=128, cout=0, got sum=127, cout=0" in feedback
    # Next round the verifier's stimulus counts too (the golden's outputs on it).
    _, rewards, *_ = env.step({"designer": fenced(wrong)})
    assert env.state.pass_rate < rate + 0.05
    assert len(env.state.stimulus) == 3


def test_verifier_rewards_full_partial_failed_and_missing() -> None:
    wrong_model = MODELS["decade_counter"].replace("self.q == 9 else", "self.q == 8 else")
    crashing = "class RefModel:\n    def step(self, i):\n        return 1 / 0\n"
    looping = "class RefModel:\n    def step(self, i):\n        while True: pass\n"
    rewards = {}
    for name, action in {
        "right": fenced(MODELS["decade_counter"], "python"),
        "wrong": fenced(wrong_model, "python"),
        "crash": fenced(crashing, "python"),
        "loop": fenced(looping, "python"),
        "none": "I think it counts to ten.",
    }.items():
        env = env_on("decade_counter", model_timeout=1.0)
        env.step({"designer": "no design"})
        _, _, _, _, infos = env.step({"verifier": action})
        rewards[name] = infos["verifier"]["reward_parts"]["agent"]
        if name == "crash":
            assert "ZeroDivisionError" in env.last_feedback["verifier"]
        if name == "loop":
            assert "timeout" in env.last_feedback["verifier"]
    assert rewards["right"] == 1.0 and rewards["none"] == -1.0
    assert 0.0 < rewards["wrong"] < 0.5
    assert rewards["crash"] == rewards["loop"] == 0.0


def test_single_agent_designer_alone_succeeds_with_the_golden() -> None:
    env = env_on("sequence_1101", single_agent=True)
    assert env.agents == ["designer"]
    _, rewards, terms, _, infos = env.step({"designer": fenced(TASKS["sequence_1101"].golden)})
    assert terms["designer"] and infos["designer"]["success"] and rewards["designer"] == 2.0


def test_snapshot_restore_replays_the_same_judgement() -> None:
    env = env_on("popcount_8")
    snap = env.snapshot()
    first = env.step({"designer": fenced(TASKS["popcount_8"].golden.replace("+ in[i]", "+ 1"))})
    env.restore(snap)
    second = env.step({"designer": fenced(TASKS["popcount_8"].golden.replace("+ in[i]", "+ 1"))})
    assert first[1] == second[1] and first[0] == second[0]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.text(max_size=200).map(fenced),
        st.text(
            alphabet="module top_(); input output assign endmodule[]:0123456789+-&|^~", max_size=200
        ).map(fenced),
    )
)
def test_fuzzed_designs_fail(text: str) -> None:
    env = env_on("mux2_8bit", single_agent=True)
    _, rewards, _, _, infos = env.step({"designer": text})
    assert not infos["designer"]["success"] and rewards["designer"] <= 0.5


# --- hostile designs ----------------------------------------------------------------------------

HEADER = "module top_module (input [7:0] a, input [7:0] b, input sel, output [7:0] y);\n"
HOSTILE = {
    "system": ('initial $system("touch /tmp/pwned");\nassign y = a;', "forbidden", "$system"),
    "fopen": (
        'integer f;\ninitial f = $fopen("/etc/passwd", "r");\nassign y = a;',
        "forbidden",
        "$fopen",
    ),
    "readmem": (
        'reg [7:0] m [0:1];\ninitial $readmemh("/etc/hostname", m);\nassign y = a;',
        "forbidden",
        "$readmemh",
    ),
    "include": ('`include "/etc/passwd"\nassign y = a;', "forbidden", "outside the task"),
    "include_up": ('`include "../../etc/passwd"\nassign y = a;', "forbidden", "outside the task"),
    "include_macro": (
        '`define P "/etc/passwd"\n`include `P\nassign y = a;',
        "forbidden",
        "outside the task",
    ),
    # Token pasting hides the call from the text; the preprocessed text shows it.
    "macro_fopen": (
        '`define CAT(p, q) p``q\ninteger f;\ninitial f = `CAT($, fopen)("/etc/passwd", "r");\n'
        "assign y = a;",
        "forbidden",
        "$fopen is not allowed",
    ),
    "zero_delay_always": (
        "reg r = 0;\nalways #0 r = ~r;\nassign y = a;",
        "compile_error",
        "infinite loop",
    ),
    "busy_loop": ("reg r = 0;\ninitial while (1) r = ~r;\nassign y = a;", "timeout", "timeout"),
    "never_ends": ("reg r = 0;\nalways #1 r = ~r;\nassign y = sel ? b : a;", "pass", ""),
    "flood": (
        'initial while (1) $display("%0128d", 1);\nassign y = a;',
        "output_limit",
        "output limit",
    ),
    "chatty": ('always #1 $display("%0128d", 1);\nassign y = sel ? b : a;', "pass", ""),
    "finish": ("initial #20 $finish;\nassign y = sel ? b : a;", "ended_early", ""),
    "syntax": ("assign y = a +;", "compile_error", "syntax error"),
    "comb_loop": ("wire [7:0] t = ~t;\nassign y = t;", "wrong", "got y='b"),
}


def test_hostile_designs_are_contained_and_named() -> None:
    task = TASKS["mux2_8bit"]
    judge = VerilogJudge(timeout=3.0)
    start = time.monotonic()
    designs = {name: HEADER + body + "\nendmodule\n" for name, (body, _, _) in HOSTILE.items()}
    results = judge.simulate([Sim(task, d, (task.vectors,)) for d in designs.values()])
    assert time.monotonic() - start < 60
    for (name, (_, status, words)), result in zip(HOSTILE.items(), results):
        check = compare(result, 0, task.vectors, task.expected)
        assert check.status == status, (name, check.status, check.message[-300:])
        assert words in check.describe(task), (name, check.describe(task))
    assert not Path("/tmp/pwned").exists()


def test_hostile_design_in_the_env_is_reported_to_the_designer() -> None:
    env = env_on("mux2_8bit")
    _, rewards, *_ = env.step({"designer": fenced(HEADER + HOSTILE["system"][0] + "\nendmodule")})
    assert "rejected before compiling: $system is not allowed" in env.last_feedback["designer"]
    assert rewards["designer"] == 0.0
    env.step({"verifier": "none"})
    env.step({"designer": fenced(HEADER + "assign y = a +;\nendmodule")})
    assert "compile error" in env.last_feedback["designer"]
    assert "syntax error" in env.last_feedback["designer"]


# --- loaders ------------------------------------------------------------------------------------


def test_verilogeval_layout_loads_and_its_references_pass() -> None:
    tasks = {t.id: t for t in load_verilog_tasks(f"verilogeval:{DATA / 'verilogeval'}")}
    assert sorted(tasks) == ["Prob001_zero", "Prob018_vector2", "Prob031_dff8r"]
    dff = tasks["Prob031_dff8r"]
    assert dff.module == "TopModule" and dff.clock == "clk" and "module TopModule" in dff.golden
    assert [p.name for p in dff.inputs] == ["d", "reset"]
    env = masenvs.make("verilog", source=f"verilogeval:{DATA / 'verilogeval'}", single_agent=True)
    env.reset(seed=0, options={"task": dff})
    assert "module TopModule (" in env.observe("designer")
    _, rewards, *_ = env.step({"designer": fenced(dff.golden)})
    assert env.state.success


def test_rtllm_layout_loads_with_include_files_and_active_low_reset() -> None:
    tasks = {t.id: t for t in load_verilog_tasks(f"rtllm:{DATA / 'rtllm'}")}
    assert sorted(tasks) == ["Arithmetic/Adder/adder_8bit", "Control/Counter/counter_12"]
    counter = tasks["Control/Counter/counter_12"]
    assert set(counter.files) == {"defs.vh"} and counter.vectors[0][0] == 0  # rst_n asserted
    assert [p.width for p in counter.outputs] == [4]
    assert max(int(o[0], 2) for o in counter.expected) == 11
    judge = VerilogJudge()
    for task in tasks.values():
        assert judge.check_design(task, task.golden).status == "pass", task.id
    # A design may include the task's own files, and nothing else.
    assert judge.check_design(counter, counter.golden.replace("defs.vh", "../defs.vh")).status == (
        "forbidden"
    )


def test_parse_module_reads_ansi_non_ansi_and_parameters() -> None:
    name, ports = parse_module(
        "module m #(parameter W = 8, parameter D = W*2) (input clk, input [W-1:0] a, b,\n"
        "  output reg [D-1:0] y, output z); endmodule"
    )
    assert name == "m"
    assert [(p.name, p.direction, p.width) for p in ports] == [
        ("clk", "input", 1),
        ("a", "input", 8),
        ("b", "input", 8),
        ("y", "output", 16),
        ("z", "output", 1),
    ]
    _, ports = parse_module(
        "module n(x, y); // old style\n parameter N = 4;\n input [N:0] x;\n output y;\nendmodule"
    )
    assert [(p.name, p.width) for p in ports] == [("x", 5), ("y", 1)]
    with pytest.raises(ValueError, match="not declared"):
        parse_module("module k(x); endmodule")


def test_unknown_source_fails_clearly() -> None:
    with pytest.raises(Exception, match="unknown verilog source"):
        masenvs.make("verilog", source="nope:/x")
    with pytest.raises(Exception, match="does not exist"):
        masenvs.make("verilog", source="rtllm:/no/such/dir")


# --- training -----------------------------------------------------------------------------------


def test_two_tiny_training_steps_on_verilog(tmp_path: Path) -> None:
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.train import train

    overrides = [
        "env.name=verilog",
        "env.options={kind: combinational}",
        "model.name=tiny",
        "model.device=cpu",
        "backend.kind=embedded",
        "steps=2",
        "rollout.tasks_per_step=1",
        "rollout.branches=2",
        "rollout.max_tokens=8",
        "rollout.max_rounds=1",
        "rollout.concurrency=2",
        "validation.episodes=1",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        f"run_dir={tmp_path / 'run'}",
    ]
    result = train(load_config(None, overrides))
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    trained = [r for r in rows if "time/update_s" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # Random 8-token answers hold no module: both roles get the format penalty.
    assert all(r["train/success"] == 0.0 for r in trained)
    checkpoint = result.run_dir / "checkpoints" / "step_00000002"
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 2


def test_verilogeval_v1_jsonl_layout_loads() -> None:
    tasks = {t.id: t for t in load_verilog_tasks(f"verilogeval:{DATA / 'verilogeval_v1'}")}
    assert sorted(tasks) == ["dff8", "popcount3"]
    assert "population count" in tasks["popcount3"].spec and tasks["dff8"].clock == "clk"
    dff = tasks["dff8"]  # q takes d at every edge
    assert [int(o[0], 2) for o in dff.expected] == [v[0] for v in dff.vectors]
    judge = VerilogJudge()
    for task in tasks.values():
        assert judge.check_design(task, task.golden).status == "pass", task.id


def test_jsonl_source_round_trips_and_simulates_tasks_without_vectors(tmp_path: Path) -> None:
    stored = TASKS["gray_to_binary"]
    bare = {**TASKS["counter_4bit"].to_dict(), "id": "bare_counter", "vectors": [], "expected": []}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(stored.to_dict()) + "\n" + json.dumps(bare) + "\n")
    tasks = {t.id: t for t in load_verilog_tasks(f"jsonl:{path}")}
    assert tasks["gray_to_binary"] == stored
    counter = tasks["bare_counter"]
    assert len(counter.vectors) == 120 and counter.vectors[0] == (1,)  # starts in reset
    assert VerilogJudge().check_design(counter, counter.golden).status == "pass"

"""Verilog problems written for masenvs: combinational and sequential, each with a golden
module, a spec and hidden vectors.

The vectors come from seeded random stimulus (`stimulus`) and the golden's outputs on it,
simulated with Icarus Verilog; they are stored in `data/verilog_problems.json` so that an env
needs no simulator to reset. Regenerate after changing a problem:

    python -m masenvs.tasks.verilog_problems --write

Conventions every spec shares: the module is `top_module`; sequential designs change on the
rising edge of `clk` and `reset` is synchronous and active high.

Longer than 500 lines because it is data: the 58 problems as their author writes them (spec,
ports and golden Verilog side by side, one `P(...)` each), the source that the generated JSON
is built from. Split across files or moved into JSON strings they would be harder to review.
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from masenvs.tasks.verilog_judge import Port, Vector, VerilogJudge, VerilogTask

DATA = Path(__file__).with_name("data") / "verilog_problems.json"
MODULE = "top_module"
COMBINATIONAL_VECTORS = 128  # random vectors when exhaustive testing would be larger
SEQUENTIAL_CYCLES = 120
EXHAUSTIVE_BITS = 8  # combinational designs with at most this many input bits: every input


@dataclass(frozen=True)
class Problem:
    """A problem as written: `ports` as in a Verilog-2001 header (`output reg` where the
    golden assigns procedurally; the header shown to agents drops `reg`), `body` the golden's
    module body."""

    id: str
    spec: str
    ports: str
    body: str
    bias: dict[str, float] = field(default_factory=dict)  # P(1) of 1-bit inputs (default 0.5)
    reset_rate: float = 0.04  # P(reset) per cycle after the first two (which reset)

    @property
    def sequential(self) -> bool:
        return bool(re.search(r"\binput\s+clk\b", self.ports))

    def golden(self) -> str:
        return f"module {MODULE} ({self.ports});\n{self.body.strip()}\nendmodule\n"

    def port_list(self) -> tuple[Port, ...]:
        return parse_ansi_ports(self.ports)


_PORT = re.compile(
    r"\b(input|output|inout)\b\s*(?:wire|reg|logic)?\s*(?:signed)?\s*(?:\[\s*(\d+)\s*:\s*(\d+)\s*\])?\s*(\w+)"
)


def parse_ansi_ports(text: str) -> tuple[Port, ...]:
    """Ports of an ANSI header with numeric ranges: `input [7:0] a, output reg y`."""
    ports = []
    direction = width = None
    for item in text.split(","):
        match = _PORT.search(item)
        if match:
            direction = match.group(1)
            hi, lo = match.group(2), match.group(3)
            width = abs(int(hi) - int(lo)) + 1 if hi is not None else 1
            ports.append(Port(match.group(4), direction, width))
        elif direction and item.strip().isidentifier():  # `input a, b`: same declaration
            ports.append(Port(item.strip(), direction, width or 1))
    return tuple(ports)


# --- stimulus ---------------------------------------------------------------------------------


def stimulus(
    task: VerilogTask, rng: np.random.Generator, problem: Problem | None = None
) -> list[Vector]:
    """Hidden stimulus: every input combination of a small combinational design, else random
    vectors (with all-zeros and all-ones first); sequential designs start with two resets."""
    inputs = task.inputs
    bias = problem.bias if problem else {}
    reset_rate = problem.reset_rate if problem else 0.04
    if not task.sequential:
        bits = sum(p.width for p in inputs)
        if bits <= EXHAUSTIVE_BITS:
            vectors = []
            for n in range(1 << bits):
                vec, shift = [], 0
                for p in inputs:
                    vec.append((n >> shift) & ((1 << p.width) - 1))
                    shift += p.width
                vectors.append(tuple(vec))
            return vectors
        corners = [tuple(0 for _ in inputs), tuple((1 << p.width) - 1 for p in inputs)]
        return corners + [_random_vector(inputs, rng, bias) for _ in range(COMBINATIONAL_VECTORS)]
    vectors = []
    for cycle in range(SEQUENTIAL_CYCLES):
        vec = list(_random_vector(inputs, rng, bias))
        for i, p in enumerate(inputs):
            if is_reset(p.name):
                asserted = cycle < 2 or rng.random() < reset_rate
                vec[i] = int(asserted != active_low(p.name))
        vectors.append(tuple(vec))
    return vectors


def is_reset(name: str) -> bool:
    """A reset input by its usual names (`reset`, `rst`, `rst_n`, `areset`, `resetn`...)."""
    return re.fullmatch(r"a?(reset|rst)(_?n|_?b|_l)?", name.lower()) is not None


def active_low(name: str) -> bool:
    return re.search(r"(_?n|_?b|_l)$", name.lower()) is not None and is_reset(name)


def _random_vector(inputs: tuple[Port, ...], rng: np.random.Generator, bias: dict) -> Vector:
    vec = []
    for p in inputs:
        if p.width == 1:
            vec.append(int(rng.random() < bias.get(p.name, 0.5)))
        else:
            vec.append(int(rng.integers(0, 1 << min(p.width, 62))))
    return tuple(vec)


def seed_of(problem_id: str) -> int:
    return zlib.crc32(problem_id.encode())


def build_task(problem: Problem, judge: VerilogJudge | None = None) -> VerilogTask:
    """The problem with its hidden vectors and the golden's outputs, simulated now."""
    ports = problem.port_list()
    task = VerilogTask(
        id=problem.id,
        spec=problem.spec.strip(),
        module=MODULE,
        ports=ports,
        golden=problem.golden(),
        clock="clk" if problem.sequential else None,
        examples=8 if problem.sequential else 4,
    )
    vectors = stimulus(task, np.random.default_rng(seed_of(problem.id)), problem)
    (outputs,) = (judge or VerilogJudge()).golden_outputs(task, [vectors])
    if any("x" in b or "z" in b for row in outputs for b in row):
        raise RuntimeError(f"the golden of {problem.id} gives x or z: define every output")
    return VerilogTask(**{**task.__dict__, "vectors": tuple(vectors), "expected": tuple(outputs)})


@cache
def builtin_tasks() -> tuple[VerilogTask, ...]:
    """Our problems with their stored vectors (`data/verilog_problems.json`)."""
    rows = json.loads(DATA.read_text(encoding="utf-8"))
    return tuple(VerilogTask.from_dict(r) for r in rows)


# --- the problems -----------------------------------------------------------------------------

P = Problem
PROBLEMS: tuple[Problem, ...] = (
    # combinational ----------------------------------------------------------------------------
    P(
        "and_or_xor",
        "Compute the bitwise AND, OR and XOR of the 4-bit inputs a and b.",
        "input [3:0] a, input [3:0] b, output [3:0] y_and, output [3:0] y_or, output [3:0] y_xor",
        "assign y_and = a & b;\nassign y_or = a | b;\nassign y_xor = a ^ b;",
    ),
    P(
        "mux2_8bit",
        "A 2-to-1 multiplexer of 8-bit values: y = b when sel is 1, else a.",
        "input [7:0] a, input [7:0] b, input sel, output [7:0] y",
        "assign y = sel ? b : a;",
    ),
    P(
        "mux4_4bit",
        "A 4-to-1 multiplexer of 4-bit values: y is d0, d1, d2 or d3 as sel is 0, 1, 2 or 3.",
        "input [3:0] d0, input [3:0] d1, input [3:0] d2, input [3:0] d3, input [1:0] sel, "
        "output reg [3:0] y",
        "always @* case (sel)\n  2'd0: y = d0;\n  2'd1: y = d1;\n  2'd2: y = d2;\n"
        "  default: y = d3;\nendcase",
    ),
    P(
        "half_adder",
        "A half adder: sum is a XOR b, cout is a AND b.",
        "input a, input b, output sum, output cout",
        "assign sum = a ^ b;\nassign cout = a & b;",
    ),
    P(
        "full_adder",
        "A full adder of the bits a, b and cin: sum and carry out cout.",
        "input a, input b, input cin, output sum, output cout",
        "assign {cout, sum} = a + b + cin;",
    ),
    P(
        "adder_8bit",
        "Add the unsigned 8-bit a and b and the carry in cin: sum is the low 8 bits, cout the "
        "carry out.",
        "input [7:0] a, input [7:0] b, input cin, output [7:0] sum, output cout",
        "assign {cout, sum} = a + b + cin;",
    ),
    P(
        "subtractor_8bit",
        "Subtract: diff = a - b modulo 256 (8-bit unsigned); borrow is 1 when b > a.",
        "input [7:0] a, input [7:0] b, output [7:0] diff, output borrow",
        "assign diff = a - b;\nassign borrow = b > a;",
    ),
    P(
        "saturating_add",
        "Add the unsigned 8-bit a and b; when the sum does not fit in 8 bits, y is 255.",
        "input [7:0] a, input [7:0] b, output [7:0] y",
        "wire [8:0] s = a + b;\nassign y = s[8] ? 8'hff : s[7:0];",
    ),
    P(
        "priority_encoder_8",
        "A priority encoder: pos is the index of the highest set bit of in (7 for bit 7); valid "
        "is 1 when any bit is set. When in is 0, pos is 0 and valid is 0.",
        "input [7:0] in, output reg [2:0] pos, output valid",
        "integer i;\nalways @* begin\n  pos = 0;\n  for (i = 0; i < 8; i = i + 1)\n"
        "    if (in[i]) pos = i;\nend\nassign valid = |in;",
    ),
    P(
        "lowest_set_bit",
        "pos is the index of the lowest set bit of the 8-bit in (0 for bit 0); when in is 0, "
        "pos is 0 and none is 1 (else none is 0).",
        "input [7:0] in, output reg [2:0] pos, output none",
        "integer i;\nalways @* begin\n  pos = 0;\n  for (i = 7; i >= 0; i = i - 1)\n"
        "    if (in[i]) pos = i;\nend\nassign none = ~|in;",
    ),
    P(
        "decoder_3to8",
        "A 3-to-8 decoder with enable: when en is 1, y has exactly bit sel set; when en is 0, "
        "y is 0.",
        "input [2:0] sel, input en, output [7:0] y",
        "assign y = en ? (8'd1 << sel) : 8'd0;",
    ),
    P(
        "popcount_8",
        "count is the number of 1 bits in the 8-bit in.",
        "input [7:0] in, output reg [3:0] count",
        "integer i;\nalways @* begin\n  count = 0;\n  for (i = 0; i < 8; i = i + 1)\n"
        "    count = count + in[i];\nend",
    ),
    P(
        "comparator_4bit",
        "Compare the unsigned 4-bit a and b: eq is a == b, gt is a > b, lt is a < b.",
        "input [3:0] a, input [3:0] b, output eq, output gt, output lt",
        "assign eq = a == b;\nassign gt = a > b;\nassign lt = a < b;",
    ),
    P(
        "signed_less_than",
        "lt is 1 when a < b, with a and b read as 8-bit two's complement numbers.",
        "input [7:0] a, input [7:0] b, output lt",
        "assign lt = $signed(a) < $signed(b);",
    ),
    P(
        "binary_to_gray",
        "Convert the 8-bit binary number bin to Gray code: gray = bin XOR (bin >> 1).",
        "input [7:0] bin, output [7:0] gray",
        "assign gray = bin ^ (bin >> 1);",
    ),
    P(
        "gray_to_binary",
        "Convert the 8-bit Gray code gray to binary: bin[7] = gray[7] and bin[i] = bin[i+1] XOR "
        "gray[i].",
        "input [7:0] gray, output reg [7:0] bin",
        "integer i;\nalways @* begin\n  bin[7] = gray[7];\n  for (i = 6; i >= 0; i = i - 1)\n"
        "    bin[i] = bin[i + 1] ^ gray[i];\nend",
    ),
    P(
        "parity_16",
        "parity is the XOR of all 16 bits of in (1 when the number of ones is odd).",
        "input [15:0] in, output parity",
        "assign parity = ^in;",
    ),
    P(
        "bit_reverse_8",
        "out is in with its bit order reversed: out[0] = in[7], ..., out[7] = in[0].",
        "input [7:0] in, output reg [7:0] out",
        "integer i;\nalways @* for (i = 0; i < 8; i = i + 1) out[i] = in[7 - i];",
    ),
    P(
        "barrel_shift_left",
        "Shift the 8-bit in left by shamt (0 to 7) places, filling with zeros.",
        "input [7:0] in, input [2:0] shamt, output [7:0] out",
        "assign out = in << shamt;",
    ),
    P(
        "rotate_right",
        "Rotate the 8-bit in right by shamt (0 to 7) places: bits leaving at bit 0 enter at bit 7.",
        "input [7:0] in, input [2:0] shamt, output [7:0] out",
        "wire [15:0] d = {in, in} >> shamt;\nassign out = d[7:0];",
    ),
    P(
        "absolute_value",
        "in is an 8-bit two's complement number; out is its absolute value as an unsigned 8-bit "
        "number (|-128| = 128).",
        "input [7:0] in, output [7:0] out",
        "assign out = in[7] ? -in : in;",
    ),
    P(
        "max_of_three",
        "y is the largest of the unsigned 8-bit a, b and c.",
        "input [7:0] a, input [7:0] b, input [7:0] c, output [7:0] y",
        "wire [7:0] ab = a > b ? a : b;\nassign y = ab > c ? ab : c;",
    ),
    P(
        "multiplier_4bit",
        "Multiply the unsigned 4-bit a and b into the 8-bit product p.",
        "input [3:0] a, input [3:0] b, output [7:0] p",
        "assign p = a * b;",
    ),
    P(
        "alu_8bit",
        "An ALU on 8-bit a and b: op 0 gives a + b, 1 gives a - b, 2 gives a AND b, 3 gives a OR "
        "b (results modulo 256). zero is 1 when y is 0.",
        "input [7:0] a, input [7:0] b, input [1:0] op, output reg [7:0] y, output zero",
        "always @* case (op)\n  2'd0: y = a + b;\n  2'd1: y = a - b;\n  2'd2: y = a & b;\n"
        "  default: y = a | b;\nendcase\nassign zero = y == 0;",
    ),
    P(
        "seven_segment",
        "Drive a seven-segment display from the digit d. seg is {g,f,e,d,c,b,a}, 1 = segment on. "
        "Digits 0..9 give 0111111, 0000110, 1011011, 1001111, 1100110, 1101101, 1111101, "
        "0000111, 1111111, 1101111; any other d gives 0000000.",
        "input [3:0] d, output reg [6:0] seg",
        "always @* case (d)\n  4'd0: seg = 7'b0111111;\n  4'd1: seg = 7'b0000110;\n"
        "  4'd2: seg = 7'b1011011;\n  4'd3: seg = 7'b1001111;\n  4'd4: seg = 7'b1100110;\n"
        "  4'd5: seg = 7'b1101101;\n  4'd6: seg = 7'b1111101;\n  4'd7: seg = 7'b0000111;\n"
        "  4'd8: seg = 7'b1111111;\n  4'd9: seg = 7'b1101111;\n  default: seg = 7'b0000000;\n"
        "endcase",
    ),
    P(
        "thermometer",
        "Thermometer code: y has its n lowest bits set and the others clear (n is 0 to 7).",
        "input [2:0] n, output [6:0] y",
        "assign y = (7'd1 << n) - 7'd1;",
    ),
    P(
        "leading_zeros",
        "count is the number of leading zero bits of the 8-bit in, from bit 7 down (8 when in "
        "is 0).",
        "input [7:0] in, output reg [3:0] count",
        "integer i;\nreg done;\nalways @* begin\n  count = 0;\n  done = 0;\n"
        "  for (i = 7; i >= 0; i = i - 1)\n    if (!done) begin\n"
        "      if (in[i]) done = 1; else count = count + 1;\n    end\nend",
    ),
    P(
        "sign_extend",
        "Sign-extend the 4-bit two's complement in to the 8-bit out.",
        "input [3:0] in, output [7:0] out",
        "assign out = {{4{in[3]}}, in};",
    ),
    P(
        "bcd_add_digit",
        "Add two BCD digits a and b (each 0 to 9) and the carry in cin: sum is the BCD digit of "
        "the result and cout is 1 when the result is 10 or more. Inputs above 9 are added as "
        "binary numbers all the same (result = a + b + cin; if result > 9, sum = result + 6 "
        "modulo 16 and cout = 1).",
        "input [3:0] a, input [3:0] b, input cin, output [3:0] sum, output cout",
        "wire [4:0] r = a + b + cin;\nassign cout = r > 9;\nassign sum = cout ? r + 6 : r;",
    ),
    # sequential -------------------------------------------------------------------------------
    P(
        "dff_reset",
        "An 8-bit register: on each rising clock edge q takes d, or 0 when reset is 1.",
        "input clk, input reset, input [7:0] d, output reg [7:0] q",
        "always @(posedge clk) q <= reset ? 8'd0 : d;",
    ),
    P(
        "dff_enable",
        "An 8-bit register with enable: on a rising edge q takes d when en is 1 and keeps its "
        "value otherwise; reset sets q to 0 (reset wins over en).",
        "input clk, input reset, input en, input [7:0] d, output reg [7:0] q",
        "always @(posedge clk)\n  if (reset) q <= 0;\n  else if (en) q <= d;",
        bias={"en": 0.4},
    ),
    P(
        "counter_4bit",
        "A 4-bit counter: it counts up by one every clock cycle, wrapping from 15 to 0; reset "
        "sets it to 0.",
        "input clk, input reset, output reg [3:0] q",
        "always @(posedge clk) q <= reset ? 4'd0 : q + 4'd1;",
    ),
    P(
        "up_down_counter",
        "An 8-bit up/down counter: when en is 1 it counts up if up is 1 and down otherwise "
        "(modulo 256); when en is 0 it holds. reset sets it to 0.",
        "input clk, input reset, input en, input up, output reg [7:0] q",
        "always @(posedge clk)\n  if (reset) q <= 0;\n  else if (en) q <= up ? q + 1 : q - 1;",
        bias={"en": 0.7},
    ),
    P(
        "decade_counter",
        "A decade counter: q counts 0, 1, ..., 9, 0, ... one step per cycle while en is 1 and "
        "holds while en is 0; reset sets q to 0. tc is 1 when q is 9.",
        "input clk, input reset, input en, output reg [3:0] q, output tc",
        "always @(posedge clk)\n  if (reset) q <= 0;\n  else if (en) q <= q == 9 ? 4'd0 : q + 1;\n"
        "assign tc = q == 9;",
        bias={"en": 0.8},
    ),
    P(
        "loadable_down_counter",
        "A loadable down counter: when load is 1, q takes value; else when q is not 0 it counts "
        "down by one; at 0 it stays. reset sets q to 0. zero is 1 when q is 0.",
        "input clk, input reset, input load, input [7:0] value, output reg [7:0] q, output zero",
        "always @(posedge clk)\n  if (reset) q <= 0;\n  else if (load) q <= value;\n"
        "  else if (q != 0) q <= q - 1;\nassign zero = q == 0;",
        bias={"load": 0.1},
    ),
    P(
        "shift_register_sipo",
        "An 8-bit serial-in, parallel-out shift register: each cycle q shifts left by one and "
        "the serial input din enters at bit 0. reset clears q.",
        "input clk, input reset, input din, output reg [7:0] q",
        "always @(posedge clk) q <= reset ? 8'd0 : {q[6:0], din};",
    ),
    P(
        "shift_register_piso",
        "An 8-bit parallel-in, serial-out shift register: when load is 1, the register takes "
        "data; otherwise it shifts left by one, filling bit 0 with 0. dout is the register's bit "
        "7. reset clears the register.",
        "input clk, input reset, input load, input [7:0] data, output dout",
        "reg [7:0] r;\nalways @(posedge clk)\n  if (reset) r <= 0;\n  else if (load) r <= data;\n"
        "  else r <= {r[6:0], 1'b0};\nassign dout = r[7];",
        bias={"load": 0.15},
    ),
    P(
        "shift_register_bidir",
        "A 4-bit bidirectional shift register: mode 0 holds, 1 shifts left (sin enters at bit "
        "0), 2 shifts right (sin enters at bit 3), 3 loads d. reset clears q.",
        "input clk, input reset, input [1:0] mode, input sin, input [3:0] d, output reg [3:0] q",
        "always @(posedge clk)\n  if (reset) q <= 0;\n  else case (mode)\n"
        "    2'd1: q <= {q[2:0], sin};\n    2'd2: q <= {sin, q[3:1]};\n    2'd3: q <= d;\n"
        "    default: q <= q;\n  endcase",
    ),
    P(
        "lfsr_8bit",
        "An 8-bit Fibonacci LFSR: reset sets q to 1; otherwise each cycle q becomes "
        "{q[6:0], q[7] ^ q[5] ^ q[4] ^ q[3]}.",
        "input clk, input reset, output reg [7:0] q",
        "always @(posedge clk) q <= reset ? 8'd1 : {q[6:0], q[7] ^ q[5] ^ q[4] ^ q[3]};",
    ),
    P(
        "ring_counter",
        "A 4-bit ring counter: reset sets q to 0001; each cycle q rotates left by one (bit 3 "
        "goes to bit 0).",
        "input clk, input reset, output reg [3:0] q",
        "always @(posedge clk) q <= reset ? 4'b0001 : {q[2:0], q[3]};",
    ),
    P(
        "johnson_counter",
        "A 4-bit Johnson counter: reset sets q to 0; each cycle q becomes {q[2:0], ~q[3]}.",
        "input clk, input reset, output reg [3:0] q",
        "always @(posedge clk) q <= reset ? 4'd0 : {q[2:0], ~q[3]};",
    ),
    P(
        "rising_edge_detector",
        "Detect rising edges of in: rise is 1 for the one cycle after a clock edge at which in "
        "was 1 and, at the edge before, 0. Formally, at each edge rise <= in & ~prev and prev <= "
        "in. reset clears rise and prev.",
        "input clk, input reset, input in, output reg rise",
        "reg prev;\nalways @(posedge clk)\n  if (reset) begin rise <= 0; prev <= 0; end\n"
        "  else begin rise <= in & ~prev; prev <= in; end",
    ),
    P(
        "toggle_parity",
        "odd is 1 when an odd number of cycles since reset had in = 1 (in is counted at each "
        "rising edge). reset sets odd to 0.",
        "input clk, input reset, input in, output reg odd",
        "always @(posedge clk) odd <= reset ? 1'b0 : odd ^ in;",
    ),
    P(
        "sequence_101",
        "A Moore FSM that detects the bit sequence 1, 0, 1 on in, overlaps allowed: found is 1 "
        "in the cycle after the edge at which the last 1 of a 101 was sampled. reset returns to "
        "the idle state (no bits seen) with found 0.",
        "input clk, input reset, input in, output found",
        "reg [1:0] s;\n// 0: idle, 1: seen 1, 2: seen 10, 3: seen 101\n"
        "always @(posedge clk)\n  if (reset) s <= 0;\n  else case (s)\n"
        "    2'd0: s <= in ? 2'd1 : 2'd0;\n    2'd1: s <= in ? 2'd1 : 2'd2;\n"
        "    2'd2: s <= in ? 2'd3 : 2'd0;\n    default: s <= in ? 2'd1 : 2'd2;\n  endcase\n"
        "assign found = s == 3;",
    ),
    P(
        "sequence_1101",
        "A Moore FSM that detects 1, 1, 0, 1 on in without overlap: after a detection it starts "
        "afresh (the final 1 does not begin a new match). found is 1 in the cycle after the "
        "edge that completes a match. reset returns to the idle state with found 0.",
        "input clk, input reset, input in, output found",
        "reg [2:0] s;\nalways @(posedge clk)\n  if (reset) s <= 0;\n  else case (s)\n"
        "    3'd0: s <= in ? 3'd1 : 3'd0;\n    3'd1: s <= in ? 3'd2 : 3'd0;\n"
        "    3'd2: s <= in ? 3'd2 : 3'd3;\n    3'd3: s <= in ? 3'd4 : 3'd0;\n"
        "    default: s <= in ? 3'd1 : 3'd0;\n  endcase\nassign found = s == 4;",
    ),
    P(
        "traffic_light",
        "A traffic light FSM. light is 0 (green), 1 (yellow) or 2 (red); green lasts 4 cycles, "
        "yellow 2, red 3. reset goes to green with timer 0. At each other edge: when timer "
        "equals the current light's length minus 1, the light moves on (green to yellow to red "
        "to green) and timer becomes 0; else timer goes up by 1. Output timer too.",
        "input clk, input reset, output reg [1:0] light, output reg [2:0] timer",
        "wire [2:0] len = light == 0 ? 3'd4 : light == 1 ? 3'd2 : 3'd3;\n"
        "always @(posedge clk)\n  if (reset) begin light <= 0; timer <= 0; end\n"
        "  else if (timer == len - 1) begin timer <= 0; light <= light == 2 ? 2'd0 : light + 1; "
        "end\n  else timer <= timer + 1;",
        reset_rate=0.01,
    ),
    P(
        "accumulator",
        "A 12-bit accumulator: when en is 1, acc adds the 8-bit in (modulo 4096); when clear is "
        "1, acc becomes 0 (clear wins over en). reset sets acc to 0.",
        "input clk, input reset, input en, input clear, input [7:0] in, output reg [11:0] acc",
        "always @(posedge clk)\n  if (reset || clear) acc <= 0;\n  else if (en) acc <= acc + in;",
        bias={"clear": 0.05, "en": 0.7},
    ),
    P(
        "moving_sum",
        "sum is the sum of the last four values of the 8-bit in sampled at rising edges "
        "(fewer after reset: the missing ones count as 0). reset clears the history.",
        "input clk, input reset, input [7:0] in, output [9:0] sum",
        "reg [7:0] h0, h1, h2, h3;\nalways @(posedge clk)\n"
        "  if (reset) begin h0 <= 0; h1 <= 0; h2 <= 0; h3 <= 0; end\n"
        "  else begin h0 <= in; h1 <= h0; h2 <= h1; h3 <= h2; end\n"
        "assign sum = h0 + h1 + h2 + h3;",
    ),
    P(
        "clock_divider",
        "Divide by 6: out toggles every third cycle. reset sets out to 0 and the cycle count to "
        "0; the count goes 0, 1, 2 and when it is 2 at an edge, out toggles and the count "
        "returns to 0.",
        "input clk, input reset, output reg out",
        "reg [1:0] c;\nalways @(posedge clk)\n  if (reset) begin c <= 0; out <= 0; end\n"
        "  else if (c == 2) begin c <= 0; out <= ~out; end\n  else c <= c + 1;",
        reset_rate=0.01,
    ),
    P(
        "pwm",
        "A PWM generator: a 4-bit counter counts up every cycle (wrapping, reset to 0); out is "
        "1 when the counter is less than duty.",
        "input clk, input reset, input [3:0] duty, output out",
        "reg [3:0] c;\nalways @(posedge clk) c <= reset ? 4'd0 : c + 1;\nassign out = c < duty;",
    ),
    P(
        "fifo_4x8",
        "A 4-entry FIFO of bytes. At an edge, push with din is accepted when the FIFO is not "
        "full and pop removes the oldest entry when it is not empty (both may happen in one "
        "cycle; a push and a pop on a full FIFO only pops). dout shows the oldest entry (0 when "
        "empty); empty and full say how many entries are held. reset empties it.",
        "input clk, input reset, input push, input pop, input [7:0] din, output [7:0] dout, "
        "output empty, output full",
        "reg [7:0] mem [0:3];\nreg [1:0] rd, wr;\nreg [2:0] n;\n"
        "wire do_push = push && n != 4;\nwire do_pop = pop && n != 0;\n"
        "always @(posedge clk)\n  if (reset) begin rd <= 0; wr <= 0; n <= 0; end\n"
        "  else begin\n    if (do_push) begin mem[wr] <= din; wr <= wr + 1; end\n"
        "    if (do_pop) rd <= rd + 1;\n    n <= n + do_push - do_pop;\n  end\n"
        "assign empty = n == 0;\nassign full = n == 4;\nassign dout = empty ? 8'd0 : mem[rd];",
    ),
    P(
        "fifo_8x4_count",
        "An 8-entry FIFO of 4-bit values with a count. At an edge, wr_en with wdata is accepted "
        "when not full, rd_en removes the oldest entry when not empty (both may happen in one "
        "cycle; on a full FIFO only the read happens). rdata shows the oldest entry (0 when "
        "empty) and count how many entries are held. reset empties it.",
        "input clk, input reset, input wr_en, input rd_en, input [3:0] wdata, "
        "output [3:0] rdata, output [3:0] count",
        "reg [3:0] mem [0:7];\nreg [2:0] rd, wr;\nreg [3:0] n;\n"
        "wire w = wr_en && n != 8;\nwire r = rd_en && n != 0;\n"
        "always @(posedge clk)\n  if (reset) begin rd <= 0; wr <= 0; n <= 0; end\n"
        "  else begin\n    if (w) begin mem[wr] <= wdata; wr <= wr + 1; end\n"
        "    if (r) rd <= rd + 1;\n    n <= n + w - r;\n  end\n"
        "assign count = n;\nassign rdata = n == 0 ? 4'd0 : mem[rd];",
        bias={"wr_en": 0.6, "rd_en": 0.4},
    ),
    P(
        "stack_4x8",
        "A 4-entry stack (LIFO) of bytes. At an edge with push 1, din goes on top if the stack "
        "is not full (pop is then ignored); with push 0 and pop 1, the top is removed if the "
        "stack is not empty. top shows "
        "the top entry (0 when empty); empty and full flag the depth. reset empties it.",
        "input clk, input reset, input push, input pop, input [7:0] din, output [7:0] top, "
        "output empty, output full",
        "reg [7:0] mem [0:3];\nreg [2:0] n;\nalways @(posedge clk)\n  if (reset) n <= 0;\n"
        "  else if (push) begin if (n != 4) begin mem[n[1:0]] <= din; n <= n + 1; end end\n"
        "  else if (pop && n != 0) n <= n - 1;\n"
        "assign empty = n == 0;\nassign full = n == 4;\n"
        "wire [1:0] t = n[1:0] - 2'd1;\nassign top = empty ? 8'd0 : mem[t];",
    ),
    P(
        "round_robin_arbiter",
        "A 4-way round-robin arbiter. Each cycle the grant (one-hot, registered) goes to the "
        "first requester in req at or after the position just after the last granted one, "
        "wrapping around; with no request, grant is 0 and the last position is kept. After "
        "reset the search starts at requester 0 and grant is 0.",
        "input clk, input reset, input [3:0] req, output reg [3:0] grant",
        "reg [1:0] next;\nreg [1:0] k;\nreg found;\ninteger i;\nreg [3:0] g;\n"
        "always @* begin\n  g = 0; found = 0; k = 0;\n  for (i = 0; i < 4; i = i + 1) begin\n"
        "    k = next + i;\n    if (!found && req[k]) begin g = 4'd1 << k; found = 1; end\n  end\nend\n"
        "always @(posedge clk)\n  if (reset) begin grant <= 0; next <= 0; end\n"
        "  else begin\n    grant <= g;\n    if (g != 0)\n"
        "      next <= (g[0] ? 2'd1 : g[1] ? 2'd2 : g[2] ? 2'd3 : 2'd0);\n  end",
    ),
    P(
        "gray_counter",
        "A 4-bit Gray code counter: an internal binary counter counts up every cycle while en "
        "is 1 (reset to 0); q is its Gray code (b ^ (b >> 1)).",
        "input clk, input reset, input en, output [3:0] q",
        "reg [3:0] b;\nalways @(posedge clk)\n  if (reset) b <= 0;\n  else if (en) b <= b + 1;\n"
        "assign q = b ^ (b >> 1);",
        bias={"en": 0.7},
    ),
    P(
        "serial_adder",
        "A bit-serial adder: each cycle it adds the bits a and b and the stored carry; sum is "
        "the registered sum bit and the carry is stored for the next cycle. reset clears the "
        "carry and sum.",
        "input clk, input reset, input a, input b, output reg sum",
        "reg c;\nalways @(posedge clk)\n  if (reset) begin c <= 0; sum <= 0; end\n"
        "  else {c, sum} <= a + b + c;",
    ),
    P(
        "debounce",
        "A debouncer: out follows in only after in has held the same value for 3 consecutive "
        "edges. Keep a 2-bit count of consecutive edges where in differs from out: when in "
        "equals out the count is 0; else it counts up, and when it would reach 3 out takes in "
        "and the count returns to 0. reset sets out and the count to 0.",
        "input clk, input reset, input in, output reg out",
        "reg [1:0] c;\nalways @(posedge clk)\n  if (reset) begin out <= 0; c <= 0; end\n"
        "  else if (in == out) c <= 0;\n  else if (c == 2) begin out <= in; c <= 0; end\n"
        "  else c <= c + 1;",
        bias={"in": 0.5},
        reset_rate=0.02,
    ),
    P(
        "vending_machine",
        "A vending machine FSM for a 15-cent item. Each cycle coin is 0 (none), 1 (a nickel, 5 "
        "cents) or 2 (a dime, 10 cents); 3 counts as none. credit (in cents) adds each coin; "
        "when credit reaches 15 or more at an edge, vend is 1 for the next cycle and credit "
        "becomes credit - 15. Otherwise vend is 0. reset clears credit and vend.",
        "input clk, input reset, input [1:0] coin, output reg vend, output reg [4:0] credit",
        "wire [4:0] add = coin == 1 ? 5'd5 : coin == 2 ? 5'd10 : 5'd0;\n"
        "wire [4:0] total = credit + add;\nalways @(posedge clk)\n"
        "  if (reset) begin credit <= 0; vend <= 0; end\n"
        "  else if (total >= 15) begin credit <= total - 15; vend <= 1; end\n"
        "  else begin credit <= total; vend <= 0; end",
    ),
)


def main() -> None:
    parser = argparse.ArgumentParser(description="Simulate the goldens and store the vectors.")
    parser.add_argument("--write", action="store_true", help=f"write {DATA}")
    args = parser.parse_args()
    judge = VerilogJudge()
    tasks = [build_task(p, judge) for p in PROBLEMS]
    kinds = sum(t.sequential for t in tasks)
    print(
        f"{len(tasks)} problems ({kinds} sequential), {sum(len(t.vectors) for t in tasks)} vectors"
    )
    if args.write:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps([t.to_dict() for t in tasks], separators=(",", ":")) + "\n")
        print(f"wrote {DATA}")


if __name__ == "__main__":
    main()

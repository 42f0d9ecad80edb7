// VerilogEval's own testbench (not used by masenvs, which simulates RefModule instead).
module tb();
endmodule

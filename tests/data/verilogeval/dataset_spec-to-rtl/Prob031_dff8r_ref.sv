
module RefModule (
  input clk,
  input [7:0] d,
  input reset,
  output logic [7:0] q
);

  always_ff @(posedge clk)
    if (reset)
      q <= 0;
    else
      q <= d;

endmodule


`include "defs.vh"

module counter_12 #(parameter WIDTH = 4) (
    input rst_n,
    input clk,
    input valid_count,
    output reg [WIDTH-1:0] out
);
    always @(posedge clk or negedge rst_n) begin
        if (!rst_n)
            out <= 0;
        else if (valid_count) begin
            if (out == `MAX_COUNT)
                out <= 0;
            else
                out <= out + 1;
        end
    end
endmodule

`define MAX_COUNT 4'd11

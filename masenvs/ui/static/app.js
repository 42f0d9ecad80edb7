// masenvs ui: draws the curves (uPlot) of every <figure data-chart> and again after htmx
// swaps in a live page's new content. The pages themselves are rendered by the server.
"use strict";

const PALETTE = ["#2b6cb0", "#dd6b20", "#38a169", "#d53f8c", "#805ad5", "#c53030", "#319795", "#718096"];

// 1.5e-6, 0.25, 1.2k: an axis stays readable from learning rates to tokens/s
function short(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a < 1e-3) return v.toExponential(1);
  return String(+v.toPrecision(3));
}

function drawChart(figure) {
  const spec = JSON.parse(figure.querySelector("script").textContent);
  const width = Math.max(280, figure.clientWidth - 8);
  const options = {
    width: width,
    height: 220,
    legend: { live: false },
    scales: { x: { time: false } },
    axes: [
      { label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] },
      { size: 64, values: (u, splits) => splits.map(short) },
    ],
    series: [{ label: "step" }].concat(spec.series.map((s, i) => ({
      label: s.label,
      stroke: PALETTE[i % PALETTE.length],
      width: 1.5,
      spanGaps: true,
      points: { show: spec.x.length < 40 },
      dash: s.label.includes("val/") ? [6, 4] : undefined,
    }))),
  };
  const old = figure.querySelector(".uplot");
  if (old) old.remove();
  new uPlot(options, [spec.x].concat(spec.series.map((s) => s.values)), figure);
  figure.dataset.drawn = "yes";
}

function drawCharts(root) {
  root.querySelectorAll("figure[data-chart]").forEach(drawChart);
}

document.addEventListener("DOMContentLoaded", () => drawCharts(document));
document.body.addEventListener("htmx:afterSettle", (event) => drawCharts(event.detail.elt));

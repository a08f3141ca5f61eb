/* Minimal canvas line chart (no dependencies): LineChart(canvas, labels) with push(x, values) and draw(). */
(function () {
  "use strict";
  var COLORS = ["#1f6feb", "#1a7f37", "#cf222e", "#9a6700"];
  function LineChart(canvas, labels, maxPoints) {
    this.canvas = canvas; this.labels = labels; this.maxPoints = maxPoints || 120;
    this.points = []; // [x, [v0, v1, ...]]
  }
  LineChart.prototype.push = function (x, values) {
    this.points.push([x, values]);
    if (this.points.length > this.maxPoints) this.points.shift();
    this.draw();
  };
  LineChart.prototype.draw = function () {
    var c = this.canvas, g = c.getContext("2d"), w = c.width, h = c.height, pad = 28, pts = this.points;
    g.clearRect(0, 0, w, h);
    g.font = "11px system-ui"; g.fillStyle = "#5b6470"; g.strokeStyle = "#d7dbe0";
    g.strokeRect(pad, 4, w - pad - 4, h - pad);
    var lo = Infinity, hi = -Infinity, x0 = pts.length ? pts[0][0] : 0, x1 = pts.length ? pts[pts.length - 1][0] : 1;
    pts.forEach(function (p) { p[1].forEach(function (v) { if (v != null) { lo = Math.min(lo, v); hi = Math.max(hi, v); } }); });
    if (!isFinite(lo)) { lo = 0; hi = 1; }
    if (lo > 0) lo = 0;
    if (hi === lo) hi = lo + 1;
    g.fillText(String(+hi.toPrecision(3)), 2, 12); g.fillText(String(+lo.toPrecision(3)), 2, h - pad);
    var sx = function (x) { return pad + (x1 === x0 ? 0 : (x - x0) / (x1 - x0)) * (w - pad - 6); };
    var sy = function (v) { return 4 + (1 - (v - lo) / (hi - lo)) * (h - pad - 4); };
    this.labels.forEach(function (label, i) {
      g.strokeStyle = COLORS[i % COLORS.length]; g.beginPath();
      var started = false;
      pts.forEach(function (p) {
        var v = p[1][i]; if (v == null) return;
        if (started) g.lineTo(sx(p[0]), sy(v)); else { g.moveTo(sx(p[0]), sy(v)); started = true; }
      });
      g.stroke();
      g.fillStyle = COLORS[i % COLORS.length];
      g.fillText(label, pad + 6 + i * 90, h - 8);
    });
    c.dataset.points = String(pts.length);
  };
  window.LineChart = LineChart;
})();

/* Time-series charts on uPlot (vendor/uplot): KV.chart(el, opts) -> {set(xs, ys)}.
   opts: series [{label, color?, dash?}], unit (a KV.units key), stacked (bool: areas stacked bottom-up, legend
   shows each series' own value), range01 (y fixed at 0..1), height, spark (no axes/legend: a sparkline),
   markers (a function returning [{ts, label}]: dashed vertical lines, e.g. the steps of a rebalance), gaps
   (bool: a null breaks the line; without it lines span nulls).
   xs are epoch seconds; ys one array per series (null = gap). The x range is the page's window selector
   (#window, seconds: 5 min / 1 h), its ticks 24-hour local times (KV.time); the legend shows the latest
   values unless the cursor is over the plot. */
(function () {
  "use strict";
  var KV = window.KV;
  var PALETTE = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9"];
  var charts = [];
  /* a sparkline has no axis: its y range starts this share of the range below 0, so a 0 is drawn as a line
     inside the box, never on its bottom edge where the plot clips it away (a null is still no point, never a 0) */
  var SPARK_FLOOR = 0.12;

  KV.windowS = function () { var w = KV.$("#window"); return w ? Number(w.value) : 300; };

  function tint(hex, alpha) {
    var n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16) + "," + ((n >> 8) & 255) + "," + (n & 255) + "," + alpha + ")";
  }

  KV.chart = function (el, opts) {
    var unit = opts.unit || "count", fmt = function (v) { return KV.fmt(v, unit); };
    var axisFmt = unit === "%" || unit === "s" ? fmt : KV.compact;
    var raw = [[]], hovering = false;
    var series = [{ value: function (u, v) { return v == null ? "–" : KV.time.text(v); } }].concat(opts.series.map(function (s, i) {
      var color = s.color || PALETTE[i % PALETTE.length];
      return {
        label: s.label, stroke: color, width: 1.5, spanGaps: !opts.gaps, dash: s.dash,
        fill: opts.stacked ? tint(color, 0.85) : undefined,
        points: { show: false },
        value: function (u, v, si, idx) { return idx == null ? "–" : fmt(raw[si] ? raw[si][idx] : v); }
      };
    }));
    if (opts.stacked) series = [series[0]].concat(series.slice(1).reverse());  // top of the stack drawn first
    var axisFont = "12px system-ui, sans-serif";
    var uopts = {
      width: Math.max(200, el.clientWidth), height: opts.height || (opts.spark ? 40 : 200),
      cursor: opts.spark ? { show: false } : { points: { size: 6 } },
      legend: { show: !opts.spark, live: true },
      scales: {
        x: { time: true },
        y: { range: opts.range01 ? [0, 1] : function (u, min, max) {
          var top = max > 0 ? max * 1.1 : 1;
          return [opts.spark ? -top * SPARK_FLOOR : 0, top];
        } }
      },
      axes: opts.spark ? [{ show: false }, { show: false }] : [
        { stroke: "#3d4550", font: axisFont, grid: { stroke: "#e3e6ea", width: 1 }, ticks: { stroke: "#c9ced4" },
          values: timeTicks },
        { stroke: "#3d4550", font: axisFont, size: 64, grid: { stroke: "#e3e6ea", width: 1 }, ticks: { stroke: "#c9ced4" },
          incrs: unit === "reqs" || unit === "count" ? [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 1e5, 1e6] : undefined,
          label: unit === "%" || unit === "s" ? undefined : unit, labelSize: 18, labelFont: axisFont,
          values: function (u, vals) { return vals.map(axisFmt); } }
      ],
      series: series,
      hooks: {
        setCursor: [function (u) { hovering = u.cursor.idx != null && u.cursor.left >= 0; }],
        setScale: [function (u, key) { if (key === "x") el.dataset.windowS = String(Math.round(u.scales.x.max - u.scales.x.min)); }],
        draw: opts.markers ? [function (u) { drawMarkers(u, opts.markers()); }] : []
      }
    };
    var u = new window.uPlot(uopts, [[]].concat(series.slice(1).map(function () { return []; })), el);
    el.addEventListener("mouseleave", function () { hovering = false; showLatest(); });

    function showLatest() {  // the newest sample where every series has a value (else any value)
      if (hovering || opts.spark) return;
      var n = u.data[0].length, any = -1;
      for (var i = n - 1; i >= 0; i--) {
        var vals = u.data.slice(1).map(function (c) { return c[i]; });
        if (vals.every(function (v) { return v != null; })) { u.setLegend({ idx: i }); return; }
        if (any < 0 && vals.some(function (v) { return v != null; })) any = i;
      }
      if (any >= 0) u.setLegend({ idx: any });
    }
    var api = {
      uplot: u,
      set: function (xs, ys) {
        var cols = ys;
        if (opts.stacked) {
          var acc = xs.map(function () { return 0; });
          cols = ys.map(function (col) {
            return col.map(function (v, i) { acc[i] += v || 0; return v == null ? null : acc[i]; });
          });
          raw = [xs].concat(ys.slice().reverse());
          cols = cols.slice().reverse();
        } else {
          raw = [xs].concat(ys);
        }
        u.setData([xs].concat(cols), false);
        var now = xs.length ? Math.max(xs[xs.length - 1], Date.now() / 1000) : Date.now() / 1000;
        u.setScale("x", { min: now - KV.windowS(), max: now });
        el.dataset.points = String(xs.length);
        showLatest();
      }
    };
    charts.push(api);
    el.kvChart = api;  // the element's chart, for browser tests and devtools (el.kvChart.uplot.data)
    return api;
  };

  /* x ticks in the console's one time format (KV.time: local, 24-hour), never uPlot's US 12-hour default
     ("6:11pm 12/3/26"): "18:05" (with seconds when ticks are under a minute apart), the date under the
     first tick and wherever the day changes */
  function timeTicks(u, splits, axisIdx, space, incr) {
    var prev = null;
    return splits.map(function (v) {
      var day = KV.time.date(v), text = KV.time.clock(v, incr < 60);
      if (day !== prev) text += "\n" + day;
      prev = day;
      return text;
    });
  }

  function drawMarkers(u, marks) {
    var ctx = u.ctx, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
    ctx.save();
    ctx.strokeStyle = "#545d68"; ctx.fillStyle = "#3d4550"; ctx.lineWidth = 1; ctx.setLineDash([4, 4]);
    ctx.font = Math.round(11 * window.devicePixelRatio) + "px system-ui, sans-serif";
    marks.forEach(function (m, i) {
      var x = u.valToPos(m.ts, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
      var right = x > u.bbox.left + u.bbox.width * 0.85;  // near the right edge: label on the left
      ctx.textAlign = right ? "right" : "left";
      ctx.fillText(m.label, x + (right ? -3 : 3), top + 12 * window.devicePixelRatio * (1 + (i % 2)));
    });
    ctx.restore();
  }

  function resize() {
    charts.forEach(function (c) {
      var w = c.uplot.root.parentNode.clientWidth;
      if (w && Math.abs(w - c.uplot.width) > 4) c.uplot.setSize({ width: w, height: c.uplot.height });
    });
  }
  window.addEventListener("resize", resize);
  document.addEventListener("change", function (e) {  // the window selector: pages redraw on kv:window
    if (e.target.id === "window") document.dispatchEvent(new CustomEvent("kv:window"));
  });
})();

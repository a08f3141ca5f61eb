/* Capacity page: run the what-if sweep through the API and plot the served share per tier against the swept
   capacity (uPlot, numeric x axis), with the chosen pool's current configuration as a dashed line and its
   workers' page size as the replay's and a default L1 sweep around its current L1 (server-rendered, with where
   it came from); the sizing calculator starts from the selected worker's reported
   numbers. */
KV.ready(function () {
  "use strict";
  var workers = JSON.parse(KV.$("#workers-data").textContent);
  var form = KV.$("#whatif-form"), chartEl = KV.$("#whatif-chart"), plot = null;
  var COLORS = ["#2563eb", "#16a34a", "#d97706"];

  function poolChosen() {  // the replay's page size and default L1 sweep follow the pool asked about
    var chosen = form.pool.selectedOptions[0].dataset;
    form.page_size.value = chosen.pageSize;
    form.l1_tokens.value = chosen.l1Sweep;
    KV.$("#l1-source").textContent = "Default: " + chosen.l1Source;
    form.l2_tokens.value = chosen.l2;
    form.hicache_ratio.value = chosen.ratio;
    form.l3_tokens.value = chosen.l3;
    KV.$("#upper-source").textContent = "Default: " + chosen.upperSource;
  }
  form.pool.addEventListener("change", poolChosen);
  form.trace.addEventListener("change", function () {
    KV.$("#upload-row").hidden = form.trace.value !== "upload";
    var pool = form.trace.value.indexOf("pool:") === 0 ? form.trace.value.slice(5) : null;
    if (pool && pool !== form.pool.value) {  // a pool's own traffic: every pool listener follows (defaults, calibration)
      form.pool.value = pool;
      form.pool.dispatchEvent(new Event("change"));
    }
  });

  function pct(v) { return KV.fmt(v, "%"); }  // shares as the rest of the console shows them: "33.1 %"
  function tokens(v) { return v === "inf" ? "unbounded" : Number(v).toLocaleString(); }  // "2,048", as the sizing table
  function sweptTier(points, l2FollowsL1) {  // the tier whose capacity changes across the points (L1 when none does)
    var tiers = l2FollowsL1 ? ["l3", "l1"] : ["l3", "l2", "l1"];  // L2 swept by the ratio moves with L1
    for (var i = 0; i < tiers.length; i++) {
      var seen = {};
      points.forEach(function (p) { seen[p[tiers[i] + "_tokens"]] = 1; });
      if (Object.keys(seen).length > 1) return tiers[i];
    }
    return "l1";
  }
  function current(pool, tier) {  // the pool's current capacity of a tier: its first reporting worker's
    var w = workers.filter(function (x) { return x.pool === pool && x[tier + "_tokens"] != null; })[0];
    return w ? w[tier + "_tokens"] : null;
  }
  function draw(points, l2FollowsL1) {
    var tier = sweptTier(points, l2FollowsL1);
    var rows = points.filter(function (p) { return p[tier + "_tokens"] !== "inf"; });
    rows.sort(function (a, b) { return a[tier + "_tokens"] - b[tier + "_tokens"]; });
    var xs = rows.map(function (p) { return p[tier + "_tokens"]; });
    var acc = rows.map(function () { return 0; });
    var ys = ["l1", "l2", "l3"].map(function (t) {
      return rows.map(function (p, i) { acc[i] += 100 * p[t].share; return acc[i]; });
    });
    var optimum = rows.map(function (p) { return p.optimum ? 100 * p.optimum.share : null; });
    var hasOptimum = optimum.some(function (v) { return v != null; });
    var mark = current(form.pool.value, tier);
    var ceiling = points.length ? points[0].ceiling_share : null;  // the same for every point of the sweep
    var logX = xs.length > 1 && xs[0] > 0 && xs[xs.length - 1] / xs[0] >= 8;
    chartEl.dataset.xScale = logX ? "log2" : "linear";
    var opts = {
      width: Math.max(320, chartEl.clientWidth || 900), height: 300,
      // a sweep of x0.25-x16 on a linear axis crowds every point into its first tenth: log (base 2), when
      // every capacity is > 0 and they span a factor of 8 or more
      scales: { x: logX ? { time: false, distr: 3, log: 2 } : { time: false }, y: { range: [0, 100] } },
      axes: [{ label: tier.toUpperCase() + " capacity (tokens" + (logX ? ", log scale" : "") + ")", values: function (u, v) { return v.map(KV.compact); } },
             { label: "share of input tokens (%)" }],
      series: [{ label: tier.toUpperCase() + " tokens", value: function (u, v) { return v == null ? "–" : tokens(v); } }].concat(["L1", "L1 + L2", "L1 + L2 + L3"].map(function (label, i) {
        return { label: label, stroke: COLORS[i], width: 2, points: { show: true }, value: function (u, v) { return v == null ? "–" : pct(v / 100); } };
      })).concat(hasOptimum ? [{ label: "optimum (Belady's MIN, all tiers)", stroke: "#7c3aed", width: 2, dash: [8, 4],
        points: { show: true }, value: function (u, v) { return v == null ? "–" : pct(v / 100); } }] : []),
      hooks: { draw: [function (u) {
        if (ceiling != null) {  // what an unbounded cache serves: no capacity or policy goes above it
          var y = u.valToPos(100 * ceiling, "y", true), c = u.ctx;
          c.save(); c.setLineDash([2, 3]); c.strokeStyle = "#6b7280"; c.lineWidth = 2;
          c.beginPath(); c.moveTo(u.bbox.left, y); c.lineTo(u.bbox.left + u.bbox.width, y); c.stroke();
          c.fillStyle = "#374151"; c.textAlign = "right"; c.textBaseline = "bottom";
          c.font = (12 * devicePixelRatio) + "px sans-serif";
          c.fillText("ceiling " + pct(ceiling), u.bbox.left + u.bbox.width - 4 * devicePixelRatio, y - 2 * devicePixelRatio);
          c.restore();
        }
        if (mark == null) return;
        var x = u.valToPos(mark, "x", true), ctx = u.ctx;
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;  // outside the swept range
        ctx.save(); ctx.setLineDash([6, 4]); ctx.strokeStyle = "#dc2626"; ctx.lineWidth = 2;
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        ctx.fillStyle = "#dc2626"; ctx.textAlign = "left"; ctx.textBaseline = "top";
        ctx.font = (12 * devicePixelRatio) + "px sans-serif";
        ctx.fillText("current " + form.pool.value + ": " + KV.fmt(mark, "tok"), x + 6 * devicePixelRatio, u.bbox.top + 4 * devicePixelRatio);
        ctx.restore();
      }] }
    };
    if (plot) plot.destroy();
    plot = new window.uPlot(opts, [xs].concat(ys, hasOptimum ? [optimum] : []), chartEl);
    setTimeout(showLargest);  // after uPlot's first commit, which clears the legend
    chartEl.dataset.marked = mark == null ? "" : String(mark);
    KV.$("#whatif-empty").hidden = true;
    showCeiling(points, ceiling);
    KV.$("#whatif-table").hidden = false;
    var live = current(form.pool.value, "l1");
    KV.replaceRows(KV.$("#whatif-table tbody"), KV.$("#tpl-point"), points.map(function (p) {
      var label = p.l1_tokens === live ? "live configuration" : "";
      if (p.rejected) label = (label ? label + "; " : "") + p.rejected + " of " + p.requests + " requests do not fit in L1 (the engine refuses them)";
      return { label: label, l1_tokens: tokens(p.l1_tokens), l2_tokens: tokens(p.l2_tokens), l3_tokens: tokens(p.l3_tokens),
        l1: pct(p.l1.share), l2: pct(p.l2.share), l3: pct(p.l3.share), share: pct(p.share),
        optimum: p.optimum ? pct(p.optimum.share) : "—",
        lost_policy: p.lost && p.lost.policy != null ? pointsOf(p.lost.policy) : "—",
        lost_capacity: p.lost && p.lost.capacity != null ? pointsOf(p.lost.capacity) : "—" };
    }));
  }

  function pointsOf(share) { return (100 * share).toFixed(1) + " pts"; }  // a gap in points of input tokens

  function policyText() {  // the eviction policy and any admission filter the run used
    var filters = [["L2", form.l2_admission.value], ["L3", form.l3_admission.value]].filter(function (f) { return f[1] !== "none"; });
    return form.eviction.value + " policy" + filters.map(function (f) { return " with " + f[1] + " admission to " + f[0]; }).join(" and");
  }

  // Tells "the cache is too small" from "the traffic has little reuse": the best point against the ceiling.
  function showCeiling(points, ceiling) {
    var el = KV.$("#whatif-ceiling");
    el.hidden = ceiling == null;
    if (ceiling == null) return;
    var top = points.reduce(function (a, p) { return p.share > a.share ? p : a; }, points[0]);
    var best = top.share, gap = 100 * (ceiling - best);
    var split = "";
    if (gap >= 1 && top.optimum && top.lost && top.lost.capacity != null) {  // Belady's MIN at that point
      split = " Of it, " + pointsOf(Math.max(0, top.lost.capacity)) + " no eviction policy keeps at that capacity (Belady's MIN, the offline optimum, serves " +
        pct(top.optimum.share) + ") and " + (top.lost.policy >= 0
          ? pointsOf(top.lost.policy) + " a better policy would keep."
          : "the " + policyText() + " serves " + pointsOf(-top.lost.policy) + " more than that reference.");
    }
    el.textContent = "Ceiling: " + pct(ceiling) + " of input tokens repeat at all, what an unbounded cache would serve. " +
      "The best point here serves " + pct(best) + (gap < 1
        ? ": at the ceiling, so more capacity or another policy cannot raise it; only more reuse in the traffic can."
        : ", " + gap.toFixed(1) + " points below: that much is lost to capacity or the " + policyText() + "." + split);
  }

  function showLargest() {  // the legend shows the largest capacity's shares unless the cursor is on the plot
    if (plot && plot.data[0].length) plot.setLegend({ idx: plot.data[0].length - 1 });
  }
  chartEl.addEventListener("mouseleave", showLargest);

  form.addEventListener("submit", function (e) {
    e.preventDefault();
    KV.$("#whatif-error").textContent = "";
    var body = { l1_tokens: form.l1_tokens.value, l3_tokens: form.l3_tokens.value,
                 page_size: Number(form.page_size.value), eviction: form.eviction.value, write_policy: form.write_policy.value,
                 l2_admission: form.l2_admission.value, l3_admission: form.l3_admission.value };
    if (form.l2_tokens.value.trim() !== "") body.l2_tokens = form.l2_tokens.value;
    if (form.hicache_ratio.value !== "") body.hicache_ratio = Number(form.hicache_ratio.value);
    var reporting = workers.filter(function (x) { return x.pool === form.pool.value && x.kv_bytes_per_token != null; })[0];
    if (reporting) body.kv_bytes_per_token = reporting.kv_bytes_per_token;  // the worker's own, else the API's
    var ready = Promise.resolve();
    if (form.trace.value === "upload") {
      var file = form.file.files[0];
      if (!file) { KV.$("#whatif-error").textContent = "Choose a trace file to upload."; return; }
      ready = file.text().then(function (t) { body.trace_text = t; });
    } else {
      body.trace = form.trace.value;
    }
    // one engine replay per point (a child process each): show the time so far, so slow is not taken for stuck
    var started = Date.now(), status = KV.$("#whatif-status");
    function tick() { status.textContent = "Replaying… " + Math.round((Date.now() - started) / 1000) + " s"; }
    tick();
    var ticker = setInterval(tick, 1000);
    ready.then(function () { return KV.api("POST", "/api/v1/capacity/whatif/", body); })
      .finally(function () { clearInterval(ticker); })
      .then(function (res) {
        var skipped = (res.skipped || []).length ? "; skipped points: " + res.skipped.join("; ") : "";
        KV.$("#whatif-status").textContent = res.points.length + (res.points.length === 1 ? " point" : " points") + skipped;
        draw(res.points, body.hicache_ratio != null);
      })
      .catch(function (err) { KV.$("#whatif-status").textContent = ""; KV.$("#whatif-error").textContent = KV.errorText(err); });
  });

  // Calibration: the what-if at each worker's live configuration over its recorded traffic (each worker its
  // own L1 and L2, one shared L3), beside what the workers measured over the same window, in all and per tier
  // (one replay per live configuration, so it runs after the page is drawn).
  var calText = KV.$("#calibration-text");
  var TIERS = [["l1", "L1"], ["l2", "L2"], ["l3", "L3"]];
  function points(d) { return (d >= 0 ? "+" : "−") + Math.abs(d).toFixed(1); }
  function split(shares) { return TIERS.map(function (t) { return t[1] + " " + pct(shares[t[0]]); }).join(" / "); }
  // the HiCache settings a worker was replayed with and where they came from: "w0 (read 2026-12-07 06:31:28
  // UTC): prefetch threshold 32 tokens, eviction lru, write policy write_through" (+ admission filters on)
  function replayedText(w) {
    var l = w.live, parts = ["prefetch threshold " + l.prefetch_threshold.toLocaleString("en-US") + " tokens",
                             "eviction " + l.eviction, "write policy " + l.write_policy];
    if (l.l2_admission !== "none") parts.push("L2 admission " + l.l2_admission);
    if (l.l3_admission !== "none") parts.push("L3 admission " + l.l3_admission);
    var guessed = Object.keys(w.config_defaulted), source = guessed.length
      ? "engine defaults for " + guessed.join(", ") + ": " + guessed.map(function (k) { return w.config_defaulted[k]; })
          .filter(function (v, i, a) { return a.indexOf(v) === i; }).join("; ")
      : w.config_read_at ? "read " + KV.time.text(w.config_read_at) : "read from it";
    return w.worker + " (" + source + "): " + parts.join(", ");
  }
  function pair(whatif, measured) { return (whatif == null ? "–" : pct(whatif)) + " / " + (measured == null ? "–" : pct(measured)); }
  function calibrate() {
    var pool = form.pool.value, settings = KV.$("#calibration-settings");
    if (settings) settings.hidden = true;
    if (!calText || !calText.dataset.pools || calText.dataset.pools.split(" ").indexOf(pool) < 0) {
      if (calText && calText.dataset.pools) {
        calText.textContent = "No recorded traffic for pool " + pool + " yet: start its workers with --record-trace.";
        KV.$("#calibration-table").hidden = true;
      }
      return;
    }
    calText.textContent = "Replaying " + pool + "'s recorded traffic at its live configuration…";
    KV.api("GET", "/api/v1/capacity/calibration/" + encodeURIComponent(pool) + "/").then(function (r) {
      if (r.whatif_share == null || r.measured_share == null) { calText.textContent = "No calibration: " + r.note + "."; return; }
      var ws = r.workers, from = Math.min.apply(null, ws.map(function (w) { return w.from_ms; }));
      var to = Math.max.apply(null, ws.map(function (w) { return w.to_ms; }));
      var target = r.target_points, whatif = {}, measured = {};
      TIERS.forEach(function (t) { whatif[t[0]] = r.tiers[t[0]].whatif_share; measured[t[0]] = r.tiers[t[0]].measured_share; });
      var off = [["all tiers", r.difference_points]].concat(TIERS.map(function (t) { return [t[1], r.tiers[t[0]].difference_points]; }))
        .filter(function (d) { return Math.abs(d[1]) > target; });
      var defaulted = ws.filter(function (w) { return Object.keys(w.config_defaulted).length; });
      var verdict = (r.config_changes || []).length
        ? "No verdict: a worker's configuration changed inside the window (see the note), so what-if and measured do not describe the same cache."
        : defaulted.length
        ? "No verdict: the HiCache settings of " + defaulted.map(function (w) { return w.worker; }).join(", ") + " are not known, so the replay took the engine's defaults (see the note)."
        : off.length
        ? "Outside the " + target + "-point target: " + off.map(function (d) { return d[0] + " " + points(d[1]) + " points"; }).join(", ") +
          " (what-if minus measured), so the split the what-if draws is not what the workers do; see docs/capacity.md."
        : "Within the " + target + "-point target in every tier (largest difference " +
          points(TIERS.map(function (t) { return r.tiers[t[0]].difference_points; }).concat([r.difference_points])
            .reduce(function (m, d) { return Math.abs(d) > Math.abs(m) ? d : m; }, 0)) + " points).";
      calText.textContent = "Over " + r.requests.toLocaleString() + " recorded requests (" + KV.time.text(new Date(from)) +
        " to " + KV.time.text(new Date(to)) + "), replayed per worker (each its own L1 and L2, one shared L3): the what-if serves " +
        pct(r.whatif_share) + " of input tokens at the live configuration (" + split(whatif) + "); the workers measured " +
        pct(r.measured_share) + " (" + split(measured) + "). " + verdict + (r.note ? " Note: " + r.note + "." : "");
      var tbody = KV.$("#calibration-table tbody");
      tbody.textContent = "";
      function row(cells, strong) {
        var tr = document.createElement("tr");
        cells.forEach(function (v, i) {
          var td = document.createElement(i || !strong ? "td" : "th"); td.textContent = v; if (i) td.className = "num";
          if (!i && strong) td.scope = "row";
          tr.appendChild(td);
        });
        tbody.appendChild(tr);
      }
      ws.forEach(function (w) {
        var n = w.whatif_input_tokens, m = w.measured_prompt_tokens;
        row([w.worker, w.requests.toLocaleString(), w.live.l1_tokens.toLocaleString() + " / " + w.live.l2_tokens.toLocaleString()]
          .concat(TIERS.map(function (t) { return pair(n ? w.whatif_tiers[t[0]] / n : null, m ? w.measured_tiers[t[0]] / m : null); }))
          .concat([pair(n ? w.whatif_tokens_served / n : null, m ? w.measured_cached_tokens / m : null)]));
      });
      settings.replaceChildren(document.createTextNode("Replayed with each worker's live HiCache settings: "));
      ws.forEach(function (w, i) {
        var span = document.createElement("span");
        span.dataset.worker = w.worker; span.textContent = replayedText(w);
        settings.appendChild(span);
        settings.appendChild(document.createTextNode(i < ws.length - 1 ? "; " : "."));
      });
      settings.hidden = false;
      row(["Pool " + r.pool, r.requests.toLocaleString(), ""]
        .concat(TIERS.map(function (t) { return pair(whatif[t[0]], measured[t[0]]) + " (" + points(r.tiers[t[0]].difference_points) + ")"; }))
        .concat([pair(r.whatif_share, r.measured_share) + " (" + points(r.difference_points) + ")"]), true);
      KV.$("#calibration-table").hidden = false;
    }).catch(function (err) { calText.textContent = "Calibration failed: " + KV.errorText(err); });
  }
  form.pool.addEventListener("change", calibrate);
  calibrate();

  var sizing = KV.$("#sizing-form");
  function fillFromWorker() {
    var w = workers[Number(sizing.worker.value)];
    if (!w) return;
    sizing.page_size.value = w.page_size;
    sizing.tp_size.value = w.tp_size || 1;
    // bytes per token as the worker itself reports it (its model and KV dtype), never a guess
    sizing.bytes_per_token.value = w.kv_bytes_per_token == null ? "" : w.kv_bytes_per_token;
    KV.$("#bytes-source").textContent = w.kv_bytes_per_token == null
      ? w.name + " did not answer /get_model_info: enter the model's bytes per token"
      : "from " + w.name + "'s /get_model_info" + ((w.tp_size || 1) > 1 ? " (rank 0's pool: its share of the KV heads)" : "");
    if (w.l1_tokens != null) sizing.max_total_tokens.value = w.l1_tokens;
    sizing.enable_hierarchical_cache.checked = w.l2_tokens != null && w.l2_tokens > 0;
    // the engine's host pool is ratio x L1 rounded up past whole pages: undo the extra page
    if (w.l1_tokens && w.l2_tokens) sizing.hicache_ratio.value = +((w.l2_tokens - w.page_size) / w.l1_tokens).toFixed(4);
  }
  function calculate(auto) {
    KV.$("#sizing-error").textContent = "";
    if (sizing.bytes_per_token.value === "") {
      /* a worker that did not report its bytes per token: #bytes-source asks for it; nothing to size yet */
      if (!auto) KV.$("#sizing-error").textContent = "KV bytes per token: enter the model's (the worker did not report it).";
      return Promise.resolve();
    }
    var q = new URLSearchParams();
    ["bytes_per_token", "page_size", "max_total_tokens", "mem_fraction_static", "free_gpu_memory_bytes", "hicache_ratio",
     "hicache_size", "host_memory_bytes", "l3_bytes", "tp_size"].forEach(function (k) { if (sizing[k].value !== "") q.set(k, sizing[k].value); });
    q.set("enable_hierarchical_cache", sizing.enable_hierarchical_cache.checked ? "true" : "false");
    var w = workers[Number(sizing.worker.value)] || {};
    return KV.api("GET", "/api/v1/capacity/sizing/?" + q.toString()).then(function (r) {
      /* a TP-N worker has pools per rank: each holds every token for its share of the KV heads */
      KV.$("#sizing-caption").textContent = r.per_rank
        ? "Per rank (each of the " + r.tp_size + " ranks has these pools, on its own device; host RAM is shared by the ranks)"
        : "Per worker";
      KV.$("#rank-note").textContent = r.per_rank ? "L1 and L2 are sized per rank" : "";
      var tbody = KV.$("#sizing-table tbody");
      tbody.textContent = "";
      /* a tier that is not there (no L3 size entered: none attached or not measured; no L2 host pool without
         --enable-hierarchical-cache) is visibly absent, never "0 B" */
      var noL2 = !sizing.enable_hierarchical_cache.checked, noL3 = !(Number(sizing.l3_bytes.value) > 0);
      var why = { L2: "no L2 host pool without --enable-hierarchical-cache",
                  L3: "no L3 size entered: no L3 attached, or its size is not measured" };
      var reports = "not reported by " + (w.name || "the worker");
      [["L1", r.l1_tokens, r.l1_bytes, w.l1_tokens], ["L2", noL2 ? null : r.l2_tokens, noL2 ? null : r.l2_bytes, w.l2_tokens],
       ["L3", noL3 ? null : r.l3_tokens, noL3 ? null : r.l3_bytes, null]].forEach(function (row) {
        var tr = document.createElement("tr");
        row.forEach(function (v, i) {
          var td = document.createElement("td");
          if (i) td.className = "num";
          if (i && v == null) {
            td.textContent = KV.ABSENT; td.classList.add("absent");
            td.title = i === 3 ? (row[0] === "L3" ? "workers report no L3 size" : reports) : why[row[0]] || "not computed";
          } else {
            td.textContent = i === 0 ? v : i === 2 ? KV.fmt(v, "bytes") : v.toLocaleString();
          }
          tr.appendChild(td);
        });
        tbody.appendChild(tr);
      });
      var ul = KV.$("#sizing-warnings");
      ul.textContent = "";
      r.warnings.forEach(function (text) { var li = document.createElement("li"); li.textContent = text; ul.appendChild(li); });
    }).catch(function (err) { KV.$("#sizing-error").textContent = KV.errorText(err); });
  }
  sizing.worker.addEventListener("change", function () { fillFromWorker(); calculate(true); });
  sizing.addEventListener("submit", function (e) { e.preventDefault(); calculate(false); });
  fillFromWorker();
  calculate(true);

  // Load vs recompute: per worker and tier the measured crossover and the numbers behind it, the current and
  // recommended prefetch threshold, an Apply (operators) that previews before -> after and creates the
  // operation through POST /capacity/crossover/apply/, and after an applied change its TTFT p50 verdict.
  var xsection = KV.$("#crossover");
  function tok(v) { return Number(v).toLocaleString("en-US", { maximumFractionDigits: 1 }); }  // "538.5", "2,048"
  function perSec(v) { return v == null ? null : Math.round(v).toLocaleString("en-US") + " tok/s"; }
  function ms(v) { return v == null ? null : Math.round(v * 1000).toLocaleString("en-US") + " ms"; }
  var VERDICTS = { helped: "helped", no_better: "did not help", worse: "did not help (worse)",
                   not_enough_traffic_after: "too little traffic yet", not_enough_traffic_before: "too little before" };
  function count(buckets) { return (buckets || []).reduce(function (n, b) { return n + b.count; }, 0); }  // operations measured
  function settingText(v) { return v == null ? "not set" : String(v); }
  // where a worker's live setting came from (w.config: read_at, why, unreported), for titles and the preview
  function readText(at) { return "read from the worker" + (at ? " at " + KV.time.text(new Date(at)) : ""); }
  // a live setting without a value: the worker's config is not known (why), it does not report it, or unset
  function configWhy(w, k) {
    return w.current == null ? "not known: " + (w.config.why || "not read from the worker") : w.config.unreported[k] || "not set";
  }
  function crossoverRows(w) {
    var fits = w.fits, prefill = fits.prefill, rows = [];
    [["L2", "load_back"], ["L3", "prefetch"]].forEach(function (t, i) {
      var tier = w.tiers[t[0]], load = fits[t[1]];
      var cross = tier.loading_wins === "never" ? "never" : tier.crossover_tokens == null ? null
        : tok(tier.crossover_tokens) + " tok" + (tier.loading_wins === "always" ? " (always)" : "");
      var why = w.notes.join("; ") || "not measured enough";
      var row = { worker: w.worker, worker_cell: i ? "" : w.worker, tier: t[0], crossover: cross,
        load: perSec(load && load.tokens_per_s), prefill: perSec(prefill && prefill.tokens_per_s),
        samples: count(w.measured[t[1]]) + " / " + count(w.measured.prefill),
        absent: { crossover: why, load: why, prefill: why } };
      if (t[0] === "L2") {
        row.now = w.load_back_threshold.engine + " (load-back, fixed)";
        row.recommended = null; row.absent.recommended = "the engine's load-back threshold is fixed, not a setting";
      } else {
        row.now = w.current && w.current.prefetch_threshold != null ? tok(w.current.prefetch_threshold) : null;
        row.absent.now = configWhy(w, "prefetch_threshold");
        row.now_title = row.now == null ? "" : readText(w.config.read_at);
        row.recommended = w.recommended.prefetch_threshold == null ? null : tok(w.recommended.prefetch_threshold);
        row.absent.recommended = "no recommendation yet: " + why;
      }
      rows.push(row);
    });
    return rows;
  }
  function applyCell(td, w) {
    if (!Object.keys(w.recommended).length) return;
    if (!Object.keys(w.changes).length) { td.textContent = "applied"; td.className = "act muted nowrap"; td.title = "the worker runs the recommended values"; return; }
    if (!KV.canWrite) return;  // viewers see the figures, not the button
    var b = document.createElement("button");
    b.type = "button"; b.className = "apply-crossover"; b.textContent = "Apply…";
    b.setAttribute("aria-label", "Apply the recommendation to " + w.worker);
    b.addEventListener("click", function () { applyCrossover(w, b); });
    td.appendChild(b);
  }
  function applyCrossover(w, button) {
    var err = KV.$("#crossover-error");
    err.textContent = "";
    var rows = Object.keys(w.changes).sort().map(function (k) {  // before null: not known (why), or not set
      var before = w.changes[k].before;
      return { worker: w.worker + ": " + k, before: before == null ? configWhy(w, k) : settingText(before), after: settingText(w.changes[k].after) };
    });
    return KV.confirm({ title: "Apply the measured crossover to " + w.worker + "?", column: "Worker: setting", rows: rows,
      text: "This creates an apply config revision operation on " + w.worker + ": the values below become the next revision of " +
        "config profile crossover-" + w.worker + ", applied once the worker is idle, verified, audited and revertible.",
      confirmLabel: "Apply", reason: true
    }).then(function (ok) {
      if (!ok) return;
      button.disabled = true;
      return KV.api("POST", "/api/v1/capacity/crossover/apply/", { worker: w.worker, reason: KV.confirmReason() })
        .then(function (r) { location.href = "/operations/" + r.operation + "/"; });
    }).catch(function (e) { button.disabled = false; err.textContent = KV.errorText(e); });
  }
  function effectRow(w) {
    var e = w.effect, changes = Object.keys(e.changes).sort();
    return { worker: w.worker, operation: e.operation, operation_text: "#" + e.operation, applied: e.applied_at,
      change_text: changes.map(function (k) { return k.replace(/^prefetch_/, "") + " " + settingText(e.changes[k].before) + " → " + settingText(e.changes[k].after); })[0] +
        (changes.length > 1 ? " (+" + (changes.length - 1) + ")" : ""),
      before_p50: ms(e.before.ttft_p50_s), after_p50: ms(e.after.ttft_p50_s),
      requests: e.before.requests.toLocaleString("en-US") + " / " + e.after.requests.toLocaleString("en-US"),
      changes_all: changes.map(function (k) { return k + ": " + settingText(e.changes[k].before) + " → " + settingText(e.changes[k].after); }).join("; "),
      verdict_text: VERDICTS[e.verdict] || e.verdict };
  }
  function showCrossover() {
    var status = KV.$("#crossover-status");
    return KV.api("GET", "/api/v1/capacity/crossover/").then(function (r) {
      if (r.unavailable) { status.textContent = "No measured costs: " + r.unavailable + "."; return; }
      if (!r.workers.length) { status.textContent = "No worker exports measured costs (sglang:kv_cost_*) yet: a KVFleet worker with --enable-hierarchical-cache measures them from its traffic."; return; }
      status.textContent = "";
      var tbody = KV.$("#crossover-table tbody"), frag = document.createDocumentFragment();
      r.workers.forEach(function (w) {
        crossoverRows(w).forEach(function (row, i) {
          var tr = KV.fill(KV.$("#tpl-crossover-row"), row);
          tr.dataset.worker = w.worker; tr.dataset.tier = row.tier;
          if (row.now_title) KV.$("[data-f=now]", tr).title = row.now_title;
          if (i) applyCell(KV.$("td.act", tr), w);
          frag.appendChild(tr);
        });
        if (w.notes.length) {
          var note = KV.fill(KV.$("#tpl-crossover-note"), { text: "Why: " + w.notes.join("; ") + "." });
          note.dataset.worker = w.worker; frag.appendChild(note);
        }
      });
      tbody.replaceChildren(frag);
      KV.$("#crossover-table").hidden = false;
      var applied = r.workers.filter(function (w) { return w.effect; });
      KV.$("#effect-empty").hidden = applied.length > 0;
      KV.replaceRows(KV.$("#effect-table tbody"), KV.$("#tpl-effect-row"), applied.map(effectRow), function (tr, row) {
        tr.dataset.worker = row.worker; KV.$("[data-f=change_text]", tr).title = row.changes_all;
      });
      KV.$("#effect-table").hidden = !applied.length;
      var ul = KV.$("#effect-texts");
      ul.replaceChildren();
      applied.forEach(function (w) { var li = document.createElement("li"); li.dataset.worker = w.worker; li.textContent = w.worker + ": " + w.effect.text; ul.appendChild(li); });
    }).catch(function (e) { status.textContent = "Could not read the crossover: " + KV.errorText(e); })
      .then(function () { xsection.dataset.loaded = "1"; });
  }
  if (xsection) showCrossover();
});

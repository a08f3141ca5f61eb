/* Fleet page: pool cards with sparklines and the worker, host and router tables. Inventory is read once;
   each fleet.metrics push updates the live cells and pool cards in place and extends the sparklines; the
   reconciler's alert card follows fleet.alert events (js/alerts.js). */
KV.ready(function () {
  "use strict";
  var POOL_TITLES = { regular: "Regular pool", prefill: "Prefill pool", decode: "Decode pool", encoder: "Encoder pool" };
  var SPARK_S = 300;
  var workers = [], hostNames = {}, rows = {}, cards = {}, spark = {};
  var tplWorker = KV.$("#tpl-worker"), tplPool = KV.$("#tpl-pool");
  var seeds = JSON.parse(KV.$("#pool-history").textContent);  // server-side 5 min of history per pool

  /* TP cell: the rank count, and the GPUs the ranks hold (rank 0 first) when the agent reported any */
  function devicesView(w) {
    var d = w.devices || [];
    return {
      devices_text: d.length ? "GPU " + d.join(",") : "",
      devices_title: w.tp_size + (w.tp_size === 1 ? " rank" : " ranks") + (d.length ? " on GPU " + d.join(", ") : " (no GPU reported)")
    };
  }
  function matches(w, q) {
    return !q || [w.name, w.host_name, w.model_name, w.role, w.storage_backend].join(" ").toLowerCase().indexOf(q) >= 0;
  }
  function applyFilter() {
    var q = (KV.$("#filter").value || "").trim().toLowerCase();
    var shown = workers.filter(function (w) { rows[w.id].hidden = !matches(w, q); return !rows[w.id].hidden; });
    KV.$("#nomatch-query").textContent = q;
    KV.$("#workers-nomatch").hidden = !(q && workers.length && !shown.length);  // an empty table says why
  }
  function renderWorkers() {
    rows = {};
    KV.replaceRows(KV.$("#workers tbody"), tplWorker, workers, function (row, w) { rows[w.id] = row; });
    applyFilter();
    showPicked();
  }
  // cached_rate: the pool's workers' cached tokens/s, each over its own last 10 s or more (summed server-side),
  // so a push for another pool's sample does not change it. Sparkline points are placed at the pool's newest
  // sample time (server clock, p.ts), never the browser's, so the series stays sorted by time.
  function renderPools(summary) {
    var pools = summary.pools || {};
    Object.keys(pools).forEach(function (pool) {
      var p = pools[pool];
      if (!p.workers) return;
      p.cached_rate = p.reporting ? p.cached_tokens_per_s : null;
      p.absent = Object.assign({ cached_rate: (p.absent || {}).cached_tokens_per_s }, p.absent);
      p.pool = pool; p.title = POOL_TITLES[pool] || pool;
      if (pool === "encoder") {  // EPD encoders: image figures, no KV figures and no token sparklines
        if (!cards[pool]) KV.$("#pools").appendChild(cards[pool] = KV.fill(KV.$("#tpl-encoder-pool"), p));
        else KV.fill(cards[pool], p);
        return;
      }
      if (!cards[pool]) {
        cards[pool] = KV.fill(tplPool, p);
        KV.$("#pools").appendChild(cards[pool]);
        var seed = seeds[pool] || { ts: [], cached_rate: [], running: [] };
        spark[pool] = {
          xs: seed.ts.slice(), cached: seed.cached_rate.slice(), running: seed.running.slice(),
          cachedChart: KV.chart(KV.$("[data-spark=cached]", cards[pool]), { series: [{ label: "cached tokens/s" }], unit: "tok/s", spark: true }),
          runningChart: KV.chart(KV.$("[data-spark=running]", cards[pool]), { series: [{ label: "running" }], unit: "reqs", spark: true })
        };
      } else {
        KV.fill(cards[pool], p);
      }
      var s = spark[pool], ts = p.ts, n = s.xs.length;
      if (ts == null || (p.cached_rate == null && n)) return;
      if (n && ts <= s.xs[n - 1]) {  // not newer than the last point (a seed bucket's end, or a repeat): update it
        s.cached[n - 1] = p.cached_rate; s.running[n - 1] = p.num_running_reqs;
      } else {
        s.xs.push(ts); s.cached.push(p.cached_rate); s.running.push(p.num_running_reqs);
      }
      while (s.xs.length && s.xs[0] < ts - SPARK_S) { s.xs.shift(); s.cached.shift(); s.running.shift(); }
      s.cachedChart.set(s.xs, [s.cached]); s.runningChart.set(s.xs, [s.running]);
    });
  }
  /* TTFT / ITL p50 over the server's recent window (recent_window_s, the worker page's 5 min): values; "no
     requests" across both cells when none came in it; "–" without a window (fewer than two samples in it) or
     on a PD prefill worker, which records no latency; the cells' title says which. */
  function latencyCells(w, live, windowS) {
    var span = "the last " + Math.round(windowS / 60) + " min";
    if (w.role === "encoder") return { ttft_text: "–", itl_text: "–", latency_title: "an EPD encoder serves no tokens: it encodes images for prefill workers" };
    if (w.role === "prefill") return { ttft_text: "–", itl_text: "–", latency_title: "a PD prefill worker records no TTFT / ITL: see its decode workers" };
    if (live.recent_requests == null) return { ttft_text: "–", itl_text: "–", latency_title: "fewer than two samples in " + span };
    if (!live.recent_requests) return { ttft_text: "no requests", itl_text: "", latency_title: "no request in " + span, no_requests: true };
    return { ttft_text: KV.fmt(live.recent_ttft_p50_s, "s"), itl_text: KV.fmt(live.recent_itl_p50_s, "s"),
             latency_title: "p50 of " + live.recent_requests + (live.recent_requests === 1 ? " request" : " requests") + " in " + span };
  }
  function showLatency(row, cells) {
    var ttft = KV.$("[data-f=ttft_text]", row), itl = KV.$("[data-f=itl_text]", row);
    ttft.colSpan = cells.no_requests ? 2 : 1;
    itl.hidden = !!cells.no_requests;
  }
  /* the workers whose L3 breaker is open in their newest sample, raised above the pools */
  function showBreakers(summary) {
    var open = summary.breakers_open || [], list = KV.$("#breaker-workers");
    list.replaceChildren.apply(list, open.reduce(function (out, w, i) {
      var a = document.createElement("a");
      a.href = "/workers/" + w.id + "/";
      a.textContent = w.name;
      if (i) out.push(document.createTextNode(", "));
      out.push(a);
      return out;
    }, []));
    KV.$("#breaker-alert").hidden = !open.length;
  }
  function applySummary(summary) {
    showBreakers(summary);
    KV.$("#reporting").textContent = summary.reporting + " of " + summary.workers.length + " workers reporting";
    summary.workers.forEach(function (live) {
      var w = workers.filter(function (x) { return x.id === live.id; })[0];
      if (!w) return;
      ["cache_hit_rate", "num_running_reqs", "num_queue_reqs", "host_pool_use", "ts", "state", "role"].forEach(function (k) { w[k] = live[k]; });
      var cells = latencyCells(w, live, summary.recent_window_s);
      Object.assign(w, cells);
      KV.fill(rows[w.id], w);
      showLatency(rows[w.id], cells);
    });
    renderPools(summary);
  }
  function load() {
    return Promise.all([
      KV.api("GET", "/api/v1/inventory/workers/?limit=500"), KV.api("GET", "/api/v1/inventory/hosts/?limit=500"),
      KV.api("GET", "/api/v1/inventory/routers/?limit=500"), KV.api("GET", "/api/v1/telemetry/fleet/")
    ]).then(function (r) {
      var perHost = {}, perRouter = {};
      r[1].results.forEach(function (h) { hostNames[h.id] = h.name; });
      workers = r[0].results.map(function (w) {
        perHost[w.host] = (perHost[w.host] || 0) + 1; perRouter[w.router] = (perRouter[w.router] || 0) + 1;
        return Object.assign({}, w, devicesView(w), { host_name: hostNames[w.host] || "", select_label: "select " + w.name, latency_title: "" });
      });
      renderWorkers();
      KV.replaceRows(KV.$("#hosts tbody"), KV.$("#tpl-host"), r[1].results.map(function (h) {
        return Object.assign({}, h, { gpu_count: h.gpus.length, worker_count: perHost[h.id] || 0 });
      }));
      KV.replaceRows(KV.$("#routers tbody"), KV.$("#tpl-router"), r[2].results.map(function (x) {
        return Object.assign({}, x, { worker_count: perRouter[x.id] || 0 });
      }));
      applySummary(r[3]);
    });
  }
  KV.$("#filter").addEventListener("input", applyFilter);
  var all = KV.$("#select-all");  // the picking column is there only for a role that may launch
  if (all) all.addEventListener("change", function (e) {
    KV.$$(".pick").forEach(function (c) { if (!c.closest("tr").hidden) c.checked = e.target.checked; });
  });
  var btn = KV.$("#launch-selected");
  function picked() { return KV.$$(".pick").filter(function (c) { return c.checked; }); }
  /* "Launch on selected" waits for a pick: with none it would open an empty launch form */
  function showPicked() {
    if (!btn) return;
    var n = picked().length;
    btn.disabled = !n;
    btn.title = n ? "launch an operation on the " + (n === 1 ? "selected worker" : n + " selected workers") : "select one or more workers in the table first";
    KV.$("#launch-selected-hint").hidden = !!n;
  }
  if (btn) {
    KV.$("#workers").addEventListener("change", showPicked);
    btn.addEventListener("click", function () {
      var ids = picked().map(function (c) { return "worker=" + c.value; });
      if (ids.length) location.href = "/operations/new/?" + ids.join("&");
    });
  }
  KV.subscribe(["fleet"].concat(KV.fleetAlerts.groups), function (msg) {
    if (msg.type === "fleet.metrics") applySummary(msg.data);
    else KV.fleetAlerts.apply(msg);
  }, function () { return Promise.all([load(), KV.fleetAlerts.resync()]); });
  return load();
});

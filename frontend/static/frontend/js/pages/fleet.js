/* Fleet page: pool cards with sparklines and the worker, host and router tables. The worker table shows
   one page of the fleet (table.page_size workers by name, ?page=N); its inventory is read with the page;
   each fleet.metrics push updates the pool cards in place, extends the sparklines and, on the first page,
   the live cells; another page's live cells come as fleet.rows on its own group (fleet.page.N), which the
   page joins while it shows it. The reconciler's alert card follows fleet.alert events (js/alerts.js). */
KV.ready(function () {
  "use strict";
  var POOL_TITLES = { regular: "Regular pool", prefill: "Prefill pool", decode: "Decode pool", encoder: "Encoder pool" };
  var SPARK_S = 300, GAP_S = 30;  // a push is due every few seconds: 30 s without one is a gap
  var ROW_FIGURES = ["num_running_reqs", "num_queue_reqs", "hit_rate", "host_pool_use"];
  var workers = [], hostNames = {}, rows = {}, cards = {}, spark = {};
  var tplWorker = KV.$("#tpl-worker"), tplPool = KV.$("#tpl-pool");
  var seeds = JSON.parse(KV.$("#pool-history").textContent);  // server-side 5 min of history per pool
  var table = JSON.parse(KV.$("#worker-table").textContent);  // page size, workers per host and router
  var page = Math.max(1, parseInt(new URLSearchParams(location.search).get("page"), 10) || 1);

  /* TP cell: the rank count, and the GPUs the ranks hold (rank 0 first) when the agent reported any */
  function devicesView(w) {
    var d = w.devices || [];
    return {
      devices_text: d.length ? "GPU " + d.join(",") : "",
      devices_title: w.tp_size + (w.tp_size === 1 ? " rank" : " ranks") + (d.length ? " on GPU " + d.join(", ") : " (no GPU reported)")
    };
  }
  function matches(w, q) {
    return !q || [w.name, w.host_name, w.model_name, w.role, w.storage_backend, w.engine_text].join(" ").toLowerCase().indexOf(q) >= 0;
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
      KV.$("[data-testid=pool-hit-parts]", cards[pool]).hidden = p.hit_rate == null;  // no parts of no figure
      var s = spark[pool], ts = p.ts, n = s.xs.length;
      if (ts == null || (p.cached_rate == null && n)) return;
      if (n && ts - s.xs[n - 1] > GAP_S) {  // no point for a while (the metrics store was down): draw a gap
        s.xs.push(s.xs[n - 1] + 1); s.cached.push(null); s.running.push(null); n += 1;
      }
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
  /* the metrics store (Prometheus) did not answer: say since when, and every figure is absent with that why */
  function showDown(summary) {
    var down = summary.unavailable;
    KV.$("#metrics-down").hidden = !down;
    KV.$("#metrics-down-text").textContent = down ? down.charAt(0).toUpperCase() + down.slice(1) : "";
  }
  /* the pager: which page of how many; hidden while the fleet fits one page */
  function showPager(summary) {
    var pages = summary.pages || 1, size = summary.page_size || table.page_size, first = (page - 1) * size + 1;
    KV.$("#workers-pager").hidden = pages <= 1;
    KV.$("#page-text").textContent = "Workers " + first.toLocaleString() + "–" +
      Math.min(page * size, summary.worker_count).toLocaleString() + " of " + summary.worker_count.toLocaleString() +
      " · page " + page + " of " + pages;
    KV.$("#page-prev").disabled = page <= 1;
    KV.$("#page-next").disabled = page >= pages;
    KV.$("#page-next").dataset.pages = pages;
  }
  function applySummary(summary) {
    showDown(summary);
    showBreakers(summary);
    KV.$("#reporting").textContent = summary.reporting + " of " + summary.worker_count + " workers reporting";
    if (summary.page === page) applyRows(summary);
    showPager(summary);
    renderPools(summary);
  }
  /* the live cells of this page's rows (a fleet.metrics summary of the first page, or fleet.rows of another) */
  function applyRows(summary) {
    summary.workers.forEach(function (live) {
      var w = workers.filter(function (x) { return x.id === live.id; })[0];
      if (!w) return;
      ["hit_rate", "hit_rate_title", "num_running_reqs", "num_queue_reqs", "host_pool_use", "ts", "state", "role"].forEach(function (k) { w[k] = live[k]; });
      var cells = summary.unavailable ? { ttft_text: "–", itl_text: "–", latency_title: summary.unavailable }
        : latencyCells(w, live, summary.recent_window_s);
      Object.assign(w, cells);
      w.absent = { hit_rate: live.hit_rate_title };  // why a worker has no hit rate (its cell's title says it too)
      if (summary.unavailable) {
        ROW_FIGURES.forEach(function (k) { w.absent[k] = summary.unavailable; });
        w.hit_rate_title = summary.unavailable;  // the cell's title: why it has no figure now
      }
      KV.fill(rows[w.id], w);
      showLatency(rows[w.id], cells);
    });
  }
  function groups() { return ["fleet"].concat(page > 1 ? ["fleet.page." + page] : [], KV.fleetAlerts.groups); }
  function onMessage(msg) {
    if (msg.type === "fleet.metrics") applySummary(msg.data);
    else if (msg.type === "fleet.rows") { if (msg.data.page === page) applyRows(msg.data); }
    else KV.fleetAlerts.apply(msg);
  }
  function resync() { return Promise.all([load(), KV.fleetAlerts.resync()]); }
  /* show page p: its address, its group (the join's resync reads its rows) */
  function goTo(p) {
    page = p;
    history.replaceState(null, "", p > 1 ? "?page=" + p : location.pathname);
    KV.subscribe(groups(), onMessage, resync);
  }
  function load() {
    var size = table.page_size, shown = page;
    return Promise.all([
      KV.api("GET", "/api/v1/inventory/workers/?limit=" + size + "&offset=" + (shown - 1) * size),
      KV.api("GET", "/api/v1/inventory/hosts/?limit=500"),
      KV.api("GET", "/api/v1/inventory/routers/?limit=500"), KV.api("GET", "/api/v1/telemetry/fleet/?page=" + shown)
    ]).then(function (r) {
      if (shown !== page) return;  // another page was asked for meanwhile: its own load shows it
      if (r[3].page !== page) { goTo(r[3].page); return; }  // past the last page (workers went away): the last
      r[1].results.forEach(function (h) { hostNames[h.id] = h.name; });
      workers = r[0].results.map(function (w) {
        return Object.assign({}, w, devicesView(w), {
          host_name: hostNames[w.host] || "", select_label: "select " + w.name, latency_title: "", hit_rate_title: "",
          // a worker that runs upstream SGLang says so (and its version) under its name
          engine_text: w.engine === "sglang" ? "SGLang " + (w.engine_version || "") : ""
        });
      });
      renderWorkers();
      KV.replaceRows(KV.$("#hosts tbody"), KV.$("#tpl-host"), r[1].results.map(function (h) {
        return Object.assign({}, h, { gpu_count: h.gpus.length, worker_count: table.hosts[h.id] || 0 });
      }));
      KV.replaceRows(KV.$("#routers tbody"), KV.$("#tpl-router"), r[2].results.map(function (x) {
        return Object.assign({}, x, { worker_count: table.routers[x.id] || 0 });
      }));
      applySummary(r[3]);
    });
  }
  KV.$("#filter").addEventListener("input", applyFilter);
  KV.$("#page-prev").addEventListener("click", function () { if (page > 1) goTo(page - 1); });
  KV.$("#page-next").addEventListener("click", function (e) {
    if (page < Number(e.target.dataset.pages || 1)) goTo(page + 1);
  });
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
  KV.subscribe(groups(), onMessage, resync);
  return load();
});

/* Why prompt tokens missed, per pool and worker (js/misses.js), from each pool's recorded traffic. */
(function () {  // not KV.ready: body[data-loaded] stays the charts' first render
  "use strict";
  var box = KV.$("#fleet-miss-bars");
  if (!box) return;
  Promise.all(["regular", "prefill"].map(function (pool) {
    return KV.api("GET", "/api/v1/capacity/misses/?pool=" + pool);
  })).then(function (pools) {
    var rows = [], causes = pools[0].causes;
    pools.forEach(function (res) {
      if (!res.fleet.requests && res.pool !== "regular") return;  // a pool with no traffic: left out
      rows.push(["pool " + res.pool, res.fleet, "no recorded traffic with miss attribution: start the workers with --record-trace"]);
      Object.keys(res.workers).forEach(function (name) { rows.push([name, res.workers[name], "no attributed traffic from this worker"]); });
    });
    KV.missBars(box, rows, causes);
  }).catch(function (err) { box.textContent = KV.errorText(err); });
})();

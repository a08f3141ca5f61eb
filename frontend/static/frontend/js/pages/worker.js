/* Worker page: its charts from the metrics store (Prometheus), one hour at the server's step from
   /api/v1/telemetry/workers/<id>/series/, then each worker.series push (the newest point, queried once per
   interval for every open page) appended in place. Every figure is the server's (PromQL over the recording
   rules): per-tier cached tokens/s and cache I/O tokens/s (1 min rates), the hit rate per tier (cached over
   prompt tokens in the 5 min before each point: controlplane/telemetry/hit_rate.py, the fleet page's
   figure), TTFT / ITL p50 and p90 over the 5 min before each point (none on a PD prefill worker, whose page
   has a note instead), prefetch outcomes per second (1 min rates; the counters since start and in flight =
   issued - completed - timed out - revoked in the line below), finished requests per second. A step
   the store has no point for is a gap, never a 0; while the store does not answer the page says "metrics
   unavailable since ..." and draws nothing new. The L3 breaker fact shows the newest point's breaker state
   and counters; the tenant table its per-tenant cached tokens (named where the worker's tenants file names
   the label). An EPD encoder's page has its own charts instead (its template has #chart-images): images/s
   and encode seconds per second (1 min rates), mean encode time per image and the local / global
   embedding cache hit rates (1 min); an encoder reports no KV figure. */
/* A tenant label (sglang's per-tenant metric label) as this page names it everywhere, the tenant table and
   the miss bars alike: unsalted traffic ("none") is "shared (no salt)", a label the worker's tenants file
   names "<name> (<label>)". */
KV.tenantName = function (label) {
  if (label === "none") return "shared (no salt)";
  if (label === "other") return "other";
  var names = JSON.parse((KV.$("#tenant-names") || {}).textContent || "{}");
  return names[label] ? names[label] + " (" + label + ")" : label;
};
KV.ready(function () {
  "use strict";
  var TIERS = ["device", "host", "storage"];
  var TIER_LABELS = ["L1 device", "L2 host", "L3 storage"];
  var BREAKER_STATES = ["closed", "half_open", "open"];
  var ENCODER = !!KV.$("#chart-images");
  var charts = ENCODER ? {
    images: KV.chart(KV.$("#chart-images"), { series: [{ label: "images/s" }], unit: "images/s", gaps: true }),
    encode: KV.chart(KV.$("#chart-encode"), { series: [{ label: "mean per image" }], unit: "s", gaps: true }),
    busy: KV.chart(KV.$("#chart-busy"), { series: [{ label: "busy" }], unit: "%", gaps: true }),
    mmHits: KV.chart(KV.$("#chart-mm-hits"), { series: [{ label: "local LRU" }, { label: "global (Mooncake)" }], unit: "%", gaps: true, range01: true })
  } : {
    cached: KV.chart(KV.$("#chart-cached"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "tok/s", gaps: true, stacked: true }),
    hits: KV.chart(KV.$("#chart-hits"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "%", gaps: true, range01: true, stacked: true }),
    ttft: KV.$("#chart-ttft") && KV.chart(KV.$("#chart-ttft"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s", gaps: true }),
    itl: KV.$("#chart-itl") && KV.chart(KV.$("#chart-itl"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s", gaps: true }),
    pool: KV.chart(KV.$("#chart-pool"), { series: [{ label: "host pool use" }], unit: "%", gaps: true, range01: true }),
    bw: KV.chart(KV.$("#chart-bw"), { series: [{ label: "load-back" }, { label: "prefetch" }, { label: "backup" }], unit: "tok/s", gaps: true }),
    prefetch: KV.chart(KV.$("#chart-prefetch"), {
      series: [{ label: "completed" }, { label: "timed out" }, { label: "revoked" }], unit: "prefetches/s", gaps: true, stacked: true
    }),
    reqs: KV.chart(KV.$("#chart-reqs"), { series: [{ label: "finished" }], unit: "req/s", gaps: true })
  };

  var WINDOW_S = 3600, step = 5, xs = [], series = {}, latest = {};
  var KEYS = {
    images: ["encoder_images_per_s"], encode: ["encode_s_per_image"], busy: ["encoder_busy"],
    mmHits: ["mm_embedding_cache_hit_rate", "mm_global_cache_hit_rate"],
    cached: TIERS.map(function (t) { return "cached_" + t + "_per_s"; }),
    hits: TIERS.map(function (t) { return "hit_rate_" + t; }),
    ttft: ["ttft_p50_s", "ttft_p90_s"], itl: ["itl_p50_s", "itl_p90_s"], pool: ["host_pool_use"],
    bw: ["load_back_tokens_per_s", "prefetch_tokens_per_s", "backup_tokens_per_s"],
    prefetch: ["prefetch_completed_per_s", "prefetch_timeout_per_s", "prefetch_revoked_per_s"],
    reqs: ["requests_per_s"]
  };
  var CHARTS = ENCODER ? ["images", "encode", "busy", "mmHits"] : ["cached", "hits", "ttft", "itl", "pool", "bw", "prefetch", "reqs"];
  /* The worker's last role change: its figures before and after are of different jobs, so the lines break
     there (an empty point at that time). */
  var ROLE_AT = KV.$("[data-testid=worker-role] time") ? Date.parse(KV.$("[data-testid=worker-role] time").getAttribute("datetime")) / 1000 : null;
  // kept for the lines under the charts, not charted: the prefetch balance since start, the hit rate's
  // tokens, the running / queued requests now
  var EXTRA = ENCODER ? [] : ["prefetch_started_total", "prefetch_completed_total", "prefetch_timeout_total", "prefetch_revoked_total",
    "prefetch_in_flight", "hit_rate", "hit_prompt_tokens", "num_running_reqs", "num_queue_reqs"];
  function allKeys() { return CHARTS.reduce(function (a, k) { return a.concat(KEYS[k]); }, EXTRA); }
  function value(v) { return v == null ? null : v; }
  function reset() { xs = []; series = {}; allKeys().forEach(function (k) { series[k] = []; }); }
  reset();
  /* one point: its time and {key: value}; a point at or before the newest replaces nothing older */
  function append(ts, figures) {
    var n = xs.length;
    if (n && ts < xs[n - 1]) return;
    if (n && ts === xs[n - 1]) { allKeys().forEach(function (k) { series[k][n - 1] = value(figures[k]); }); return; }
    if (n && ts - xs[n - 1] > step * 1.5) {  // missed pushes (a page asleep, a slow publisher): a gap
      xs.push(xs[n - 1] + step); allKeys().forEach(function (k) { series[k].push(null); });
    }
    xs.push(ts); allKeys().forEach(function (k) { series[k].push(value(figures[k])); });
    while (xs.length && xs[0] < ts - WINDOW_S) { xs.shift(); allKeys().forEach(function (k) { series[k].shift(); }); }
  }
  function redraw() {
    var cx = xs, cols = series;
    var at = ROLE_AT != null && xs.length && xs[0] < ROLE_AT && ROLE_AT < xs[xs.length - 1] ? ROLE_AT : null;
    if (at != null) {  // an empty point at the role change: no line reaches across it
      var i = 0;
      while (xs[i] < at) i++;
      cx = xs.slice(0, i).concat([at], xs.slice(i));
      cols = {};
      allKeys().forEach(function (k) { cols[k] = series[k].slice(0, i).concat([null], series[k].slice(i)); });
    }
    CHARTS.forEach(function (c) { if (charts[c]) charts[c].set(cx, KEYS[c].map(function (k) { return cols[k] || []; })); });
    var from = Date.now() / 1000 - KV.windowS();  // "Live samples": the points the charts show now
    KV.$("[data-testid=samples]").textContent = String(xs.filter(function (ts, i) {
      return ts >= from && allKeys().some(function (k) { return series[k][i] != null; });
    }).length);
    var last = {};
    allKeys().forEach(function (k) { for (var j = xs.length - 1; j >= 0; j--) if (series[k][j] != null) { last[k] = series[k][j]; return; } });
    showBreaker(latest, latest.scraped_at);
    showTenants(latest);
    if (ENCODER) return;
    var count = function (v) { return v == null ? "–" : KV.fmt(v, "count"); };
    /* the hit rate of the newest point: the same figure (and window) as the fleet page's and the tenant table's total */
    var newest = {};
    if (xs.length) allKeys().forEach(function (k) { newest[k] = series[k][xs.length - 1]; });
    KV.$("#hit-rate-now").textContent = KV.fmt(newest.hit_rate, "%");
    KV.$("#hit-rate-detail").textContent = newest.hit_prompt_tokens == null ? "(fewer than two scrapes in the window)" :
      newest.hit_rate == null ? "(no prompt token in the window)" : "of " + Math.round(newest.hit_prompt_tokens).toLocaleString("en-US") + " prompt tokens";
    KV.$("#reqs-now").textContent = last.num_running_reqs == null ? "" :
      "Now: " + KV.fmt(last.num_running_reqs, "reqs") + " running, " + KV.fmt(last.num_queue_reqs, "reqs") + " queued";
    KV.$("#prefetch-balance").textContent = last.prefetch_started_total != null || last.prefetch_completed_total != null ?
      "Since the worker started: issued " + count(last.prefetch_started_total) + " = completed " +
      count(last.prefetch_completed_total) + " + timed out " + count(last.prefetch_timeout_total) +
      " + revoked " + count(last.prefetch_revoked_total) + " + in flight " + count(last.prefetch_in_flight) : "";
  }
  /* the metrics store did not answer: say since when (the charts draw nothing new, never zeros) */
  function showDown(r) {
    var down = r.unavailable;
    KV.$("#metrics-down").hidden = !down;
    KV.$("#metrics-down-text").textContent = down ? down.charAt(0).toUpperCase() + down.slice(1) : "";
  }
  /* the L3 circuit breaker of the newest point (0 closed, 1 half-open, 2 open); nothing without an L3 */
  function showBreaker(s, ts) {
    if (!s || s.storage_breaker_state == null) return;
    var state = BREAKER_STATES[s.storage_breaker_state] || String(s.storage_breaker_state);
    var badge = document.createElement("span");
    badge.className = "badge s-" + state;
    badge.textContent = state.replace("_", "-");
    KV.$("#breaker-state").replaceChildren(badge);
    KV.$("#breaker-detail").textContent = KV.fmt(s.storage_breaker_failed_calls_total || 0, "count") + " failed L3 calls, " +
      KV.fmt(s.storage_breaker_short_circuited_total || 0, "count") + " skipped while open, " +
      KV.fmt(s.storage_dropped_backup_pages_total || 0, "count") + " backup pages dropped" +
      (state === "open" ? ": lookups miss and requests recompute until a probe succeeds" : "");
    /* auto_detach_after_s: the worker detached its L3 itself (seconds ago in the sample), as the storage page says */
    var out = s.storage_auto_detached_s, auto = KV.$("#breaker-auto");
    auto.hidden = out == null || !ts;
    if (!auto.hidden) KV.time.set(KV.$("#breaker-auto-since"), ts - out);
  }
  var tenantName = KV.tenantName;
  /* a table row: the first text a row header, the rest right-aligned number cells */
  function headedRow(texts) {
    var tr = document.createElement("tr");
    texts.forEach(function (text, i) {
      var td = document.createElement(i ? "td" : "th");
      if (i) td.className = "num"; else td.scope = "row";
      td.textContent = text;
      tr.appendChild(td);
    });
    return tr;
  }
  /* prompt and cached tokens per tier and tenant over the hit-rate window, in the newest point; each row's
     hit rate is cached / prompt (the server's hit_rate.ratio), the footer's all tenants together */
  function tenantCells(t) {
    var cached = t.device + t.host + t.storage;
    return [KV.fmt(t.prompt, "count")].concat(TIERS.map(function (tier) { return KV.fmt(t[tier], "count"); }))
      .concat([t.prompt > 0 ? KV.fmt(Math.min(1, cached / t.prompt), "%") : "–"]);
  }
  function showTenants(s) {
    if (!s || !s.tenants || !s.tenants.length) return;
    var body = KV.$("#tenant-hits tbody"), sum = { prompt: 0, device: 0, host: 0, storage: 0 };
    body.replaceChildren.apply(body, s.tenants.map(function (t) {
      Object.keys(sum).forEach(function (k) { sum[k] += t[k]; });
      var tr = headedRow([tenantName(t.tenant)].concat(tenantCells(t)));
      tr.dataset.tenant = t.tenant;
      return tr;
    }));
    var foot = KV.$("#tenant-hits tfoot");
    KV.$$("td", foot).forEach(function (td, i) { td.textContent = tenantCells(sum)[i]; });
    foot.hidden = false;
  }
  /* the isolation self-test (POST .../check-isolation/): the verdict, both TTFTs and each probe's hits */
  var checkButton = KV.$("#check-isolation");
  function showIsolation(r) {
    var verdict = document.createElement("span");
    verdict.className = "badge s-" + (r.ok ? "succeeded" : "failed");
    verdict.textContent = r.ok ? "isolated" : r.verdict === "not_isolatable" ? "not isolatable" : "failed";
    KV.$("#isolation-verdict").replaceChildren(verdict);
    KV.$("#isolation-probes").hidden = !r.probes.length;  /* a gRPC worker is not probed: no figures */
    KV.$("#isolation-summary").textContent = !r.probes.length ? "" : r.prompt_tokens + "-token prompt; other salt TTFT " + KV.fmt(r.ttft_other_salt_s, "s") +
      ", same salt again " + KV.fmt(r.ttft_same_salt_s, "s") +
      (r.ttft_same_salt_s > 0 ? " (" + (r.ttft_other_salt_s / r.ttft_same_salt_s).toFixed(2) + "x)" : "");
    var names = ["salt A (cold)", "salt B", "salt A (again)"], body = KV.$("#isolation-probes tbody");
    body.replaceChildren.apply(body, r.probes.map(function (p, i) {
      return headedRow([names[i], KV.fmt(p.ttft_s, "s")].concat(TIERS.map(function (t) { return KV.fmt(p.cached[t], "count"); })));
    }));
    var problems = KV.$("#isolation-problems");
    problems.replaceChildren.apply(problems, r.problems.map(function (text) { var li = document.createElement("li"); li.textContent = text; return li; }));
    KV.$("#isolation-result").hidden = false;
  }
  if (checkButton) checkButton.addEventListener("click", function () {
    checkButton.disabled = true;
    KV.$("#isolation-status").textContent = "running three requests on the worker…";
    KV.api("POST", "/api/v1/inventory/workers/" + KV.pk + "/check-isolation/", { words: Number(KV.$("#isolation-words").value) }).then(function (r) {
      KV.$("#isolation-status").textContent = "";
      showIsolation(r);
    }, function (e) {
      KV.$("#isolation-status").textContent = "could not run: " + e.message;
    }).then(function () { checkButton.disabled = false; });
  });
  function load() {
    return KV.api("GET", "/api/v1/telemetry/workers/" + KV.pk + "/series/?window_s=" + WINDOW_S).then(function (r) {
      step = r.step_s; reset();
      r.ts.forEach(function (ts, i) {
        var f = {};
        Object.keys(r.series).forEach(function (k) { f[k] = r.series[k][i]; });
        append(ts, f);
      });
      latest = r.latest || {};
      showDown(r);
      redraw();
    }, function (e) {  // the history did not load (a busy server): the pushes go on; ask again shortly
      if (window.console) console.warn("worker history: " + e.message + "; retrying in 3 s");
      setTimeout(load, 3000);
    });
  }
  document.addEventListener("kv:window", redraw);
  KV.subscribe(["worker." + KV.pk], function (msg) {
    if (msg.type !== "worker.series") return;
    var p = msg.data;
    showDown(p);
    if (p.unavailable) return;  // no figure: the charts keep their last points and gain none
    append(p.ts, p.figures);
    latest = p.latest || {};
    redraw();
  }, load);
  return load();
});

/* Why this worker's prompt tokens missed (js/misses.js): its bar from its pool's recorded traffic, then one
   per tenant it served (measured by the worker since it started; the fleet split and ceiling are absent),
   then one per request for its newest recorded requests (data-recent of them). */
(function () {  // not KV.ready: body[data-loaded] stays the charts' first render
  "use strict";
  var card = KV.$("#misses"), box = KV.$("#miss-bars");
  if (!card) return;
  var name = card.dataset.worker;
  var list = KV.$("#miss-requests");
  var query = "?pool=" + encodeURIComponent(card.dataset.pool) + "&recent=" + encodeURIComponent(card.dataset.recent);
  KV.api("GET", "/api/v1/capacity/misses/" + query).then(function (res) {
    var mine = res.workers[name] || { served_share: null, ceiling_share: null, causes: {}, cause_shares: {} };
    var rows = [[name, mine, "no recorded traffic with miss attribution from this worker: start it with --record-trace"]];
    (res.tenants || []).forEach(function (t) {
      var f = t.workers[name];
      var label = KV.tenantName(t.tenant);
      if (f) rows.push([t.tenant === "none" ? label : "tenant " + label, f, "no prompt tokens from this tenant"]);
    });
    KV.missBars(box, rows, res.causes);
    if (res.tenants == null) {
      box.appendChild(Object.assign(document.createElement("p"), { className: "muted", textContent: "Per tenant: — (the metrics store did not answer: " + res.tenants_unavailable + ")" }));
    }
    list.textContent = "";
    if (!(mine.recent || []).length) {
      list.appendChild(Object.assign(document.createElement("p"), { className: "muted", textContent: "No recorded request with miss attribution from this worker yet." }));
    }
    (mine.recent || []).forEach(function (r) {  // the sampled per-request view
      var at = r.arrived_ms == null ? "–" : KV.time.clock(r.arrived_ms / 1000, true);
      var row = KV.missBar(at + " · " + r.input_tokens.toLocaleString() + " tok", r, res.causes);
      if (r.arrived_ms != null) row.title = "arrived " + KV.time.text(r.arrived_ms / 1000);
      list.appendChild(row);
    });
  }).catch(function (err) { box.textContent = KV.errorText(err); list.textContent = ""; });
})();

/* Worker page: one hour of samples from the API, then each worker.metrics push appended in place.
   Derived series: per-tier cached tokens/s and cache I/O tokens/s (counter rates over 10 s), hit share over
   a sliding 60 s window, TTFT / ITL p50 and p90 over the 5 min before each sample (the increase of the
   worker's cumulative histogram buckets, KV.pools; none on a PD prefill worker, whose page has a note
   instead), prefetch in flight = started - completed - timed out - revoked. */
KV.ready(function () {
  "use strict";
  var HIT_WINDOW_S = 60, RATE_WINDOW_S = 10, LATENCY_WINDOW_S = 300, MAX_SAMPLES = 1800;
  var TIERS = ["device", "host", "storage"];
  var TIER_LABELS = ["L1 device", "L2 host", "L3 storage"];
  var samples = [], lastSeq = 0, pushed = 0;
  var charts = {
    cached: KV.chart(KV.$("#chart-cached"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "tok/s", stacked: true }),
    hits: KV.chart(KV.$("#chart-hits"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "%", range01: true }),
    ttft: KV.$("#chart-ttft") && KV.chart(KV.$("#chart-ttft"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s" }),
    itl: KV.$("#chart-itl") && KV.chart(KV.$("#chart-itl"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s" }),
    pool: KV.chart(KV.$("#chart-pool"), { series: [{ label: "host pool use" }], unit: "%", range01: true }),
    bw: KV.chart(KV.$("#chart-bw"), { series: [{ label: "load-back" }, { label: "prefetch" }, { label: "backup" }], unit: "tok/s" }),
    prefetch: KV.chart(KV.$("#chart-prefetch"), {
      series: [{ label: "completed" }, { label: "timed out" }, { label: "revoked" }, { label: "in flight" }], unit: "count", stacked: true
    }),
    reqs: KV.chart(KV.$("#chart-reqs"), { series: [{ label: "running" }, { label: "queued" }], unit: "reqs" })
  };

  function col(key) { return samples.map(function (s) { return s[key] == null ? null : s[key]; }); }
  function delta(a, b, key) { var d = (b[key] || 0) - (a[key] || 0); return d >= 0 ? d : (b[key] || 0); }  // counter reset

  /* per-second rate of counter `key` over the last RATE_WINDOW_S (as Prometheus rate()), one per sample */
  function rate(key) {
    var j = 0;
    return samples.map(function (s, i) {
      while (j < i - 1 && s.ts - samples[j + 1].ts >= RATE_WINDOW_S) j++;
      var base = samples[j], dt = s.ts - base.ts;
      return i > 0 && dt > 0 && s[key] != null && base[key] != null ? delta(base, s, key) / dt : null;
    });
  }
  function redraw() {
    var xs = col("ts");
    var shares = TIERS.map(function () { return []; });
    var j = 0;
    samples.forEach(function (s, i) {
      while (j < i && s.ts - samples[j].ts > HIT_WINDOW_S) j++;  // oldest sample inside the window
      var base = samples[j], hits = TIERS.map(function (t) { return j < i ? delta(base, s, "cached_tokens_" + t) : 0; });
      var total = hits[0] + hits[1] + hits[2];
      TIERS.forEach(function (t, k) { shares[k].push(total > 0 ? hits[k] / total : null); });
    });
    charts.cached.set(xs, TIERS.map(function (t) { return rate("cached_tokens_" + t); }));
    charts.hits.set(xs, shares);
    if (charts.ttft) {
      var member = [{ samples: samples }];
      var lat = samples.map(function (s) { return KV.pools.at(member, s.ts, LATENCY_WINDOW_S) || {}; });
      var pick = function (key) { return lat.map(function (v) { return v[key] == null ? null : v[key]; }); };
      charts.ttft.set(xs, [pick("ttft_p50_s"), pick("ttft_p90_s")]);
      charts.itl.set(xs, [pick("itl_p50_s"), pick("itl_p90_s")]);
    }
    charts.pool.set(xs, [col("host_pool_use")]);
    charts.bw.set(xs, [rate("load_back_tokens_total"), rate("prefetched_tokens_total"), rate("backuped_tokens_total")]);
    var done = ["prefetch_completed_total", "prefetch_timeout_total", "prefetch_revoked_total"];
    var inflight = samples.map(function (s) {
      return Math.max(0, (s.prefetch_started_total || 0) - done.reduce(function (a, k) { return a + (s[k] || 0); }, 0));
    });
    charts.prefetch.set(xs, [col(done[0]), col(done[1]), col(done[2]), inflight]);
    charts.reqs.set(xs, [col("num_running_reqs"), col("num_queue_reqs")]);
    var last = samples[samples.length - 1];
    KV.$("#prefetch-balance").textContent = last ? "Started " + KV.fmt(last.prefetch_started_total, "count") + " = completed " +
      KV.fmt(last.prefetch_completed_total || 0, "count") + " + timed out " + KV.fmt(last.prefetch_timeout_total || 0, "count") +
      " + revoked " + KV.fmt(last.prefetch_revoked_total || 0, "count") + " + in flight " + KV.fmt(inflight[inflight.length - 1], "count") : "";
  }
  function add(s) {
    if (!s || s.seq <= lastSeq) return false;
    lastSeq = s.seq;
    var at = samples.length;
    while (at > 0 && samples[at - 1].ts > s.ts) at--;  // keep time order (samples carry their scrape time)
    samples.splice(at, 0, s);
    if (samples.length > MAX_SAMPLES) samples.shift();
    return true;
  }
  function load() {
    return KV.api("GET", "/api/v1/telemetry/workers/" + KV.pk + "/?history=" + MAX_SAMPLES).then(function (r) {
      samples = []; lastSeq = 0;
      r.history.forEach(add);
      redraw();
    });
  }
  document.addEventListener("kv:window", redraw);
  KV.subscribe(["worker." + KV.pk], function (msg) {
    if (msg.type === "worker.metrics" && add(msg.data)) {
      pushed += 1; KV.$("[data-testid=samples]").textContent = String(pushed);
      redraw();
    }
  }, load);
  return load();
});

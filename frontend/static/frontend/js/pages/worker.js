/* Worker page: one hour of samples from the API, then each worker.metrics push appended in place.
   Derived series: per-tier cached tokens/s (counter deltas), hit share over a sliding 60 s window,
   prefetch in flight = started - completed - timed out - revoked. */
KV.ready(function () {
  "use strict";
  var HIT_WINDOW_S = 60, MAX_SAMPLES = 1800, TIERS = ["device", "host", "storage"];
  var TIER_LABELS = ["L1 device", "L2 host", "L3 storage"];
  var samples = [], lastSeq = 0, pushed = 0;
  var charts = {
    cached: KV.chart(KV.$("#chart-cached"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "tok/s", stacked: true }),
    hits: KV.chart(KV.$("#chart-hits"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "%", range01: true }),
    ttft: KV.chart(KV.$("#chart-ttft"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s" }),
    itl: KV.chart(KV.$("#chart-itl"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s" }),
    pool: KV.chart(KV.$("#chart-pool"), { series: [{ label: "host pool use" }], unit: "%", range01: true }),
    bw: KV.chart(KV.$("#chart-bw"), { series: [{ label: "load-back" }, { label: "prefetch" }, { label: "backup" }], unit: "tok/s" }),
    prefetch: KV.chart(KV.$("#chart-prefetch"), {
      series: [{ label: "completed" }, { label: "timed out" }, { label: "revoked" }, { label: "in flight" }], unit: "count", stacked: true
    }),
    reqs: KV.chart(KV.$("#chart-reqs"), { series: [{ label: "running" }, { label: "queued" }], unit: "reqs" })
  };

  function col(key) { return samples.map(function (s) { return s[key] == null ? null : s[key]; }); }
  function delta(a, b, key) { var d = (b[key] || 0) - (a[key] || 0); return d >= 0 ? d : (b[key] || 0); }  // counter reset

  function redraw() {
    var xs = col("ts");
    var rates = TIERS.map(function () { return []; }), shares = TIERS.map(function () { return []; });
    var j = 0;
    samples.forEach(function (s, i) {
      var prev = samples[i - 1], dt = prev ? s.ts - prev.ts : 0;
      TIERS.forEach(function (t, k) { rates[k].push(prev && dt > 0 ? delta(prev, s, "cached_tokens_" + t) / dt : null); });
      while (j < i && s.ts - samples[j].ts > HIT_WINDOW_S) j++;  // oldest sample inside the window
      var base = samples[j], hits = TIERS.map(function (t) { return j < i ? delta(base, s, "cached_tokens_" + t) : 0; });
      var total = hits[0] + hits[1] + hits[2];
      TIERS.forEach(function (t, k) { shares[k].push(total > 0 ? hits[k] / total : null); });
    });
    charts.cached.set(xs, rates);
    charts.hits.set(xs, shares);
    charts.ttft.set(xs, [col("ttft_p50_s"), col("ttft_p90_s")]);
    charts.itl.set(xs, [col("itl_p50_s"), col("itl_p90_s")]);
    charts.pool.set(xs, [col("host_pool_use")]);
    charts.bw.set(xs, [col("load_back_tokens_per_s"), col("prefetch_tokens_per_s"), col("backup_tokens_per_s")]);
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
    samples.push(s);
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

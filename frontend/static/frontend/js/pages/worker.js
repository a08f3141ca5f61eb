/* Worker page: one hour of samples from the API, then each worker.metrics push appended in place.
   Derived series: per-tier cached tokens/s and cache I/O tokens/s (counter rates over 10 s), hit share over
   a sliding 60 s window, TTFT / ITL p50 and p90 over the 5 min before each sample (the increase of the
   worker's cumulative histogram buckets, KV.pools; none on a PD prefill worker, whose page has a note
   instead), prefetch in flight = issued - completed - timed out - revoked. The L3 breaker fact shows the
   newest sample's breaker state and counters; the tenant table its per-tenant cached tokens (named where
   the worker's tenants file names the label). An EPD encoder's page has its own charts instead (its
   template has #chart-images): images/s and encode seconds per second (10 s rates), mean encode time per
   image (encode seconds over images encoded in the last 10 s) and the local / global embedding cache hit
   rates (hits over lookups in the last 60 s); an encoder reports no KV figure. */
KV.ready(function () {
  "use strict";
  var HIT_WINDOW_S = 60, RATE_WINDOW_S = 10, LATENCY_WINDOW_S = 300, MAX_SAMPLES = 1800;
  var TIERS = ["device", "host", "storage"];
  var TIER_LABELS = ["L1 device", "L2 host", "L3 storage"];
  var BREAKER_STATES = ["closed", "half_open", "open"];
  var samples = [], lastSeq = 0;
  var ENCODER = !!KV.$("#chart-images");
  var charts = ENCODER ? {
    images: KV.chart(KV.$("#chart-images"), { series: [{ label: "images/s" }], unit: "images/s", gaps: true }),
    encode: KV.chart(KV.$("#chart-encode"), { series: [{ label: "mean per image" }], unit: "s", gaps: true }),
    busy: KV.chart(KV.$("#chart-busy"), { series: [{ label: "busy" }], unit: "%", gaps: true }),
    mmHits: KV.chart(KV.$("#chart-mm-hits"), { series: [{ label: "local LRU" }, { label: "global (Mooncake)" }], unit: "%", gaps: true, range01: true })
  } : {
    cached: KV.chart(KV.$("#chart-cached"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "tok/s", gaps: true, stacked: true }),
    hits: KV.chart(KV.$("#chart-hits"), { series: TIER_LABELS.map(function (l) { return { label: l }; }), unit: "%", gaps: true, range01: true }),
    ttft: KV.$("#chart-ttft") && KV.chart(KV.$("#chart-ttft"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s", gaps: true }),
    itl: KV.$("#chart-itl") && KV.chart(KV.$("#chart-itl"), { series: [{ label: "p50" }, { label: "p90" }], unit: "s", gaps: true }),
    pool: KV.chart(KV.$("#chart-pool"), { series: [{ label: "host pool use" }], unit: "%", gaps: true, range01: true }),
    bw: KV.chart(KV.$("#chart-bw"), { series: [{ label: "load-back" }, { label: "prefetch" }, { label: "backup" }], unit: "tok/s", gaps: true }),
    prefetch: KV.chart(KV.$("#chart-prefetch"), {
      series: [{ label: "completed" }, { label: "timed out" }, { label: "revoked" }, { label: "in flight" }], unit: "count", gaps: true, stacked: true
    }),
    reqs: KV.chart(KV.$("#chart-reqs"), { series: [{ label: "running" }, { label: "queued" }], unit: "reqs", gaps: true })
  };

  /* A figure that was not measured stays null (a gap), never 0. */
  function col(list, key) { return list.map(function (s) { return s[key] == null ? null : s[key]; }); }
  function delta(a, b, key) {  // counter increase (a reset restarts from 0); null unless both samples have it
    if (a[key] == null || b[key] == null) return null;
    var d = b[key] - a[key];
    return d >= 0 ? d : b[key];
  }
  /* per-second rate of counter `key` over the last RATE_WINDOW_S (as Prometheus rate()), one per sample */
  function rate(list, key) {
    var j = 0;
    return list.map(function (s, i) {
      while (j < i - 1 && s.ts - list[j + 1].ts >= RATE_WINDOW_S) j++;
      var base = list[j], dt = s.ts - base.ts, d = i > 0 ? delta(base, s, key) : null;
      return d != null && dt > 0 ? d / dt : null;
    });
  }
  /* Where the charts break: a pause in reporting longer than GAP_FACTOR x the usual interval (at least
     MIN_GAP_S), and the worker's last role change (its figures before and after are of different jobs).
     Each run between breaks is computed on its own, so no rate or window reaches across one. */
  var GAP_FACTOR = 3, MIN_GAP_S = 6;
  var ROLE_AT = KV.$("[data-testid=worker-role] time") ? Date.parse(KV.$("[data-testid=worker-role] time").getAttribute("datetime")) / 1000 : null;
  function runs() {
    var steps = samples.slice(1).map(function (s, i) { return s.ts - samples[i].ts; }).sort(function (a, b) { return a - b; });
    var gap = Math.max(MIN_GAP_S, GAP_FACTOR * (steps.length ? steps[Math.floor(steps.length / 2)] : 0));
    var out = [];
    samples.forEach(function (s, i) {
      var p = samples[i - 1];
      var cut = !p || s.ts - p.ts > gap || (ROLE_AT != null && p.ts < ROLE_AT && s.ts >= ROLE_AT);
      if (cut) out.push([]);
      out[out.length - 1].push(s);
    });
    return out;
  }
  /* per sample, f(oldest sample within windowS before it, the sample); null for the first of a run */
  function windowed(list, windowS, f) {
    var j = 0;
    return list.map(function (s, i) {
      while (j < i - 1 && s.ts - list[j + 1].ts >= windowS) j++;
      return i > 0 ? f(list[j], s) : null;
    });
  }
  function ratio(num, den) { return num != null && den != null && den > 0 ? num / den : null; }
  function encoderFigures(list) {
    var hitRate = function (cache) {
      return windowed(list, HIT_WINDOW_S, function (a, b) {
        var h = delta(a, b, cache + "_hits_total"), m = delta(a, b, cache + "_misses_total");
        return h == null || m == null ? null : ratio(h, h + m);
      });
    };
    return {
      xs: col(list, "ts"),
      images: [rate(list, "encoder_images_total")],
      encode: [windowed(list, RATE_WINDOW_S, function (a, b) {
        return ratio(delta(a, b, "encoder_encode_seconds_total"), delta(a, b, "encoder_images_total"));
      })],
      busy: [rate(list, "encoder_encode_seconds_total")],
      mmHits: [hitRate("mm_embedding_cache"), hitRate("mm_global_cache")]
    };
  }
  function figures(list) {  // every chart's series over one run of samples
    if (ENCODER) return encoderFigures(list);
    var shares = TIERS.map(function () { return []; });
    var j = 0;
    list.forEach(function (s, i) {
      while (j < i && s.ts - list[j].ts > HIT_WINDOW_S) j++;  // oldest sample inside the window
      var hits = TIERS.map(function (t) { return j < i ? delta(list[j], s, "cached_tokens_" + t) : null; });
      var total = hits.reduce(function (a, h) { return a + (h || 0); }, 0);
      TIERS.forEach(function (t, k) { shares[k].push(total > 0 && hits[k] != null ? hits[k] / total : null); });
    });
    var member = [{ samples: list }];
    var lat = list.map(function (s) { return KV.pools.at(member, s.ts, LATENCY_WINDOW_S) || {}; });
    var pick = function (key) { return lat.map(function (v) { return v[key] == null ? null : v[key]; }); };
    var done = ["prefetch_completed_total", "prefetch_timeout_total", "prefetch_revoked_total"];
    var inflight = list.map(function (s) {
      if (s.prefetch_started_total == null || done.some(function (k) { return s[k] == null; })) return null;
      return Math.max(0, s.prefetch_started_total - done.reduce(function (a, k) { return a + s[k]; }, 0));
    });
    return {
      xs: col(list, "ts"),
      cached: TIERS.map(function (t) { return rate(list, "cached_tokens_" + t); }),
      hits: shares,
      ttft: [pick("ttft_p50_s"), pick("ttft_p90_s")], itl: [pick("itl_p50_s"), pick("itl_p90_s")],
      pool: [col(list, "host_pool_use")],
      bw: [rate(list, "load_back_tokens_total"), rate(list, "prefetched_tokens_total"), rate(list, "backuped_tokens_total")],
      prefetch: [col(list, done[0]), col(list, done[1]), col(list, done[2]), inflight],
      reqs: [col(list, "num_running_reqs"), col(list, "num_queue_reqs")]
    };
  }
  var CHARTS = ENCODER ? ["images", "encode", "busy", "mmHits"] : ["cached", "hits", "ttft", "itl", "pool", "bw", "prefetch", "reqs"];
  function redraw() {
    var all = null;
    runs().forEach(function (list) {
      var f = figures(list);
      if (!all) { all = f; return; }
      var at = ROLE_AT != null && all.xs[all.xs.length - 1] < ROLE_AT && f.xs[0] >= ROLE_AT ? ROLE_AT : (all.xs[all.xs.length - 1] + f.xs[0]) / 2;
      all.xs = all.xs.concat([at], f.xs);  // one empty point between runs: the line breaks there
      CHARTS.forEach(function (k) { all[k] = all[k].map(function (ys, n) { return ys.concat([null], f[k][n]); }); });
    });
    all = all || figures([]);
    CHARTS.forEach(function (k) { if (charts[k]) charts[k].set(all.xs, all[k]); });
    var from = Date.now() / 1000 - KV.windowS();  // "Live samples": the samples the charts show now
    KV.$("[data-testid=samples]").textContent = String(samples.filter(function (s) { return s.ts >= from; }).length);
    var last = samples[samples.length - 1], count = function (v) { return v == null ? "–" : KV.fmt(v, "count"); };
    showBreaker(last);
    showTenants(last);
    if (ENCODER) return;
    var inflight = all.prefetch[3][all.prefetch[3].length - 1];
    KV.$("#prefetch-balance").textContent = last ? "Issued " + count(last.prefetch_started_total) + " = completed " +
      count(last.prefetch_completed_total) + " + timed out " + count(last.prefetch_timeout_total) +
      " + revoked " + count(last.prefetch_revoked_total) + " + in flight " + count(inflight) : "";
  }
  /* the L3 circuit breaker of the newest sample (0 closed, 1 half-open, 2 open); nothing without an L3 */
  function showBreaker(s) {
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
    auto.hidden = out == null || !s.ts;
    if (!auto.hidden) KV.time.set(KV.$("#breaker-auto-since"), s.ts - out);
  }
  var TENANT_NAMES = JSON.parse((KV.$("#tenant-names") || {}).textContent || "{}");
  function tenantName(label) {
    if (label === "none") return "shared (no salt)";
    if (label === "other") return "other";
    return TENANT_NAMES[label] ? TENANT_NAMES[label] + " (" + label + ")" : label;
  }
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
  /* cached tokens per tier and tenant in the newest sample (counters since the worker started) */
  function showTenants(s) {
    if (!s || !s.tenants || !s.tenants.length) return;
    var body = KV.$("#tenant-hits tbody");
    body.replaceChildren.apply(body, s.tenants.map(function (t) {
      var cached = t.device + t.host + t.storage;
      var tr = headedRow([tenantName(t.tenant), KV.fmt(t.prompt, "count")]
        .concat(TIERS.map(function (tier) { return KV.fmt(t[tier], "count"); }))
        .concat([t.prompt ? KV.fmt(cached / t.prompt, "%") : "–"]));
      tr.dataset.tenant = t.tenant;
      return tr;
    }));
  }
  /* the isolation self-test (POST .../check-isolation/): the verdict, both TTFTs and each probe's hits */
  var checkButton = KV.$("#check-isolation");
  function showIsolation(r) {
    var verdict = document.createElement("span");
    verdict.className = "badge s-" + (r.ok ? "succeeded" : "failed");
    verdict.textContent = r.ok ? "isolated" : "failed";
    KV.$("#isolation-verdict").replaceChildren(verdict);
    KV.$("#isolation-summary").textContent = r.prompt_tokens + "-token prompt; other salt TTFT " + KV.fmt(r.ttft_other_salt_s, "s") +
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
    if (msg.type === "worker.metrics" && add(msg.data)) redraw();
  }, load);
  return load();
});

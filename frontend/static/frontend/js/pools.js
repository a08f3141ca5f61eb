/* Pool figures from worker samples, the P:D planner's window math in the browser (controlplane/rebalance/
   planner/window.py): rates are counter increases between a worker's first and last sample in the window
   over the time between them, summed over the pool; p90s come from the summed histogram bucket increases
   (ttft_buckets / itl_buckets, cumulative [[upper bound s, count], ...]). KV.pools.at(members, t, windowS)
   -> {input_tps, output_tps, requests_ps, ttft_p50_s, ttft_p90_s, itl_p50_s, itl_p90_s, workers} or null (a
   p50 / p90 is null when no request finished in the window); KV.pools.series(members, from, to, step,
   windowS) -> {ts: [...], <key>: [...]}. members: [{samples}] (oldest first). The worker page uses at() with
   its one worker. */
(function () {
  "use strict";
  var KV = window.KV;
  var COUNTERS = { input_tps: "prompt_tokens_total", output_tps: "generation_tokens_total", requests_ps: "num_requests_total" };

  function lastAtOrBefore(samples, t) {  // binary search: newest sample with ts <= t
    var lo = 0, hi = samples.length - 1, found = null;
    while (lo <= hi) {
      var mid = (lo + hi) >> 1;
      if (samples[mid].ts <= t) { found = samples[mid]; lo = mid + 1; } else hi = mid - 1;
    }
    return found;
  }
  function firstAfter(samples, t) {  // binary search: oldest sample with ts > t
    var lo = 0, hi = samples.length - 1, found = null;
    while (lo <= hi) {
      var mid = (lo + hi) >> 1;
      if (samples[mid].ts > t) { found = samples[mid]; hi = mid - 1; } else lo = mid + 1;
    }
    return found;
  }
  function quantile(q, buckets) {  // as Prometheus histogram_quantile, linear inside a bucket
    var bounds = Object.keys(buckets).map(Number).sort(function (a, b) { return a - b; });
    if (!bounds.length) return null;
    var total = buckets[bounds[bounds.length - 1]];
    if (!(total > 0)) return null;
    var rank = q * total, prevB = 0, prevC = 0;
    for (var i = 0; i < bounds.length; i++) {
      var b = bounds[i], c = buckets[b];
      if (c >= rank) {
        if (b >= 1e308) return prevB;
        var w = c - prevC;
        return prevB + (b - prevB) * (w ? (rank - prevC) / w : 1);
      }
      prevB = b; prevC = c;
    }
    return prevB;
  }
  function addBuckets(acc, first, last, key) {
    var before = {};
    (first[key] || []).forEach(function (p) { before[p[0]] = p[1]; });
    var delta = {};
    var ok = (last[key] || []).every(function (p) {
      var d = p[1] - (before[p[0]] || 0);
      delta[p[0]] = d;
      return d >= 0;
    });
    if (!ok) return false;
    Object.keys(delta).forEach(function (b) { acc[b] = (acc[b] || 0) + delta[b]; });
    return true;
  }

  function at(members, t, windowS) {
    var sums = { input_tps: 0, output_tps: 0, requests_ps: 0 }, ttft = {}, itl = {}, used = 0;
    members.forEach(function (m) {
      var last = lastAtOrBefore(m.samples, t);
      var first = last && firstAfter(m.samples, t - windowS);
      if (!last || !first || last.ts <= first.ts) return;
      var dt = last.ts - first.ts, rates = {};
      var ok = Object.keys(COUNTERS).every(function (k) {
        var d = (last[COUNTERS[k]] || 0) - (first[COUNTERS[k]] || 0);
        rates[k] = d / dt;
        return d >= 0;
      });
      if (!ok) return;  // restarted inside the window
      var t1 = {}, i1 = {};
      if (!addBuckets(t1, first, last, "ttft_buckets") || !addBuckets(i1, first, last, "itl_buckets")) return;
      used++;
      Object.keys(rates).forEach(function (k) { sums[k] += rates[k]; });
      Object.keys(t1).forEach(function (b) { ttft[b] = (ttft[b] || 0) + t1[b]; });
      Object.keys(i1).forEach(function (b) { itl[b] = (itl[b] || 0) + i1[b]; });
    });
    if (!used) return null;
    return Object.assign(sums, {
      ttft_p50_s: quantile(0.5, ttft), ttft_p90_s: quantile(0.9, ttft),
      itl_p50_s: quantile(0.5, itl), itl_p90_s: quantile(0.9, itl), workers: used
    });
  }

  function series(members, from, to, step, windowS) {
    var out = { ts: [], input_tps: [], output_tps: [], requests_ps: [], ttft_p90_s: [], itl_p90_s: [] };
    for (var t = from; t <= to; t += step) {
      var v = at(members(t), t, windowS);
      out.ts.push(t);
      ["input_tps", "output_tps", "requests_ps", "ttft_p90_s", "itl_p90_s"].forEach(function (k) { out[k].push(v ? v[k] : null); });
    }
    return out;
  }

  KV.pools = { at: at, series: series, quantile: quantile };
})();

/* Shared by the operation pages: labels and per-target summaries of an operation. */
(function () {
  "use strict";
  var KV = window.KV;
  KV.KIND_LABELS = { attach: "attach L3", detach: "detach L3", apply_config: "apply config revision", restart_with_flags: "restart with flags" };
  KV.opView = function (op) {
    var counts = {};
    op.targets.forEach(function (t) { counts[t.state] = (counts[t.state] || 0) + 1; });
    var end = op.finished_at || (op.state === "running" ? new Date().toISOString() : null);
    return Object.assign({}, op, {
      kind_label: KV.KIND_LABELS[op.kind] || op.kind, policy_label: op.policy.replace(/_/g, " "),
      targets_text: op.targets.length + " worker" + (op.targets.length === 1 ? "" : "s") + ": " +
        Object.keys(counts).sort().map(function (k) { return counts[k] + " " + KV.stateText(k); }).join(", "),
      duration: KV.time.duration(KV.time.between(op.started_at, end)) + (op.finished_at ? "" : " so far")
    });
  };
  /* A finished operation's fleet outcome (summary keys changed, restored, left_changed) in words. */
  KV.outcomeText = function (op) {
    var s = op.summary || {};
    if (op.state === "running") return "not finished yet";
    if (!s.changed) return "";
    var parts = [s.changed.length ? "changed: " + s.changed.join(", ") : "no worker was changed"];
    if (s.restored && s.restored.length) parts.push("restored to the before state: " + s.restored.join(", "));
    var left = Object.keys(s.left_changed || {}).sort();
    if (left.length) parts.push("left changed: " + left.map(function (n) { return n + " (" + KV.readable(s.left_changed[n]) + ")"; }).join(", "));
    return parts.join("; ");
  };
})();

/* A worker's raw error text -> a readable sentence: "PUT http://w/x -> 400: {json}" becomes
   "worker answered 400: <error.message>", and a cache-I/O refusal names the blocking I/O. */
(function () {
  "use strict";
  var KV = window.KV;
  function messageOf(obj) {
    if (!obj || typeof obj !== "object") return null;
    if (obj.error) return typeof obj.error === "string" ? obj.error : messageOf(obj.error) || JSON.stringify(obj.error);
    return obj.message || obj.detail || null;
  }
  KV.readable = function (text) {
    if (!text) return "";
    var out = String(text).replace(/(?:GET|PUT|POST|DELETE|PATCH) \S+ -> (\d{3}): /g, "worker answered $1: ");
    var start = out.indexOf("{");
    if (start >= 0) {
      try {
        var msg = messageOf(JSON.parse(out.slice(start)));
        if (msg) out = out.slice(0, start) + msg;
      } catch (e) { /* not JSON: keep the text */ }
    }
    return out.replace(/cache I\/O in flight \{([^}]*)\}/, function (_, io) {
      var busy = io.split(",").map(function (kv) { return kv.replace(/['"\s]/g, "").split(":"); })
        .filter(function (kv) { return Number(kv[1]) > 0; }).map(function (kv) { return kv[0] + " " + kv[1]; });
      return "blocked by cache I/O in flight (" + (busy.join(", ") || "none reported") + ")";
    });
  };
})();

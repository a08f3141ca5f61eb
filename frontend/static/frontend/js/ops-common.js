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
  KV.outcomeText = function (op, targetsShown) {  /* targetsShown: the page lists each target's why */
    var s = op.summary || {};
    if (op.state === "running") return "not finished yet";
    if (!s.changed) return "";
    var parts = [s.changed.length ? "changed: " + s.changed.join(", ") : "no worker was changed"];
    if (s.restored && s.restored.length) parts.push("restored to the before state: " + s.restored.join(", "));
    var left = Object.keys(s.left_changed || {}).sort();
    if (left.length) parts.push("left changed: " + left.map(function (n) { return n + " (" + (targetsShown ? "see Targets" : KV.readable(s.left_changed[n])) + ")"; }).join(", "));
    return parts.join("; ");
  };
})();

/* A worker's raw error text -> a readable sentence: "PUT http://w/x -> 400: {json}; more" becomes
   "worker answered 400: <error.message>; more" (each JSON object in the text, wherever it ends, replaced by
   its message, line breaks read as spaces), and a cache-I/O refusal names the blocking I/O. */
(function () {
  "use strict";
  var KV = window.KV;
  function messageOf(obj) {
    if (!obj || typeof obj !== "object") return null;
    if (obj.error) return typeof obj.error === "string" ? obj.error : messageOf(obj.error) || JSON.stringify(obj.error);
    return obj.message || obj.detail || null;
  }
  /* the index after the JSON object starting at text[start] ("{"), strings and escapes skipped; -1: none */
  function objectEnd(text, start) {
    var depth = 0, inString = false;
    for (var i = start; i < text.length; i++) {
      var c = text[i];
      if (inString) { if (c === "\\") i++; else if (c === '"') inString = false; continue; }
      if (c === '"') inString = true;
      else if (c === "{") depth++;
      else if (c === "}" && --depth === 0) return i + 1;
    }
    return -1;
  }
  KV.readable = function (text) {
    if (!text) return "";
    var out = String(text).replace(/(?:GET|PUT|POST|DELETE|PATCH) \S+ -> (\d{3}): /g, "worker answered $1: ");
    for (var from = 0, start; (start = out.indexOf("{", from)) >= 0;) {
      var end = objectEnd(out, start), msg = null;
      if (end < 0) break;
      try { msg = messageOf(JSON.parse(out.slice(start, end))); } catch (e) { /* not JSON: keep the text */ }
      if (msg) { msg = String(msg).replace(/\s*\n\s*/g, " ").trim(); out = out.slice(0, start) + msg + out.slice(end); from = start + msg.length; }
      else from = end;
    }
    return out.replace(/cache I\/O in flight \{([^}]*)\}/, function (_, io) {
      var busy = io.split(",").map(function (kv) { return kv.replace(/['"\s]/g, "").split(":"); })
        .filter(function (kv) { return Number(kv[1]) > 0; }).map(function (kv) { return kv[0] + " " + kv[1]; });
      return "blocked by cache I/O in flight (" + (busy.join(", ") || "none reported") + ")";
    });
  };
  /* An operation's explanation where each target's failure, told in full in the Targets table, is named
     only ("w1 failed (see Targets)"), so the page says the worker's error once. */
  KV.opExplanation = function (op) {
    var text = op.explanation || "", failures = (op.summary || {}).failures || {};
    Object.keys(failures).forEach(function (name) {
      text = text.split(name + " failed: " + failures[name]).join(name + " failed (see Targets)");
    });
    return KV.readable(text);
  };
})();

/* Audit log: filters in the URL, per-field diffs (long values folded), paging, and "Revert to this" behind
   a confirmation listing each worker's change (now -> restored). */
KV.ready(function () {
  "use strict";
  var form = KV.$("#audit-filter"), next = null, events = {}, tpl = KV.$("#tpl-event");
  new URLSearchParams(location.search).forEach(function (v, k) { if (form[k]) form[k].value = v; });
  function query() {
    var p = new URLSearchParams();
    KV.$$("input, select", form).forEach(function (el) { if (el.value) p.set(el.name, el.value); });
    return p.toString();
  }
  var TYPES = { "inventory.engineworker": "worker", "inventory.storageprofile": "storage profile", "inventory.router": "router",
    "inventory.host": "host", "inventory.gpu": "GPU", "operations.operation": "operation", "accounts.apitoken": "API token",
    "auth.user": "user", "configs.configprofile": "config profile", "configs.configrevision": "config revision" };
  /* "worker gpu-0"; a repr that already names its type ("operation 2 (attach)") is not prefixed again, and
     the operation's own record names it once, as the link to its page. */
  function targetText(e) {
    var label = TYPES[e.object_type] || e.object_type, repr = e.object_repr || "";
    if (e.object_type === "operations.operation" && String(e.object_id) === String(e.operation_id)) return "";
    return repr.toLowerCase().indexOf(label.toLowerCase() + " ") === 0 ? repr : (label + " " + repr).trim();
  }
  function operationText(e) {
    if (!e.operation_id) return "";
    var own = e.object_type === "operations.operation" && String(e.object_id) === String(e.operation_id);
    return own ? (e.object_repr || "").replace(/^operation (\d+)/, "operation #$1") : "operation #" + e.operation_id;
  }
  function view(e) {
    var x = e.extra || {};
    return Object.assign({}, e, {
      target_text: targetText(e), action_label: e.action.replace(/_/g, " "),
      actor_text: e.actor_display + (e.token_prefix ? " (API token)" : ""),
      request_short: (e.request_id || "").slice(0, 8) || "–",
      operation_text: operationText(e),
      rebalance_id: x.rebalance_id, router_id: x.router_id,  // a role switch links its rebalance and step
      rebalance_text: x.rebalance_id ? "rebalance #" + x.rebalance_id + (x.step_index != null ? ", step " + (x.step_index + 1) : "") : "",
      message_text: KV.readable(e.message)
    });
  }
  function decorate(row, e) {
    events[e.id] = e;
    KV.diff(KV.$(".diff", row), e.changes, e.before);
    if (KV.canWrite && e.undo) KV.$(".act", row).appendChild(KV.fill(KV.$("#tpl-undo"), { title: "Back to the state before this change: " + e.undo.after }));
    if (KV.canWrite && e.revertible) KV.$(".act", row).appendChild(KV.fill(KV.$("#tpl-revert"), {}));
    if (KV.canWrite && e.revert_together_changes.length) {  // every worker of its operation, in one operation
      KV.$(".act", row).appendChild(KV.fill(KV.$("#tpl-revert-together"), {
        label: "Revert all " + e.revert_together_changes.length + "…",
        title: "Revert every worker operation #" + e.operation_id + " changed to this state, in one operation" }));
    }
  }
  function load(url, append) {
    return KV.api("GET", url).then(function (r) {
      var tbody = KV.$("#audit tbody"), frag = document.createDocumentFragment();
      r.results.forEach(function (e) { var row = KV.fill(tpl, view(e)); decorate(row, e); frag.appendChild(row); });
      if (append) tbody.appendChild(frag); else tbody.replaceChildren(frag);
      next = r.next; KV.$("#more").hidden = !next;
      KV.$("#audit-empty").hidden = tbody.children.length > 0;
    });
  }
  /* The server's revert_changes (together: revert_together_changes): only the workers the revert would
     change, now -> after. */
  function revert(e, together) {
    var restore = e.extra.restore, changes = together ? e.revert_together_changes : e.revert_changes;
    var rows = changes.map(function (c) { return { worker: c.worker, before: c.now, after: c.after }; });
    return KV.confirm({ title: together ? "Revert every worker of operation #" + e.operation_id + " to the state of record #" + e.id + "?"
      : "Revert to the state of record #" + e.id + "?", confirmLabel: "Launch revert",
      text: "This launches a new " + (KV.KIND_LABELS[restore.kind] || restore.kind) + " operation that changes " + rows.length +
        " worker(s) as listed; workers already in the recorded state are left alone.", rows: rows,
      reason: true, drain: true
    }).then(function (ok) {
      if (!ok) return;
      var body = { reason: KV.confirmReason() || "revert to audit record #" + e.id, together: !!together, drain: KV.confirmDrain() };
      return KV.api("POST", "/api/v1/audit/events/" + e.id + "/revert/", body).then(function (op) { location.href = "/operations/" + op.id + "/"; });
    });
  }
  /* The server's undo plan: the one worker back to the state the record found (its `before`). */
  function undo(e) {
    var u = e.undo;
    return KV.confirm({ title: "Undo record #" + e.id + "?", confirmLabel: "Launch undo",
      text: "This launches a new " + (KV.KIND_LABELS[u.kind] || u.kind) + " operation that puts " + u.worker +
        " back to the state it had before this change.", rows: [{ worker: u.worker, before: u.now, after: u.after }],
      reason: "required", drain: true
    }).then(function (ok) {
      if (!ok) return;
      return KV.api("POST", "/api/v1/audit/events/" + e.id + "/undo/", { reason: KV.confirmReason(), drain: KV.confirmDrain() }).then(function (op) { location.href = "/operations/" + op.id + "/"; });
    });
  }
  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    history.replaceState(null, "", "?" + query());
    load("/api/v1/audit/events/?" + query(), false);
  });
  form.addEventListener("reset", function () { setTimeout(function () { form.requestSubmit(); }, 0); });
  KV.$("#more").addEventListener("click", function () { if (next) load(next, true); });
  KV.$("#audit").addEventListener("click", function (ev) {
    var undoing = ev.target.classList.contains("undo");
    if (!undoing && !ev.target.classList.contains("revert")) return;
    var e = events[ev.target.closest("tr").dataset.event];
    (undoing ? undo(e) : revert(e, ev.target.dataset.together === "1")).catch(function (err) { KV.$("#page-error").textContent = KV.errorText(err); KV.$("#page-error").hidden = false; });
  });
  return load("/api/v1/audit/events/?" + query(), false);
});

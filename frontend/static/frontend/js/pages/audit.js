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
    return Object.assign({}, e, {
      target_text: targetText(e), action_label: e.action.replace(/_/g, " "),
      actor_text: e.actor_display + (e.token_prefix ? " (API token)" : ""),
      request_short: (e.request_id || "").slice(0, 8) || "–",
      operation_text: operationText(e),
      message_text: KV.readable(e.message)
    });
  }
  function decorate(row, e) {
    events[e.id] = e;
    KV.diff(KV.$(".diff", row), e.changes);
    if (KV.canWrite && e.revertible) KV.$(".act", row).appendChild(KV.fill(KV.$("#tpl-revert"), {}));
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
  function restoredTo(restore, profiles) {
    if (restore.kind === "attach") { var p = profiles[restore.storage_profile_id]; return p ? p.backend + " (" + p.name + ")" : "storage profile #" + restore.storage_profile_id; }
    if (restore.kind === "detach") return "none (detached)";
    return "config revision #" + restore.revision_id;
  }
  function revert(e) {
    var restore = e.extra.restore, ids = restore.worker_ids || [];
    return Promise.all([KV.api("GET", "/api/v1/inventory/workers/?limit=500"), KV.api("GET", "/api/v1/inventory/storage-profiles/?limit=500")]).then(function (r) {
      var profiles = {};
      r[1].results.forEach(function (p) { profiles[p.id] = p; });
      var rows = r[0].results.filter(function (w) { return ids.indexOf(w.id) >= 0; }).map(function (w) {
        var now = restore.kind === "apply_config" ? (w.config_revision ? "config revision #" + w.config_revision : "no revision applied") : (w.storage_backend || "none");
        return { worker: w.name, before: now, after: restoredTo(restore, profiles) };
      });
      return KV.confirm({ title: "Revert to the state of record #" + e.id + "?", confirmLabel: "Launch revert",
        text: "This launches a new " + (KV.KIND_LABELS[restore.kind] || restore.kind) + " operation on " + rows.length + " worker(s).", rows: rows });
    }).then(function (ok) {
      if (!ok) return;
      return KV.api("POST", "/api/v1/audit/events/" + e.id + "/revert/", { reason: "revert to audit record #" + e.id }).then(function (op) { location.href = "/operations/" + op.id + "/"; });
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
    if (!ev.target.classList.contains("revert")) return;
    var e = events[ev.target.closest("tr").dataset.event];
    revert(e).catch(function (err) { KV.$("#page-error").textContent = KV.errorText(err); KV.$("#page-error").hidden = false; });
  });
  return load("/api/v1/audit/events/?" + query(), false);
});

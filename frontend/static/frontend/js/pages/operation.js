/* Operation page: read once; operation.target_changed / state_changed pushes update the target row and the
   header in place. When the operation ends it is read once more for the workers' read-back "after" state. */
KV.ready(function () {
  "use strict";
  var tpl = KV.$("#tpl-target"), rows = {}, op = null;
  var ACTIVE = ["pending", "waiting_for_idle", "applying", "verifying", "reverting"];

  function targetView(t) {
    var end = t.finished_at || (ACTIVE.indexOf(t.state) >= 0 ? null : t.updated_at);
    return Object.assign({}, t, {
      explanation_text: KV.readable(t.explanation),
      duration: end ? KV.time.duration(KV.time.between(op.created_at, end)) : "running"
    });
  }
  function putTarget(t) {
    var view = targetView(t);
    if (!rows[t.id]) { rows[t.id] = KV.fill(tpl, view); KV.$("#op-targets tbody").appendChild(rows[t.id]); }
    else KV.fill(rows[t.id], view);
    var cell = KV.$(".diff", rows[t.id]);
    if (t.after == null) cell.textContent = t.before == null ? "–" : "not changed yet";
    else KV.diff(cell, KV.changes(t.before, t.after));
  }
  var profileNames = {};
  function change() {
    if (op.kind === "attach") return "attach L3 storage profile " + (profileNames[op.storage_profile] || "#" + op.storage_profile);
    if (op.kind === "apply_config") return "apply config revision #" + op.revision;
    return "detach L3 storage";
  }
  function renderHead() {
    var view = KV.opView(op);
    KV.$("#op-kind").textContent = view.kind_label;
    var st = KV.$("#op-state"); st.textContent = op.state; st.className = "badge s-" + op.state;
    KV.fill(KV.$("#op-facts"), Object.assign(view, {
      policy_text: op.policy.replace(/_/g, " ") + (op.drain ? ", drained from router while applying" : ""),
      change: change(), idle_timeout: op.idle_timeout_s + " s",
      explanation_text: op.state === "running" ? (op.cancel_requested ? "Cancel requested." : "Running.") : KV.readable(op.explanation),
      duration: view.duration
    }));
    var cancel = KV.$("#cancel");
    if (cancel) cancel.disabled = op.state !== "running" || op.cancel_requested;
  }
  function render(fresh) {
    op = fresh;
    renderHead();
    op.targets.forEach(putTarget);
  }
  function load() {
    return Promise.all([KV.api("GET", "/api/v1/operations/" + KV.pk + "/"), KV.api("GET", "/api/v1/inventory/storage-profiles/?limit=500")])
      .then(function (r) {
        r[1].results.forEach(function (p) { profileNames[p.id] = p.name + " (" + p.backend + ")"; });
        render(r[0]);
      });
  }
  setInterval(function () { if (op && op.state === "running") renderHead(); }, 1000);  // running duration

  var cancel = KV.$("#cancel");
  if (cancel) cancel.addEventListener("click", function () {
    KV.confirm({
      title: "Cancel operation #" + op.id + "?",
      text: "Targets not yet applied are cancelled; workers already changed keep their new state.",
      confirmLabel: "Cancel operation",
      rows: op.targets.map(function (t) {
        return { worker: t.worker_name, before: t.state, after: ACTIVE.indexOf(t.state) >= 0 ? "cancelled (not applied)" : t.state + " (kept)" };
      })
    }).then(function (ok) {
      if (!ok) return;
      KV.api("POST", "/api/v1/operations/" + KV.pk + "/cancel/", { reason: "cancelled from the console" }).then(render)
        .catch(function (err) { KV.$("#page-error").textContent = KV.errorText(err); KV.$("#page-error").hidden = false; });
    });
  });
  KV.subscribe(["operation." + KV.pk], function (msg) {
    if (!op) return;
    var d = msg.data;
    if (msg.type === "operation.target_changed") {
      var t = op.targets.filter(function (x) { return x.id === d.target_id; })[0];
      if (!t) return;
      t.state = d.state; t.explanation = d.explanation; t.updated_at = msg.ts;
      if (ACTIVE.indexOf(d.state) < 0 && !t.finished_at) t.finished_at = msg.ts;
      putTarget(t);
    } else if (msg.type === "operation.state_changed") {
      op.state = d.state; op.explanation = d.explanation; op.summary = d.summary;
      renderHead();
      if (d.state !== "running") load();  // once, at the end: workers' read-back state and exact times
    }
  }, load);
  return load();
});

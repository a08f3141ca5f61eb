/* Operation page: renders one API read of the operation at a time (the server reads the operation and its
   targets on one database snapshot). operation.target_changed / state_changed pushes trigger a re-read (one
   read in flight, coalesced, so an older answer never overwrites a newer one); so does each websocket join
   (a push sent before it was missed) and, while running, every POLL_REFRESH_S (idle polls move without a
   push). */
KV.ready(function () {
  "use strict";
  var tpl = KV.$("#tpl-target"), rows = {}, op = null;
  var ACTIVE = KV.machines.target.active;
  var POLL_REFRESH_S = 5;

  function targetView(t) {
    var end = t.finished_at || (ACTIVE.indexOf(t.state) >= 0 ? null : t.updated_at);
    return Object.assign({}, t, {
      explanation_text: KV.readable(t.explanation),
      duration: end ? KV.time.duration(KV.time.between(op.started_at, end)) : "running"
    });
  }
  function putTarget(t) {
    var view = targetView(t);
    if (!rows[t.id]) { rows[t.id] = KV.fill(tpl, view); KV.$("#op-targets tbody").appendChild(rows[t.id]); }
    else KV.fill(rows[t.id], view);
    var cell = KV.$(".diff", rows[t.id]);
    // no after: still to come while the target is active; a target that ended so (cancelled, failed) never changed
    if (op.kind === "restart_with_flags" && t.before) { commandLines(cell, t); return; }
    if (t.after == null) cell.textContent = t.before == null ? "–" : ACTIVE.indexOf(t.state) >= 0 ? "not changed yet" : "not changed (" + KV.stateText(t.state) + ")";
    else KV.diff(cell, KV.changes(t.before, t.after), t.before);
  }
  /* restart_with_flags: the command line before and after (read back from what its agent reports), the
     flags that differ marked */
  function commandLines(cell, t) {
    var was = t.before.command_line || [], now = t.after ? t.after.command_line || [] : null;
    function line(label, items, other, mark) {
      var div = document.createElement("div"), name = document.createElement("span"), code = document.createElement("code");
      name.className = "field"; name.textContent = label + ": "; div.append(name, code); div.className = "cmdline";
      items.forEach(function (item, i) {
        var el = document.createElement(other && other.indexOf(item) < 0 ? mark : "span");
        el.textContent = item; code.append(i ? " " : "", el);
      });
      return div;
    }
    var rowsOut = [line("before", was, now, "del")];
    rowsOut.push(now ? line("after", now, was, "ins") : document.createTextNode(ACTIVE.indexOf(t.state) >= 0 ? "after: not restarted yet" : "after: unknown (" + KV.stateText(t.state) + ")"));
    cell.replaceChildren.apply(cell, rowsOut);
  }
  var profileNames = {};
  function change() {
    if (op.kind === "restart_with_flags") {
      var f = op.flags || {}, set = Object.keys(f.set || {}).map(function (k) { return k + "=" + (typeof f.set[k] === "string" ? f.set[k] : JSON.stringify(f.set[k])); });
      return "restart with flags: " + [set.length ? "set " + set.join(" ") : "", (f.remove || []).length ? "remove " + f.remove.join(" ") : ""].filter(Boolean).join("; ");
    }
    if (op.kind === "attach") return "attach L3 storage profile " + (profileNames[op.storage_profile] || "#" + op.storage_profile);
    if (op.kind === "apply_config") return "apply config revision #" + op.revision;
    return "detach L3 storage";
  }
  function renderHead() {
    var view = KV.opView(op);
    KV.$("#op-kind").textContent = view.kind_label;
    var st = KV.$("#op-state"); st.textContent = KV.stateText(op.state); st.className = "badge s-" + op.state;
    KV.fill(KV.$("#op-facts"), Object.assign(view, {
      policy_text: op.policy.replace(/_/g, " ") + (op.drain ? ", drained from router while applying" : ""),
      change: change(), idle_timeout: op.idle_timeout_s + " s",
      explanation_text: op.state === "running" ? (op.cancel_requested ? "Cancel requested." : "Running.") : KV.opExplanation(op),
      duration: view.duration, outcome_text: KV.outcomeText(op, true)
    }));
    var cancel = KV.$("#cancel");
    if (cancel) { cancel.hidden = op.state !== "running"; cancel.disabled = !!op.cancel_requested; }
    var retry = KV.$("#retry-drain");  // workers that stayed busy undrained: the launch form, drain on, them picked
    if (retry) {
      var q = new URLSearchParams({ kind: op.kind, drain: "1", idle_timeout_s: String(op.idle_timeout_s) });
      if (op.storage_profile) q.set("storage_profile", op.storage_profile);
      if (op.revision) q.set("revision", op.revision);
      if (op.reason) q.set("reason", op.reason);  // the launch form requires one: the original's, to edit
      (op.drain_on_retry || []).forEach(function (id) { q.append("worker", id); });
      retry.href = "/operations/new/?" + q.toString();
      retry.hidden = op.state === "running" || !(op.drain_on_retry || []).length;
    }
  }
  function render(fresh) {
    op = fresh;
    renderHead();
    op.targets.forEach(putTarget);
  }
  var reading = null, readAgain = false;
  function refresh() {  // re-read the operation; a push during a read asks for one more read after it
    if (reading) { readAgain = true; return reading; }
    function done() { reading = null; if (readAgain) { readAgain = false; refresh(); } }
    reading = KV.api("GET", "/api/v1/operations/" + KV.pk + "/").then(render)
      .then(done, function (err) { done(); if (!op) throw err; });  // later failures: the next push or tick reads again
    return reading;
  }
  var ticks = 0;
  setInterval(function () {  // running duration; idle polls, which change without a push
    if (!op || op.state !== "running") return;
    renderHead();
    if (++ticks % POLL_REFRESH_S === 0) refresh();
  }, 1000);

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
  /* A push is only a cue: the page re-reads the operation, so what it shows (state, finish time, each
     target's before/after) is always one API snapshot, never a push's fields beside an older read. */
  function onMessage() { refresh(); }
  return KV.api("GET", "/api/v1/inventory/storage-profiles/?limit=500").then(function (r) {
    r.results.forEach(function (p) { profileNames[p.id] = p.name + " (" + p.backend + ")"; });
    KV.subscribe(["operation." + KV.pk], onMessage, refresh);  // each join re-reads
    return refresh();
  });
});

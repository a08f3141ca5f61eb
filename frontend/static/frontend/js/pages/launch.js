/* Launch form: only the fields of the chosen kind are shown; every worker's "Idle now?" is polled on load and again
   by "Review and launch", then a confirmation dialog lists each worker's change (now -> after) before anything is sent. */
KV.ready(function () {
  "use strict";
  var form = KV.$("#launch-form"), key = (window.crypto && crypto.randomUUID) ? crypto.randomUUID() : String(Date.now());
  var params = new URLSearchParams(location.search), preselect = params.getAll("worker");
  /* a retry from an operation's page: its kind, drain, idle timeout, profile, revision and reason (checked on Review) */
  if (params.get("kind")) form.kind.value = params.get("kind");
  if (params.get("drain") === "1") form.drain.checked = true;
  if (params.get("idle_timeout_s")) form.idle_timeout_s.value = params.get("idle_timeout_s");
  if (params.get("reason")) form.reason.value = params.get("reason");
  /* drain defaults on while every picked worker is served by a router (its traffic can keep it busy past the
     idle timeout), off otherwise (a drain without a router is refused); a link's drain= or the operator's click wins */
  var drainChosen = params.has("drain");
  form.drain.addEventListener("change", function () { drainChosen = true; });
  var workers = {}, profiles = {}, revisions = {};

  function kindChanged() {
    var k = KV.$("#kind").value;
    KV.$$("[data-kind]", form).forEach(function (el) {
      el.hidden = el.dataset.kind !== k;
      KV.$$("select, input", el).forEach(function (c) { c.disabled = el.hidden; });
    });
  }
  function option(value, text) { var o = document.createElement("option"); o.value = value; o.textContent = text; return o; }
  function picked() { return KV.$$(".pick").filter(function (c) { return c.checked; }).map(function (c) { return Number(c.value); }); }
  function defaultDrain() {
    var ids = picked();
    if (!drainChosen) form.drain.checked = ids.length > 0 && ids.every(function (id) { return workers[id] && workers[id].router != null; });
  }
  function error(text) { KV.$("#launch-error").textContent = text; }

  /* the restart's change from the form: {set: {name: value}, remove: [name]}; a value that reads as JSON
     (32, true, {"a": 1}) is sent as such, else as text; a bare name switches a flag on */
  function flagsChange() {
    var set = {};
    form.flags_set.value.split("\n").map(function (l) { return l.trim(); }).filter(Boolean).forEach(function (line) {
      var at = line.indexOf("="), name = at < 0 ? line : line.slice(0, at).trim(), text = at < 0 ? "true" : line.slice(at + 1).trim();
      var value = text;
      try { value = JSON.parse(text); } catch (e) { /* plain text */ }
      set[name] = value;
    });
    var remove = form.flags_remove.value.split(/[\s,]+/).filter(Boolean);
    return { set: set, remove: remove };
  }
  function flagsText(change) {
    var parts = Object.keys(change.set).map(function (k) { return k + "=" + (typeof change.set[k] === "string" ? change.set[k] : JSON.stringify(change.set[k])); });
    return (parts.length ? "set " + parts.join(" ") : "") + (change.remove.length ? (parts.length ? "; " : "") + "remove " + change.remove.join(" ") : "");
  }
  function after(w) {
    var k = form.kind.value;
    if (k === "restart_with_flags") return "restarted: " + flagsText(flagsChange());
    if (k === "attach") { var p = profiles[form.storage_profile.value]; return p ? p.backend + " (" + p.name + ")" : "?"; }
    if (k === "detach") return "none";
    var r = revisions[form.revision.value];
    return r ? r.label + " " + JSON.stringify(r.content) : "?";
  }
  function before(w, probe) {
    var k = form.kind.value, idle = !probe.reachable ? "unreachable" : probe.is_idle ? "idle" : "busy: waits for idle";
    var now = k === "apply_config" ? (w.config_revision ? "revision #" + w.config_revision : "no revision applied") :
      k === "restart_with_flags" ? ((w.command_line || []).join(" ") || "no command line reported (no agent)") :
      (probe.storage_backend || w.storage_backend || "none");
    return now + " [" + idle + "]";
  }

  function probe(ids) {  // the review's idle poll of these workers, shown in the "Idle now?" column
    return KV.api("GET", "/api/v1/operations/preview/?" + ids.map(function (i) { return "worker=" + i; }).join("&")).then(function (probes) {
      probes.forEach(function (p) {
        var cell = KV.$('tr[data-worker="' + p.worker_id + '"] .idle');
        if (cell) cell.textContent = !p.reachable ? "unreachable" : p.is_idle ? "idle" : "busy (" + p.num_running_reqs + " running, " +
          p.num_waiting_reqs + " waiting" + (p.num_http_reqs ? ", " + p.num_http_reqs + " HTTP request" + (p.num_http_reqs === 1 ? "" : "s") + " unanswered" : "") + ")";
      });
      return probes;
    });
  }

  function load() {
    return Promise.all([KV.api("GET", "/api/v1/inventory/workers/?limit=500"), KV.api("GET", "/api/v1/inventory/storage-profiles/?limit=500"),
      KV.api("GET", "/api/v1/configs/profiles/?limit=500")]).then(function (r) {
      KV.replaceRows(KV.$("#targets tbody"), KV.$("#tpl-target"), r[0].results.map(function (w) {
        workers[w.id] = w;
        return Object.assign({}, w, { pick_label: "target " + w.name, idle: "checking…" });
      }), function (row, w) { KV.$(".pick", row).checked = preselect.indexOf(String(w.id)) >= 0; });
      defaultDrain();
      var ids = r[0].results.map(function (w) { return w.id; });
      if (ids.length) probe(ids).catch(function () { KV.$$("#targets .idle").forEach(function (c) { c.textContent = "not checked: press Review"; }); });
      KV.$("#storage-profile").replaceChildren.apply(KV.$("#storage-profile"), r[1].results.map(function (p) {
        profiles[p.id] = p; return option(p.id, p.name + " (" + p.backend + ")");
      }));
      if (params.get("storage_profile")) KV.$("#storage-profile").value = params.get("storage_profile");
      return Promise.all(r[2].results.filter(function (p) { return p.head_number > 0; }).map(function (p) {
        return KV.api("GET", "/api/v1/configs/profiles/" + p.id + "/revisions/?limit=20").then(function (rv) {
          return rv.results.map(function (x) { revisions[x.id] = { label: p.name + "@" + x.number, content: x.content }; return option(x.id, p.name + "@" + x.number); });
        });
      })).then(function (opts) {
        var sel = KV.$("#revision");
        sel.replaceChildren.apply(sel, [].concat.apply([], opts));
        if (params.get("revision")) sel.value = params.get("revision");
      });
    });
  }

  KV.$("#kind").addEventListener("change", kindChanged);
  kindChanged();
  KV.$("#select-all").addEventListener("change", function (e) { KV.$$(".pick").forEach(function (c) { c.checked = e.target.checked; }); defaultDrain(); });
  KV.$("#targets tbody").addEventListener("change", function (e) { if (e.target.classList.contains("pick")) defaultDrain(); });
  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var ids = picked();
    if (!ids.length) { error("Choose at least one worker."); return; }
    if (form.kind.value === "attach" && !form.storage_profile.value) { error("Choose a storage profile (create one on the Storage page)."); return; }
    if (form.kind.value === "apply_config" && !form.revision.value) { error("Choose a config revision."); return; }
    if (form.kind.value === "restart_with_flags" && !flagsText(flagsChange())) { error("Give at least one flag to set or remove."); return; }
    error("");
    var btn = KV.$("#review"); btn.disabled = true;
    probe(ids).then(function (probes) {
      return KV.confirm({
        title: "Launch " + KV.$("#kind").selectedOptions[0].textContent + " on " + ids.length + " worker" + (ids.length === 1 ? "" : "s") + "?",
        text: "Policy " + form.policy.value.replace(/_/g, " ") + (form.drain.checked ? ", drained from the router while applying" : "") +
          ". Busy workers are changed once idle (up to " + form.idle_timeout_s.value + " s)" +
          (form.drain.checked || probes.every(function (p) { return p.is_idle; }) ? "" :
            ": a worker under steady traffic may never be idle without drain, which takes it out of its router first") +
          ". Reason: " + (form.reason.value || "none"),
        confirmLabel: "Launch",
        rows: probes.map(function (p) { var w = workers[p.worker_id]; return { worker: w.name, before: before(w, p), after: after(w) }; })
      });
    }).then(function (ok) {
      if (!ok) { btn.disabled = false; return; }
      var data = { kind: form.kind.value, workers: ids, policy: form.policy.value, drain: form.drain.checked,
        idle_timeout_s: Number(form.idle_timeout_s.value), reason: form.reason.value };
      if (data.kind === "attach") data.storage_profile = Number(form.storage_profile.value);
      if (data.kind === "apply_config") data.revision = Number(form.revision.value);
      if (data.kind === "restart_with_flags") data.flags = flagsChange();
      return KV.api("POST", "/api/v1/operations/", data, { "Idempotency-Key": key }).then(function (op) { location.href = "/operations/" + op.id + "/"; });
    }).catch(function (err) { btn.disabled = false; error(KV.errorText(err)); });
  });
  return load();
});

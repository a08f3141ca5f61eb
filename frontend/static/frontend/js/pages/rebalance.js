/* Rebalance page of one PD router: pools now (60 s figures from the workers' samples, KV.pools: read once
   per member at load, then extended by the pools.<router id> pushes, one TSDB read per interval shared by
   every viewer, telemetry.services.publish_pools), the P:D
   planner's recommendation (re-read every REC_REFRESH_S), the selected rebalance (?rebalance=ID, else the
   newest) with its steps, live over the websocket (rebalance.<id>: a push updates the row at once, then one
   coalesced re-read makes it match the API), approve / pause / resume / abort and start, each behind a
   confirmation, before/after figures, and throughput / latency charts with the steps marked. */
KV.ready(function () {
  "use strict";
  var data = JSON.parse(KV.$("#page-data").textContent);
  var WINDOW_S = 60, STEP_S = 5, REC_REFRESH_S = 15, COMPARE_S = 120, HISTORY = 1800;
  var PUSH_WINDOW_S = 3 * STEP_S;  /* a pools.<id> push's scrapes: the last 3 publish intervals (publish_pools) */
  /* seconds of each member's scrapes to read from the metrics store: the window and the comparisons around it */
  function historyWindowS() { return Math.max(60, Math.min(3600, Math.ceil(KV.windowS() + 2 * COMPARE_S))); }
  var SWITCHED = KV.machines.step.switched;  // the worker already runs its new role
  var members = data.workers.map(function (w) { return Object.assign({ samples: [], lastSeq: 0 }, w); });
  var rec = null, rb = null, list = [], stepRows = {};
  var wanted = Number(new URLSearchParams(location.search).get("rebalance")) || null;

  var SLO_LINE = { color: "#b3261e", dash: [6, 4] };
  var charts = {
    ttft: KV.chart(KV.$("#chart-ttft"), { series: [{ label: "TTFT p90" }, Object.assign({ label: data.slo_labels.ttft_p90_s }, SLO_LINE)], unit: "s", markers: markers }),
    itl: KV.chart(KV.$("#chart-itl"), { series: [{ label: "ITL p90", color: "#d55e00" }, Object.assign({ label: data.slo_labels.itl_p90_s }, SLO_LINE)], unit: "s", markers: markers }),
    input: KV.chart(KV.$("#chart-input"), { series: [{ label: "prompt tokens" }], unit: "tok/s", markers: markers }),
    output: KV.chart(KV.$("#chart-output"), { series: [{ label: "output tokens", color: "#d55e00" }], unit: "tok/s", markers: markers })
  };

  function ts(v) { return v ? new Date(v).getTime() / 1000 : null; }
  function split(c) { return c.prefill + "P:" + c.decode + "D"; }
  function showError(err) { var box = KV.$("#page-error"); box.textContent = KV.errorText(err); box.hidden = false; }
  function clearError() { KV.$("#page-error").hidden = true; }
  function workersText(n) { return n + (n === 1 ? " worker" : " workers"); }

  /* ---- pools: a worker counts in the pool of the role it ran at time t (the shown rebalance's switched
     steps decide around their start; otherwise the role it had when the page loaded) ---- */
  function roleAt(m, t) {
    var role = m.role;
    (rb ? rb.steps : []).forEach(function (s) {
      if (s.worker !== m.id || SWITCHED.indexOf(s.state) < 0 || !s.started_at) return;
      role = ts(s.started_at) > t ? s.from_role : s.to_role;
    });
    return role;
  }
  function pool(role) { return function (t) { return members.filter(function (m) { return roleAt(m, t) === role; }); }; }
  function poolsAt(t, windowS) {
    return { prefill: KV.pools.at(pool("prefill")(t), t, windowS), decode: KV.pools.at(pool("decode")(t), t, windowS) };
  }
  function renderNow() {
    var now = Date.now() / 1000, p = poolsAt(now, WINDOW_S);
    var counts = { prefill: pool("prefill")(now).length, decode: pool("decode")(now).length };
    var devices = function (role) { return pool(role)(now).reduce(function (n, m) { return n + (m.tp_size || 1); }, 0); };
    KV.fill(KV.$("#now"), {
      prefill_workers: counts.prefill + " (" + devices("prefill") + ")", decode_workers: counts.decode + " (" + devices("decode") + ")",
      ttft_p90_s: clientTtft(p.prefill && p.prefill.ttft_p90_s, p.decode && p.decode.ttft_p90_s), itl_p90_s: p.decode && p.decode.itl_p90_s,
      input_tps: p.prefill && p.prefill.input_tps, output_tps: p.decode && p.decode.output_tps
    });
    KV.$("[data-testid=split]").textContent = split(counts);
  }
  /* the client's TTFT: measured on the decode workers in PD (first token streamed), else the prefill's own */
  function clientTtft(prefill, decode) { return decode != null ? decode : prefill; }
  function markers() {
    if (!rb) return [];
    var out = [];
    if (rb.started_at) out.push({ ts: ts(rb.started_at), label: "start" });
    rb.steps.forEach(function (s) { if (s.started_at) out.push({ ts: ts(s.started_at), label: "step " + (s.index + 1) }); });
    if (rb.finished_at) out.push({ ts: ts(rb.finished_at), label: "end" });
    return out;
  }
  function renderCharts() {
    var now = Date.now() / 1000, from = Math.floor((now - KV.windowS()) / STEP_S) * STEP_S;
    var pre = KV.pools.series(pool("prefill"), from, now, STEP_S, WINDOW_S);
    var dec = KV.pools.series(pool("decode"), from, now, STEP_S, WINDOW_S);
    var slo = function (v) { return pre.ts.map(function () { return v; }); };
    charts.ttft.set(pre.ts, [pre.ts.map(function (_, i) { return clientTtft(pre.ttft_p90_s[i], dec.ttft_p90_s[i]); }), slo(data.slo.ttft_p90_s)]);
    charts.itl.set(dec.ts, [dec.itl_p90_s, slo(data.slo.itl_p90_s)]);
    charts.input.set(pre.ts, [pre.input_tps]);
    charts.output.set(dec.ts, [dec.output_tps]);
  }

  /* ---- recommendation ---- */
  function renderRec() {
    KV.fill(KV.$("#rec"), rec);
    KV.replaceRows(KV.$("#rec-reasons"), KV.$("#tpl-reason"), rec.reasons.map(function (r) { return { text: r }; }));
    /* the router's EPD encoder pool: advice only ("add an encoder"), never part of the P:D split */
    var enc = rec.encoders, encBox = KV.$("#rec-encoders");
    encBox.hidden = !enc;
    if (enc) {
      KV.$("#rec-encoders-advice").className = "badge s-" + (enc.advice === "add_encoder" ? "pending" : "none");
      KV.$("#rec-encoders-advice").textContent = KV.stateText(enc.advice);
      KV.$("#rec-encoders-text").textContent = enc.message;
    }
    var rows = ["prefill", "decode"].filter(function (k) { return rec.pools[k]; }).map(function (k) {
      var f = rec.pools[k], unit = k === "prefill" ? "tok/s" : "tok/s";
      return Object.assign({}, f, {
        pool: k, workers_text: f.devices + " (" + workersText(f.workers) + ", " + f.warm_workers + " warm)",
        demand_text: KV.fmt(f.demand, unit) + (k === "prefill" ? " computed" : " out"),
        hit_rate: k === "prefill" ? f.hit_rate : null,
        smoothed_utilisation: (rec.smoothed_utilisation || {})[k],
        latency_text: KV.fmt(f.latency_p90_s, "s") + " / " + KV.fmt(f.slo_p90_s, "s"),
        capacity_text: KV.fmt(f.per_device_capacity, unit)
      });
    });
    KV.replaceRows(KV.$("#rec-pools tbody"), KV.$("#tpl-rec-pool"), rows);
    /* the planner's figures cover its own window (config.window_s, 120 s), not the 60 s of the tiles above */
    var win = rec.config && rec.config.window_s;
    KV.$("[data-testid=rec-window]").textContent = win ? "(" + win + " s)" : "";
    KV.$("#rec-pools").hidden = !rows.length;
    var moved = rec.moves.map(function (m) { return m.worker + " (" + m.devices + (m.devices === 1 ? " device" : " devices") + ") to " + m.to_role; });
    KV.fill(KV.$("#rec-units"), {
      workers_text: split(rec.recommended_workers) + (moved.length ? "; moving " + moved.join(", ") : ""),
      window_text: win ? "Its figures cover the " + win + " s before it was evaluated (the tiles above: the last " + WINDOW_S + " s, live); the split utilisations in its reasons are smoothed." : "",
      smoothing_text: rec.config && rec.config.smoothing_s ? rec.config.smoothing_s + " s" : "none"
    });
    /* the pools need more devices than the router has: no split helps, say so (the reason has the numbers) */
    var short = rec.devices_short || 0;
    KV.$("#rec-short").hidden = !short;
    KV.$("#rec-short-text").textContent = short ? rec.capacity_advice.replace(/^add capacity: /, "") + "." : "";
    /* the rebalance's target is in workers: the planner's least-moving way to its device split */
    var p = KV.$("#target-prefill"), d = KV.$("#target-decode");
    if (p && !p.dataset.touched) { p.value = rec.recommended_workers.prefill; d.value = rec.recommended_workers.decode; }
  }
  function loadRec() {
    return KV.api("GET", "/api/v1/inventory/routers/" + KV.pk + "/recommendation/").then(function (r) { rec = r; renderRec(); });
  }

  /* ---- the selected rebalance ---- */
  function stepView(s) {
    var devices = s.devices > 1 ? " (" + s.devices + " devices)" : "";  // a TP-N worker moves N devices
    var cost = s.out_of_router_s == null ? "–" : KV.fmt(s.out_of_router_s, "s") + (s.restart_s == null ? "" : " (restart " + KV.fmt(s.restart_s, "s") + ")");
    return Object.assign({}, s, { number: s.index + 1, roles: s.from_role + " → " + s.to_role + devices, explanation: KV.readable(s.explanation), cost: cost });
  }
  function putStep(s) {
    if (!stepRows[s.id]) { stepRows[s.id] = KV.fill(KV.$("#tpl-step"), stepView(s)); KV.$("#rb-steps tbody").appendChild(stepRows[s.id]); }
    else KV.fill(stepRows[s.id], stepView(s));
  }
  function figure(v, unit) { return v == null ? "–" : KV.fmt(v, unit); }
  function renderCompare() {
    var start = ts(rb.started_at || rb.created_at), end = ts(rb.finished_at), now = Date.now() / 1000;
    var before = poolsAt(start, COMPARE_S), after = end ? poolsAt(Math.min(now, end + COMPARE_S), Math.min(COMPARE_S, now - end)) : { prefill: null, decode: null };
    function get(p, pool, key) {
      if (key === "ttft") return clientTtft(p.prefill && p.prefill.ttft_p90_s, p.decode && p.decode.ttft_p90_s);
      return p[pool] && p[pool][key];
    }
    var rows = [
      ["TTFT p90 (client)", "", "ttft", "s"], ["Decode ITL p90", "decode", "itl_p90_s", "s"],
      ["Prompt tokens in (prefill)", "prefill", "input_tps", "tok/s"], ["Output tokens (decode)", "decode", "output_tps", "tok/s"]
    ].map(function (r) {
      return { label: r[0], before: figure(get(before, r[1], r[2]), r[3]), after: end ? figure(get(after, r[1], r[2]), r[3]) : "not finished" };
    });
    KV.replaceRows(KV.$("#rb-compare tbody"), KV.$("#tpl-compare"), rows);
  }
  function renderRb() {
    var box = KV.$("#rb");
    box.hidden = !rb;
    if (!rb) return;
    KV.fill(box, Object.assign({}, rb, {
      title: "#" + rb.id, change: split(rb.before) + " → " + split(rb.target) + " workers, moving " + rb.moved_devices + (rb.moved_devices === 1 ? " device" : " devices"),
      approval_text: rb.approval === "per_step" ? "each step (" + rb.approved_steps + " approved)" : "automatic",
      soak_text: rb.soak_s + " s", idle_timeout_text: rb.idle_timeout_s + " s", rollback_text: rb.rollback ? "yes, the whole rebalance" : "no",
      explanation: KV.readable(rb.explanation) || (rb.pause_requested ? "Pause requested." : rb.abort_requested ? "Abort requested." : "")
    }));
    rb.steps.forEach(putStep);
    /* the server says which actions the rebalance takes now (the services' own rule) */
    KV.$$("#rb-actions [data-action]").forEach(function (b) { b.hidden = rb.allowed_actions.indexOf(b.dataset.action) < 0; });
    renderCompare();
  }
  function select(id) {
    if (!id) { rb = null; renderRb(); return Promise.resolve(); }
    return KV.api("GET", "/api/v1/rebalances/" + id + "/").then(function (r) {
      if (!rb || rb.id !== r.id) { stepRows = {}; KV.$("#rb-steps tbody").replaceChildren(); }
      rb = r; renderRb(); renderCharts(); resubscribe();
    });
  }
  /* one read in flight per kind; a push during a read asks for one more read after it */
  function coalesced(read) {
    var running = null, again = false;
    return function run() {
      if (running) { again = true; return running; }
      running = read().catch(showError).then(function () { running = null; if (again) { again = false; run(); } });
      return running;
    };
  }
  var refreshRb = coalesced(function () { return rb ? select(rb.id) : Promise.resolve(); });
  var reloadList = coalesced(function () { return loadList(); });
  function loadRoles() {  // the role each worker runs now (a finished rebalance changed some)
    return KV.api("GET", "/api/v1/inventory/workers/?router_id=" + KV.pk + "&limit=500").then(function (r) {
      r.results.forEach(function (w) { members.forEach(function (m) { if (m.id === w.id) m.role = w.role; }); });
    });
  }
  function loadList() {
    return Promise.all([KV.api("GET", "/api/v1/rebalances/?router=" + KV.pk + "&limit=20"), loadRoles()]).then(function (got) {
      var r = got[0];
      list = r.results;
      KV.replaceRows(KV.$("#rb-history tbody"), KV.$("#tpl-history"), list.map(function (x) {
        return Object.assign({}, x, { title: "#" + x.id, change: split(x.before) + " → " + split(x.target) });
      }));
      KV.$("#rb-history-empty").hidden = list.length > 0;  // an empty history says so
      return select(wanted || (list[0] && list[0].id)).then(renderNow);
    });
  }

  /* ---- actions, each behind the confirmation dialog ---- */
  var ACTIONS = {
    approve: { title: "Approve the next step?", label: "Approve", text: "The next pending step starts: its worker leaves the router, drains, switches role, is checked and soaks." },
    pause: { title: "Pause this rebalance?", label: "Pause", text: "The running step finishes (or rolls back); no further step starts until it is resumed." },
    resume: { title: "Resume this rebalance?", label: "Resume", text: "The next step starts as the approval mode allows." },
    abort: { title: "Abort this rebalance?", label: "Abort rebalance", text: "Steps not started are cancelled; a running step stops at its next safe point. Finished steps keep their new role." }
  };
  function stepRowsFor(action) {
    return rb.steps.map(function (s) {
      var after = s.state;
      if (action === "abort" && s.state === "pending") after = "cancelled";
      else if (action === "approve" && s.index === rb.approved_steps) after = "runs now";
      return { worker: "#" + (s.index + 1) + " " + s.worker_name + " (" + s.from_role + " → " + s.to_role + ")", before: KV.stateText(s.state), after: KV.stateText(after) };
    });
  }
  KV.$$("#rb-actions [data-action]").forEach(function (button) {
    button.addEventListener("click", function () {
      var a = ACTIONS[button.dataset.action];
      clearError();
      KV.confirm({ title: a.title + " (#" + rb.id + ")", text: a.text, confirmLabel: a.label, rows: stepRowsFor(button.dataset.action), reason: true }).then(function (ok) {
        if (!ok) return;  /* the audit record keeps what the operator typed (empty when nothing was) */
        KV.api("POST", "/api/v1/rebalances/" + rb.id + "/" + button.dataset.action + "/", { reason: KV.confirmReason() })
          .then(function () { refreshRb(); }).catch(showError);
      });
    });
  });
  var start = KV.$("#start");
  if (start) {
    ["#target-prefill", "#target-decode"].forEach(function (sel) { KV.$(sel).addEventListener("input", function (e) { e.target.dataset.touched = "1"; }); });
    /* the server's refusals (docs/rebalance.md), checked here so no dialog opens for a target it refuses */
    /* [field, message] of the first problem, or null */
    function targetProblem(target, now) {
      var bad = ["prefill", "decode"].filter(function (k) { return !(Number.isInteger(target[k]) && target[k] >= 1); })[0];
      if (bad) return [KV.$("#target-" + bad), "Target " + bad + ": enter a whole number of workers, at least 1."];
      var total = now.prefill + now.decode;
      if (target.prefill + target.decode !== total) {
        return [KV.$("#target-prefill"), "Target: " + split(target) + " has " + workersText(target.prefill + target.decode) +
          "; prefill + decode must equal the router's " + workersText(total) + "."];
      }
      if (target.prefill === now.prefill) return [KV.$("#target-prefill"), "Target: the router already runs " + split(now) + "."];
      return null;
    }
    var FIELDS = { target: "#target-prefill", approval: "#approval", idle_timeout_s: "#idle-timeout", reason: "#reason" };
    function clearFields() { Object.keys(FIELDS).forEach(function (k) { KV.fieldError(KV.$(FIELDS[k]), ""); }); }
    /* a refusal whose detail names form fields goes to those fields; anything else to the page banner */
    function showRefusal(err) {
      var detail = err && err.body && err.body.error && err.body.error.detail;
      var named = detail && typeof detail === "object" ? Object.keys(detail).filter(function (k) { return FIELDS[k]; }) : [];
      if (!named.length) { showError(err); return; }
      named.forEach(function (k) {
        var d = {}; d[k] = detail[k];
        KV.fieldError(KV.$(FIELDS[k]), KV.errorText({ body: { error: { message: err.body.error.message, detail: d } } }));
      });
    }
    start.addEventListener("click", function () {
      var value = function (sel) { var v = KV.$(sel).value.trim(); return v === "" ? NaN : Number(v); };
      var target = { prefill: value("#target-prefill"), decode: value("#target-decode") };
      var now = rec ? rec.current_workers : { prefill: pool("prefill")(Date.now() / 1000).length, decode: pool("decode")(Date.now() / 1000).length };
      var idle = KV.$("#idle-timeout");  // the launch form's bounds, the API's: 0.1 to 3600 s
      var problem = targetProblem(target, now) ||
        (idle.checkValidity() ? null : [idle, "Idle timeout: enter the seconds a worker may stay busy, from " + idle.min + " to " + idle.max + "."]);
      clearError(); clearFields();
      if (problem) { KV.fieldError(problem[0], problem[1]); problem[0].focus(); return; }
      KV.confirm({
        column: "Pool",
        title: "Start rebalance " + split(now) + " → " + split(target) + "?",
        text: "Workers move one at a time from donor to receiver role, " + (KV.$("#approval").value === "per_step" ? "each step after your approval" : "without further approval") +
          "; a busy worker is switched once idle (its step fails after " + idle.value + " s); a failed gate or a breached SLO rolls back.",
        confirmLabel: "Start rebalance",
        rows: ["prefill", "decode"].map(function (k) { return { worker: k, before: workersText(now[k]), after: workersText(target[k]) }; })
      }).then(function (ok) {
        if (!ok) return;
        KV.api("POST", "/api/v1/rebalances/", { router: Number(KV.pk), target: target, approval: KV.$("#approval").value, reason: KV.$("#reason").value,
                                           idle_timeout_s: Number(idle.value) })
          .then(function (r) {
            wanted = r.id; history.replaceState(null, "", "?rebalance=" + r.id);
            /* started: the form is for the next one; the reason goes, the target follows the recommendation again */
            KV.$("#reason").value = "";
            ["#target-prefill", "#target-decode"].forEach(function (sel) { delete KV.$(sel).dataset.touched; });
            return Promise.all([loadList(), loadRec()]);
          }).catch(showRefusal);
      });
    });
  }

  /* ---- live data ---- */
  function addSample(m, s) {
    if (!s || s.seq <= m.lastSeq) return false;
    m.lastSeq = s.seq;
    var at = m.samples.length;
    while (at > 0 && m.samples[at - 1].ts > s.ts) at--;
    m.samples.splice(at, 0, s);
    if (m.samples.length > HISTORY) m.samples.shift();
    return true;
  }
  /* one member's scrapes from the metrics store (its /api/v1/telemetry/workers/<id>/ history) */
  function loadMember(m) {
    return KV.api("GET", "/api/v1/telemetry/workers/" + m.id + "/?window_s=" + historyWindowS()).then(function (r) {
      m.samples = []; m.lastSeq = 0; r.history.forEach(function (s) { addSample(m, s); });
    });
  }
  function loadSamples() {
    return Promise.all(members.map(function (m) {
      return loadMember(m);
    }));
  }
  function groups() {
    return ["rebalances", "pools." + KV.pk].concat(rb ? ["rebalance." + rb.id] : []);
  }
  var subscribed = "";
  function resubscribe() {
    var g = groups();
    if (g.join() === subscribed) return;
    subscribed = g.join();
    KV.subscribe(g, onMessage, resync);
  }
  var dirty = false;
  function onMessage(msg) {
    var d = msg.data;
    if (msg.type === "pools.samples") {  // the members' newest scrapes, the same push for every viewer
      d.workers.forEach(function (w) {
        members.forEach(function (m) { if (m.id === w.worker_id) w.samples.forEach(function (s) { if (addSample(m, s)) dirty = true; }); });
      });
    } else if (msg.type === "rebalance.step_changed" && rb && d.rebalance_id === rb.id) {
      var s = rb.steps.filter(function (x) { return x.id === d.step_id; })[0];
      if (s) { s.state = d.state; s.explanation = d.explanation; putStep(s); }
      refreshRb();
    } else if (msg.type === "rebalance.state_changed" && d.router_id === Number(KV.pk)) {
      loadRec().catch(function () { /* the next tick reads it again */ });
      if (rb && d.rebalance_id === rb.id) { rb.state = d.state; rb.explanation = d.explanation; rb.allowed_actions = d.allowed_actions; renderRb(); }
      if (!rb || d.rebalance_id === rb.id || !wanted) reloadList();  // history; a new one is followed
    }
  }
  setInterval(function () { if (dirty) { dirty = false; renderNow(); renderCharts(); } }, 1000);
  setInterval(function () { loadRec().catch(function () { /* shown on the next read */ }); }, REC_REFRESH_S * 1000);
  document.addEventListener("kv:window", function () { loadSamples().then(renderCharts).catch(showError); });

  function loadAll() {
    return Promise.all([loadSamples(), loadRec(), loadList()]).then(function () { renderNow(); renderCharts(); if (rb) renderRb(); });
  }
  /* on every (re)join: what may have been missed. A push carries its members' scrapes of the last few
     intervals, so a member's scrapes are read again only when its newest is older than that (the socket
     was away longer, or it has none); the recommendation and the history always. */
  function resync() {
    var now = Date.now() / 1000;
    var gap = members.filter(function (m) { return !m.samples.length || now - m.samples[m.samples.length - 1].ts > PUSH_WINDOW_S; });
    return Promise.all([Promise.all(gap.map(loadMember)), loadRec(), loadList()])
      .then(function () { renderNow(); renderCharts(); if (rb) renderRb(); }).catch(showError);
  }
  return loadAll().then(resubscribe);
});

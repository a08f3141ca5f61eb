/* KVFleet console: REST calls to /api/v1 (session + CSRF), live updates from /ws/v1/events/, keyboard nav. */
(function () {
  "use strict";
  var body = document.body, page = body.dataset.page, pk = body.dataset.pk, canWrite = body.dataset.canWrite === "1";
  var $ = function (sel, root) { return (root || document).querySelector(sel); };
  var $$ = function (sel, root) { return Array.prototype.slice.call((root || document).querySelectorAll(sel)); };

  function esc(v) {
    return String(v == null ? "" : v).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function cookie(name) {
    var m = document.cookie.match(new RegExp("(?:^|; )" + name + "=([^;]*)"));
    return m ? decodeURIComponent(m[1]) : "";
  }
  function api(method, url, data, headers) {
    var opts = { method: method, credentials: "same-origin", headers: Object.assign({ Accept: "application/json" }, headers || {}) };
    if (data !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(data); }
    if (method !== "GET") opts.headers["X-CSRFToken"] = cookie("csrftoken");
    return fetch(url, opts).then(function (r) {
      return r.text().then(function (t) {
        var json = t ? JSON.parse(t) : null;
        if (!r.ok) { var e = new Error((json && json.error && json.error.message) || r.statusText); e.body = json; throw e; }
        return json;
      });
    });
  }
  function fmt(v, digits) {
    if (v == null || v === "") return "–";
    if (typeof v === "number") return String(+v.toFixed(digits == null ? 2 : digits));
    return esc(v);
  }
  function when(iso) { return iso ? new Date(typeof iso === "number" ? iso * 1000 : iso).toLocaleTimeString() : "–"; }
  function badge(state) { return '<span class="badge s-' + esc(state) + '">' + esc(state) + "</span>"; }

  /* ---- websocket: one socket, subscribe replaces the group set, reconnect with backoff ---- */
  var handlers = {}, wsGroups = [], socket = null, backoff = 500;
  function subscribe(groups, onMessage) {
    wsGroups = groups; handlers.message = onMessage; connect();
  }
  function connect() {
    var proto = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(proto + location.host + "/ws/v1/events/");
    socket.onopen = function () {
      backoff = 500; $("#live").classList.add("on");
      socket.send(JSON.stringify({ action: "subscribe", groups: wsGroups }));
    };
    socket.onmessage = function (ev) {
      var msg = JSON.parse(ev.data);
      if (msg.type === "control.subscribed") { body.dataset.wsReady = "1"; if (handlers.resync) handlers.resync(); return; }
      if (handlers.message) handlers.message(msg);
    };
    socket.onclose = function () {
      $("#live").classList.remove("on"); body.dataset.wsReady = "0";
      setTimeout(connect, backoff); backoff = Math.min(backoff * 2, 10000);
    };
  }

  /* ---- keyboard ---- */
  var pendingG = false;
  document.addEventListener("keydown", function (e) {
    var t = e.target.tagName;
    if (t === "INPUT" || t === "TEXTAREA" || t === "SELECT") { if (e.key === "Escape") e.target.blur(); return; }
    if (e.key === "?") { $("#help").showModal(); return; }
    if (e.key === "/") { var f = $("#filter"); if (f) { e.preventDefault(); f.focus(); } return; }
    if (e.key === "n" && canWrite) { location.href = "/operations/new/"; return; }
    if (pendingG) {
      pendingG = false;
      var go = { f: "/", s: "/storage/", o: "/operations/", a: "/audit/" }[e.key];
      if (go) location.href = go;
      return;
    }
    if (e.key === "g") { pendingG = true; setTimeout(function () { pendingG = false; }, 1000); }
  });

  /* ---- pages ---- */
  var pages = {};

  pages.fleet = function () {
    var workers = [], live = {};
    function render() {
      var q = ($("#filter").value || "").toLowerCase();
      $("#workers tbody").innerHTML = workers.filter(function (w) { return !q || w.name.toLowerCase().indexOf(q) >= 0; })
        .map(function (w) {
          var m = live[w.id] || {};
          return '<tr data-worker="' + w.id + '"><td><input type="checkbox" class="pick" value="' + w.id + '" aria-label="select ' + esc(w.name) + '"></td>' +
            '<td><a href="/workers/' + w.id + '/">' + esc(w.name) + "</a></td><td>" + esc(w.role) + "</td><td>" + badge(w.state) +
            "</td><td>" + fmt(w.storage_backend || "none") + "</td><td>" + fmt(m.num_running_reqs, 0) + "</td><td>" + fmt(m.num_queue_reqs, 0) +
            "</td><td>" + fmt(m.cache_hit_rate, 3) + "</td><td>" + when(m.ts) + "</td></tr>";
        }).join("");
    }
    function renderTotals(summary) {
      var t = summary.totals;
      live = {}; summary.workers.forEach(function (w) { live[w.id] = w; });
      $("#totals").innerHTML = [["Workers reporting", summary.reporting], ["Running", t.num_running_reqs], ["Queued", t.num_queue_reqs],
        ["L1 hit share", t.hit_share_device], ["L2 hit share", t.hit_share_host], ["L3 hit share", t.hit_share_storage],
        ["Host pool use", t.host_pool_use]].map(function (x) { return "<div>" + x[0] + "<b>" + fmt(x[1], 3) + "</b></div>"; }).join("");
      render();
    }
    function load() {
      return Promise.all([api("GET", "/api/v1/inventory/workers/?limit=500"), api("GET", "/api/v1/telemetry/fleet/")]).then(function (r) {
        workers = r[0].results; renderTotals(r[1]);
      });
    }
    load();
    $("#filter").addEventListener("input", render);
    $("#select-all").addEventListener("change", function (e) { $$(".pick").forEach(function (c) { c.checked = e.target.checked; }); });
    var btn = $("#launch-selected");
    if (btn) btn.addEventListener("click", function () {
      var ids = $$(".pick").filter(function (c) { return c.checked; }).map(function (c) { return "worker=" + c.value; });
      location.href = "/operations/new/?" + ids.join("&");
    });
    handlers.resync = load;
    subscribe(["fleet"], function (msg) { if (msg.type === "fleet.metrics") renderTotals(msg.data); });
  };

  pages.worker = function () {
    var charts = {
      reqs: new window.LineChart($("#chart-reqs"), ["running", "queued"]),
      hits: new window.LineChart($("#chart-hits"), ["L1", "L2", "L3"]),
      ttft: new window.LineChart($("#chart-ttft"), ["p50", "p99"]),
      bw: new window.LineChart($("#chart-bw"), ["load-back", "backup", "prefetch"]),
      pool: new window.LineChart($("#chart-pool"), ["host pool"]),
      prefetch: new window.LineChart($("#chart-prefetch"), ["started", "completed", "timed out"])
    };
    var lastSeq = 0, pushed = 0;
    function add(s) {
      if (!s || s.seq <= lastSeq) return false;
      lastSeq = s.seq;
      charts.reqs.push(s.ts, [s.num_running_reqs, s.num_queue_reqs]);
      charts.hits.push(s.ts, [s.hit_share_device, s.hit_share_host, s.hit_share_storage]);
      charts.ttft.push(s.ts, [s.ttft_p50_s, s.ttft_p99_s]);
      charts.bw.push(s.ts, [s.load_back_tokens_per_s, s.backup_tokens_per_s, s.prefetch_tokens_per_s]);
      charts.pool.push(s.ts, [s.host_pool_use]);
      charts.prefetch.push(s.ts, [s.prefetch_started_total, s.prefetch_completed_total, s.prefetch_timeout_total]);
      return true;
    }
    function load() {
      return Promise.all([api("GET", "/api/v1/inventory/workers/" + pk + "/"), api("GET", "/api/v1/telemetry/workers/" + pk + "/")]).then(function (r) {
        var w = r[0];
        $("#worker-name").textContent = w.name;
        $("#facts").innerHTML = [["URL", w.url], ["Role", w.role], ["Model", w.model_name], ["TP / DP", w.tp_size + " / " + w.dp_size],
          ["Page size", w.page_size], ["State", w.state], ["L3 backend", w.storage_backend || "none"], ["Last seen", w.last_seen],
          ["HiCache config", JSON.stringify(w.hicache_config)]].map(function (x) { return "<dt>" + x[0] + "</dt><dd>" + esc(x[1]) + "</dd>"; }).join("");
        r[1].history.forEach(add);
      });
    }
    load();
    handlers.resync = load;
    subscribe(["worker." + pk], function (msg) {
      if (msg.type === "worker.metrics" && add(msg.data)) { pushed += 1; $("[data-testid=samples]").textContent = String(pushed); }
    });
  };

  pages.storage = function () {
    function load() {
      Promise.all([api("GET", "/api/v1/inventory/storage-profiles/?limit=500"), api("GET", "/api/v1/inventory/workers/?limit=500")]).then(function (r) {
        var count = {};
        r[1].results.forEach(function (w) { if (w.storage_profile) count[w.storage_profile] = (count[w.storage_profile] || 0) + 1; });
        $("#profiles tbody").innerHTML = r[0].results.map(function (p) {
          return "<tr><td>" + esc(p.name) + "</td><td>" + esc(p.backend) + "</td><td><code>" + esc(JSON.stringify(p.extra_config)) +
            "</code></td><td>" + (count[p.id] || 0) + "</td><td>" + esc(p.description) + "</td></tr>";
        }).join("");
      });
    }
    load();
    var form = $("#profile-form");
    if (form) form.addEventListener("submit", function (e) {
      e.preventDefault();
      var extra;
      try { extra = JSON.parse(form.extra_config.value || "{}"); } catch (err) { $("#profile-error").textContent = "Extra config is not valid JSON"; return; }
      api("POST", "/api/v1/inventory/storage-profiles/", { name: form.name.value, backend: form.backend.value, extra_config: extra, description: form.description.value })
        .then(function () { form.reset(); $("#profile-error").textContent = ""; load(); })
        .catch(function (err) { $("#profile-error").textContent = err.message + " " + JSON.stringify((err.body && err.body.error.detail) || {}); });
    });
  };

  function targetsText(op) { return op.targets.map(function (t) { return t.worker_name + ":" + t.state; }).join(" "); }

  pages.operations = function () {
    function load() {
      api("GET", "/api/v1/operations/?limit=100").then(function (r) {
        $("#operations tbody").innerHTML = r.results.map(function (op) {
          return '<tr><td><a href="/operations/' + op.id + '/">' + op.id + "</a></td><td>" + esc(op.kind) + "</td><td>" + esc(op.policy) +
            "</td><td>" + badge(op.state) + "</td><td>" + esc(targetsText(op)) + "</td><td>" + esc(op.created_by) + "</td><td>" +
            when(op.created_at) + "</td><td>" + esc(op.explanation) + "</td></tr>";
        }).join("");
      });
    }
    load();
    handlers.resync = load;
    subscribe(["operations"], load);
  };

  pages.launch = function () {
    var form = $("#launch-form"), key = (window.crypto && crypto.randomUUID) ? crypto.randomUUID() : String(Date.now());
    var preselect = new URLSearchParams(location.search).getAll("worker");
    function kindChanged() {
      var k = $("#kind").value;
      $("#profile-field").hidden = k !== "attach"; $("#revision-field").hidden = k !== "apply_config";
    }
    $("#kind").addEventListener("change", kindChanged); kindChanged();
    Promise.all([api("GET", "/api/v1/inventory/workers/?limit=500"), api("GET", "/api/v1/inventory/storage-profiles/?limit=500"),
      api("GET", "/api/v1/configs/profiles/?limit=500")]).then(function (r) {
      $("#targets tbody").innerHTML = r[0].results.map(function (w) {
        var checked = preselect.indexOf(String(w.id)) >= 0 ? " checked" : "";
        return '<tr data-worker="' + w.id + '"><td><input type="checkbox" class="pick" value="' + w.id + '"' + checked + ' aria-label="target ' + esc(w.name) + '"></td><td>' +
          esc(w.name) + "</td><td>" + esc(w.role) + "</td><td>" + badge(w.state) + "</td><td>" + fmt(w.storage_backend || "none") + '</td><td class="idle">–</td></tr>';
      }).join("");
      $("#storage-profile").innerHTML = r[1].results.map(function (p) { return '<option value="' + p.id + '">' + esc(p.name) + " (" + esc(p.backend) + ")</option>"; }).join("");
      return Promise.all(r[2].results.filter(function (p) { return p.head_number > 0; }).map(function (p) {
        return api("GET", "/api/v1/configs/profiles/" + p.id + "/revisions/?limit=20").then(function (rv) {
          return rv.results.map(function (x) { return '<option value="' + x.id + '">' + esc(p.name) + "@" + x.number + "</option>"; }).join("");
        });
      })).then(function (opts) { $("#revision").innerHTML = opts.join(""); });
    });
    $("#select-all").addEventListener("change", function (e) { $$(".pick").forEach(function (c) { c.checked = e.target.checked; }); });
    function picked() { return $$(".pick").filter(function (c) { return c.checked; }).map(function (c) { return Number(c.value); }); }
    $("#targets").addEventListener("change", function () { $("#launch").disabled = true; });
    $("#preview").addEventListener("click", function () {
      var ids = picked();
      if (!ids.length) { $("#launch-error").textContent = "Choose at least one worker"; return; }
      $("#launch-error").textContent = "";
      api("GET", "/api/v1/operations/preview/?" + ids.map(function (i) { return "worker=" + i; }).join("&")).then(function (rows) {
        rows.forEach(function (row) {
          var cell = $('tr[data-worker="' + row.worker_id + '"] .idle');
          cell.innerHTML = !row.reachable ? '<span class="s-failed">unreachable</span>' :
            row.is_idle ? '<span class="s-succeeded">idle</span>' :
            '<span class="s-waiting_for_idle">busy (' + row.num_running_reqs + " running, " + row.num_waiting_reqs + " waiting)</span>";
        });
        $("#launch").disabled = false; $("#launch").focus();
      }).catch(function (err) { $("#launch-error").textContent = err.message; });
    });
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      var data = { kind: form.kind.value, workers: picked(), policy: form.policy.value, drain: form.drain.checked,
        idle_timeout_s: Number(form.idle_timeout_s.value), reason: form.reason.value };
      if (data.kind === "attach") data.storage_profile = Number(form.storage_profile.value);
      if (data.kind === "apply_config") data.revision = Number(form.revision.value);
      $("#launch").disabled = true;
      api("POST", "/api/v1/operations/", data, { "Idempotency-Key": key }).then(function (op) { location.href = "/operations/" + op.id + "/"; })
        .catch(function (err) { $("#launch").disabled = false; $("#launch-error").textContent = err.message; });
    });
  };

  pages.operation = function () {
    function render(op) {
      $("#op-id").textContent = "#" + op.id + " " + op.kind + " (" + op.policy + (op.drain ? ", drain" : "") + ")";
      $("#op-state").textContent = op.state; $("#op-state").className = "badge s-" + op.state;
      $("#op-explanation").textContent = op.explanation || op.reason;
      $("#op-audit").href = "/audit/?operation_id=" + op.id;
      $("#op-targets tbody").innerHTML = op.targets.map(function (t) {
        return '<tr data-target="' + t.id + '"><td><a href="/workers/' + t.worker + '/">' + esc(t.worker_name) + "</a></td><td>" + badge(t.state) +
          "</td><td>" + esc(t.explanation) + "</td><td>" + t.polls + "</td><td>" + when(t.updated_at) + "</td></tr>";
      }).join("");
      var cancel = $("#cancel");
      if (cancel) cancel.disabled = op.state !== "running" || op.cancel_requested;
    }
    function load() { return api("GET", "/api/v1/operations/" + pk + "/").then(render); }
    load();
    var cancel = $("#cancel");
    if (cancel) cancel.addEventListener("click", function () {
      api("POST", "/api/v1/operations/" + pk + "/cancel/", { reason: "cancelled from console" }).then(render);
    });
    handlers.resync = load;
    subscribe(["operation." + pk], load);
  };

  function diffHtml(changes) {
    return '<div class="diff">' + Object.keys(changes || {}).map(function (k) {
      return "<div>" + esc(k) + ": <del>" + esc(JSON.stringify(changes[k][0])) + "</del> → <ins>" + esc(JSON.stringify(changes[k][1])) + "</ins></div>";
    }).join("") + "</div>";
  }

  pages.audit = function () {
    var form = $("#audit-filter"), next = null;
    new URLSearchParams(location.search).forEach(function (v, k) { if (form[k]) form[k].value = v; });
    function query() {
      var p = new URLSearchParams();
      $$("input, select", form).forEach(function (el) { if (el.value) p.set(el.name, el.value); });
      return p.toString();
    }
    function row(e) {
      var revert = canWrite && e.revertible ? '<button type="button" class="revert" data-id="' + e.id + '">Revert to this</button>' : "";
      return '<tr data-event="' + e.id + '"><td>' + new Date(e.occurred_at).toLocaleString() + "</td><td>" + esc(e.actor_display) +
        (e.token_prefix ? " (token)" : "") + "</td><td>" + esc(e.action) + "</td><td>" + esc(e.object_type) + " " + esc(e.object_repr) +
        (e.operation_id ? ' <a href="/operations/' + e.operation_id + '/">op ' + e.operation_id + "</a>" : "") + "</td><td>" + badge(e.outcome) +
        "</td><td>" + diffHtml(e.changes) + "</td><td>" + esc(e.message) + '</td><td><code title="request id">' + esc(e.request_id.slice(0, 12)) +
        "</code></td><td>" + revert + "</td></tr>";
    }
    function load(url, append) {
      api("GET", url).then(function (r) {
        var html = r.results.map(row).join("");
        $("#audit tbody").innerHTML = append ? $("#audit tbody").innerHTML + html : html;
        next = r.next; $("#more").hidden = !next;
      });
    }
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      history.replaceState(null, "", "?" + query());
      load("/api/v1/audit/events/?" + query(), false);
    });
    $("#more").addEventListener("click", function () { if (next) load(next, true); });
    $("#audit").addEventListener("click", function (e) {
      if (!e.target.classList.contains("revert")) return;
      if (!confirm("Create an operation that restores this revision?")) return;
      api("POST", "/api/v1/audit/events/" + e.target.dataset.id + "/revert/", {}).then(function (op) { location.href = "/operations/" + op.id + "/"; })
        .catch(function (err) { alert(err.message); });
    });
    load("/api/v1/audit/events/?" + query(), false);
  };

  if (pages[page]) pages[page]();
  if (!socket) $("#live").hidden = true; // this page shows no live data
})();

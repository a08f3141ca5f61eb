/* KVFleet console core (window.KV): REST calls (session + CSRF), one websocket with resubscribe/backoff,
   <template> filling (textContent only, never HTML strings), one time format, units, the confirmation
   dialog, keyboard shortcuts. Page modules live in js/pages/<page>.js and call KV.ready(fn). */
(function () {
  "use strict";
  var body = document.body;
  var KV = (window.KV = { page: body.dataset.page, pk: body.dataset.pk, canWrite: body.dataset.canWrite === "1" });
  KV.$ = function (sel, root) { return (root || document).querySelector(sel); };
  KV.$$ = function (sel, root) { return Array.prototype.slice.call((root || document).querySelectorAll(sel)); };
  /* the server's state machines: {target|rebalance|step: {states, active, final, outcome, ...}}, rendered
     into the page from the tables the services use (controlplane/core/state_machine.py), never retyped here */
  var machines = KV.$("#state-machines");
  KV.machines = machines ? JSON.parse(machines.textContent) : {};

  function cookie(name) {
    var m = document.cookie.match(new RegExp("(?:^|; )" + name + "=([^;]*)"));
    return m ? decodeURIComponent(m[1]) : "";
  }

  /* Error envelope {error: {code, message, detail}} -> one readable sentence naming the fields; nested
     details name their path ({"target": {"extra": [..]}} -> "target.extra: .."), never raw JSON. */
  function detailParts(v, path) {
    if (v == null) return [];
    if (Array.isArray(v)) {
      if (v.every(function (x) { return typeof x !== "object" || x === null; })) return [(path ? path + ": " : "") + v.join(" ")];
      return [].concat.apply([], v.map(function (x, i) { return detailParts(x, path + "[" + i + "]"); }));
    }
    if (typeof v !== "object") return [(path ? path + ": " : "") + v];
    return [].concat.apply([], Object.keys(v).map(function (k) {
      return detailParts(v[k], k === "non_field_errors" ? path : path ? path + "." + k : k);
    }));
  }
  KV.errorText = function (err) {
    var e = err && err.body && err.body.error;
    if (!e) return err.message || String(err);
    var detail = e.detail && typeof e.detail === "object" ? detailParts(e.detail, "").join("; ") : "";
    return e.message + (detail ? " (" + detail + ")" : "");
  };

  /* A form problem shown at its field: ``message`` under the field's label (role alert, linked by
     aria-describedby from every field of the label), ``input`` alone marked aria-invalid; removed with ""
     or once a field of the label is edited. Fields sharing a label share one message. Returns the message
     element. */
  KV.fieldError = function (input, message) {
    var label = input.closest("label") || input.parentNode;
    var first = KV.$("input, select, textarea", label) || input;
    var id = first.id + "-error";
    var box = document.getElementById(id);
    if (!box) {
      box = document.createElement("small");
      box.id = id; box.className = "error field-error"; box.setAttribute("role", "alert");
      label.appendChild(box);
    }
    var fields = KV.$$("input, select, textarea", label);
    box.textContent = message || "";
    box.hidden = !message;
    fields.forEach(function (f) {
      var ids = (f.getAttribute("aria-describedby") || "").split(" ").filter(function (x) { return x && x !== id; });
      if (message) ids.push(id);
      if (message && f === input) f.setAttribute("aria-invalid", "true"); else f.removeAttribute("aria-invalid");
      if (ids.length) f.setAttribute("aria-describedby", ids.join(" ")); else f.removeAttribute("aria-describedby");
      if (message && !f.dataset.clearsError) {
        f.dataset.clearsError = "1";
        f.addEventListener("input", function () { KV.fieldError(f, ""); });
      }
    });
    return box;
  };

  KV.api = function (method, url, data, headers) {
    var opts = { method: method, credentials: "same-origin", headers: Object.assign({ Accept: "application/json" }, headers || {}) };
    if (data !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(data); }
    if (method !== "GET") opts.headers["X-CSRFToken"] = cookie("csrftoken");
    return fetch(url, opts).then(function (r) {
      return r.text().then(function (t) {
        var json = null;
        try { json = t ? JSON.parse(t) : null; } catch (e) { json = null; }
        if (!r.ok) { var e = new Error((json && json.error && json.error.message) || r.statusText); e.body = json; throw e; }
        return json;
      });
    });
  };

  /* ---- time: one format everywhere (local time, 24-hour, with zone), ISO on hover ---- */
  var dateFmt = new Intl.DateTimeFormat(undefined, {
    year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit",
    hourCycle: "h23", timeZoneName: "short"
  });
  function toDate(v) { return v instanceof Date ? v : new Date(typeof v === "number" ? v * 1000 : v); }
  function parts(v) {
    var p = {};
    dateFmt.formatToParts(toDate(v)).forEach(function (x) { p[x.type] = x.value; });
    return p;
  }
  KV.time = {
    text: function (v) {
      if (v == null || v === "") return "–";
      var p = parts(v);
      return p.year + "-" + p.month + "-" + p.day + " " + p.hour + ":" + p.minute + ":" + p.second + " " + p.timeZoneName;
    },
    /* the same clock for chart axes, shorter: "18:05" (or "18:05:30" with seconds), "2026-12-03" for date */
    clock: function (v, seconds) { var p = parts(v); return p.hour + ":" + p.minute + (seconds ? ":" + p.second : ""); },
    date: function (v) { var p = parts(v); return p.year + "-" + p.month + "-" + p.day; },
    /* fill a <time> element: local text, ISO (UTC) in datetime and title */
    set: function (el, v) {
      if (v == null || v === "") { el.textContent = "empty" in el.dataset ? el.dataset.empty : "–"; el.removeAttribute("datetime"); el.removeAttribute("title"); return; }
      var iso = toDate(v).toISOString();
      el.dateTime = iso; el.title = iso; el.textContent = KV.time.text(v);
    },
    duration: function (seconds) {
      if (seconds == null || !isFinite(seconds)) return "–";
      if (seconds < 1) return Math.round(seconds * 1000) + " ms";
      if (seconds < 60) return seconds.toFixed(1) + " s";
      var m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
      return m < 60 ? m + " min " + s + " s" : Math.floor(m / 60) + " h " + (m % 60) + " min";
    },
    between: function (a, b) { return a && b ? (toDate(b) - toDate(a)) / 1000 : null; }
  };
  function localizeTimes(root) { KV.$$("time[datetime]", root).forEach(function (el) { KV.time.set(el, el.getAttribute("datetime")); }); }

  /* ---- units ---- */
  function si(v) {
    var a = Math.abs(v);
    if (a >= 1e9) return +(v / 1e9).toFixed(2) + " G";
    if (a >= 1e6) return +(v / 1e6).toFixed(2) + " M";
    if (a >= 1e3) return +(v / 1e3).toFixed(2) + " k";
    return +v.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : 2) + " ";
  }
  /* bytes: binary units everywhere (KiB/MiB/GiB/TiB, 1024-based), one formatter for every page */
  function binary(v) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return +v.toFixed(i === 0 ? 0 : Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) + " " + units[i];
  }
  KV.units = {
    "%": function (v) { return v == null ? "–" : +(v * 100).toFixed(1) + " %"; },
    "s": function (v) { return v == null ? "–" : v < 1 ? +(v * 1000).toFixed(v < 0.01 ? 2 : 0) + " ms" : +v.toFixed(2) + " s"; },
    "tok/s": function (v) { return v == null ? "–" : si(v) + "tok/s"; },
    "images/s": function (v) { return v == null ? "–" : si(v) + "images/s"; },
    "prefetches/s": function (v) { return v == null ? "–" : si(v) + "/s"; },
    "req/s": function (v) { return v == null ? "–" : si(v) + "req/s"; },
    "tok": function (v) { return v == null ? "–" : si(v) + "tok"; },
    "reqs": function (v) { return v == null ? "–" : String(Math.round(v)); },
    "count": function (v) { return v == null ? "–" : si(v).trim(); },
    "bytes": function (v) { return v == null ? "–" : binary(v); }
  };
  /* axis ticks: 3 significant digits with k/M/G, no unit (the axis label carries it) */
  KV.compact = function (v) { return v == null ? "" : si(v).trim(); };
  KV.fmt = function (v, unit) { return (KV.units[unit] || KV.units.count)(v == null ? null : Number(v)); };
  /* server-rendered values: <data value="N" data-unit="bytes"> gets the same text as a KV.fill slot */
  function formatValues(root) { KV.$$("data[data-unit]", root).forEach(function (el) { el.textContent = KV.fmt(el.value, el.dataset.unit); }); }
  /* a state name in plain words: "revert_failed" -> "revert failed" (the raw name stays in the title) */
  KV.stateText = function (v) { return v == null || v === "" ? "–" : String(v).replace(/_/g, " "); };

  /* ---- templates: clone <template id=...>, fill [data-f] slots by textContent, [data-href] links, <time> ---- */
  KV.ABSENT = "\u2014";  // "—": what a figure shows when nothing reported it
  KV.fill = function (tplOrNode, data) {
    var node = tplOrNode.content ? tplOrNode.content.firstElementChild.cloneNode(true) : tplOrNode;
    function withSelf(sel) { var all = KV.$$(sel, node); if (node.matches(sel)) all.unshift(node); return all; }
    withSelf("[data-f]").forEach(function (el) {
      var v = data[el.dataset.f];
      if (el.tagName === "TIME") KV.time.set(el, v);
      else if (el.dataset.unit) el.textContent = KV.fmt(v, el.dataset.unit);
      else el.textContent = v == null || v === "" ? ("empty" in el.dataset ? el.dataset.empty : "–") : String(v);
      if (el.classList.contains("badge")) { el.className = "badge s-" + (v || "none"); el.textContent = KV.stateText(v); el.title = v || ""; }
      /* a figure nobody reported is visibly absent, never 0: data-absent="why" (data.absent[field] says why
         when the server knows better) gives "—" with the reason as its title; a real value drops the title */
      if ("absent" in el.dataset) {
        if (v == null || v === "") { el.textContent = KV.ABSENT; el.title = (data.absent && data.absent[el.dataset.f]) || el.dataset.absent; el.classList.add("absent"); }
        else { el.removeAttribute("title"); el.classList.remove("absent"); }
      }
    });
    withSelf("[data-href]").forEach(function (el) {
      var missing = false;
      var href = el.dataset.href.replace(/\{(\w+)\}/g, function (_, k) { if (data[k] == null) missing = true; return encodeURIComponent(data[k]); });
      if (missing) el.removeAttribute("href"); else el.href = href;
    });
    withSelf("[data-attr]").forEach(function (el) {  // data-attr="aria-label:label,value:id"
      el.dataset.attr.split(",").forEach(function (pair) { var kv = pair.split(":"); el.setAttribute(kv[0], data[kv[1]]); });
    });
    return node;
  };
  KV.replaceRows = function (tbody, tpl, items, decorate) {
    var frag = document.createDocumentFragment();
    items.forEach(function (item) { var row = KV.fill(tpl, item); if (decorate) decorate(row, item); frag.appendChild(row); });
    tbody.replaceChildren(frag);
  };

  /* ---- confirmation: modal <dialog> with a before -> after table (first column opts.column, default
     "Worker"); resolves true/false ---- */
  KV.confirm = function (opts) {
    var dlg = KV.$("#confirm"), tbody = KV.$("#confirm-rows");
    KV.$("#confirm-title").textContent = opts.title;
    KV.$("#confirm-text").textContent = opts.text || "";
    KV.$("#confirm-ok").textContent = opts.confirmLabel || "Confirm";
    KV.$("#confirm-column").textContent = opts.column || "Worker";
    KV.replaceRows(tbody, KV.$("#tpl-confirm-row"), opts.rows || []);
    KV.$("#confirm-table").hidden = !(opts.rows && opts.rows.length);
    /* opts.reason: ask for one; the caller reads what was typed with KV.confirmReason() */
    KV.$("#confirm-reason-label").hidden = !opts.reason;
    KV.$("#confirm-reason").value = "";
    KV.$("#confirm-reason").required = opts.reason === "required";  // the OK button then needs one typed
    /* opts.drain: offer the drain checkbox, ticked when true; read with KV.confirmDrain() */
    KV.$("#confirm-drain-label").hidden = opts.drain == null;
    KV.$("#confirm-drain").checked = opts.drain === true;
    return new Promise(function (resolve) {
      function done(ok) { dlg.removeEventListener("close", onClose); if (dlg.open) dlg.close(); resolve(ok); }
      function onClose() { done(dlg.returnValue === "ok"); }
      dlg.returnValue = "";
      dlg.addEventListener("close", onClose);
      dlg.showModal();
      KV.$("#confirm-cancel").focus();
    });
  };
  KV.confirmReason = function () { return KV.$("#confirm-reason").value.trim(); };
  KV.confirmDrain = function () { return KV.$("#confirm-drain").checked; };
  KV.show = function (v) {
    if (v == null || v === "") return "none";
    return typeof v === "object" ? JSON.stringify(v) : String(v);
  };

  /* ---- websocket: one socket; subscribe replaces the group set; reconnect with backoff; resync on every join
     (events sent between the page's first read and the join, or while reconnecting, were never received) ---- */
  var ws = { groups: [], onMessage: null, onResync: null, socket: null, backoff: 500 };
  KV.subscribe = function (groups, onMessage, onResync) {
    ws.groups = groups; ws.onMessage = onMessage; ws.onResync = onResync;
    if (!ws.socket) connect();
    else if (ws.socket.readyState === WebSocket.OPEN) ws.socket.send(JSON.stringify({ action: "subscribe", groups: groups }));
    // still connecting: onopen sends the groups set here
  };
  function connect() {
    var live = KV.$("#live");
    live.hidden = false;
    var proto = location.protocol === "https:" ? "wss://" : "ws://";
    ws.socket = new WebSocket(proto + location.host + "/ws/v1/events/");
    ws.socket.onopen = function () {
      ws.backoff = 500;
      ws.socket.send(JSON.stringify({ action: "subscribe", groups: ws.groups }));
    };
    ws.socket.onmessage = function (ev) {
      var msg = JSON.parse(ev.data);
      if (msg.type === "control.subscribed") {
        live.classList.add("on"); live.title = "live: connected"; KV.$("#live-text").textContent = "live";
        body.dataset.wsReady = "1";
        if (ws.onResync) ws.onResync();
        return;
      }
      if (ws.onMessage) ws.onMessage(msg);
    };
    ws.socket.onclose = function () {
      live.classList.remove("on"); live.title = "live: reconnecting"; KV.$("#live-text").textContent = "reconnecting";
      body.dataset.wsReady = "0";
      setTimeout(connect, ws.backoff); ws.backoff = Math.min(ws.backoff * 2, 10000);
    };
  }

  /* ---- keyboard: g f/s/o/a/h navigate, n new operation, / filter, ? help ---- */
  var pendingG = false;
  document.addEventListener("keydown", function (e) {
    var t = e.target.tagName;
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    if (t === "INPUT" || t === "TEXTAREA" || t === "SELECT") { if (e.key === "Escape") e.target.blur(); return; }
    if (KV.$("dialog[open]")) return;
    if (e.key === "?") { KV.$("#help").showModal(); return; }
    if (e.key === "/") { var f = KV.$("#filter"); if (f) { e.preventDefault(); f.focus(); } return; }
    if (pendingG) {
      pendingG = false;
      var go = { f: "/", s: "/storage/", o: "/operations/", a: "/audit/" }[e.key];
      if (go) location.href = go;
      return;
    }
    if (e.key === "n" && KV.canWrite) { location.href = "/operations/new/"; return; }
    if (e.key === "g") { pendingG = true; setTimeout(function () { pendingG = false; }, 1000); }
  });

  /* Page modules register with KV.ready; body[data-loaded=1] marks the first render (tests and screenshots). */
  KV.ready = function (fn) {
    KV.hasModule = true;
    localizeTimes(document); formatValues(document);
    Promise.resolve().then(fn).then(function () { body.dataset.loaded = "1"; }, function (err) {
      var box = KV.$("#page-error");
      box.textContent = "Could not load this page: " + KV.errorText(err); box.hidden = false;
      body.dataset.loaded = "1";
    });
  };
  document.addEventListener("DOMContentLoaded", function () {  // server-rendered pages without a module
    if (!KV.hasModule) { localizeTimes(document); formatValues(document); body.dataset.loaded = "1"; }
  });
})();

/* Operations list: read once; operation.state_changed pushes update that row in place (a new operation,
   not yet listed, is read alone); a line says when there is none. */
KV.ready(function () {
  "use strict";
  var tpl = KV.$("#tpl-op"), rows = {}, ops = {};
  function put(op) {
    ops[op.id] = op;
    var view = KV.opView(op);
    if (rows[op.id]) { KV.fill(rows[op.id], view); return; }
    rows[op.id] = KV.fill(tpl, view);
    KV.$("#operations tbody").prepend(rows[op.id]);
    KV.$("#no-operations").hidden = true;
  }
  function load() {
    return KV.api("GET", "/api/v1/operations/?limit=100").then(function (r) {
      rows = {}; KV.$("#operations tbody").replaceChildren();
      r.results.slice().reverse().forEach(put);
      KV.$("#no-operations").hidden = r.results.length > 0;  // an empty table says so
    });
  }
  KV.subscribe(["operations"], function (msg) {
    if (msg.type !== "operation.state_changed") return;
    var d = msg.data, op = ops[d.operation_id];
    if (!op) { KV.api("GET", "/api/v1/operations/" + d.operation_id + "/").then(put); return; }
    put(Object.assign({}, op, { state: d.state, explanation: d.explanation, summary: d.summary, finished_at: d.state === "running" ? null : msg.ts }));
  }, load);
  return load();
});

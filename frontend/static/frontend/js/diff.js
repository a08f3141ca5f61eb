/* Per-field diffs rendered from <template id="tpl-change">; long values (over FOLD chars) fold into a
   <details> so tables keep their width, summarised from just before where the two values first differ (two
   long values with the same start would otherwise read the same). KV.diff(cell, changes, before) with changes
   {field: [before, after]} and before the old snapshot (optional: which fields existed). */
(function () {
  "use strict";
  var KV = window.KV, FOLD = 80;
  function firstDifference(a, b) {
    var i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    return i;
  }
  function valueNode(tag, v, other) {
    var text = KV.show(v), el = document.createElement(tag);
    if (text.length <= FOLD) { el.textContent = text; return el; }
    var d = document.createElement("details"), s = document.createElement("summary"), pre = document.createElement("pre");
    var start = other == null ? 0 : Math.max(0, firstDifference(text, KV.show(other)) - 10);
    s.textContent = (start ? "…" : "") + text.slice(start, start + 40) + "… (" + text.length + " chars)";
    pre.className = "json"; pre.textContent = typeof v === "object" ? JSON.stringify(v, null, 1) : text;
    d.append(s, pre); el.appendChild(d);
    return el;
  }
  /* A field is new (a create: only its value is shown) when its old value is undefined or `before`, the
     old snapshot when the caller has it, is null or lacks the field; a field that was there and null is a
     change from "none" (an attach: storage_backend none → mooncake), never shown as its new value alone. */
  KV.diff = function (cell, changes, before) {
    var tpl = KV.$("#tpl-change"), frag = document.createDocumentFragment();
    function created(k) {
      return changes[k][0] === undefined || (before !== undefined && (before == null || !(k in before)));
    }
    Object.keys(changes || {}).forEach(function (k) {
      var row = KV.fill(tpl, { key: k, before: "", after: "" });
      if (created(k)) {  // a new field (create): only the value
        KV.$("del", row).nextSibling.remove(); KV.$("del", row).remove();
      } else KV.$("del", row).replaceWith(valueNode("del", changes[k][0], changes[k][1]));
      KV.$("ins", row).replaceWith(valueNode("ins", changes[k][1], changes[k][0]));
      frag.appendChild(row);
    });
    cell.replaceChildren(frag);
    if (!Object.keys(changes || {}).length) cell.textContent = "–";
  };
  /* {field: [before, after]} for the fields that differ between two snapshots */
  KV.changes = function (before, after) {
    var out = {};
    Object.keys(Object.assign({}, before || {}, after || {})).forEach(function (k) {
      var b = (before || {})[k], a = (after || {})[k];
      if (JSON.stringify(b) !== JSON.stringify(a)) out[k] = [b, a];
    });
    return out;
  };
})();

/* Why prompt tokens missed: one stacked bar per worker, tenant or pool from GET /api/v1/capacity/misses/.
   The bar is 100 % of the prompt tokens: the served share first, then each miss cause (the worker's own,
   its never-seen tokens split by the control plane into "new" and "elsewhere"), with the fleet-wide
   ceiling (what an unbounded cache shared by every worker serves) as a line across it. A figure that was
   not measured shows "—" with the reason, never 0. Built with DOM nodes and textContent only. */
(function () {
  "use strict";
  var LABELS = {
    new: "new (first sighting in the fleet)", elsewhere: "elsewhere (another worker computed it)",
    not_seen_here: "not seen here", evicted_device: "evicted here from L1", evicted_host: "evicted here from L2",
    host_below_threshold: "L2 below load-back threshold", over_capacity: "over capacity",
    l3_below_threshold: "L3 below prefetch threshold", l3_timeout: "L3 prefetch timed out",
    l3_revoked: "L3 prefetch revoked", l3_breaker_open: "L3 breaker open", l3_not_admitted: "L3 not admitted",
    partial_page: "partial page", prompt_logprobs: "prompt log-probabilities"
  };
  var COLORS = {
    new: "#9ca3af", elsewhere: "#f59e0b", not_seen_here: "#d1d5db", evicted_device: "#dc2626",
    evicted_host: "#f87171", host_below_threshold: "#a855f7", over_capacity: "#7c3aed",
    l3_below_threshold: "#0ea5e9", l3_timeout: "#0284c7", l3_revoked: "#38bdf8", l3_breaker_open: "#1e3a8a",
    l3_not_admitted: "#60a5fa", partial_page: "#e5e7eb", prompt_logprobs: "#fde68a"
  };
  KV.missLabel = function (cause) { return LABELS[cause] || cause; };

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text != null) node.textContent = text;
    return node;
  }
  function pct(v) { return v == null ? "—" : KV.fmt(v, "%"); }

  /* One row: label, bar, and the figures as text. ``f``: the API's figures of one worker / tenant / pool. */
  KV.missBar = function (label, f, causes, note) {
    var row = el("div", "missrow");
    row.dataset.name = label;
    row.appendChild(el("div", "misslabel", label));
    var bar = el("div", "missbar");
    bar.setAttribute("role", "img");
    var parts = [];
    if (f.served_share == null) {
      bar.classList.add("absent");
      bar.appendChild(el("span", "missnone", "—"));
      bar.title = note || "no attributed traffic yet";
      bar.setAttribute("aria-label", label + ": no attributed traffic");
    } else {
      var served = el("span", "seg served");
      served.style.width = (100 * f.served_share) + "%";
      served.title = "served from cache " + pct(f.served_share);
      bar.appendChild(served);
      parts.push("served " + pct(f.served_share));
      causes.forEach(function (c) {
        var share = f.cause_shares[c];
        if (!share) return;
        var seg = el("span", "seg");
        seg.dataset.cause = c;
        seg.style.width = (100 * share) + "%";
        seg.style.background = COLORS[c] || "#6b7280";
        seg.title = KV.missLabel(c) + " " + pct(share) + " (" + Number(f.causes[c]).toLocaleString() + " tokens)";
        bar.appendChild(seg);
        parts.push(KV.missLabel(c) + " " + pct(share));
      });
      if (f.ceiling_share != null) {
        var line = el("span", "ceiling");
        line.style.left = (100 * f.ceiling_share) + "%";
        line.title = "ceiling " + pct(f.ceiling_share);
        bar.appendChild(line);
      }
      bar.setAttribute("aria-label", label + ": " + parts.join(", ") + "; ceiling " + pct(f.ceiling_share));
    }
    row.appendChild(bar);
    var facts = el("div", "missfacts");
    facts.appendChild(el("span", "", "served " + pct(f.served_share)));
    var ceil = el("span", f.ceiling_share == null ? "absent" : "", "ceiling " + pct(f.ceiling_share));
    if (f.ceiling_share == null) ceil.title = note || "no traffic to compute it over";
    facts.appendChild(ceil);
    var evicted = (f.cause_shares.evicted_device || 0) + (f.cause_shares.evicted_host || 0);
    var elsewhere = f.cause_shares.elsewhere;
    facts.appendChild(el("span", elsewhere == null ? "absent" : "", "elsewhere " + pct(elsewhere)));
    var ev = "evicted here " + (f.served_share == null ? "—" : pct(evicted));
    if (evicted > 0) {  // what more L1 / L2, or a better policy, would have kept: the what-if's answer
      var link = el("a", "", ev);
      link.href = "/capacity/";
      link.title = "the capacity page's what-if: how much more L1 or L2, or another eviction policy " +
        "(against Belady's MIN, the offline optimum), would serve of this traffic";
      facts.appendChild(link);
    } else {
      facts.appendChild(el("span", "", ev));
    }
    row.appendChild(facts);
    return row;
  };

  KV.missLegend = function (causes, shown) {
    var legend = el("ul", "misslegend");
    var served = el("li");
    served.appendChild(el("span", "swatch served"));
    served.appendChild(document.createTextNode("served from cache"));
    legend.appendChild(served);
    causes.forEach(function (c) {
      if (!shown[c]) return;
      var li = el("li");
      var sw = el("span", "swatch");
      sw.style.background = COLORS[c] || "#6b7280";
      li.appendChild(sw);
      li.appendChild(document.createTextNode(KV.missLabel(c)));
      legend.appendChild(li);
    });
    var ceil = el("li");
    ceil.appendChild(el("span", "swatch ceilingmark"));
    ceil.appendChild(document.createTextNode("ceiling (unbounded cache shared by the fleet)"));
    legend.appendChild(ceil);
    return legend;
  };

  /* Fill ``box`` with one bar per entry of ``rows`` ([label, figures, note]) and a legend of the causes seen. */
  KV.missBars = function (box, rows, causes) {
    box.textContent = "";
    var shown = {};
    rows.forEach(function (r) {
      causes.forEach(function (c) { if (r[1].cause_shares[c]) shown[c] = 1; });
      box.appendChild(KV.missBar(r[0], r[1], causes, r[2]));
    });
    box.appendChild(KV.missLegend(causes, shown));
  };
})();

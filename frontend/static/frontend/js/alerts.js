/* The reconciler's alert card (frontend/_reconcile.html, #fleet-alerts) kept current over the websocket.
   KV.fleetAlerts.groups: the groups to subscribe (["alerts"]); .apply(msg): applies one fleet.alert event
   (state "open": adds the alert, or rewrites its text in place; "resolved": removes it) and returns true, or
   returns false for any other message; .resync(): re-reads the open alerts (GET /api/v1/inventory/alerts/
   ?open=true), for every (re)join, since events sent while the socket was away never arrive, then marks the
   card data-synced="1". On a router page (the card's data-router) only that router's alerts count. The card
   is hidden while it lists none. */
(function () {
  "use strict";
  var KV = window.KV, card = KV.$("#fleet-alerts");
  if (!card) return;
  var list = KV.$("ul", card), tpl = KV.$("#tpl-fleet-alert");
  var only = card.dataset.router ? Number(card.dataset.router) : null;

  function item(id) { return KV.$('li[data-alert="' + id + '"]', list); }
  function show() { card.hidden = !list.children.length; }
  function put(alert) {
    var li = KV.fill(tpl, alert), old = item(alert.id);
    if (old) list.replaceChild(li, old); else list.appendChild(li);
  }
  KV.fleetAlerts = {
    groups: ["alerts"],
    apply: function (msg) {
      if (msg.type !== "fleet.alert") return false;
      var alert = msg.data;
      if (only !== null && alert.router !== only) return true;
      if (alert.state === "resolved") {
        var li = item(alert.id);
        if (li) li.remove();
      } else {
        put(alert);
      }
      show();
      return true;
    },
    resync: function () {
      var url = "/api/v1/inventory/alerts/?open=true&ordering=opened_at&limit=500" + (only !== null ? "&router=" + only : "");
      return KV.api("GET", url).then(function (r) {
        list.replaceChildren();
        r.results.forEach(put);
        show();
        card.dataset.synced = "1";
      });
    }
  };
})();

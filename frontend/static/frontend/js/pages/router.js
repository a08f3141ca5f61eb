/* Router page: server-rendered facts; the reconciler's alert card follows fleet.alert events (js/alerts.js).
   The traffic card and the workers table are re-read from the server every REFRESH_MS (the page's own HTML:
   the figures are the TSDB's over the last minute, so a faster refresh would show nothing new), so the
   health, share and in-flight figures never stay as they were when the page opened. */
KV.ready(function () {
  "use strict";
  var REFRESH_MS = 10000;
  KV.subscribe(KV.fleetAlerts.groups, KV.fleetAlerts.apply, KV.fleetAlerts.resync);
  function refresh() {
    if (document.hidden) return;
    fetch(location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) return;
        var fresh = new DOMParser().parseFromString(html, "text/html");
        ["#router-traffic", "#router-workers"].forEach(function (sel) {
          var now = KV.$(sel), next = fresh.querySelector(sel);
          if (now && next) now.replaceWith(document.adoptNode(next));
        });
        document.body.dataset.trafficRefreshed = String(Date.now());
      })
      .catch(function () { /* the next tick tries again */ });
  }
  setInterval(refresh, REFRESH_MS);
});

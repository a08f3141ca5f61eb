/* Router page: server-rendered facts; the reconciler's alert card follows fleet.alert events (js/alerts.js). */
KV.ready(function () {
  "use strict";
  KV.subscribe(KV.fleetAlerts.groups, KV.fleetAlerts.apply, KV.fleetAlerts.resync);
});

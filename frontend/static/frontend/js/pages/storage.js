/* Storage page: the table is server-rendered; the form creates a profile through the API and reloads. */
KV.ready(function () {
  "use strict";
  var form = KV.$("#profile-form");
  if (!form) return;
  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var extra;
    try { extra = JSON.parse(form.extra_config.value || "{}"); } catch (err) { KV.$("#profile-error").textContent = "Extra config is not valid JSON: " + err.message; return; }
    KV.api("POST", "/api/v1/inventory/storage-profiles/", { name: form.name.value, backend: form.backend.value, extra_config: extra, description: form.description.value })
      .then(function () { location.reload(); })
      .catch(function (err) { KV.$("#profile-error").textContent = KV.errorText(err); });
  });
});

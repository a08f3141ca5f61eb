/* Storage page: the table is server-rendered; the form creates a profile through the API and reloads the
   page with ?created=<id>, which confirms the save at the top and marks its row. The hint under the extra
   config names the keys the chosen backend takes (server-rendered per backend; the one chosen shown). */
KV.ready(function () {
  "use strict";
  var form = KV.$("#profile-form");
  if (!form) return;
  function showHint() {
    KV.$$(".hints [data-backend]", form).forEach(function (el) { el.hidden = el.dataset.backend !== form.backend.value; });
    form.extra_config.setAttribute("aria-describedby", "hint-" + form.backend.value + " hicache-hint");
  }
  form.backend.addEventListener("change", showHint);
  showHint();
  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var extra;
    try { extra = JSON.parse(form.extra_config.value || "{}"); } catch (err) { KV.$("#profile-error").textContent = "Extra config is not valid JSON: " + err.message; return; }
    KV.api("POST", "/api/v1/inventory/storage-profiles/", { name: form.name.value, backend: form.backend.value, extra_config: extra, description: form.description.value })
      .then(function (made) { location.assign(location.pathname + "?created=" + made.id + "#profile-" + made.id); })
      .catch(function (err) { KV.$("#profile-error").textContent = KV.errorText(err); });
  });
});

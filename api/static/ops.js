// The operators' console: overview and history, jobs, a job's page, the batch
// lane's batches, clients, workers, webhook endpoints, and the actions (cancel a job, cancel the
// pending jobs a filter matches, revoke a client's keys, send a dead webhook
// delivery again) with the record of those taken. Screens are hash routes
// (#/?range=..., #/jobs?..., #/jobs/ID, #/batches, #/clients, #/workers, #/webhooks)
// over the JSON endpoints under /ops/api; each screen is a module of its own.
//
// Every value from the api is untrusted (stories and error texts come from
// an LLM and a provider): it is only ever inserted as text (textContent, or
// text nodes), never parsed as HTML. The operator key travels in the
// Authorization header of each request, never in a cookie.
import { byId, jobHref, query } from "./format.js";
import { cancelMatching, filterFromForm, loadJobs, moreJobs } from "./ops-jobs.js";
import { cancelCurrentJob, loadJob } from "./ops-job.js";
import { loadBatches, moreBatches } from "./ops-batches.js";
import { loadClients } from "./ops-clients.js";
import { loadActions } from "./ops-actions.js";
import { loadOverview, stopOverview } from "./ops-overview.js";
import { loadWebhooks } from "./ops-webhooks.js";
import { loadWorkers } from "./ops-workers.js";
import { forgetKey, guard, keepKey, operatorKey, route, show, showError, showNotice } from "./ops-ui.js";

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

async function render() {
  showError("");
  stopOverview();
  if (!operatorKey()) {
    show("key");
    byId("key-input").focus();
    return;
  }
  const where = route();
  show(where.screen);
  if (where.screen === "overview") await loadOverview(where.range);
  else if (where.screen === "jobs") await loadJobs(where.filter);
  else if (where.screen === "job") await loadJob(where.jobId);
  else if (where.screen === "batches") await loadBatches();
  else if (where.screen === "workers") await loadWorkers();
  else if (where.screen === "webhooks") await loadWebhooks();
  else await loadClients();
}

byId("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = byId("key-input").value.trim();
  if (!key) {
    showError("Paste an operator key first.");
    return;
  }
  keepKey(key, byId("key-keep").checked);
  byId("key-input").value = "";
  showNotice("");
  guard(render());
});

byId("forget-key").addEventListener("click", () => {
  forgetKey();
  showNotice("The key is forgotten on this device.");
  guard(render());
});

byId("find-job").addEventListener("submit", (event) => {
  event.preventDefault();
  const id = byId("find-job-id").value.trim();
  if (!UUID.test(id)) {
    showError("A job id is a whole UUID, as the client was given it (e.g. 0b6f3c9e-7f3a-4d3c-9c1e-5a7e2b1d9f00).");
    return;
  }
  byId("find-job-id").value = "";
  location.hash = jobHref(id.toLowerCase());
});

byId("filters").addEventListener("submit", (event) => {
  event.preventDefault();
  showNotice("");
  const target = `#/jobs${query(filterFromForm())}`;
  if (location.hash === target) guard(loadJobs(filterFromForm()));
  else location.hash = target;
});

byId("f-clear").addEventListener("click", () => {
  showNotice("");
  if (location.hash === "#/jobs") guard(loadJobs({}));
  else location.hash = "#/jobs";
});

byId("jobs-more").addEventListener("click", () => guard(moreJobs()));
byId("batches-more").addEventListener("click", () => guard(moreBatches()));
byId("cancel-matching").addEventListener("click", () => guard(cancelMatching()));
byId("job-cancel").addEventListener("click", () => guard(cancelCurrentJob()));
byId("actions-log").addEventListener("toggle", () => {
  if (byId("actions-log").open) guard(loadActions());
});
document.addEventListener("visibilitychange", () => {
  const where = route();
  if (document.visibilityState === "visible" && where.screen === "overview" && operatorKey()) {
    guard(loadOverview(where.range));
  }
});
window.addEventListener("hashchange", () => {
  showNotice("");
  guard(render());
});

guard(render());

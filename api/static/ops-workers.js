// The workers, as their heartbeats and requests show them: the busy ones by
// the jobs they hold, the idle ones by their last request.
import { badge, byId, count, duration, h, jobHref, shortId, when } from "./format.js";
import { api } from "./ops-ui.js";

function renderWorkers(answer) {
  byId("workers-note").textContent = `Workers seen in the last hour. One whose last heartbeat is older than ` +
    `${duration(answer.heartbeat_timeout_s)} is presumed gone (the sweeper fails its jobs).`;
  byId("workers-rows").replaceChildren(...answer.workers.map((worker) => h("tr", { "data-worker-id": worker.worker_id },
    h("td", { class: "mono" }, worker.worker_id),
    h("td", { "data-k": "state" }, badge(worker.state)),
    h("td", { class: "num" }, count(worker.running)),
    h("td", {}, worker.last_heartbeat_at ? `${when(worker.last_heartbeat_at)} (${duration(worker.heartbeat_age_s)} ago)` : "—"),
    h("td", {}, when(worker.last_request_at)),
    h("td", {}, worker.job_ids.map((id) => h("a", { href: jobHref(id), class: "mono", title: id }, shortId(id), " "))))));
  if (!answer.workers.length) {
    byId("workers-rows").replaceChildren(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No worker seen in the last hour.")));
  }
}

export async function loadWorkers() {
  renderWorkers(await api("GET", "/ops/api/workers"));
}

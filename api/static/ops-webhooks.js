// The clients' webhook endpoints: each one's state and counts, and its last
// deliveries with how their last attempt ended; a dead delivery can be sent
// again (it becomes pending, due now, and a 410-disabled endpoint is enabled).
import { byId, count, h, jobHref, shortId, when } from "./format.js";
import { api, guard, showNotice } from "./ops-ui.js";

// as shared/webhooks.py names the events
function eventOf(delivery) {
  if (delivery.job_status === "completed") return "job.completed";
  return delivery.error_code === "cancelled" ? "job.cancelled" : "job.failed";
}

function stateOf(endpoint) {
  if (endpoint.disabled_at) return "disabled";
  return endpoint.failing_since ? "failing" : "active";
}

function since(endpoint) {
  if (endpoint.disabled_at) return `disabled ${when(endpoint.disabled_at)} (it answered 410 Gone)`;
  if (endpoint.failing_since) return `failing since ${when(endpoint.failing_since)}`;
  return `since ${when(endpoint.created_at)}`;
}

// the event over its job, the retry under the state: three columns left on a phone
function deliveryRows(delivery) {
  const action = delivery.state === "dead" ? h("button", { type: "button", class: "secondary" }, "Retry") : null;
  if (action) action.addEventListener("click", () => guard(retry(delivery, action)));
  const row = h("tr", { "data-delivery-id": delivery.id },
    h("td", {}, h("span", { "data-k": "event" }, eventOf(delivery)), h("br"),
      h("a", { href: jobHref(delivery.job_id), class: "mono", title: delivery.job_id }, shortId(delivery.job_id))),
    h("td", {}, h("span", { class: `badge ${delivery.state}`, "data-k": "state" }, delivery.state),
      action ? [h("br"), action] : null),
    h("td", { class: "num wide", "data-k": "attempts" }, count(delivery.attempts)),
    h("td", { class: "num", "data-k": "status-code" }, delivery.last_status_code ?? "—"),
    h("td", { class: "wide", "data-k": "last-attempt" }, when(delivery.last_attempt_at)));
  if (!delivery.last_error) return [row];
  row.classList.add("has-error");
  return [row, h("tr", { class: "error-row" }, h("td", { colspan: 5, class: "error-text", "data-k": "last-error" },
    delivery.last_error))];
}

function endpointCard(endpoint) {
  const state = stateOf(endpoint);
  const deliveries = endpoint.last_deliveries.length
    ? h("div", { class: "scroll" }, h("table", { class: "list deliveries" },
      h("thead", {}, h("tr", {},
        h("th", { scope: "col" }, "Event, job"), h("th", { scope: "col" }, "State"),
        h("th", { scope: "col", class: "num wide" }, "Attempts"), h("th", { scope: "col", class: "num" }, "HTTP status"),
        h("th", { scope: "col", class: "wide" }, "Last attempt"))),
      h("tbody", {}, endpoint.last_deliveries.flatMap(deliveryRows))))
    : h("p", { class: "muted" }, "No delivery yet.");
  return h("article", { class: "endpoint", "data-endpoint-id": endpoint.id },
    h("div", { class: "heading" },
      h("h2", {}, endpoint.client_name || `client ${endpoint.client_id}`),
      h("span", { class: `badge ${state}`, "data-k": "endpoint-state" }, state),
      h("span", { class: "muted" }, `client ${endpoint.client_id}`)),
    h("p", { class: "mono", "data-k": "url" }, endpoint.url),
    h("p", { class: "muted", "data-k": "counts" },
      `${count(endpoint.pending)} pending · ${count(endpoint.dead)} dead · ${endpoint.events.join(", ")} · ${since(endpoint)}`),
    deliveries);
}

export async function loadWebhooks() {
  const { endpoints } = await api("GET", "/ops/api/webhooks");
  byId("webhooks-list").replaceChildren(...endpoints.map(endpointCard));
  byId("webhooks-empty").hidden = endpoints.length > 0;
}

async function retry(delivery, button) {
  button.disabled = true;
  try {
    await api("POST", `/ops/api/webhooks/deliveries/${encodeURIComponent(delivery.id)}/retry`);
  } finally {
    button.disabled = false;
  }
  showNotice(`The ${eventOf(delivery)} delivery of job ${shortId(delivery.job_id)} will be sent again.`);
  await loadWebhooks();
}

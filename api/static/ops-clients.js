// The clients: today's spend against each one's budget, today's jobs and
// failures, their weight (their share of the workers), which can be set, and
// their keys, which can be revoked; below them, the operators' recent actions.
import { byId, count, h, query, usd, when } from "./format.js";
import { actionsOpen, loadActions } from "./ops-actions.js";
import { api, confirmAction, guard, showNotice } from "./ops-ui.js";

function keyItem(client, key) {
  const item = h("li", { "data-key-prefix": key.key_prefix },
    h("code", {}, key.key_prefix), " ",
    h("span", { class: "muted" }, key.revoked_at ? `revoked ${when(key.revoked_at)}` : `active since ${when(key.created_at)}`));
  if (!key.revoked_at) {
    const button = h("button", { type: "button", class: "link danger" }, "Revoke");
    button.addEventListener("click", () => guard(revokeKey(client, key)));
    item.append(" ", button);
  }
  return item;
}

function spendCell(today) {
  const used = Number(today.spent_usd) + Number(today.reserved_usd);
  const text = `${usd(today.spent_usd)} spent` + (Number(today.reserved_usd) ? ` + ${usd(today.reserved_usd)} reserved` : "");
  if (today.budget_usd === null) return [text, h("br"), h("span", { class: "muted" }, "no budget")];
  const share = Number(today.budget_usd) ? Math.min(1, used / Number(today.budget_usd)) : 1;
  return [text, h("br"), h("span", { class: "muted" }, `of ${usd(today.budget_usd)} (${Math.round(share * 100)} %)`),
    h("meter", { min: 0, max: 1, high: 0.8, value: share.toFixed(3), "aria-label": "share of the budget used" })];
}

function weightCell(client) {
  const input = h("input", { type: "number", min: 1, max: 1000, step: 1, value: client.weight, required: "",
    "aria-label": `weight of ${client.name}`, class: "weight" });
  const form = h("form", { class: "weight" }, input, " ", h("button", { type: "submit", class: "link" }, "Set"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (input.reportValidity()) guard(setWeight(client, Number(input.value)));
  });
  return form;
}

function renderClients(clients) {
  byId("clients-rows").replaceChildren(...clients.map((client) => {
    const active = client.keys.filter((key) => !key.revoked_at);
    const all = h("button", { type: "button", class: "danger" }, "Revoke all keys…");
    all.disabled = active.length === 0;
    all.addEventListener("click", () => guard(revokeClient(client, active)));
    const jobs = h("a", { href: `#/jobs${query({ client_id: client.client_id })}` }, "jobs");
    const today = client.today;
    return h("tr", { "data-client-id": client.client_id },
      h("td", {}, h("strong", {}, client.name), h("br"), h("span", { class: "muted" }, `client ${client.client_id} · `), jobs),
      h("td", { "data-k": "spend" }, spendCell(today)),
      h("td", { class: "num", "data-k": "jobs" }, count(today.jobs)),
      h("td", { class: "num", "data-k": "failures" }, count(today.failed)),
      h("td", { "data-k": "weight" }, weightCell(client)),
      h("td", { class: "wide" }, client.keys.length ? h("ul", { class: "keys" }, client.keys.map((key) => keyItem(client, key)))
        : h("span", { class: "muted" }, "no keys")),
      h("td", { class: "wide" }, all));
  }));
}

export async function loadClients() {
  const [{ clients }] = await Promise.all([api("GET", "/ops/api/clients"), actionsOpen() ? loadActions() : null]);
  renderClients(clients);
}

async function revokeClient(client, active) {
  const text = `Revoke ${active.length} active key${active.length === 1 ? "" : "s"} of ${client.name} ` +
    `(${active.map((key) => key.key_prefix).join(", ")})? Their next request is refused.`;
  if (!(await confirmAction(text, "Revoke"))) return;
  const done = await api("POST", `/ops/api/clients/${encodeURIComponent(client.client_id)}/revoke-keys`);
  showNotice(`Revoked ${done.revoked.length} key${done.revoked.length === 1 ? "" : "s"} of ${client.name}.`);
  await loadClients();
}

async function revokeKey(client, key) {
  if (!(await confirmAction(`Revoke key ${key.key_prefix} of ${client.name}? Its next request is refused.`, "Revoke"))) return;
  await api("POST", `/ops/api/keys/${encodeURIComponent(key.key_prefix)}/revoke`);
  showNotice(`Revoked key ${key.key_prefix} of ${client.name}.`);
  await loadClients();
}

async function setWeight(client, weight) {
  if (weight === client.weight) return;
  await api("PUT", `/ops/api/clients/${encodeURIComponent(client.client_id)}/weight`, { weight });
  showNotice(`${client.name} now has weight ${weight}: ${weight} of its jobs to one of a weight-1 client's, ` +
    "for the jobs it sends from now on.");
  await loadClients();
}

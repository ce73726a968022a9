// The clients screen's "Recent operator actions": who did what (cancel a job,
// cancel by filter, revoke keys, set a weight), on what, and how many it changed, from
// /ops/api/actions. Loaded when the section is opened, and again with the
// clients while it is open, so an action just taken shows at once.
import { byId, count, h, jobHref, shortId, when } from "./format.js";
import { api } from "./ops-ui.js";

const LIMIT = 50;
// a filter in the console's words; "through" (an opaque position: the jobs
// pending when the operator looked) says nothing to a reader
const WORDS = {
  client_id: (value) => `client ${value}`,
  key_prefix: (value) => `key ${value}`,
  created_after: (value) => `created after ${when(value)}`,
  created_before: (value) => `created before ${when(value)}`,
  weight: (value) => `weight ${value}`,
  through: () => null,
};
// in this order, whatever order the stored filter's keys come in
const ORDER = Object.keys(WORDS);
const rank = ([name]) => (ORDER.includes(name) ? ORDER.indexOf(name) : ORDER.length);

function target(action) {
  if (action.job_id) return ["job ", h("a", { href: jobHref(action.job_id), title: action.job_id, class: "mono" }, shortId(action.job_id))];
  const parts = Object.entries(action.filter || {}).filter(([, value]) => value !== null && value !== undefined)
    .sort((a, b) => rank(a) - rank(b))
    .map(([name, value]) => (Object.hasOwn(WORDS, name) ? WORDS[name](value) : `${name} ${value}`)).filter(Boolean);
  if (!parts.length && action.action === "pending_cancel") return "every pending job";
  return parts.join(", ");
}

function actionRow(action) {
  return h("tr", { "data-action-id": action.id },
    h("td", {}, when(action.acted_at)),
    h("td", {}, `${action.operator} (${action.operator_key_prefix})`),
    h("td", {}, action.action),
    h("td", {}, target(action)),
    h("td", { class: "num" }, count(action.touched)));
}

export const actionsOpen = () => byId("actions-log").open;

export async function loadActions() {
  byId("actions-status").textContent = "Loading…";
  try {
    const { actions } = await api("GET", `/ops/api/actions?limit=${LIMIT}`);
    byId("actions-rows").replaceChildren(...actions.map(actionRow));
    byId("actions-status").textContent = actions.length ? "" : "No operator action yet.";
  } catch (error) {
    byId("actions-status").textContent = "";
    throw error;
  }
}

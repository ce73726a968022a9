// The jobs list: filters, pages of jobs newest first, and the cancel of the
// pending jobs a filter matches.
import { badge, byId, count, h, jobHref, pad, query, shortId, usd, when } from "./format.js";
import { api, confirmAction, failed, showNotice } from "./ops-ui.js";

const PAGE_SIZE = 50;
// a page that came back short is continued by itself up to this many
// requests (each looks at a bounded stretch of history)
const AUTO_PAGES = 10;

let cursor = null;
let current = {};
let generation = 0;
let vocabulary = null;

// the values of an enum somewhere in a parameter's schema ($ref followed)
function enumOf(schema, openapi) {
  if (!schema || typeof schema !== "object") return null;
  if (typeof schema.$ref === "string" && schema.$ref.startsWith("#/components/schemas/")) {
    return enumOf(openapi.components.schemas[schema.$ref.slice("#/components/schemas/".length)], openapi);
  }
  if (Array.isArray(schema.enum)) return schema.enum.filter((v) => v !== null);
  for (const key of ["oneOf", "anyOf", "allOf"]) {
    for (const part of schema[key] || []) {
      const found = enumOf(part, openapi);
      if (found) return found;
    }
  }
  return null;
}

// the vocabulary, from the api's own OpenAPI document
async function loadVocabulary() {
  if (vocabulary) return vocabulary;
  vocabulary = { status: [], error_code: [] };
  try {
    const response = await fetch("/schema/openapi.json", { cache: "no-store", credentials: "omit" });
    const openapi = await response.json();
    for (const param of openapi.paths["/ops/api/jobs"].get.parameters || []) {
      if (param.name in vocabulary) vocabulary[param.name] = enumOf(param.schema, openapi) || [];
    }
  } catch {
    // the selects keep "any" only; the list still works
  }
  return vocabulary;
}

function fillSelect(select, values) {
  const chosen = select.value;
  select.replaceChildren(h("option", { value: "" }, "any"), ...values.map((value) => h("option", { value }, value)));
  select.value = chosen;
}

// datetime-local values are local times; the api gets UTC
const toUtc = (local) => (local ? new Date(local).toISOString() : "");

function toLocalInput(iso) {
  if (!iso) return "";
  const t = new Date(iso);
  return `${t.getFullYear()}-${pad(t.getMonth() + 1)}-${pad(t.getDate())}T${pad(t.getHours())}:${pad(t.getMinutes())}:${pad(t.getSeconds())}`;
}

export function filterFromForm() {
  const form = byId("filters");
  return {
    status: form.elements.status.value,
    client_id: form.elements.client_id.value,
    error_code: form.elements.error_code.value,
    created_after: toUtc(form.elements.created_after.value),
    created_before: toUtc(form.elements.created_before.value),
  };
}

function filterToForm(filter) {
  const form = byId("filters");
  form.elements.status.value = filter.status || "";
  form.elements.client_id.value = filter.client_id || "";
  form.elements.error_code.value = filter.error_code || "";
  form.elements.created_after.value = toLocalInput(filter.created_after);
  form.elements.created_before.value = toLocalInput(filter.created_before);
}

// on a phone the columns marked "wide" give way, so status and cost stay in view
function jobRow(job) {
  return h("tr", { "data-job-id": job.job_id },
    h("td", { class: "wide" }, when(job.created_at)),
    h("td", { class: "mono" }, h("a", { href: jobHref(job.job_id), title: job.job_id }, shortId(job.job_id))),
    h("td", { class: "wide" }, job.client_name),
    h("td", { "data-k": "status" }, badge(job.status, job.error_code)),
    h("td", { class: "wide" }, job.error_code && job.error_code !== "cancelled" ? job.error_code : ""),
    h("td", { class: "mono wide" }, job.worker_id || ""),
    h("td", { class: "wide", "data-k": "lane" }, job.lane),
    h("td", { class: "num wide" }, `${job.billed_calls}/${job.calls}`),
    h("td", { class: "num", "data-k": "cost" }, usd(job.cost_usd)));
}

async function loadClientsInto(select) {
  try {
    const { clients } = await api("GET", "/ops/api/clients");
    const chosen = select.value;
    select.replaceChildren(h("option", { value: "" }, "any"),
      ...clients.map((c) => h("option", { value: String(c.client_id) }, c.name)));
    select.value = chosen;
  } catch (error) {
    failed(error);
  }
}

const cancelFilter = (filter) => ({ client_id: filter.client_id, created_after: filter.created_after,
  created_before: filter.created_before });

// offered only where the filter can match pending jobs and some do
async function offerCancel(filter, mine) {
  const button = byId("cancel-matching");
  button.hidden = true;
  if ((filter.status && filter.status !== "pending") || filter.error_code) return;
  const match = await api("GET", `/ops/api/cancel-pending${query(cancelFilter(filter))}`);
  if (mine !== generation) return;
  button.hidden = !match.pending;
  button.textContent = `Cancel the ${count(match.pending)} pending job${match.pending === 1 ? "" : "s"} matching this filter…`;
}

export async function loadJobs(filter) {
  const mine = ++generation;
  current = filter;
  cursor = null;
  byId("jobs-rows").replaceChildren();
  byId("jobs-more").hidden = true;
  byId("cancel-matching").hidden = true;
  const words = await loadVocabulary();
  fillSelect(byId("f-status"), words.status);
  fillSelect(byId("f-error"), words.error_code);
  await loadClientsInto(byId("f-client"));
  filterToForm(filter);
  await Promise.all([moreJobs(mine), offerCancel(filter, mine)]);
}

export async function moreJobs(mine = generation) {
  byId("jobs-more").disabled = true;
  let found = 0;
  try {
    for (let request = 0; request < AUTO_PAGES; request += 1) {
      byId("jobs-status").textContent = "Loading…";
      const page = await api("GET", `/ops/api/jobs${query({ ...current, cursor, limit: PAGE_SIZE })}`);
      if (mine !== generation) return;
      byId("jobs-rows").append(...page.jobs.map(jobRow));
      found += page.jobs.length;
      cursor = page.next_cursor;
      if (!cursor || found >= PAGE_SIZE) break;
    }
    const shown = byId("jobs-rows").children.length;
    byId("jobs-status").textContent = cursor
      ? `${count(shown)} jobs shown; older jobs may match.`
      : `${count(shown)} jobs: all that match.`;
    byId("jobs-more").hidden = !cursor;
  } finally {
    byId("jobs-more").disabled = false;
  }
}

function describeFilter(filter) {
  const parts = [];
  // the client of the filter sent, which the form may no longer show
  const client = [...byId("f-client").options].find((option) => option.value === String(filter.client_id));
  if (filter.client_id) parts.push(`of client ${client ? client.textContent : `#${filter.client_id}`}`);
  if (filter.created_after) parts.push(`created after ${when(filter.created_after)}`);
  if (filter.created_before) parts.push(`created before ${when(filter.created_before)}`);
  return parts.length ? ` ${parts.join(", ")}` : " (no filter: every pending job)";
}

export async function cancelMatching() {
  const filter = cancelFilter(current);
  const match = await api("GET", `/ops/api/cancel-pending${query(filter)}`);
  if (!match.pending) {
    showNotice("No pending job matches this filter: nothing to cancel.");
    byId("cancel-matching").hidden = true;
    return;
  }
  const text = `Cancel ${count(match.pending)} pending job${match.pending === 1 ? "" : "s"}${describeFilter(filter)}? ` +
    "Jobs that arrive from now on are not affected.";
  if (!(await confirmAction(text, `Cancel ${count(match.pending)} jobs`))) return;
  const body = { through: match.through };
  if (filter.client_id) body.client_id = Number(filter.client_id);
  if (filter.created_after) body.created_after = filter.created_after;
  if (filter.created_before) body.created_before = filter.created_before;
  const done = await api("POST", "/ops/api/cancel-pending", body);
  showNotice(`Cancelled ${count(done.cancelled)} pending job${done.cancelled === 1 ? "" : "s"}.`);
  await loadJobs(current);
}

export const currentFilter = () => current;

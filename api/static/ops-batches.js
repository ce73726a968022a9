// The batch lane's message batches, newest first: each one's state, the
// provider's id and counts of its requests, its age and expiry, what its
// ledger rows cost at the batch price and what that saved against the
// interactive price; 50 at a time, "Older batches" for more.
import { byId, count, duration, h, query, usd, when } from "./format.js";
import { api } from "./ops-ui.js";

const PAGE_SIZE = 50;

let cursor = null;
let generation = 0;
let totals = { cost: 0, saved: 0 };

const requests = (n) => `${count(n)} request${n === 1 ? "" : "s"}`;

// what the provider last counted; an intent, a refused or a lost batch was never counted there
function countsText(batch) {
  const c = batch.counts;
  if (!c) return requests(batch.request_count);
  const ended = [["succeeded", c.succeeded], ["errored", c.errored], ["expired", c.expired], ["canceled", c.canceled]]
    .filter(([, n]) => n > 0).map(([word, n]) => `${count(n)} ${word}`);
  if (c.processing > 0) ended.push(`${count(c.processing)} processing`);
  return ended.length ? ended.join(", ") : requests(batch.request_count);
}

// in flight: how long it has left before the provider ends it
function expiresCell(batch) {
  if (!batch.expires_at) return "—";
  const left = (new Date(batch.expires_at) - Date.now()) / 1000;
  const live = batch.state === "sent" || batch.state === "stray";
  return live && left > 0
    ? [when(batch.expires_at), h("br"), h("span", { class: "muted" }, `in ${duration(left)}`)]
    : when(batch.expires_at);
}

// on a phone the columns marked "wide" give way: the batch, its state, its counts and its cost stay
function batchRow(batch) {
  return h("tr", { "data-batch-id": batch.id },
    h("td", { class: "wide", "data-k": "created" }, when(batch.created_at), h("br"),
      h("span", { class: "muted" }, `${duration(batch.age_s)} ago`)),
    // the provider's id is long: on a phone the batch's own number stands for it
    h("td", { "data-k": "batch" }, h("span", { class: "mono" }, `#${batch.id}`),
      batch.provider_batch_id ? h("span", { class: "wide" }, h("br"),
        h("span", { class: "mono muted", title: batch.provider_batch_id }, batch.provider_batch_id)) : null,
      batch.lost_batch_id ? [h("br"), h("span", { class: "muted" }, `found for lost #${batch.lost_batch_id}`)] : null),
    h("td", { "data-k": "state" }, h("span", { class: `badge ${batch.state}` }, batch.state)),
    h("td", { "data-k": "counts" }, countsText(batch)),
    h("td", { class: "wide", "data-k": "expires" }, expiresCell(batch)),
    h("td", { class: "num", "data-k": "cost" }, usd(batch.cost_usd)),
    h("td", { class: "num wide", "data-k": "saved" }, usd(batch.saved_usd)));
}

export async function loadBatches() {
  const mine = ++generation;
  cursor = null;
  totals = { cost: 0, saved: 0 };
  byId("batches-rows").replaceChildren();
  byId("batches-more").hidden = true;
  await moreBatches(mine);
}

export async function moreBatches(mine = generation) {
  byId("batches-more").disabled = true;
  try {
    byId("batches-status").textContent = "Loading…";
    const page = await api("GET", `/ops/api/batches${query({ cursor, limit: PAGE_SIZE })}`);
    if (mine !== generation) return;
    byId("batches-rows").append(...page.batches.map(batchRow));
    for (const batch of page.batches) {
      totals.cost += Number(batch.cost_usd);
      totals.saved += Number(batch.saved_usd);
    }
    cursor = page.next_cursor;
    const shown = byId("batches-rows").children.length;
    byId("batches-empty").hidden = shown > 0;
    byId("batches-status").textContent = shown
      ? `${count(shown)} batch${shown === 1 ? "" : "es"} shown${cursor ? " (older ones below)" : ""}: ` +
        `${usd(totals.cost)} at ${Number(page.price_factor) * 100} % of the interactive price, ` +
        `${usd(totals.saved)} saved.`
      : "";
    byId("batches-more").hidden = !cursor;
  } finally {
    byId("batches-more").disabled = false;
  }
}

// The overview: the queue now, the last hour and day, spend against the
// budget, the provider's limits, and the history charts.
import { byId, count, duration, h, ratio, svg, usd, when } from "./format.js";
import { api, guard, route } from "./ops-ui.js";

const REFRESH_MS = 15000;

const ROWS = [
  ["Jobs completed", "jobs", "completed", count],
  ["Jobs failed", "jobs", "failed", count],
  ["… of which cancelled", "jobs", "cancelled", count],
  ["Failure ratio (cancellations aside)", "jobs", "failure_ratio", ratio],
  ["Spend", "spend", "usd", usd],
  ["Billed requests", "spend", "billed_calls", count],
  ["Tokens billed, input", "spend", "input_tokens", count],
  ["Tokens billed, output", "spend", "output_tokens", count],
  ["Stories billed but not delivered", "undelivered", "jobs", count],
  ["… what they cost", "undelivered", "usd", usd],
  ["Provider 429s (rate limited)", "provider", "rate_limited", count],
  ["Provider 529s (overloaded)", "provider", "overloaded", count],
];

function renderOverview(overview) {
  const queue = overview.queue;
  document.querySelector('[data-k="queue.pending"]').textContent = count(queue.pending);
  document.querySelector('[data-k="queue.queue_max"]').textContent = count(queue.queue_max);
  document.querySelector('[data-k="queue.running"]').textContent = count(queue.running);
  document.querySelector('[data-k="queue.batch_live"]').textContent = count(queue.batch_live);
  document.querySelector('[data-k="queue.batch_queue_max"]').textContent = count(queue.batch_queue_max);
  document.querySelector('[data-k="queue.oldest_pending_age"]').textContent =
    queue.pending ? duration(queue.oldest_pending_age_s) : "—";
  byId("overview-rows").replaceChildren(...ROWS.map(([label, group, field, format]) =>
    h("tr", {},
      h("th", { scope: "row" }, label),
      ...["last_hour", "last_day"].map((window) => h("td", { class: "num", "data-k": `${group}.${window}.${field}` },
        format(overview[group][window][field]))))));
  const today = overview.spend.today;
  byId("budget-today").textContent = today.budget_usd === null
    ? `${usd(today.spent_usd)} spent + ${usd(today.reserved_usd)} reserved (no daily budget)`
    : `${usd(today.spent_usd)} spent + ${usd(today.reserved_usd)} reserved of ${usd(today.budget_usd)}: ` +
      `${usd(today.left_usd)} left`;
  const limiter = overview.provider.limiter;
  const kinds = [["requests", "requests"], ["input_tokens", "input tokens"], ["output_tokens", "output tokens"]]
    .filter(([kind]) => limiter[kind] !== null)
    .map(([kind, label]) => `${label} ${count(Math.floor(limiter[kind].available))} of ` +
      `${count(Math.floor(limiter[kind].capacity))} (${count(limiter[kind].per_minute)}/min)`);
  byId("limiter-now").textContent = `${limiter.model}: ` +
    (limiter.paused_s > 0 ? `held for ${duration(limiter.paused_s)} after a 429; ` : "") +
    (kinds.length ? kinds.join(", ") : "no configured limit");
  const writers = overview.writers || [];
  byId("writers-now").textContent = writers.length
    ? writers.map((w) => (w === "offline" ? "the offline writer (no ANTHROPIC_API_KEY: stories cost nothing)" : w)).join(", ")
    : "no request in the last day";
  byId("offline-note").hidden = !writers.includes("offline");
  // an open transaction or snapshot past XMIN_HORIZON_WARN_S: VACUUM is held back
  const warning = overview.snapshots ? overview.snapshots.warning : null;
  byId("snapshot-warning").textContent = warning || "";
  byId("snapshot-warning").hidden = !warning;
  byId("overview-updated").textContent = `as of ${when(overview.generated_at)}`;
}

// -- charts: bars per bucket, a time axis under them, a scale beside them ------------

const WIDTH = 600;
const HEIGHT = 120;
const LEFT = 44;
const BOTTOM = 18;

function nice(top) {
  if (top <= 0) return 1;
  const magnitude = 10 ** Math.floor(Math.log10(top));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * magnitude >= top) return step * magnitude;
  return 10 * magnitude;
}

const timeLabel = (iso, range) => {
  const t = new Date(iso);
  const hm = `${String(t.getHours()).padStart(2, "0")}:${String(t.getMinutes()).padStart(2, "0")}`;
  return range === "week" ? `${t.getMonth() + 1}/${t.getDate()} ${hm}` : hm;
};

// counts keep whole numbers on the scale: their top is even, so its half is whole too
export function drawBars(target, buckets, series, { range, format = (v) => String(v), whole = false }) {
  const plotW = WIDTH - LEFT;
  const plotH = HEIGHT - BOTTOM;
  const step = plotW / Math.max(1, buckets.length);
  const highest = nice(Math.max(0, ...buckets.map((b) => series.reduce((sum, s) => sum + s.value(b), 0))));
  const top = whole ? Math.max(2, Math.ceil(highest / 2) * 2) : highest;
  const nodes = [];
  for (const fraction of [0, 0.5, 1]) {
    const y = plotH - fraction * (plotH - 4);
    nodes.push(svg("line", { x1: LEFT, y1: y, x2: WIDTH, y2: y, class: fraction ? "grid" : "axis" }));
    const label = svg("text", { x: LEFT - 4, y: y + 4, class: "scale", "text-anchor": "end" });
    label.textContent = format(top * fraction);
    nodes.push(label);
  }
  const ticks = 6;
  for (let i = 0; i < ticks && buckets.length; i += 1) {
    const index = Math.round((i * (buckets.length - 1)) / (ticks - 1));
    const x = LEFT + index * step + step / 2;
    nodes.push(svg("line", { x1: x, y1: plotH, x2: x, y2: plotH + 3, class: "axis" }));
    const label = svg("text", { x, y: HEIGHT - 3, class: "scale", "text-anchor": "middle" });
    label.textContent = timeLabel(buckets[index].at, range);
    nodes.push(label);
  }
  buckets.forEach((bucket, index) => {
    let base = plotH;
    for (const s of series) {
      const value = s.value(bucket);
      if (value <= 0) continue;
      const bar = Math.max(1, (value / top) * (plotH - 4));
      base -= bar;
      nodes.push(svg("rect", { x: LEFT + index * step + 0.5, y: base, width: Math.max(0.5, step - 1), height: bar,
        class: s.cls }, `${when(bucket.at)}: ${s.title(bucket)}`));
    }
  });
  target.replaceChildren(...nodes);
}

function renderHistory(history, range) {
  const buckets = history.buckets;
  drawBars(byId("chart-jobs"), buckets, [
    { cls: "completed", value: (b) => b.completed, title: (b) => `${b.completed} completed` },
    { cls: "failed", value: (b) => b.failed, title: (b) => `${b.failed} failed` },
  ], { range, format: (v) => count(v), whole: true });
  drawBars(byId("chart-depth"), buckets, [
    { cls: "pending", value: (b) => b.pending_max, title: (b) => `at most ${b.pending_max} pending` },
  ], { range, format: (v) => count(v), whole: true });
  drawBars(byId("chart-wait"), buckets, [
    { cls: "wait", value: (b) => b.wait_p95_s ?? 0, title: (b) => `waited: p50 ${duration(b.wait_p50_s)}, ` +
      `p95 ${duration(b.wait_p95_s)}; ran: p50 ${duration(b.run_p50_s)}, p95 ${duration(b.run_p95_s)}` },
  ], { range, format: (v) => (v ? duration(v) : "0") });
  drawBars(byId("chart-spend"), buckets, [
    { cls: "spend", value: (b) => Number(b.spend_usd), title: (b) => `${usd(b.spend_usd)} billed, ${b.rate_limited} 429s` },
  ], { range, format: (v) => usd(v) });
  const sum = (field) => buckets.reduce((total, b) => total + Number(b[field]), 0);
  const t = history.totals;
  byId("chart-totals").textContent =
    `In this ${range}: ${count(sum("completed"))} completed, ${count(sum("failed"))} failed, ` +
    `${usd(sum("spend_usd"))} billed, ${count(sum("rate_limited"))} 429s. ` +
    `Waited p50 ${duration(t.wait_p50_s)}, p95 ${duration(t.wait_p95_s)}; ` +
    `ran p50 ${duration(t.run_p50_s)}, p95 ${duration(t.run_p95_s)}.`;
  byId("chart-bucket").textContent = `one bar per ${history.bucket_minutes === 1 ? "minute" : `${history.bucket_minutes} minutes`}`;
  for (const link of byId("ranges").querySelectorAll("a")) {
    if (link.dataset.range === range) link.setAttribute("aria-current", "true");
    else link.removeAttribute("aria-current");
  }
}

let timer = null;

export function stopOverview() {
  clearTimeout(timer);
}

export async function loadOverview(range) {
  clearTimeout(timer);
  const [overview, history] = await Promise.all([
    api("GET", "/ops/api/overview"), api("GET", `/ops/api/history?range=${range}`)]);
  const where = route();
  if (where.screen !== "overview" || where.range !== range) return;
  renderOverview(overview);
  renderHistory(history, range);
  timer = setTimeout(() => {
    if (route().screen === "overview" && document.visibilityState === "visible") guard(loadOverview(range));
  }, REFRESH_MS);
}

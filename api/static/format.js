// Building the console's page from api values: text only, never HTML, and
// numbers, money and times written one way everywhere.

const SVG_NS = "http://www.w3.org/2000/svg";

// h("td", {class: "num"}, "12", child): strings become text nodes
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined && value !== false) node.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function svg(tag, attrs, title) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (title) {
    const tip = document.createElementNS(SVG_NS, "title");
    tip.textContent = title;
    node.append(tip);
  }
  return node;
}

export const byId = (id) => document.getElementById(id);
export const pad = (n) => String(n).padStart(2, "0");

// this browser's time zone as a short name ("UTC", "GMT+1", "CET")
export function zone(t = new Date()) {
  const part = new Intl.DateTimeFormat("en-GB", { timeZoneName: "short" }).formatToParts(t)
    .find((p) => p.type === "timeZoneName");
  return part ? part.value : "local";
}

// a moment in this browser's time zone, which it names
export function when(iso) {
  if (!iso) return "—";
  const t = new Date(iso);
  return `${t.getFullYear()}-${pad(t.getMonth() + 1)}-${pad(t.getDate())} ` +
    `${pad(t.getHours())}:${pad(t.getMinutes())}:${pad(t.getSeconds())} ${zone(t)}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

export const between = (from, to) => (from && to ? (new Date(to) - new Date(from)) / 1000 : null);

// US dollars: to the cent from a dollar up, four decimals below (a single
// request costs fractions of a cent), "$0" for nothing at all
export function usd(value) {
  const n = Number(value);
  if (!Number.isFinite(n)) return "—";
  if (n === 0) return "$0";
  const sign = n < 0 ? "−" : "";
  const abs = Math.abs(n);
  if (abs >= 1) return `${sign}$${abs.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 })}`;
  if (abs < 0.0001) return `${sign}<$0.0001`;
  return `${sign}$${abs.toFixed(4)}`;
}

export const count = (value) => Number(value).toLocaleString("en-US");
export const ratio = (value) => (value === null || value === undefined ? "—" : `${(value * 100).toFixed(1)} %`);
export const shortId = (id) => id.slice(0, 8);
export const jobHref = (id) => `#/jobs/${encodeURIComponent(id)}`;

// a job's status as an operator tells them apart: a cancellation is not a failure
export function badge(status, errorCode) {
  const shown = status === "failed" && errorCode === "cancelled" ? "cancelled" : status;
  return h("span", { class: `badge ${shown}` }, shown);
}

export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") search.set(name, value);
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

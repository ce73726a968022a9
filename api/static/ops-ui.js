// What every screen of the console shares: the operator key, the calls to
// /ops/api, the screen shown, its messages, confirmations and routes.
import { ApiError, call } from "./http.js";
import { byId } from "./format.js";

const KEY_STORAGE = "storyjobs.operatorKey";
const SCREENS = ["key", "overview", "jobs", "job", "batches", "clients", "workers", "webhooks"];

export const operatorKey = () => sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || "";

export function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  localStorage.removeItem(KEY_STORAGE);
}

export function keepKey(key, onThisDevice) {
  forgetKey();
  (onThisDevice ? localStorage : sessionStorage).setItem(KEY_STORAGE, key);
}

export const api = (method, path, body) => call(method, path, { key: operatorKey(), json: body });

export function show(screen) {
  for (const name of SCREENS) byId(`${name}-screen`).hidden = name !== screen;
  byId("nav").hidden = screen === "key";
  byId("forget-key").hidden = screen === "key";
  byId("find-job").hidden = screen === "key";
  for (const link of byId("nav").querySelectorAll("a")) {
    const current = link.dataset.screen === screen || (screen === "job" && link.dataset.screen === "jobs");
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

export function say(id, text) {
  byId(id).textContent = text || "";
  byId(id).hidden = !text;
}

export const showError = (text) => say("error", text);
export const showNotice = (text) => say("notice", text);

export function failed(error) {
  if (error instanceof ApiError && error.status === 401) {
    forgetKey();
    show("key");
    showError("The operator key was refused. Enter an operator key (a client's key does not open the console).");
    byId("key-input").focus();
  } else if (error instanceof ApiError) {
    showError(error.message);
  } else {
    showError("Something went wrong on this page. Reload it and try again.");
    throw error;
  }
}

// runs an async step; a refused key or a failed request is shown, not thrown
export const guard = (promise) => promise.catch(failed);

// resolves true when the operator confirms
export function confirmAction(text, yesLabel) {
  const dialog = byId("confirm");
  byId("confirm-text").textContent = text;
  byId("confirm-yes").textContent = yesLabel;
  return new Promise((resolve) => {
    const done = (answer) => {
      byId("confirm-yes").removeEventListener("click", yes);
      byId("confirm-no").removeEventListener("click", no);
      dialog.removeEventListener("cancel", no);
      dialog.close();
      resolve(answer);
    };
    const yes = () => done(true);
    const no = () => done(false);
    byId("confirm-yes").addEventListener("click", yes);
    byId("confirm-no").addEventListener("click", no);
    dialog.addEventListener("cancel", no);
    dialog.showModal();
  });
}

export const FILTERS = ["status", "client_id", "error_code", "created_after", "created_before"];
export const RANGES = ["hour", "day", "week"];

export function route() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, search = ""] = hash.split("?");
  const params = new URLSearchParams(search);
  const job = path.match(/^\/jobs\/([^/]+)$/);
  if (job) return { screen: "job", jobId: decodeURIComponent(job[1]) };
  if (path === "/jobs") {
    const filter = {};
    for (const name of FILTERS) filter[name] = params.get(name) || "";
    return { screen: "jobs", filter };
  }
  if (path === "/batches") return { screen: "batches" };
  if (path === "/clients") return { screen: "clients" };
  if (path === "/workers") return { screen: "workers" };
  if (path === "/webhooks") return { screen: "webhooks" };
  const range = params.get("range");
  return { screen: "overview", range: RANGES.includes(range) ? range : "hour" };
}

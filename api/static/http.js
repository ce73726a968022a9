// Talking to the api, for both pages: one fetch with the key in the
// Authorization header (never a cookie), problem details read as data, and
// Retry-After read as milliseconds.

export class ApiError extends Error {
  // status 0: no answer at all (the network, or the server down)
  constructor(status, message, problem = {}) {
    super(message);
    this.status = status;
    this.problem = problem;
  }
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// the RFC 9457 body of an error answer, or what can be said without one
export async function problemOf(response) {
  try {
    const problem = await response.json();
    if (problem && typeof problem === "object") return problem;
  } catch {
    // not JSON: a proxy's page, say
  }
  return { title: `HTTP ${response.status}`, status: response.status };
}

export const problemText = (problem, status) => String(problem.detail || problem.title || `HTTP ${status}`);

export function retryAfterMs(response) {
  const seconds = Number(response.headers.get("Retry-After"));
  return Number.isFinite(seconds) && seconds > 0 ? seconds * 1000 : null;
}

// The raw answer (a Response); throws ApiError(0) when none came.
export async function send(method, path, { key = "", headers = {}, json } = {}) {
  const all = { ...headers };
  if (key) all.Authorization = `Bearer ${key}`;
  if (json !== undefined) all["Content-Type"] = "application/json";
  try {
    return await fetch(path, {
      method,
      headers: all,
      body: json === undefined ? undefined : JSON.stringify(json),
      cache: "no-store",
      credentials: "omit",
    });
  } catch {
    throw new ApiError(0, "The server cannot be reached. Check the connection and try again.");
  }
}

// The JSON of a successful answer; an ApiError with the problem otherwise.
export async function call(method, path, options) {
  const response = await send(method, path, options);
  if (!response.ok) {
    const problem = await problemOf(response);
    throw new ApiError(response.status, problemText(problem, response.status), problem);
  }
  return response.json();
}

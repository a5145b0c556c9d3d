// Calls to the service's JSON endpoints, with its API key when it has them on (ATTEND_API_KEYS).
//
// The key is asked for when an endpoint answers 401 and kept in sessionStorage: for this tab only, gone
// when it closes, never in the URL (where it would reach the history and the server's logs).

const KEY = "attend.apiKey";

export class ApiError extends Error {
  constructor(status, body) {
    const error = body?.error ?? { code: "http_error", message: `HTTP ${status}` };
    super(error.message);
    this.status = status;
    this.error = error; // the service's one error body: {code, message, field, expected, received}
  }
}

let asking = null; // one dialog for every request that got a 401 at the same time

function askKey(message) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key");
  const slot = dialog.querySelector(".field-error");
  slot.textContent = message ?? "";
  slot.hidden = !message;
  input.value = "";
  asking = new Promise((resolve) => {
    form.addEventListener("submit", () => {
      sessionStorage.setItem(KEY, input.value.trim());
      asking = null;
      resolve();
    }, { once: true });
  });
  // Escape would close it with no key; the request would then only get its 401 again.
  dialog.addEventListener("cancel", (event) => event.preventDefault(), { once: true });
  dialog.showModal();
  input.focus();
  return asking;
}

/** The JSON body of `path`'s answer; throws ApiError with the service's error for a 4xx or 5xx. */
export async function api(path, { method = "GET", body } = {}) {
  for (;;) {
    const headers = {};
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    const parsed = await response.json().catch(() => null);
    if (response.status === 401) {
      sessionStorage.removeItem(KEY);
      await askKey(key ? parsed?.error?.message : null); // say why only when a key was given and refused
      continue;
    }
    if (!response.ok) throw new ApiError(response.status, parsed);
    return parsed;
  }
}

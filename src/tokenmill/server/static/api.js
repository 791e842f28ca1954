// What the playground and the dashboard share: the API key, calls to the server with its errors shown
// verbatim, and a reader of server-sent events over fetch (EventSource cannot send the key).
"use strict";

const KEY_STORE = "tokenmill.apiKey";

export class ApiError extends Error {
  // status 0: the connection failed or dropped (no HTTP answer)
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

// The key dialog, added to the page the first time it is needed.
function keyDialog() {
  let dialog = document.getElementById("key-dialog");
  if (dialog) return dialog;
  dialog = el("dialog", { id: "key-dialog", "aria-labelledby": "key-title" },
    el("form", { method: "dialog" },
      el("h2", { id: "key-title", text: "API key" }),
      el("p", { id: "key-reason" }),
      el("label", { for: "key-input" }, "Key sent as ", el("code", { text: "Authorization: Bearer" })),
      el("input", { id: "key-input", type: "password", autocomplete: "off" }),
      el("div", { class: "actions" },
        el("button", { value: "save", text: "Save" }),
        el("button", { value: "cancel", formnovalidate: "", text: "Cancel" }))));
  document.body.append(dialog);
  return dialog;
}

// Ask for the API key in the key dialog; resolves false when the user cancels.
export function askForKey(reason) {
  const dialog = keyDialog();
  const input = document.getElementById("key-input");
  document.getElementById("key-reason").textContent = reason || "";
  input.value = apiKey();
  dialog.showModal();
  input.focus();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      if (dialog.returnValue === "save") {
        localStorage.setItem(KEY_STORE, input.value.trim());
        resolve(true);
      } else {
        resolve(false);
      }
    }, { once: true });
  });
}

function headers(extra) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

// The server's error message, as it sent it (the OpenAI shape, or the raw text).
async function errorOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return new ApiError(response.status, body.error.message);
  } catch (_) { /* not JSON */ }
  return new ApiError(response.status, text || `HTTP ${response.status}`);
}

// fetch with the key; a 401 asks for the key once and retries. Throws ApiError on any failure.
export async function call(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    let response;
    try {
      response = await fetch(path, { ...options, headers: headers(options.headers) });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, `the connection to the server failed (${err.message})`);
    }
    if (response.ok) return response;
    const error = await errorOf(response);
    if (response.status === 401 && attempt === 0 && await askForKey(error.message)) continue;
    throw error;
  }
}

// Server-sent events of a streamed response: yields {event, data} per event until the stream ends.
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, `the connection dropped while streaming (${err.message})`);
    }
    if (chunk.done) return;
    buffer += decoder.decode(chunk.value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// The playground: chat (through Chat Completions, Responses or Messages, with attached images) and completions,
// streamed token by token.
import { ApiError, askForKey, call, el, events } from "/static/api.js";
import { APIS, readEvent } from "/static/chat_apis.js";

const STORE = "tokenmill.playground";
const MAX_KEPT_MESSAGES = 100;
const $ = (id) => document.getElementById(id);
const FIELDS = ["mode", "api", "system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop",
  "logprobs", "constraint", "constraint-value", "tools", "tool_choice"];

let state = { messages: [], settings: {} };
let running = null; // {controller, message} while an answer streams
let lastRequest = null; // what Retry sends again: {prompt, images}
let attachments = []; // {name, url}: the images (data URLs) that go with the next message, in order
let reading = Promise.resolve(); // the files being read into attachments
let modelId = null; // the served model's name, which Responses and Messages bodies carry

function save() {
  state.messages = state.messages.slice(-MAX_KEPT_MESSAGES);
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
  } catch (_) { // over the storage quota (images are large): keep the conversation without its images
    const messages = state.messages.map((m) => (imagesOf(m.content).length
      ? { ...m, content: textOf(m.content), images_not_kept: imagesOf(m.content).length } : m));
    try { localStorage.setItem(STORE, JSON.stringify({ ...state, messages })); } catch (_) { /* nothing kept */ }
  }
}

// A user turn's content: plain text, or (with images) the image parts in order, then the text part.
function userContent(prompt, images) {
  if (!images.length) return prompt;
  const parts = images.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  if (prompt.trim()) parts.push({ type: "text", text: prompt });
  return parts;
}

function textOf(content) {
  if (!Array.isArray(content)) return content || "";
  return content.filter((part) => part.type === "text").map((part) => part.text).join("");
}

function imagesOf(content) {
  return Array.isArray(content) ? content.filter((part) => part.type === "image_url").map((part) => part.image_url.url) : [];
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error || new Error("the file could not be read"));
    reader.readAsDataURL(file);
  });
}

// Reads the chosen files, in order, into the attachments.
async function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      showError(`${file.name} is not an image`, false);
      continue;
    }
    try {
      attachments.push({ name: file.name, url: await readAsDataUrl(file) });
    } catch (err) {
      showError(`${file.name} could not be read: ${err.message}`, false);
    }
  }
  renderAttachments();
}

function renderAttachments() {
  const list = $("attachments");
  list.replaceChildren(...attachments.map((image, index) => {
    const remove = el("button", { type: "button", class: "remove", "aria-label": `Remove ${image.name}`, text: "✕" });
    remove.addEventListener("click", () => {
      attachments.splice(index, 1);
      renderAttachments();
      $("prompt").focus();
    });
    return el("li", {}, el("img", { class: "thumb", src: image.url, alt: image.name }), remove);
  }));
  list.hidden = attachments.length === 0;
}

function load() {
  try {
    state = { messages: [], settings: {}, ...JSON.parse(localStorage.getItem(STORE) || "{}") };
  } catch (_) { /* a broken store starts afresh */ }
  for (const name of FIELDS) {
    const input = $(name);
    if (!(name in state.settings)) continue;
    if (input.type === "checkbox") input.checked = state.settings[name];
    else input.value = state.settings[name];
  }
}

function readSettings() {
  for (const name of FIELDS) {
    const input = $(name);
    state.settings[name] = input.type === "checkbox" ? input.checked : input.value;
  }
  save();
  return state.settings;
}

function showError(message, retryable) {
  $("error-text").textContent = message;
  $("retry").hidden = !retryable;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

function number(value) {
  return value === "" || value === undefined ? undefined : Number(value);
}

// The request body for the current settings and the new user turn's content (text, or chat content parts);
// throws Error with a message for bad settings.
function buildBody(settings, content) {
  const body = { stream: true, stream_options: { include_usage: true } };
  for (const name of ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"]) {
    const value = number(settings[name]);
    if (value !== undefined) body[name] = value;
  }
  const stop = settings.stop.split("\n").filter((s) => s.length);
  if (stop.length) body.stop = stop;
  const constraint = settings["constraint-value"];
  if (settings.constraint === "json_schema") {
    let schema;
    try { schema = JSON.parse(constraint); } catch (err) { throw new Error(`the JSON schema is not valid JSON: ${err.message}`); }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  } else if (settings.constraint === "regex") {
    body.guided_regex = constraint;
  } else if (settings.constraint === "choice") {
    body.guided_choice = constraint.split("\n").filter((s) => s.length);
  }
  if (settings.mode === "chat") {
    const messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    for (const m of state.messages) {
      if (m.kind === "chat") messages.push({ role: m.role, content: m.content || "" });
    }
    messages.push({ role: "user", content });
    body.messages = messages;
    if (settings.logprobs) { body.logprobs = true; body.top_logprobs = 5; }
    if (settings.tools.trim()) {
      try { body.tools = JSON.parse(settings.tools); } catch (err) { throw new Error(`the tools are not valid JSON: ${err.message}`); }
      body.tool_choice = settings.tool_choice;
    }
  } else {
    body.prompt = content;
    if (settings.logprobs) body.logprobs = 5;
  }
  return body;
}

function tokenSpan(token) {
  const span = el("span", { class: "token", text: token.text });
  if (token.logprob !== undefined && token.logprob !== null) {
    const alternatives = (token.top || []).map((t) => `${JSON.stringify(t.token)}: ${t.logprob.toFixed(3)}`);
    span.title = `logprob ${token.logprob.toFixed(4)} (p = ${Math.exp(token.logprob).toFixed(3)})` +
      (alternatives.length ? `\n${alternatives.join("\n")}` : "");
    span.tabIndex = 0;
  }
  return span;
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft_ms !== undefined) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  if (stats.tokens !== undefined) parts.push(`${stats.tokens} tokens`);
  if (stats.finish_reason) parts.push(`finish: ${stats.finish_reason}`);
  return parts.join(" · ");
}

function render() {
  const list = $("messages");
  list.replaceChildren();
  for (const message of state.messages) list.append(renderMessage(message));
}

function renderMessage(message) {
  const body = el("div", { class: "content" });
  const thinking = message.reasoning
    ? el("details", { class: "thinking" }, el("summary", { text: "Thinking" }), el("div", { text: message.reasoning }))
    : null;
  if (message.tokens && message.tokens.length) {
    for (const token of message.tokens) body.append(tokenSpan(token));
  } else {
    body.textContent = textOf(message.content);
  }
  const item = el("li", { class: `message ${message.role}`, "data-role": message.role },
    el("div", { class: "role", text: message.kind === "completion" && message.role === "user" ? "prompt" : message.role }));
  const images = imagesOf(message.content);
  if (images.length) {
    item.append(el("div", { class: "images" }, ...images.map((url, i) =>
      el("img", { class: "thumb", src: url, alt: `attached image ${i + 1} of ${images.length}` }))));
  }
  if (message.images_not_kept) {
    item.append(el("div", { class: "muted", text: `${message.images_not_kept} image(s) not kept: the browser's storage is full` }));
  }
  if (thinking) item.append(thinking);
  item.append(body);
  if (message.tool_calls && message.tool_calls.length) {
    item.append(el("pre", { class: "tool-calls", text: JSON.stringify(message.tool_calls, null, 2) }));
  }
  item.append(el("div", { class: "stats muted", text: statsText(message.stats) }));
  return item;
}

async function send(prompt, images = []) {
  clearError();
  const settings = readSettings();
  const content = userContent(prompt, images);
  let body;
  try {
    body = buildBody(settings, content);
  } catch (err) {
    showError(err.message, false);
    return;
  }
  const kind = settings.mode;
  const api = kind === "chat" ? settings.api || "chat_completions" : null;
  if (api) body = APIS[api].body(body, modelId);
  const user = { kind, role: "user", content };
  const answer = { kind, role: "assistant", content: "", reasoning: "", tokens: [], tool_calls: [], stats: {} };
  state.messages.push(user, answer);
  render();
  let node = $("messages").lastElementChild;
  lastRequest = { prompt, images };
  const controller = new AbortController();
  running = { controller, answer };
  $("stop-button").disabled = false;
  $("send").disabled = true;
  const started = performance.now();
  let firstToken = null;
  try {
    const path = api ? APIS[api].path : "/v1/completions";
    const response = await call(path, {
      method: "POST", body: JSON.stringify(body), signal: controller.signal,
      headers: { "Content-Type": "application/json" },
    });
    const streamState = {};
    for await (const { event, data } of events(response)) {
      if (data === "[DONE]") break;
      if (api && api !== "chat_completions") {
        const piece = readEvent(api, event, data, streamState);
        if (piece && appendPiece(answer, piece) && firstToken === null) {
          firstToken = performance.now();
          answer.stats.ttft_ms = firstToken - started;
        }
        const fresh = renderMessage(answer);
        node.replaceWith(fresh);
        node = fresh;
        continue;
      }
      const chunk = JSON.parse(data);
      if (event === "error" || chunk.error) throw new ApiError(500, chunk.error ? chunk.error.message : data);
      if (chunk.usage) answer.stats.tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const pieces = appendChoice(answer, choice, kind);
        if (pieces && firstToken === null) {
          firstToken = performance.now();
          answer.stats.ttft_ms = firstToken - started;
        }
        if (choice.finish_reason) answer.stats.finish_reason = choice.finish_reason;
      }
      const fresh = renderMessage(answer);
      node.replaceWith(fresh);
      node = fresh;
      node.scrollIntoView({ block: "end" });
    }
  } catch (err) {
    if (err.name === "AbortError") {
      answer.stats.finish_reason = "stopped";
    } else {
      answer.stats.finish_reason = "error";
      showError(err.message, err.status === 0);
    }
  } finally {
    const ended = performance.now();
    if (answer.stats.tokens === undefined && answer.tokens.length) answer.stats.tokens = answer.tokens.length;  // stopped early: no usage came
    if (firstToken !== null && answer.stats.tokens > 1 && ended > firstToken) {
      answer.stats.tokens_per_s = (answer.stats.tokens - 1) / ((ended - firstToken) / 1000);
    }
    running = null;
    $("stop-button").disabled = true;
    $("send").disabled = false;
    save();
    render();
  }
}

// Adds a streamed choice's text, tokens and tool calls to the answer; returns how many tokens came.
function appendChoice(answer, choice, kind) {
  let text = "";
  let tokens = [];
  if (kind === "chat") {
    const delta = choice.delta || {};
    text = delta.content || "";
    answer.reasoning += delta.reasoning_content || "";
    for (const call of delta.tool_calls || []) mergeToolCall(answer.tool_calls, call);
    const content = choice.logprobs && choice.logprobs.content;
    if (content) tokens = content.map((t) => ({ text: t.token, logprob: t.logprob, top: t.top_logprobs }));
  } else {
    text = choice.text || "";
    const lp = choice.logprobs;
    if (lp && lp.tokens) {
      tokens = lp.tokens.map((t, i) => ({
        text: t, logprob: lp.token_logprobs[i],
        top: lp.top_logprobs && lp.top_logprobs[i]
          ? Object.entries(lp.top_logprobs[i]).map(([token, logprob]) => ({ token, logprob })) : [],
      }));
    }
  }
  answer.content += text;
  if (tokens.length) answer.tokens.push(...tokens);
  else if (text) answer.tokens.push({ text });
  return tokens.length || (text ? 1 : 0) || (choice.delta && choice.delta.tool_calls ? 1 : 0);
}

// Adds what one Responses or Messages event brought (chat_apis.js readEvent); returns whether it held output.
function appendPiece(answer, piece) {
  answer.content += piece.text || "";
  answer.reasoning += piece.thinking || "";
  if (piece.text) answer.tokens.push({ text: piece.text });
  for (const call of piece.calls || []) mergeToolCall(answer.tool_calls, call);
  if (piece.tokens !== undefined) answer.stats.tokens = piece.tokens;
  if (piece.finish) answer.stats.finish_reason = piece.finish;
  return Boolean(piece.text || piece.thinking || piece.calls);
}

function mergeToolCall(calls, delta) {
  const index = delta.index || 0;
  calls[index] = calls[index] || { id: delta.id, type: "function", function: { name: "", arguments: "" } };
  const fn = delta.function || {};
  if (fn.name) calls[index].function.name += fn.name;
  if (fn.arguments) calls[index].function.arguments += fn.arguments;
}

async function showModel() {
  try {
    const response = await call("/v1/models");
    const models = (await response.json()).data || [];
    modelId = models.length ? models[0].id : null;
    $("model").textContent = models.length ? `model: ${models[0].id}` : "";
  } catch (err) {
    showError(err.message, err.status === 0);
  }
}

function setup() {
  load();
  render();
  $("composer").addEventListener("submit", async (event) => {
    event.preventDefault();
    await reading; // images still being read go with this message
    const prompt = $("prompt").value;
    const images = attachments;
    if ((!prompt.trim() && !images.length) || running) return;
    if (images.length && $("mode").value !== "chat") {
      showError("images go with chat only: set Mode to Chat, or remove them", false);
      return;
    }
    $("prompt").value = "";
    attachments = [];
    renderAttachments();
    send(prompt, images);
  });
  $("attach").addEventListener("change", (event) => {
    const files = [...event.target.files];
    event.target.value = ""; // the same file can be chosen again
    reading = reading.then(() => attach(files));
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("composer").requestSubmit();
  });
  $("stop-button").addEventListener("click", () => running && running.controller.abort());
  $("clear").addEventListener("click", () => { state.messages = []; save(); render(); clearError(); });
  $("retry").addEventListener("click", () => {
    if (lastRequest === null || running) return;
    state.messages.splice(-2, 2); // the failed exchange
    send(lastRequest.prompt, lastRequest.images);
  });
  $("key-button").addEventListener("click", async () => { if (await askForKey("")) showModel(); });
  $("settings").addEventListener("change", readSettings);
  showModel();
}

setup();

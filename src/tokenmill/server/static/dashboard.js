// The live dashboard: reads /v1/engine/stream (schema: docs/dashboard.md) and draws it. Reconnects after
// a dropped stream or a server restart, with a growing pause (at most 5 s, or the page's
// ?reconnect_max_ms=, 50 to 60000).
import { askForKey, call, el, events } from "/static/api.js";

const WINDOW_S = 300; // seconds of history the time charts keep
const MAX_STEP_POINTS = 600;
const KV_COLORS = ["#ffffff", "#0b5cad", "#9ecbff", "#8250df"]; // free, in use, evictable, shared
const KV_NAMES = ["free", "in use", "cached (evictable)", "cached and shared"];
const KV_KEYS = ["free", "in_use", "evictable", "shared"];
const $ = (id) => document.getElementById(id);
const DEFAULT_RECONNECT_MAX_MS = 5000;

// A page watching a server that is expected back soon (a restart) can retry more often than every 5 s.
function reconnectMaxMs() {
  const asked = Number(new URLSearchParams(location.search).get("reconnect_max_ms"));
  return Number.isFinite(asked) && asked > 0 ? Math.min(60000, Math.max(50, asked)) : DEFAULT_RECONNECT_MAX_MS;
}

const series = { t: [], running: [], waiting: [], preempted: [], output: [], prompt: [] };
const steps = { t: [], prefill: [], decode: [], ms: [] };
let previous = null; // the last sample, for rates
let charts = {};
window.tokenmillDashboard = { samples: 0, steps: 0, lastSample: null }; // read by the browser tests

function lineChart(id, labels, colors, opts = {}) {
  const node = $(id);
  const width = Math.max(300, node.clientWidth || 480);
  const chart = new uPlot({
    width, height: 200,
    scales: { x: { time: true }, ...(opts.scales || {}) },
    series: [{}, ...labels.map((label, i) => ({ label, stroke: colors[i], width: 2, scale: (opts.seriesScales || [])[i] || "y" }))],
    axes: [{}, { scale: "y" }, ...(opts.extraAxes || [])],
  }, [[], ...labels.map(() => [])], node);
  return chart;
}

function setupCharts() {
  charts.requests = lineChart("chart-requests", ["running", "waiting", "preempted"], ["#0b5cad", "#bf8700", "#cf222e"]);
  charts.steps = lineChart("chart-steps", ["prefill tokens", "decode tokens", "step ms"], ["#0b5cad", "#1a7f37", "#57606a"], {
    seriesScales: ["y", "y", "ms"], scales: { ms: {} }, extraAxes: [{ scale: "ms", side: 1, grid: { show: false } }],
  });
  charts.throughput = lineChart("chart-throughput", ["output tokens/s", "prompt tokens/s"], ["#1a7f37", "#0b5cad"]);
  const legend = $("kv-legend");
  KV_NAMES.forEach((name, i) => legend.append(el("li", {}, el("span", { class: "swatch", style: `background:${KV_COLORS[i]}` }), name)));
}

function trim(store, keepFrom) {
  let drop = 0;
  while (drop < store.t.length && store.t[drop] < keepFrom) drop++;
  if (drop) for (const key of Object.keys(store)) store[key].splice(0, drop);
}

function figure(id, text) {
  $(id).textContent = text;
}

function percent(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`;
}

function onSample(sample) {
  const s = sample.scheduler;
  const dash = window.tokenmillDashboard;
  dash.samples += 1;
  dash.lastSample = sample;
  $("model").textContent = `model: ${sample.model}`;
  let outputRate = 0, promptRate = 0, prefillRate = 0;
  if (previous) {
    const dt = sample.time - previous.time;
    if (dt > 0) {
      outputRate = Math.max(0, (sample.tokens.generation_total - previous.tokens.generation_total) / dt);
      promptRate = Math.max(0, (sample.tokens.prompt_total - previous.tokens.prompt_total) / dt);
      prefillRate = Math.max(0, (sample.tokens.prefill_total - previous.tokens.prefill_total) / dt);
    }
  }
  previous = sample;
  series.t.push(sample.time);
  series.running.push(s.running);
  series.waiting.push(s.waiting);
  series.preempted.push(s.preempted);
  series.output.push(outputRate);
  series.prompt.push(promptRate);
  trim(series, sample.time - WINDOW_S);
  for (const step of s.steps) {
    steps.t.push(step.time);
    steps.prefill.push(step.prefill_tokens);
    steps.decode.push(step.decode_tokens);
    steps.ms.push(step.duration_ms);
    dash.steps += 1;
  }
  trim(steps, sample.time - WINDOW_S);
  const extra = steps.t.length - MAX_STEP_POINTS;
  if (extra > 0) for (const key of Object.keys(steps)) steps[key].splice(0, extra);
  charts.requests.setData([series.t, series.running, series.waiting, series.preempted]);
  charts.steps.setData([steps.t, steps.prefill, steps.decode, steps.ms]);
  charts.throughput.setData([series.t, series.output, series.prompt]);

  figure("fig-running", `${s.running} / ${s.max_num_seqs}`);
  figure("fig-waiting", String(s.waiting));
  figure("fig-preempted", `${s.preempted} (${s.preemptions_total} total)`);
  figure("fig-output-rate", outputRate.toFixed(1));
  figure("fig-prefill-rate", prefillRate.toFixed(1));
  const recent = steps.ms.slice(-20);
  figure("fig-step", recent.length ? (recent.reduce((a, b) => a + b, 0) / recent.length).toFixed(1) : "–");
  figure("fig-kv", percent(sample.kv.usage));
  figure("fig-hits", percent(sample.kv.prefix_cache.hit_rate));
  figure("fig-spec", percent(sample.spec.acceptance_rate));
  const images = sample.encoder.images_total;
  figure("fig-images", images ? `${images} (${(1000 * sample.encoder.seconds_total / images).toFixed(1)} ms each)` : "–");
  const finished = Object.values(sample.requests.finished).reduce((a, b) => a + b, 0);
  figure("fig-structured", finished ? percent(sample.requests.structured / finished) : "–");
  figure("fig-errors", String(sample.requests.finished.error + sample.requests.engine_faults));
  figure("fig-rejected", String(sample.requests.rejected));
  figure("fig-finished", String(finished));
  showTenants(sample.tenants);
  drawKvMap(sample.kv);
  drawLatency(sample.latency);
  drawTimeline(sample.timeline, sample.time);
  showSlos(sample.timeline);
}

// a server with tenants sends their use (every tenant's to an admin, its own to another); others send none
function showTenants(tenants) {
  const card = document.getElementById("tenants-card");
  card.hidden = !tenants;
  if (!tenants) return;
  const against = (used, limit) => (limit == null ? String(used) : `${used} / ${limit}`);
  card.querySelector("tbody").replaceChildren(...tenants.map((t) => {
    const row = document.createElement("tr");
    const name = document.createElement("th");
    name.scope = "row";
    name.textContent = t.tenant;
    row.append(name);
    for (const text of [String(t.in_flight), against(t.requests_last_minute, t.requests_per_minute),
                        against(t.tokens_last_minute, t.tokens_per_minute),
                        t.ttft_p50_ms == null ? "–" : t.ttft_p50_ms.toFixed(1)]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.append(cell);
    }
    return row;
  }));
}

const SLO_STORE = "tokenmill.dashboard.slos";
const SLO_NAMES = ["ttft", "tpot", "e2el"];

function sloLimits() {
  const limits = {};
  for (const name of SLO_NAMES) {
    const value = Number($(`slo-${name}`).value);
    if ($(`slo-${name}`).value !== "" && value > 0) limits[name] = value / 1000;
  }
  return limits;
}

// A finished trace's TTFT, TPOT and end-to-end latency in seconds (TPOT 0 with one output token).
function observed(trace) {
  const ttft = trace.first_token === null ? null : trace.first_token - trace.arrival;
  const tokens = trace.output_tokens || 0;
  const tpot = tokens >= 2 && trace.first_token !== null ? (trace.finished - trace.first_token) / (tokens - 1) : 0;
  return { ttft, tpot, e2el: trace.finished - trace.arrival };
}

function showSlos(timeline) {
  const limits = sloLimits();
  const names = Object.keys(limits);
  const result = $("slo-result");
  if (!names.length) {
    result.textContent = "Set an objective to see how many requests meet it.";
    return;
  }
  const done = timeline.filter((t) => t.finished !== null && t.finish_reason !== "abort");
  const good = done.filter((t) => {
    const o = observed(t);
    return t.finish_reason !== "error" && names.every((n) => o[n] !== null && o[n] <= limits[n]);
  });
  const first = Math.min(...done.map((t) => t.arrival)), last = Math.max(...done.map((t) => t.finished));
  const rate = done.length && last > first ? ` · goodput ${(good.length / (last - first)).toFixed(2)} requests/s` : "";
  result.textContent = done.length
    ? `${good.length} of ${done.length} finished requests met every objective (${percent(good.length / done.length)})${rate}`
    : "No finished request on the timeline yet.";
  result.dataset.good = String(good.length);
  result.dataset.done = String(done.length);
}

function setupSlos() {
  const saved = JSON.parse(localStorage.getItem(SLO_STORE) || "{}");
  for (const name of SLO_NAMES) {
    const input = $(`slo-${name}`);
    if (saved[name]) input.value = saved[name];
    input.addEventListener("input", () => {
      const values = Object.fromEntries(SLO_NAMES.map((n) => [n, $(`slo-${n}`).value]));
      localStorage.setItem(SLO_STORE, JSON.stringify(values));
      if (previous) showSlos(previous.timeline);
    });
  }
}

function drawKvMap(kv) {
  const canvas = $("kv-map");
  const ctx = canvas.getContext("2d");
  const cells = kv.map.length;
  const columns = Math.ceil(Math.sqrt(cells * canvas.width / canvas.height));
  const size = Math.max(1, Math.floor(Math.min(canvas.width / columns, canvas.height / Math.ceil(cells / columns))));
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < cells; i++) {
    const x = (i % columns) * size, y = Math.floor(i / columns) * size;
    ctx.fillStyle = KV_COLORS[Number(kv.map[i])];
    ctx.fillRect(x, y, size, size);
    if (size > 3) {
      ctx.strokeStyle = "#d0d7de";
      ctx.strokeRect(x + 0.5, y + 0.5, size - 1, size - 1);
    }
  }
  const counts = KV_KEYS.map((key, i) => `${KV_NAMES[i]} ${kv.counts[key]}`).join(", ");
  canvas.dataset.counts = JSON.stringify(kv.counts);
  canvas.setAttribute("aria-label", `KV block map of ${kv.num_blocks} blocks: ${counts}`);
  const tier = kv.secondary ? `; second tier ${kv.secondary.used} / ${kv.secondary.capacity} blocks` : "";
  $("kv-summary").textContent = `${kv.num_blocks} blocks of ${kv.block_size} tokens` +
    (kv.blocks_per_cell > 1 ? ` (${kv.blocks_per_cell} per cell)` : "") + `: ${counts}${tier}`;
}

// The value below which a fraction q of a histogram's observations fall (upper bucket bound).
function quantile(h, q) {
  if (!h.count) return null;
  let seen = 0;
  for (let i = 0; i < h.counts.length; i++) {
    seen += h.counts[i];
    if (seen >= q * h.count) return i < h.le.length ? h.le[i] : Infinity;
  }
  return Infinity;
}

function ms(seconds) {
  if (seconds === null) return "–";
  return seconds === Infinity ? "> max" : `≤ ${Math.round(seconds * 1000)} ms`;
}

const LATENCY_NAMES = { ttft: "Time to first token", itl: "Inter-token latency", e2e: "End to end", queue: "Queue time" };

function drawLatency(latency) {
  const list = $("latency");
  list.replaceChildren();
  const holder = $("histograms");
  for (const [key, name] of Object.entries(LATENCY_NAMES)) {
    const h = latency[key];
    const mean = h.count ? `${Math.round((h.sum / h.count) * 1000)} ms` : "–";
    list.append(el("div", {}, el("dt", { text: name }),
      el("dd", { text: `p50 ${ms(quantile(h, 0.5))} · p90 ${ms(quantile(h, 0.9))} · p99 ${ms(quantile(h, 0.99))} · mean ${mean} · n ${h.count}` })));
    let canvas = document.getElementById(`hist-${key}`);
    if (!canvas) {
      canvas = el("canvas", { id: `hist-${key}`, width: "420", height: "120", role: "img" });
      holder.append(el("figure", {}, canvas, el("figcaption", { class: "muted", text: `${name}: requests per bucket` })));
    }
    drawHistogram(canvas, h, name);
  }
}

function drawHistogram(canvas, h, name) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(1, ...h.counts);
  const width = canvas.width / h.counts.length;
  ctx.fillStyle = "#0b5cad";
  h.counts.forEach((count, i) => {
    const height = (count / top) * (canvas.height - 14);
    ctx.fillRect(i * width + 1, canvas.height - 14 - height, width - 2, height);
  });
  ctx.fillStyle = "#57606a";
  ctx.font = "10px system-ui";
  [0, Math.floor(h.le.length / 2), h.le.length - 1].forEach((i) => ctx.fillText(`${h.le[i]}s`, i * width, canvas.height - 2));
  canvas.setAttribute("aria-label", `${name} histogram of ${h.count} observations`);
}

function drawTimeline(traces, now) {
  const canvas = $("timeline");
  const ctx = canvas.getContext("2d");
  const rows = traces.slice(-24);
  const start = Math.min(...rows.map((t) => t.arrival ?? now), now - 5);
  const span = Math.max(1, now - start);
  const labelWidth = 170, rowHeight = Math.max(6, Math.min(18, Math.floor(canvas.height / Math.max(rows.length, 1))));
  const x = (t) => labelWidth + ((t - start) / span) * (canvas.width - labelWidth - 8);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui";
  rows.forEach((trace, i) => {
    const y = i * rowHeight;
    ctx.fillStyle = "#1b1f24";
    const label = `${trace.id.slice(-18)}${trace.finish_reason ? ` ${trace.finish_reason}` : ""}`;
    ctx.fillText(label, 2, y + rowHeight - 4);
    const queuedEnd = trace.first_scheduled ?? trace.finished ?? now;
    ctx.fillStyle = "#d0d7de";
    ctx.fillRect(x(trace.arrival), y + 2, Math.max(1, x(queuedEnd) - x(trace.arrival)), rowHeight - 4);
    for (const [kind, s, e] of trace.spans) {
      ctx.fillStyle = kind === "prefill" ? "#0b5cad" : "#1a7f37";
      ctx.fillRect(x(s), y + 2, Math.max(2, x(e) - x(s)), rowHeight - 4);
    }
    ctx.fillStyle = "#cf222e";
    for (const t of trace.preemptions) ctx.fillRect(x(t) - 1, y, 3, rowHeight);
  });
  canvas.dataset.requests = String(rows.length);
  canvas.setAttribute("aria-label", `timeline of the last ${rows.length} requests over ${span.toFixed(1)} s`);
}

function setConnection(state, text) {
  const node = $("connection");
  node.dataset.state = state;
  node.textContent = text;
}

async function follow() {
  const maxPause = reconnectMaxMs();
  const firstPause = Math.min(250, maxPause);
  let pause = firstPause;
  for (;;) {
    try {
      const response = await call("/v1/engine/stream");
      setConnection("connected", "live");
      pause = firstPause;
      previous = null;
      for await (const { event, data } of events(response)) {
        if (event === "engine_error") {
          setConnection("reconnecting", `engine stopped: ${JSON.parse(data).message}`);
          continue;
        }
        onSample(JSON.parse(data));
      }
      setConnection("reconnecting", "stream ended; reconnecting…");
    } catch (err) {
      setConnection("reconnecting", `${err.message}; reconnecting…`);  // call() has asked for a missing key
    }
    await new Promise((resolve) => setTimeout(resolve, pause));
    pause = Math.min(maxPause, pause * 2);
  }
}

$("key-button").addEventListener("click", () => askForKey(""));
setupCharts();
setupSlos();
follow();

// colibri dashboard: chat (OpenAI chat route, streamed), live telemetry (/v1/telemetry/stream) and
// the last turn's profile (/v1/profile).
// Plain browser JavaScript, no build step. The server's API key, when it has one, is asked for
// once and kept in this tab's sessionStorage; every request sends it as a Bearer token (which is
// why the telemetry stream is read with fetch: EventSource cannot send headers).
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "colibri.conversations";
const KEY = "colibri.api-key";
const CHART_WINDOW_S = 300;
const PLACE_RGB = { p: [88, 214, 141], c: [95, 179, 249], r: [245, 176, 65], "-": [93, 100, 112] };

const app = {
  key: sessionStorage.getItem(KEY) || "",
  model: null,
  conversations: [],
  current: null,          // id of the conversation shown
  running: null,          // AbortController of the generation in flight
  telemetry: null,        // the last snapshot
  telemetryAbort: null,
  turnsSeen: null,        // turns ended (completed + cancelled) when the last profile was fetched
  profileFetch: null,     // the /v1/profile request in flight
};

// ------------------------------------------------------------------------------------ the API
class AuthError extends Error {}

function headers(extra = {}) {
  const h = { ...extra };
  if (app.key) h.authorization = "Bearer " + app.key;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) {
    askKey(app.key ? "That key was refused." : "");
    throw new AuthError("the server needs its API key");
  }
  return response;
}

// Server-sent events from a fetch response: yields {event, data} per frame.
async function* sseFrames(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
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

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (e) {
    return `${response.status} ${response.statusText}`;
  }
}

// ------------------------------------------------------------------------------------ the key
function askKey(message) {
  const dialog = $("key-dialog");
  $("key-error").textContent = message || "";
  if (!dialog.open) dialog.showModal();
}

async function useKey(key) {
  app.key = key;
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    app.key = "";
    askKey("That key was refused.");
    return;
  }
  sessionStorage.setItem(KEY, key);
  await connect();
}

// ------------------------------------------------------------------------------------ conversations
function loadConversations() {
  try {
    app.conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
  } catch (e) {
    app.conversations = [];
  }
  if (!app.conversations.length) newConversation();
  app.current = app.conversations[0].id;
}

function saveConversations() {
  localStorage.setItem(STORE, JSON.stringify(app.conversations));
}

function conversation() {
  return app.conversations.find((c) => c.id === app.current);
}

function newConversation() {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  app.conversations.unshift(c);
  app.current = c.id;
  saveConversations();
  return c;
}

function renderConversationList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const c of app.conversations) {
    const li = document.createElement("li");
    li.className = c.id === app.current ? "current" : "";
    const title = document.createElement("span");
    title.textContent = c.title;
    title.title = c.title;
    const remove = document.createElement("button");
    remove.textContent = "×";
    remove.title = "Delete this conversation";
    remove.addEventListener("click", (ev) => {
      ev.stopPropagation();
      if (app.running && c.id === app.current) return;
      app.conversations = app.conversations.filter((x) => x.id !== c.id);
      if (!app.conversations.length) newConversation();
      if (!conversation()) app.current = app.conversations[0].id;
      saveConversations();
      renderAll();
    });
    li.append(title, remove);
    li.addEventListener("click", () => {
      if (app.running) return; // one generation at a time per page
      app.current = c.id;
      renderAll();
    });
    list.append(li);
  }
}

// ------------------------------------------------------------------------------------ messages
function markdown(el, text) {
  el.innerHTML = DOMPurify.sanitize(marked.parse(text));
  for (const block of el.querySelectorAll("pre code")) hljs.highlightElement(block);
}

function messageElement(m) {
  const el = document.createElement("div");
  el.className = "msg " + m.role;
  if (m.role === "user") {
    el.textContent = m.content;
    return el;
  }
  if (m.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const body = document.createElement("div");
    body.textContent = m.reasoning;
    details.append(summary, body);
    el.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  markdown(content, m.content || "");
  el.append(content);
  if (m.stats || m.error) {
    const stats = document.createElement("div");
    stats.className = m.error ? "stats error" : "stats";
    stats.textContent = m.error ? "error: " + m.error : m.stats;
    el.append(stats);
  }
  return el;
}

function renderMessages() {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  box.replaceChildren(...conversation().messages.map(messageElement));
  if (atBottom) box.scrollTop = box.scrollHeight;
}

let renderPending = false;
function renderSoon() {
  // A token arrives every few ms; the page redraws at most once a frame.
  if (renderPending) return;
  renderPending = true;
  requestAnimationFrame(() => {
    renderPending = false;
    renderMessages();
  });
}

function renderAll() {
  renderConversationList();
  renderMessages();
  const c = conversation();
  $("system-prompt").value = c.system || "";
  setRunning(Boolean(app.running));
}

function setRunning(running) {
  $("send").disabled = running || !app.model;
  $("stop").disabled = !running;
  const msgs = conversation().messages;
  $("regenerate").disabled = running || !app.model || !msgs.some((m) => m.role === "user");
}

// ------------------------------------------------------------------------------------ a turn
async function send(text) {
  const c = conversation();
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.slice(0, 48);
  saveConversations();
  renderConversationList();
  await generate();
}

async function regenerate() {
  const c = conversation();
  while (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  await generate();
}

function cacheCounts(snapshot) {
  const e = snapshot && snapshot.experts;
  return e ? { hits: e.hits, misses: e.misses } : null;
}

async function expertCountsNow() {
  try {
    const r = await api("/v1/telemetry?experts=false");
    return r.ok ? cacheCounts(await r.json()) : null;
  } catch (e) {
    return null;
  }
}

function turnStats(t0, tFirst, tEnd, usage, tokens, before, after) {
  const parts = [];
  const n = usage ? usage.completion_tokens : tokens;
  if (tFirst !== null) {
    parts.push(`TTFT ${((tFirst - t0) / 1000).toFixed(2)} s`);
    if (n > 1 && tEnd > tFirst) parts.push(`${((n - 1) / ((tEnd - tFirst) / 1000)).toFixed(1)} tok/s`);
  }
  parts.push(`${n} tokens`);
  if (usage) {
    const reused = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(`prompt ${usage.prompt_tokens}: ${reused} reused, ${usage.prompt_tokens - reused} prefilled`);
  }
  if (before && after) {
    if (after.hits === null) parts.push("experts: all resident");
    else {
      const hits = after.hits - before.hits;
      const asked = hits + after.misses - before.misses;
      if (asked > 0) parts.push(`expert hit rate ${((100 * hits) / asked).toFixed(1)}%`);
    }
  }
  return parts.join(" · ");
}

async function generate() {
  const c = conversation();
  const messages = [];
  c.system = $("system-prompt").value;
  if (c.system.trim()) messages.push({ role: "system", content: c.system });
  for (const m of c.messages) messages.push({ role: m.role, content: m.content });
  const reply = { role: "assistant", content: "", reasoning: "" };
  c.messages.push(reply);
  const controller = new AbortController();
  app.running = controller;
  setRunning(true);
  renderMessages();
  const before = await expertCountsNow();
  const t0 = performance.now();
  let tFirst = null, usage = null, tokens = 0;
  try {
    const body = {
      model: app.model, messages, stream: true, stream_options: { include_usage: true },
      temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
    };
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorMessage(r));
    for await (const frame of sseFrames(r)) {
      if (frame.data === "[DONE]") break;
      const d = JSON.parse(frame.data);
      if (d.error) throw new Error(d.error.message);
      if (d.usage) usage = d.usage;
      const delta = d.choices && d.choices[0] && d.choices[0].delta;
      if (!delta) continue;
      if (delta.content || delta.reasoning_content) {
        if (tFirst === null) tFirst = performance.now();
        tokens += 1;
      }
      if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
      if (delta.content) reply.content += delta.content;
      renderSoon();
    }
    reply.stats = turnStats(t0, tFirst, performance.now(), usage, tokens, before, await expertCountsNow());
    refreshProfile();
  } catch (e) {
    if (e.name === "AbortError") reply.stats = `stopped after ${tokens} tokens`;
    else reply.error = e.message || String(e);
  } finally {
    app.running = null;
    saveConversations();
    renderAll();
  }
}

// ------------------------------------------------------------------------------------ telemetry
function gb(bytes) {
  return bytes >= 1e9 ? (bytes / 1e9).toFixed(2) + " GB" : (bytes / 1e6).toFixed(1) + " MB";
}

function renderTiers(tiers) {
  const box = $("tiers");
  box.replaceChildren();
  for (const t of tiers) {
    const div = document.createElement("div");
    div.className = "tier";
    div.dataset.tier = t.tier;
    const label = document.createElement("div");
    const used = t.dense_bytes + t.expert_bytes;
    label.textContent = t.note
      ? `${t.tier.toUpperCase()}: ${t.note}`
      : `${t.tier.toUpperCase()}: dense ${gb(t.dense_bytes)} + experts ${gb(t.expert_bytes)}` +
        (t.tier === "disk" ? "" : ` of ${gb(t.budget_bytes)} budget`);
    const bar = document.createElement("div");
    bar.className = "bar";
    const scale = Math.max(t.budget_bytes, used, 1);
    for (const [cls, bytes] of [["dense", t.dense_bytes], ["experts", t.expert_bytes]]) {
      const seg = document.createElement("i");
      seg.className = cls;
      seg.style.width = ((100 * bytes) / scale).toFixed(2) + "%";
      bar.append(seg);
    }
    div.append(label, bar);
    box.append(div);
  }
}

const brain = { layers: [], maxExperts: 0 };

function renderBrain(experts) {
  const canvas = $("brain");
  if (!experts || !experts.layers) {
    $("brain-note").textContent = "(no routed experts to show)";
    canvas.hidden = true;
    $("cache-line").textContent = "";
    return;
  }
  canvas.hidden = false;
  const layers = experts.layers;
  const width = Math.max(...layers.map((l) => l.places.length));
  if (canvas.width !== width || canvas.height !== layers.length) {
    canvas.width = width;
    canvas.height = layers.length;
  }
  // One pixel per expert, scaled up by CSS with pixelated rendering: 64 x 384 is 24k pixels,
  // drawn in well under a millisecond.
  const cell = Math.max(2, Math.min(14, Math.floor(320 / layers.length)));
  canvas.style.height = layers.length * cell + "px";
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(width, layers.length);
  let total = 0;
  layers.forEach((layer, row) => {
    let max = 0;
    for (const n of layer.counts) if (n > max) max = n;
    const norm = Math.log1p(max) || 1;
    for (let e = 0; e < layer.places.length; e++) {
      const n = layer.counts[e];
      total += n;
      const rgb = PLACE_RGB[layer.places[e]] || PLACE_RGB["-"];
      const light = 0.22 + 0.78 * (Math.log1p(n) / norm);
      const i = 4 * (row * width + e);
      image.data[i] = rgb[0] * light;
      image.data[i + 1] = rgb[1] * light;
      image.data[i + 2] = rgb[2] * light;
      image.data[i + 3] = 255;
    }
  });
  ctx.putImageData(image, 0, 0);
  brain.layers = layers;
  brain.maxExperts = width;
  canvas.dataset.updates = String(Number(canvas.dataset.updates || 0) + 1);
  canvas.dataset.total = String(total);
  canvas.dataset.reading = String(experts.reading || 0);
  $("brain-note").textContent = `(${layers.length} MoE layers × ${width} experts)`;
  const hit = experts.hit_rate === null || experts.hit_rate === undefined ? "" : `hit rate ${(100 * experts.hit_rate).toFixed(1)}%`;
  const read = experts.hits === null ? "all experts resident" : `${hit} · ${gb(experts.bytes_read)} read from disk`;
  $("cache-line").textContent = `${read} · ${experts.reading || 0} being read now`;
}

function brainHover(ev) {
  const canvas = $("brain");
  if (!brain.layers.length) return;
  const rect = canvas.getBoundingClientRect();
  const e = Math.floor(((ev.clientX - rect.left) / rect.width) * brain.maxExperts);
  const row = Math.floor(((ev.clientY - rect.top) / rect.height) * brain.layers.length);
  const layer = brain.layers[row];
  if (!layer || e < 0 || e >= layer.places.length) return;
  const places = (app.telemetry.experts && app.telemetry.experts.places) || {};
  $("brain-hover").textContent = `${layer.prefix} expert ${e}: routed ${layer.counts[e]}×, ${places[layer.places[e]] || "?"}`;
}

function drawChart(canvas, series, column, color) {
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth || 400);
  const h = (canvas.height = canvas.clientHeight || 60);
  ctx.clearRect(0, 0, w, h);
  if (!series.length) return;
  const now = series[series.length - 1][0];
  const max = Math.max(1, ...series.map((s) => s[column]));
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  series.forEach((s, i) => {
    const x = w - ((now - s[0]) / CHART_WINDOW_S) * w;
    const y = h - 3 - (s[column] / max) * (h - 8);
    if (i === 0) ctx.moveTo(x, y);
    else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#7d8796";
  ctx.font = "10px sans-serif";
  ctx.fillText(max.toFixed(max < 10 ? 1 : 0), 3, 10);
}

function renderQueue(s, maxContext) {
  $("queue").textContent =
    `running ${s.running} of ${s.max_batch} · queued ${s.queued} of ${s.max_queue}` +
    ` · done ${s.completed}, cancelled ${s.cancelled}, failed ${s.failed}` + (s.draining ? " · draining" : "");
  const box = $("slots");
  box.replaceChildren();
  s.slots.forEach((slot, i) => {
    const div = document.createElement("div");
    div.className = "slot" + (slot.busy ? " busy" : "");
    const name = document.createElement("b");
    name.textContent = `slot ${i}`;
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("i");
    fill.style.width = ((100 * slot.tokens) / Math.max(1, maxContext)).toFixed(1) + "%";
    bar.append(fill);
    const n = document.createElement("span");
    n.textContent = `${slot.tokens} / ${maxContext}`;
    if (slot.state_bytes !== undefined) {
      // a hybrid model: a fixed-size recurrent state, resumable only where a snapshot was kept
      const kept = slot.resumable_at.length ? slot.resumable_at.join(", ") : "none";
      n.textContent += ` · state ${(slot.state_bytes / 1048576).toFixed(1)} MiB, snapshots at ${kept}`;
    }
    div.append(name, bar, n);
    box.append(div);
  });
}

// ------------------------------------------------------------------------------------ the last turn
const PHASE_COLORS = {
  attention: "#5fb3f9", dense_mlp: "#8e7cc3", routing: "#e5c07b", routed_experts: "#58d68d",
  disk_wait: "#f28b82", head: "#c678dd", other: "#5d6470", compute: "#7d8796",
};

function seconds(s) {
  return s >= 1 ? s.toFixed(2) + " s" : (1000 * s).toFixed(s >= 0.01 ? 0 : 1) + " ms";
}

function percent(x) {
  return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%";
}

function renderProfile(p) {
  const box = $("last-turn");
  if (!p) {
    $("turn-note").textContent = "no turn yet";
    return;
  }
  box.dataset.turn = String(p.turn);
  const s = p.seconds;
  $("turn-note").textContent =
    `#${p.turn}: ${p.tokens.prompt} prompt tokens (${p.tokens.reused} reused), ${p.tokens.completion} generated ` +
    `at ${p.tok_s.decode.toFixed(1)} tok/s, ${seconds(s.total)} in all`;
  // The time split: the phase clock's when it ran, else only the disk wait against the rest.
  let parts, span;
  if (p.phases) {
    parts = Object.entries(p.phases);
    span = s.total;
  } else {
    const wait = s.disk_wait || 0;
    parts = [["disk_wait", wait], ["compute", Math.max(0, s.total - wait)]];
    span = s.total;
  }
  const bar = $("turn-split");
  const legend = $("turn-legend");
  bar.replaceChildren();
  legend.replaceChildren();
  for (const [name, secs] of parts) {
    const seg = document.createElement("i");
    seg.style.background = PHASE_COLORS[name] || PHASE_COLORS.other;
    seg.style.width = ((100 * secs) / Math.max(span, 1e-9)).toFixed(2) + "%";
    seg.title = `${name.replace("_", " ")} ${seconds(secs)}`;
    bar.append(seg);
    if (secs <= 0) continue; // (a phase this model has not: a MoE-only model's dense MLP)
    const item = document.createElement("span");
    const sw = document.createElement("i");
    sw.className = "sw";
    sw.style.background = seg.style.background;
    item.append(sw, `${name.replace("_", " ")} ${seconds(secs)}`);
    legend.append(item);
  }
  if (!p.phases) legend.append(Object.assign(document.createElement("span"), { className: "muted", textContent: "(phases not timed)" }));
  if (p.overlapping_turns)
    legend.append(Object.assign(document.createElement("span"), { className: "muted", textContent: `(shared with ${p.overlapping_turns} other turn(s))` }));

  const c = p.cache;
  if (!c) $("turn-cache").textContent = "expert cache: every expert resident (or no routed experts)";
  else {
    const tiers = [];
    if (c.vram) tiers.push(`VRAM ${percent(c.vram.hit_rate)}`);
    tiers.push(`RAM ${percent(c.ram.hit_rate)} (${c.ram.hits} hits, ${c.ram.misses} misses)`);
    $("turn-cache").textContent = `hit rate: ${tiers.join(" · ")} · ${gb(c.bytes_read)} read`;
  }
  const drives = Object.entries(p.drives || {});
  $("turn-drives").textContent = drives.length
    ? "drives: " + drives.map(([dir, d]) => `${dir.split("/").filter(Boolean).pop() || dir} ${gb(d.bytes_read)}`).join(" · ")
    : "";
  const pr = p.prediction;
  const guessed = pr && pr.predicted
    ? `prediction: precision ${percent(pr.precision)}, recall ${percent(pr.recall)} (${pr.used} of ${pr.predicted} guesses used)`
    : pr ? "prediction: nothing guessed this turn" : "";
  $("turn-prediction").textContent = [guessed, p.repins ? `${p.repins} re-pins` : ""].filter(Boolean).join(" · ");

  const spark = $("turn-entropy");
  spark.replaceChildren();
  const r = p.routing;
  if (!r || !r.layers.length) {
    $("turn-entropy-note").textContent = "(no routed experts)";
    return;
  }
  const known = r.entropy_bits.filter((h) => h !== null);
  const mean = known.length ? known.reduce((a, b) => a + b, 0) / known.length : null;
  $("turn-entropy-note").textContent =
    `(0 to ${r.max_bits} bits` + (mean === null ? ")" : `; mean ${mean.toFixed(2)})`);
  r.entropy_bits.forEach((h, i) => {
    const b = document.createElement("i");
    if (h === null) b.className = "none";
    b.style.height = (h === null ? 4 : Math.max(4, (100 * h) / (r.max_bits || 1))).toFixed(1) + "%";
    b.title = `layer ${r.layers[i]}: ${h === null ? "not routed" : h.toFixed(2) + " bits"}`;
    spark.append(b);
  });
}

async function refreshProfile() {
  // One request at a time: a turn ending while one is in flight is caught by the next frame.
  if (app.profileFetch) return;
  app.profileFetch = (async () => {
    try {
      const r = await api("/v1/profile?limit=1");
      if (r.ok) {
        const body = await r.json();
        renderProfile(body.data[body.data.length - 1] || null);
      }
    } catch (e) {
      // offline or refused: the next telemetry frame tries again
    } finally {
      app.profileFetch = null;
    }
  })();
}

function renderTelemetry(t) {
  const t0 = performance.now();
  app.telemetry = t;
  const ended = t.scheduler.completed + t.scheduler.cancelled;
  if (ended !== app.turnsSeen) {
    app.turnsSeen = ended; // a turn ended (here or from another client): its profile
    refreshProfile();
  }
  renderTiers(t.tiers);
  renderBrain(t.experts);
  $("tok-s").textContent = t.rates.tok_s.toFixed(1);
  $("read-mb-s").textContent = t.rates.read_mb_s.toFixed(1);
  drawChart($("chart-tok"), t.rates.series, 1, "#5fb3f9");
  drawChart($("chart-read"), t.rates.series, 2, "#f5b041");
  renderQueue(t.scheduler, t.model.max_context);
  $("telemetry").dataset.renderMs = (performance.now() - t0).toFixed(2); // the page's own cost, for tests
}

function setConnection(live) {
  const pill = $("conn");
  pill.textContent = live ? "live" : "offline";
  pill.className = live ? "pill live" : "pill";
}

async function followTelemetry() {
  // One stream for the page's life; reconnects after a dropped connection or a restart.
  for (;;) {
    const controller = new AbortController();
    app.telemetryAbort = controller;
    try {
      const r = await api("/v1/telemetry/stream", { signal: controller.signal });
      if (r.ok) {
        setConnection(true);
        for await (const frame of sseFrames(r)) {
          if (frame.event === "telemetry") renderTelemetry(JSON.parse(frame.data));
        }
      }
    } catch (e) {
      if (e instanceof AuthError) {
        setConnection(false);
        return; // useKey() starts it again
      }
    }
    if (controller.signal.aborted) return; // connect() replaced this stream with a new one
    setConnection(false);
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

// ------------------------------------------------------------------------------------ start
function limitMaxTokens(limit) {
  // The server refuses larger asks (its --max-tokens): offer only what it grants.
  const input = $("max-tokens");
  input.max = String(limit);
  if (Number(input.value) > limit) input.value = String(limit);
}

async function connect() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(await errorMessage(r));
    const models = await r.json();
    app.model = models.data[0].id;
    $("model-name").textContent = app.model;
    const t = await api("/v1/telemetry?experts=false");
    if (t.ok) limitMaxTokens((await t.json()).model.max_tokens);
    setRunning(Boolean(app.running));
    if (app.telemetryAbort) app.telemetryAbort.abort();
    followTelemetry();
  } catch (e) {
    if (!(e instanceof AuthError)) $("model-name").textContent = "cannot reach the server: " + e.message;
  }
}

function start() {
  marked.use({ gfm: true });
  hljs.configure({ ignoreUnescapedHTML: true });
  loadConversations();
  renderAll();
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || app.running || !app.model) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  // Aborting the request closes the connection; the server cancels the generation at its next token.
  $("stop").addEventListener("click", () => app.running && app.running.abort());
  $("regenerate").addEventListener("click", () => !app.running && regenerate());
  $("new-chat").addEventListener("click", () => {
    if (app.running) return;
    newConversation();
    renderAll();
  });
  $("system-prompt").addEventListener("change", () => {
    conversation().system = $("system-prompt").value;
    saveConversations();
  });
  $("key-button").addEventListener("click", () => askKey(""));
  $("key-form").addEventListener("submit", (ev) => {
    if (ev.submitter && ev.submitter.value === "cancel") return;
    useKey($("key-input").value.trim());
  });
  $("brain").addEventListener("mousemove", brainHover);
  connect();
}

document.addEventListener("DOMContentLoaded", start);

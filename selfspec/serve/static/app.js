// The page at / of `selfspec serve`: a chat and a completion box over the server's own OpenAI API,
// each token tinted by where it came from. The stream's trace (stream_options.selfspec_trace, see
// docs/serving.md) gives every chunk's text as tokens with a source and the verify round behind it.
"use strict";

const SOURCES = [
  ["lookup", "lookup", "accepted from a draft"], ["suffix", "suffix", "accepted from a draft"],
  ["head", "head (feature)", "accepted from a draft"], ["layers", "layers (early exit, …)", "accepted from a draft"],
  ["bonus", "bonus", "from the verify"], ["correction", "correction", "from the verify"],
  ["ar", "plain step (no draft)", "from the verify"],
];
const $ = (selector) => document.querySelector(selector);
const state = { key: sessionStorage.getItem("selfspec-key") || "", model: null, mode: "chat", messages: [], busy: false };

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: headers() });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    throw new ApiError(response.status, message);
  }
  return response;
}

// POST a streamed request; onChunk(chunk) per server-sent event until [DONE].
async function stream(path, body, onChunk) {
  const response = await api(path, { method: "POST", body: JSON.stringify(body) });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, chunk.error.message);
        onChunk(chunk);
      }
    }
  }
}

// One generation shown in one pane: its tokens, its rounds and the figures they give.
class Run {
  constructor(pane, label) {
    this.pane = pane;
    this.text = "";
    this.emitted = 0;
    this.rounds = 0; // verify rounds after the prefill
    this.drafted = 0;
    this.accepted = 0;
    this.draftedAt = [];
    this.acceptedAt = [];
    this.counts = {};
    this.usage = null;
    this.started = performance.now();
    this.elapsed = 0;
    pane.querySelector(".name").textContent = label;
    pane.querySelector(".speed").textContent = "…";
    this.out = document.createElement("div");
    this.out.className = "turn reply";
    pane.querySelector(".transcript").append(this.out);
  }

  onChunk(chunk) {
    if (chunk.usage) this.usage = chunk.usage.selfspec;
    const choice = chunk.choices && chunk.choices[0];
    const text = choice ? (choice.delta ? choice.delta.content || "" : choice.text || "") : "";
    this.text += text;
    const trace = chunk.selfspec;
    if (trace) {
      for (const token of trace.tokens) this.addToken(token.text, token.source);
      if (trace.round) this.addRound(trace.round);
    } else if (text) {
      this.addToken(text, null); // a server without the trace: plain text
    }
    this.elapsed = (performance.now() - this.started) / 1000;
    this.pane.querySelector(".speed").textContent = `${this.tokensPerSecond().toFixed(1)} tok/s`;
  }

  addToken(text, source) {
    const span = document.createElement("span");
    span.className = source ? "tok src-" + source : "tok";
    span.textContent = text;
    if (source) {
      span.title = source;
      this.counts[source] = (this.counts[source] || 0) + 1;
    }
    this.out.append(span);
  }

  addRound(round) {
    this.emitted += round.emitted;
    if (round.index === 0) return; // the prefill: no draft, not a verify round
    this.rounds += 1;
    this.drafted += round.drafted;
    this.accepted += round.accepted;
    // Position i was verified if every draft token before it was accepted (as GenerationStats counts).
    for (let i = 0; i < Math.min(round.drafted, round.accepted + 1); i++) this.draftedAt[i] = (this.draftedAt[i] || 0) + 1;
    for (let i = 0; i < round.accepted; i++) this.acceptedAt[i] = (this.acceptedAt[i] || 0) + 1;
  }

  tokensPerSecond() {
    if (this.usage) return this.usage.tokens_per_s; // the server's own: decoding time only
    return this.elapsed > 0 ? this.emitted / this.elapsed : 0;
  }

  alpha() {
    if (this.usage) return this.usage.alpha;
    return this.drafted ? this.accepted / this.drafted : null;
  }

  meanAcceptedLength() {
    if (this.usage) return this.usage.mean_accepted_length;
    return this.rounds ? (this.accepted + this.rounds) / this.rounds : null;
  }
}

function fmt(x, digits = 2) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

function showStats(run) {
  $("#stat-tps").textContent = fmt(run.tokensPerSecond(), 1);
  $("#stat-alpha").textContent = fmt(run.alpha());
  $("#stat-mal").textContent = fmt(run.meanAcceptedLength());
  $("#stat-rounds").textContent = run.usage ? String(run.usage.rounds) : String(run.rounds);
  drawChart(run.draftedAt.map((d, i) => (d ? (run.acceptedAt[i] || 0) / d : 0)));
  showLegend(run.counts);
}

// α by draft position as bars: position i's share of verified drafts accepted there.
function drawChart(alphas) {
  const svg = $("#chart");
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const add = (name, attrs, text) => {
    const el = document.createElementNS(ns, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text !== undefined) el.textContent = text;
    svg.append(el);
  };
  const left = 24, bottom = 92, height = 80, width = 210;
  add("line", { x1: left, y1: bottom, x2: left + width, y2: bottom, stroke: "#c4c9d2" });
  add("text", { x: 0, y: bottom - height + 4 }, "1.0");
  add("text", { x: 0, y: bottom + 3 }, "0");
  if (!alphas.length) {
    add("text", { x: left + 8, y: bottom - 36 }, "no draft yet");
    return;
  }
  const step = width / alphas.length;
  const barWidth = Math.min(28, step * 0.7);
  alphas.forEach((a, i) => {
    const x = left + i * step + (step - barWidth) / 2, h = Math.max(1, a * height);
    add("rect", { class: "bar", x, y: bottom - h, width: barWidth, height: h, "data-alpha": a.toFixed(3) });
    add("text", { x: x + barWidth / 2 - 3, y: bottom + 12 }, String(i + 1));
    if (alphas.length <= 10) add("text", { x: x, y: bottom - h - 3 }, a.toFixed(2));
  });
}

function showLegend(counts = {}) {
  const legend = $("#legend");
  legend.replaceChildren();
  let group = null;
  for (const [source, label, kind] of SOURCES) {
    if (kind !== group) {
      group = kind;
      const li = document.createElement("li");
      li.className = "group";
      li.textContent = kind;
      legend.append(li);
    }
    const li = document.createElement("li");
    li.className = "legend-" + source;
    li.innerHTML = `<span class="swatch src-${source}"></span><span class="label"></span><span class="count"></span>`;
    li.querySelector(".label").textContent = label;
    li.querySelector(".count").textContent = counts[source] ? String(counts[source]) : "";
    legend.append(li);
  }
}

function showError(message) {
  const box = $("#error");
  box.hidden = !message;
  box.textContent = message || "";
}

function askForKey(note) {
  $("#key").hidden = false;
  $("#key-note").textContent = note || "";
  $("#key-input").focus();
}

async function connect() {
  try {
    const models = await (await api("/v1/models")).json();
    state.model = models.data[0].id;
    $("#model").textContent = state.model;
    $("#key").hidden = true;
    return true;
  } catch (error) {
    if (error.status === 401) {
      $("#model").textContent = "API key needed";
      askForKey(state.key ? "that key was refused" : "");
    } else {
      $("#model").textContent = "not connected";
      showError(error.message);
    }
    return false;
  }
}

function request(method, messages, prompt) {
  const body = {
    model: state.model,
    max_tokens: Number($("#max-tokens").value) || 128,
    temperature: Number($("#temperature").value) || 0,
    stream: true,
    stream_options: { include_usage: true, selfspec_trace: true },
  };
  if (method) body.selfspec = { method };
  if (state.mode === "chat") body.messages = messages;
  else body.prompt = prompt;
  return body;
}

// Generate into one pane and return its Run; the figures follow the run that `live` says.
async function generate(pane, method, label, messages, prompt, live) {
  const run = new Run(pane, label);
  const path = state.mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
  await stream(path, request(method, messages, prompt), (chunk) => {
    run.onChunk(chunk);
    if (live) showStats(run);
  });
  if (run.usage && !method) pane.querySelector(".name").textContent = run.usage.method;
  pane.querySelector(".speed").textContent = `${fmt(run.tokensPerSecond(), 1)} tok/s`;
  if (live) showStats(run);
  return run;
}

function addTurn(pane, className, text) {
  const div = document.createElement("div");
  div.className = "turn " + className;
  div.textContent = text;
  pane.querySelector(".transcript").append(div);
}

async function send(event) {
  event.preventDefault();
  const prompt = $("#prompt").value;
  if (state.busy || !prompt.trim()) return;
  if (!state.model && !(await connect())) return;
  const compare = $("#compare").checked;
  const method = $("#method").value;
  const spec = $("#pane-spec"), ar = $("#pane-ar");
  ar.hidden = !compare;
  $("#panes").classList.toggle("two", compare);
  $("#verdict").hidden = true;
  showError("");
  state.busy = true;
  $("#send").disabled = true;
  const messages = [...state.messages, { role: "user", content: prompt }];
  const panes = compare ? [spec, ar] : [spec];
  for (const pane of panes) {
    if (state.mode === "completion") pane.querySelector(".transcript").replaceChildren();
    addTurn(pane, state.mode === "chat" ? "user" : "prompt", prompt);
  }
  try {
    // One after the other, not together: each speed is then that method's alone.
    const main = await generate(spec, method, method || "server default", messages, prompt, true);
    if (compare) {
      const plain = await generate(ar, "ar", "ar", messages, prompt, false);
      const verdict = $("#verdict");
      const same = main.text === plain.text;
      const speedup = plain.tokensPerSecond() ? main.tokensPerSecond() / plain.tokensPerSecond() : 0;
      verdict.className = same ? "same" : "differ";
      verdict.textContent = (same ? "✓ identical text" : "✗ the texts differ") + ` · ${speedup.toFixed(2)}× ar`;
      verdict.hidden = false;
    }
    if (state.mode === "chat") state.messages = [...messages, { role: "assistant", content: main.text }];
    $("#prompt").value = "";
  } catch (error) {
    if (error.status === 401) askForKey("the server refused the key");
    showError(error.message);
  } finally {
    state.busy = false;
    $("#send").disabled = false;
  }
}

function setMode(mode) {
  state.mode = mode;
  for (const b of document.querySelectorAll("#modes button")) b.classList.toggle("on", b.dataset.mode === mode);
  clear();
}

function clear() {
  state.messages = [];
  for (const t of document.querySelectorAll(".transcript")) t.replaceChildren();
  $("#verdict").hidden = true;
  showError("");
}

$("#ask").addEventListener("submit", send);
$("#prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
});
$("#clear").addEventListener("click", clear);
for (const b of document.querySelectorAll("#modes button")) b.addEventListener("click", () => setMode(b.dataset.mode));
$("#key").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("#key-input").value.trim();
  sessionStorage.setItem("selfspec-key", state.key);
  connect();
});
showLegend();
drawChart([]);
connect();

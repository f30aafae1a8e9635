// glassgpt's page: asks the server for the trace of a prompt and draws it.
// No framework and no build step: plain DOM, one canvas for the attention heatmaps.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  model: null,     // GET /api/model
  trace: null,     // the last POST /api/explain answer
  ids: null,       // token ids of the trace on screen; the textarea is re-encoded only once edited
  edited: false,
  chosen: null,    // the next-token id that Append adds (the greedy one until a bar is clicked)
  layer: 0,
  head: 0,
  snapshots: null, // GET /api/snapshots, on a server started on a run directory
  inflight: null,  // AbortController of the request in flight
  busy: false,
  why: null,       // the last attribution (POST /api/why, or the trace's `why`)
  source: null,    // the prompt position whose share the why grid shows, or null for the heads' own terms
  rng: seeded(123), // sampling draws from a seeded generator, so a page reloaded with the same clicks draws the same tokens
};

// mulberry32: a small seeded generator of uniform numbers in [0, 1).
function seeded(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// --- formatting -----------------------------------------------------------------

const fmt = (n) => Number(n).toLocaleString("en-US");
const shapeText = (s) => "[" + s.join(", ") + "]";
// 13.8%, 0.57%, 0.021%: two significant digits below 1%, so tiny probabilities stay readable.
const pct = (p) => (p >= 0.01 ? (100 * p).toFixed(p >= 0.1 ? 1 : 2) : p >= 1e-6 ? (100 * p).toPrecision(2) : (100 * p).toExponential(1)) + "%";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k === "style") for (const [prop, val] of Object.entries(v)) node.style.setProperty(prop, val);  // CSSOM: allowed by the CSP
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false) node.append(c);
  return node;
}

// A token's text with its whitespace made visible: "·" for a space, "↵" for a newline.
function tokenNode(text) {
  const span = el("span", { class: "tok" });
  if (text === "") { span.append(el("span", { class: "ws", text: "∅" })); return span; }
  for (const part of text.split(/( |\n|\t)/)) {
    if (part === " ") span.append(el("span", { class: "ws", text: "·" }));
    else if (part === "\n") span.append(el("span", { class: "ws", text: "↵" }));
    else if (part === "\t") span.append(el("span", { class: "ws", text: "→" }));
    else if (part) span.append(part);
  }
  return span;
}

// --- talking to the server -------------------------------------------------------

// One request at a time: a new one aborts the one in flight, and the server then drops its work.
// With `onProgress`, the answer is streamed (NDJSON): progress lines, then {"trace"} or {"error"}.
async function api(path, body, onProgress) {
  if (state.inflight) state.inflight.abort();
  const ctrl = new AbortController();
  state.inflight = ctrl;
  setBusy(true);
  const started = performance.now();
  try {
    const headers = body === undefined ? {} : { "Content-Type": "application/json" };
    if (onProgress) headers.Accept = "application/x-ndjson";
    const res = await fetch(path, {
      method: body === undefined ? "GET" : "POST",
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: ctrl.signal,
    });
    let data;
    if (res.ok && onProgress) {
      let last = null;
      await readLines(res, (line) => { if (line.progress) onProgress(line.progress); else last = line; });
      if (!last) throw new Error("the server's answer ended early: is glassgpt serve still running?");
      if (last.error) throw new Error(`${last.status}: ${last.error}`);
      data = last.trace;
    } else {
      const text = await res.text();
      try { data = JSON.parse(text); } catch { data = { error: text || res.statusText }; }
      if (!res.ok) throw new Error(`${res.status}: ${data.error || data.detail || res.statusText}`);
    }
    showError(null);
    return { data, ms: performance.now() - started };
  } catch (err) {
    if (err.name === "AbortError") return null;
    showError(err.message.startsWith("Failed to fetch") ? "the server does not answer: is glassgpt serve still running?" : err.message);
    return null;
  } finally {
    if (state.inflight === ctrl) { state.inflight = null; setBusy(false); }
  }
}

async function readLines(res, onLine) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + 1);
      if (line.trim()) onLine(JSON.parse(line));
    }
  }
  if (buffer.trim()) onLine(JSON.parse(buffer));
}

// The text to trace: the token ids on screen, or the prompt as edited since.
function promptPart() {
  return state.ids && !state.edited ? { ids: state.ids } : { prompt: $("prompt").value };
}

function requestBody(extra = {}) {
  const body = { ...optionValues(), ...extra };
  if (!("ids" in body) && !("prompt" in body)) Object.assign(body, promptPart());
  return body;
}

const STEP_NAMES = { trf_blocks: "block", logit_lens: "logit lens after block" };

function showProgress(p) {
  const [kind, n] = p.step.split(".");
  $("status").textContent = `tracing: ${STEP_NAMES[kind] ? `${STEP_NAMES[kind]} ${n}` : p.step.replace("_", " ")} ` +
    `(step ${p.done} of ${p.total})`;
  const bar = $("progress");
  bar.hidden = false;
  bar.max = p.total;
  bar.value = p.done;
}

async function explain(extra = {}, path = "/api/explain") {
  const focus = focusKey(document.activeElement);
  $("status").textContent = "tracing…";  // the last result's line would read as this one's
  const result = await api(path, requestBody(extra), showProgress);
  if (!result && state.inflight) return;  // a newer request replaced this one: it will finish the job
  $("progress").hidden = true;
  if (result) {
    state.trace = result.data;
    state.ids = result.data.tokens.map((t) => t.id);
    state.edited = false;
    state.chosen = result.data.next_token.id;
    $("prompt").value = result.data.prompt;
    $("status").textContent = `traced ${fmt(state.ids.length)} token${state.ids.length === 1 ? "" : "s"} in ${Math.round(result.ms)} ms`;
    state.why = result.data.why || null;
    state.source = null;
    render();
  } else {
    $("status").textContent = "";  // the error box says what went wrong
  }
  restoreFocus(focus);
}

function setBusy(busy) {
  state.busy = busy;
  document.body.classList.toggle("busy", busy);
  updateButtons();
}

function updateButtons() {
  const busy = state.busy;
  $("run").disabled = busy;
  const lm = state.model && state.model.kind !== "classifier";
  for (const id of ["append", "sample"]) $(id).disabled = busy || !state.trace || !lm;
  // Undo removes the last token of the trace on screen; after an edit, trace the edit first.
  $("undo").disabled = busy || state.edited || !state.ids || state.ids.length < 2;
}

// --- keyboard focus ------------------------------------------------------------------
// Controls are disabled while a trace runs and redrawn after it, which drops the focus on
// <body>. Each action gives it back to the control that was used (or to its redrawn twin).

function focusKey(node) {
  if (!node || node === document.body) return null;
  return node.dataset.focus ? `[data-focus="${node.dataset.focus}"]` : node.id ? `#${node.id}` : null;
}

function restoreFocus(key) {
  const node = key && document.querySelector(key);
  if (node && !node.disabled && document.activeElement !== node) node.focus({ preventScroll: true });
}

function keepingFocus(action) {
  return (...args) => {
    const key = focusKey(document.activeElement);
    action(...args);
    restoreFocus(key);
  };
}

function showError(message) {
  const box = $("error");
  box.hidden = !message;
  box.textContent = message ? "Error " + message : "";
}

// --- the model header -------------------------------------------------------------

function renderModel(m) {
  const c = m.config;
  const out = c.num_classes ? `${fmt(c.num_classes)} classes` : fmt(c.vocab_size);
  $("tagline").textContent = c.num_classes
    ? `where ${fmt(c.vocab_size)} token ids become ${fmt(c.emb_dim)} numbers, and then ${out}`
    : `where ${fmt(c.vocab_size)} becomes ${fmt(c.emb_dim)} and back`;
  $("model-info").replaceChildren(
    el("strong", { text: m.name }), ` · ${m.kind} · ${fmt(m.params.total)} parameters · `,
    c.n_kv_groups ? `${c.n_layers} blocks × ${c.n_heads} query heads sharing ${c.n_kv_groups} key/value groups · `
      : `${c.n_layers} blocks × ${c.n_heads} heads · `, `d = ${fmt(c.emb_dim)} · V = ${fmt(c.vocab_size)} · `,
    `context ${fmt(c.context_length)} · ${m.dtype} on ${m.device}`);
  $("model-layout").textContent = m.layout;
  $("model-trained").hidden = !m.trained;  // which parts its training run trained, as its checkpoint records
  if (m.trained) $("model-trained").textContent = `Its training run (marked on each part below): ${m.trained.line}.`;
  const banner = $("random-banner");
  banner.hidden = !m.random_weights;
  if (m.random_weights) {
    banner.replaceChildren(
      el("strong", { text: "Random weights. " }),
      `${m.name} is a preset initialised at random, not trained: every shape below is real, but the `,
      "probabilities and the generated text are noise. For GPT-2's trained weights run ",
      el("code", { text: "glassgpt serve --model openai-community/gpt2" }), ".",
      m.init ? el("span", { class: "init", text: ` Initialisation: ${m.init}.` }) : "");  // replaceChildren writes null as "null"
  }
  $("prompt").setAttribute("aria-describedby", "status");
  // A classifier's output is a class, not a token: there is nothing to append.
  $("append").hidden = $("sample").hidden = m.kind === "classifier";
}

// --- tokens -----------------------------------------------------------------------

function renderTokens(tr) {
  $("token-count").textContent = `${tr.tokens.length} token${tr.tokens.length === 1 ? "" : "s"}`;
  $("token-count").dataset.count = tr.tokens.length;
  $("tokens").replaceChildren(...tr.tokens.map((t, i) =>
    el("span", { class: "chip", title: `position ${i}, id ${t.id}` }, tokenNode(t.text), el("span", { class: "id", text: t.id }))));
}

// --- the flow ---------------------------------------------------------------------

const TRANSITION_NAMES = { "vocab->hidden": "vocab → hidden", "hidden->vocab": "hidden → vocab", "hidden->classes": "hidden → classes" };

function renderFlow(tr) {
  const c = tr.model.config;
  const stages = tr.stages;
  const byName = Object.fromEntries(stages.map((s) => [s.name, s]));
  const maxWidth = Math.max(...stages.map((s) => s.shape[s.shape.length - 1]));
  const tokEmb = byName["tok_emb"], outHead = byName["out_head"];
  const blocks = stages.filter((s) => /^trf_blocks\.\d+$/.test(s.name));

  $("summary").replaceChildren(
    summaryStep("ids", byName["tokens"].shape), arrow("tok_emb", "in"),
    summaryStep("hidden", tokEmb.shape), arrow(`${blocks.length} × trf_blocks`, ""),
    summaryStep("hidden", byName["final_norm"].shape), arrow("out_head", "out"),
    summaryStep(c.num_classes ? "class scores" : "logits", outHead.shape));

  const items = [];
  const parts = (tr.model.trained || {}).parts || {};  // each part's state in its training run, if recorded
  let group = [];
  const flush = () => {
    if (!group.length) return;
    items.push(markTrained(blockGroup(group), parts[group[0].name]));
    group = [];
  };
  for (const s of stages) {
    if (s.parent) continue;  // drawn inside their block
    if (/^trf_blocks\.\d+$/.test(s.name)) {
      const inner = stages.filter((x) => x.parent === s.name);
      if (inner.length) { flush(); items.push(markTrained(openedBlock(s, inner, maxWidth), parts[s.name])); }
      else {
        if (group.length && parts[group[0].name] !== parts[s.name]) flush();  // one group per state
        group.push(s);
      }
      continue;
    }
    flush();
    items.push(markTrained(s.transition ? transitionStage(s, tr, maxWidth) : stageRow(s, maxWidth), parts[s.name]));
  }
  flush();
  $("flow").replaceChildren(...items);
}

const TRAINED_LABELS = { trained: "trained", frozen: "frozen", lora: "trained through LoRA", "partly trained": "partly trained" };

function markTrained(row, state) {
  if (!state) return row;
  row.classList.add(`part-${state.replace(" ", "-")}`);
  row.dataset.trained = state;
  row.querySelector(".name").append(el("span", { class: "trained-mark", text: TRAINED_LABELS[state] }));
  return row;
}

function summaryStep(label, shape) {
  return el("span", { class: "step" }, el("span", { class: "shape", text: shapeText(shape) }), el("span", { class: "step-label", text: label }));
}

function arrow(label, kind) {
  return el("span", { class: `arrow ${kind}` }, el("span", { text: label }), el("span", { class: "arrow-head", text: "→" }));
}

function widthBar(s, maxWidth) {
  const w = s.shape[s.shape.length - 1];
  const frac = Math.log(Math.max(w, 2)) / Math.log(Math.max(maxWidth, 2));
  return el("span", { class: "width", title: `last dimension ${fmt(w)} (bar length on a log scale)` },
    el("span", { class: "width-fill", style: { width: `${(100 * frac).toFixed(1)}%` } }));
}

function shapes(s) {
  return el("span", { class: "shapes" },
    s.input_shape ? el("span", { class: "shape in", text: shapeText(s.input_shape) + " →" }) : null,
    el("span", { class: "shape", text: shapeText(s.shape) }));
}

function stageRow(s, maxWidth) {
  return el("li", { class: "stage", "data-stage": s.name },
    el("div", { class: "stage-head" },
      el("span", { class: "name", text: s.name }),
      el("span", { class: "module", text: s.module }),
      shapes(s),
      widthBar(s, maxWidth)),
    el("div", { class: "stage-meta" },
      s.note ? el("span", { class: "note", text: s.note }) : null,
      s.weight_shape ? el("span", { class: "weight-inline", text: `weight ${shapeText(s.weight_shape)} · ${fmt(s.params)} params` }) : null,
      el("span", { class: "dtype", text: s.dtype })));
}

function transitionStage(s, tr, maxWidth) {
  const into = s.transition === "vocab->hidden";
  const from = into ? tr.model.config.vocab_size : s.input_shape[s.input_shape.length - 1];
  const to = s.shape[s.shape.length - 1];
  const weightName = `${s.name}.weight`;
  const weight = el("div", { class: "weight" },
    el("span", { class: "weight-name", text: weightName }),
    el("span", { class: "shape", text: shapeText(s.weight_shape) }));
  if (s.shared_with) {
    weight.append(
      el("span", { class: "tied", text: `= ${s.shared_with}` }),
      el("span", { class: "weight-note", text: `tied: the very same tensor, so its ${fmt(s.params)} numbers are stored and counted once` }));
  } else {
    weight.append(el("span", { class: "weight-note", text: `${fmt(s.params)} parameters` + (into ? "" : tr.params.tied ? "" : " · its own tensor (not tied to tok_emb)") }));
  }
  const row = el("li", { class: `stage transition ${into ? "in" : "out"}`, "data-stage": s.name },
    el("div", { class: "transition-title" },
      el("span", { class: "badge", text: TRANSITION_NAMES[s.transition] }),
      el("span", { class: "big", text: `${fmt(from)} → ${fmt(to)}` })),
    el("div", { class: "stage-head" },
      el("span", { class: "name", text: s.name }),
      el("span", { class: "module", text: s.module }),
      shapes(s),
      widthBar(s, maxWidth)),
    el("p", { class: "note", text: s.note }),
    weight);
  if (into && tr.embedding_check) row.append(embeddingCheck(tr.embedding_check));
  return row;
}

function embeddingCheck(e) {
  if (e.omitted) return el("div", { class: "check", text: `The embedding check was left out: ${e.omitted}.` });
  const ok = e.equal_one_hot_matmul && e.equal_linear;
  return el("div", { class: `check ${ok ? "ok" : "bad"}` },
    el("strong", { text: ok ? "✓ tok_emb(ids) == one_hot(ids) @ W, exactly" : "✗ the lookup and the matmul differ" }),
    ` (max difference ${e.max_abs_diff}); so it is ${e.linear}. `,
    e.lookup_ms === undefined ? "" : `The lookup took ${e.lookup_ms.toFixed(3)} ms, the one-hot matmul ${e.matmul_ms.toFixed(1)} ms. `,
    `The matmul builds ${fmt(e.one_hot_bytes)} bytes of one-hot rows and does ${fmt(e.matmul_flops)} FLOPs; `,
    `the lookup reads ${fmt(e.lookup_bytes)} bytes of rows.`);
}

function openedBlock(s, inner, maxWidth) {
  return el("li", { class: "stage block opened", "data-stage": s.name },
    el("div", { class: "stage-head" },
      el("span", { class: "name", text: s.name }),
      el("span", { class: "module", text: `${s.module} · ${fmt(s.params)} params` }),
      shapes(s),
      widthBar(s, maxWidth)),
    el("p", { class: "note", text: s.note }),
    el("ol", { class: "inner" }, inner.map((x) => stageRow({ ...x, name: x.name.slice(s.name.length + 1) }, maxWidth))));
}

function blockGroup(group) {
  const first = group[0], last = group[group.length - 1];
  const names = group.length === 1 ? first.name : `${first.name} … ${last.name.split(".").pop()}`;
  const s = { ...first, name: names, module: `${group.length} × TransformerBlock · ${fmt(first.params)} params each` };
  const row = stageRow(s, 1);
  row.classList.add("block");
  row.querySelector(".width").replaceChildren();
  return row;
}

// --- next token ---------------------------------------------------------------------

function renderNext(tr) {
  const nt = tr.next_token;
  const isClass = nt.kind === "class";
  const top = nt.top;
  const kept = top.reduce((a, t) => a + t.prob, 0);
  $("next-caption").textContent = isClass
    ? `softmax over ${fmt(tr.model.config.num_classes)} classes at temperature ${nt.temperature}`
    : `softmax(logits / ${Number(nt.temperature).toFixed(2)}) over ${fmt(tr.model.config.vocab_size)} tokens; the top ${top.length} hold ${pct(kept)}. ` +
      "Right column: the same k renormalised, as top-k sampling draws them.";
  const header = el("div", { class: "bar-row bar-header", "aria-hidden": "true" },
    el("span", { class: "rank", text: "" }), el("span", { class: "bar-token", text: isClass ? "class" : "token" }),
    el("span", { class: "bar-id", text: isClass ? "" : "id" }), el("span", { class: "bar-track-label", text: "" }),
    el("span", { class: "bar-prob", text: "p" }), el("span", { class: "bar-renorm", text: isClass ? "" : "in top-k" }));
  $("bars").replaceChildren(header, ...top.map((t, rank) => {
    const row = el("button", {
      type: "button", class: "bar-row" + (t.id === state.chosen ? " chosen" : ""), role: "option",
      "aria-selected": String(t.id === state.chosen), "data-id": t.id, "data-focus": `bar-${t.id}`,
      title: `id ${t.id}: click to choose it`,
      onclick: keepingFocus(() => { if (!isClass) { state.chosen = t.id; renderNext(tr); } }),
    },
      el("span", { class: "rank", text: rank + 1 }),
      el("span", { class: "bar-token" }, tokenNode(t.text)),
      el("span", { class: "bar-id", text: isClass ? "" : t.id }),
      // The track is probability 0..1, as in the SVG: random weights' 0.0002 stay a sliver.
      el("span", { class: "bar-track", title: "the whole track is probability 1" },
        el("span", { class: "bar-fill", style: { width: `${(100 * t.prob).toFixed(2)}%` } })),
      el("span", { class: "bar-prob", text: pct(t.prob) }),
      el("span", { class: "bar-renorm", text: isClass ? "" : pct(t.prob / kept) }));
    return row;
  }));
  const chosen = top.find((t) => t.id === state.chosen) || top[0];
  $("prediction").replaceChildren(el("span", { class: "muted", text: isClass ? "predicted class: " : "next token: " }),
    el("strong", {}, tokenNode(top[0].text)), ` ${pct(top[0].prob)}` + (top.length > 1 ? `, then ` : ""),
    ...top.slice(1, 3).flatMap((t, k) => [k ? ", " : "", tokenNode(t.text), ` ${pct(t.prob)}`]));
  const label = chosen.text.replace(/\n/g, "↵");
  $("append").textContent = isClass ? "Append" : `Append “${label}”`;
  $("text-after").replaceChildren(
    isClass ? el("span", { text: `predicted class: ${nt.text} (${pct(nt.prob)})` })
      : el("span", {}, el("span", { class: "muted", text: tr.prompt }), el("mark", { text: chosen.text })));
}

function sampleTopK(tr) {
  const top = tr.next_token.top;
  const total = top.reduce((a, t) => a + t.prob, 0);
  let r = state.rng() * total;
  for (const t of top) { r -= t.prob; if (r <= 0) return t.id; }
  return top[top.length - 1].id;
}

// --- the head as a dot product --------------------------------------------------------

function renderHead(tr) {
  const hd = tr.head;
  if (!hd) {
    $("head-caption").textContent = "";
    $("head").replaceChildren();
    $("head-notes").replaceChildren();
    return;
  }
  const isClass = hd.kind === "classes";
  const untied = hd.rows.length && hd.rows[0].cos_emb_head !== undefined;
  const bias = hd.has_bias ? " + bias[id]" : "";
  $("head-caption").textContent = `logit[id] = h · W[id]${bias}: h is final_norm's ${tr.family ? "(RMSNorm) " : ""}output at the last position ` +
    `(|h| = ${hd.h_norm.toFixed(2)}), W is out_head.weight, one row per ${isClass ? "class" : "token"}. ` +
    "A dot product is |h| · |W[id]| · cos(h, W[id]).";
  const cols = ["", isClass ? "class" : "token", "logit", "= h · W[id]", "|W[id]|", "cos(h, W[id])"];
  if (hd.has_bias) cols.splice(4, 0, "+ bias");
  if (untied) cols.push("cos(tok_emb[id], W[id])");
  const rows = hd.rows.map((r, k) => {
    const cells = [k + 1, null, r.logit.toFixed(3), r.dot.toFixed(3), r.w_norm.toFixed(3), r.cos.toFixed(4)];
    if (hd.has_bias) cells.splice(4, 0, r.bias.toFixed(3));
    if (untied) cells.push(r.cos_emb_head.toFixed(4));
    return el("tr", { "data-id": r.id }, ...cells.map((v, i) => i === 1
      ? el("td", {}, tokenNode(r.text)) : el("td", { class: i ? "num" : "rank", text: v })));
  });
  $("head").replaceChildren(el("table", {}, el("thead", {}, el("tr", {}, ...cols.map((c) => el("th", { text: c })))),
    el("tbody", {}, rows)));
  const notes = [`Checked: every logit equals out_head's output (max |diff| ${hd.max_abs_diff.toExponential(1)}).`];
  notes.push(hd.tying_note.charAt(0).toUpperCase() + hd.tying_note.slice(1) + ".");  // the server's one sentence
  notes.push("Nearest to h by cosine: " + hd.nearest.map((t) => `${JSON.stringify(t.text)} ${t.cos.toFixed(3)} ` +
    `(logit rank ${fmt(t.logit_rank)})`).join(", ") + ". Another order than the logits': a longer row wins the " +
    "logits with a smaller cosine.");
  if (hd.prompt_ranks) {
    notes.push("The prompt's own tokens rank " + hd.prompt_ranks.slice(0, 8).map((t) =>
      `${JSON.stringify(t.text)} ${fmt(t.rank)}`).join(", ") + ".");
  }
  $("head-notes").replaceChildren(...notes.map((n) => el("span", { class: "head-note", text: n + " " })));
}

function renderNotes(tr) {
  const notes = tr.notes || [];
  $("notes").hidden = !notes.length;
  $("notes").replaceChildren(...notes.map((n) => el("p", { text: `Note: ${n}.` })));
}

// --- watch it learn: the run's evaluations ------------------------------------------------

function renderSnapshots(data) {
  state.snapshots = data;
  $("learn-card").hidden = false;
  $("learn-run").textContent = `${data.run} · ${fmt(data.evaluations.length)} evaluations`;
  const slider = $("snapshot");
  slider.max = Math.max(0, data.evaluations.length - 1);
  slider.value = slider.max;
  slider.disabled = data.evaluations.length < 2;
  renderSnapshot(Number(slider.value));
}

function renderSnapshot(k) {
  const data = state.snapshots;
  const view = $("snapshot-view");
  if (!data.evaluations.length) { view.replaceChildren(el("p", { class: "caption", text: data.note })); return; }
  const e = data.evaluations[k], snap = e.snapshot;
  $("snapshot-value").textContent = `${k + 1} of ${data.evaluations.length}`;
  const losses = el("p", { class: "snap-losses", "data-step": e.step },
    el("strong", { text: `step ${fmt(e.step)}` }), ` · ${fmt(e.tokens)} tokens seen`,
    e.train_loss !== null && e.train_loss !== undefined ? ` · train loss ${e.train_loss.toFixed(3)}` : "",
    e.val_loss !== null && e.val_loss !== undefined ? ` · val loss ${e.val_loss.toFixed(3)}` : "");
  if (!snap) {
    view.replaceChildren(losses, el("p", { class: "caption", text: data.note || "this evaluation recorded no snapshot" }));
    return;
  }
  const bars = el("div", { class: "bars snap-bars" }, ...snap.top.map((t, rank) => el("div", { class: "bar-row" },
    el("span", { class: "rank", text: rank + 1 }), el("span", { class: "bar-token" }, tokenNode(t.text)),
    el("span", { class: "bar-id", text: t.id }),
    el("span", { class: "bar-track" }, el("span", { class: "bar-fill", style: { width: `${(100 * t.prob).toFixed(2)}%` } })),
    el("span", { class: "bar-prob", text: pct(t.prob) }))));
  const lens = el("table", { class: "snap-lens" },
    el("thead", {}, el("tr", {}, el("th", { text: "after" }), el("th", { text: "top token at the last position" }),
      el("th", { text: "p" }))),
    el("tbody", {}, snap.lens.map((l) => el("tr", {}, el("th", { class: "layer", text: `trf_blocks.${l.layer}` }),
      el("td", {}, tokenNode(l.text)), el("td", { class: "num", text: pct(l.prob) })))));
  view.replaceChildren(losses,
    el("p", { class: "caption" }, "prompt ", el("code", { text: snap.prompt }), " → its top 5 next tokens:"),
    bars, el("p", { class: "snap-greedy" }, el("span", { class: "muted", text: "greedy sample: " }),
      el("span", { class: "mono", text: snap.greedy })), lens);
}

// --- attention ----------------------------------------------------------------------

function renderAttention(tr) {
  const att = tr.attention;
  const c = tr.model.config;
  const canvas = $("heatmap");
  const shown = Boolean(att && !att.omitted);
  canvas.hidden = $("heat-hover").hidden = !shown;
  $("att-layer").disabled = $("att-head").disabled = !shown;
  if (!shown) {
    $("attention-caption").textContent = att ? att.omitted : "not traced";
    $("head-thumbs").replaceChildren();
    return;
  }
  state.layer = Math.min(state.layer, c.n_layers - 1);
  state.head = Math.min(state.head, c.n_heads - 1);
  $("att-layer").replaceChildren(...att.layers.map((_, i) => el("option", { value: i, text: `trf_blocks.${i}`, selected: i === state.layer })));
  // A Qwen3/Llama model's query heads each read one key/value group (`groups`): the labels say which.
  const kv = (h) => (att.groups ? ` · kv${att.groups[h]}` : "");
  $("att-head").replaceChildren(...att.layers[0].map((_, i) => el("option", { value: i, text: `head ${i}${kv(i)}`, selected: i === state.head })));
  $("attention-caption").textContent = `trf_blocks.${state.layer}, ${att.groups ? "query " : ""}head ${state.head}` +
    (att.groups ? ` (it reads key/value group ${att.groups[state.head]}, shared with ` +
      `${att.groups.filter((g) => g === att.groups[state.head]).length - 1} other query heads; its queries and keys RoPE-rotated)` : "") +
    `: row = the token attending (query), column = the token attended to (key); each row sums to 1, the causal mask hides the future. ` +
    `All weights: ${shapeText(att.shape)}.`;
  drawHeatmap(canvas, att.layers[state.layer][state.head], att.tokens, true);
  $("head-thumbs").replaceChildren(...att.layers[state.layer].map((w, h) => {
    const thumb = el("canvas", { width: 56, height: 56, class: "thumb" + (h === state.head ? " active" : ""),
      title: att.groups ? `query head ${h}, key/value group ${att.groups[h]}` : `head ${h}` });
    drawHeatmap(thumb, w, null, false);
    const box = el("button", { type: "button", class: "thumb-box", "data-focus": `thumb-${h}`,
      onclick: keepingFocus(() => { state.head = h; renderAttention(tr); }) },
      thumb, el("span", { text: `h${h}${kv(h)}` }));
    return box;
  }));
}

function heatColor(v) {
  // white -> blue, the colour of the vocab -> hidden side of the flow
  const a = Math.sqrt(Math.max(0, Math.min(1, v)));
  const r = Math.round(255 + (31 - 255) * a), g = Math.round(255 + (111 - 255) * a), b = Math.round(255 + (209 - 255) * a);
  return `rgb(${r},${g},${b})`;
}

function drawHeatmap(canvas, weights, tokens, labelled) {
  const t = weights.length;
  const dpr = window.devicePixelRatio || 1;
  const cssW = labelled ? canvas.parentElement.clientWidth - 4 : 56;
  const ctx = canvas.getContext("2d");
  ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
  const clip = (s) => (s.length > 10 ? s.slice(0, 9) + "…" : s).replace(/ /g, "·").replace(/\n/g, "↵");
  const pad = labelled ? Math.min(90, 12 + Math.max(...tokens.map((s) => ctx.measureText(clip(s)).width))) : 0;
  const cell = Math.max(1, Math.floor((Math.min(cssW, 460) - pad) / t));
  const size = pad + cell * t;
  canvas.style.width = size + "px";
  canvas.style.height = size + "px";
  canvas.width = Math.round(size * dpr);
  canvas.height = Math.round(size * dpr);
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, size, size);
  for (let i = 0; i < t; i++) {
    for (let j = 0; j < t; j++) {
      ctx.fillStyle = j > i ? "#f1f1ef" : heatColor(weights[i][j]);
      ctx.fillRect(pad + j * cell, pad + i * cell, cell, cell);
    }
  }
  if (!labelled) return;
  ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
  ctx.fillStyle = "#374151";
  const every = Math.ceil(12 / cell);  // skip labels when cells are narrower than the text
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  for (let i = 0; i < t; i += every) ctx.fillText(clip(tokens[i]), pad - 6, pad + (i + 0.5) * cell);
  ctx.save();
  ctx.textAlign = "left";
  for (let j = 0; j < t; j += every) {
    ctx.save();
    ctx.translate(pad + (j + 0.5) * cell, pad - 6);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(clip(tokens[j]), 0, 0);
    ctx.restore();
  }
  ctx.restore();
  if (cell >= 28) {
    ctx.textAlign = "center";
    for (let i = 0; i < t; i++) for (let j = 0; j <= i; j++) {
      ctx.fillStyle = weights[i][j] > 0.45 ? "#ffffff" : "#1f2937";
      ctx.fillText(weights[i][j].toFixed(2), pad + (j + 0.5) * cell, pad + (i + 0.5) * cell);
    }
  }
  canvas.onmousemove = (ev) => {
    const rect = canvas.getBoundingClientRect();
    const j = Math.floor((ev.clientX - rect.left - pad) / cell), i = Math.floor((ev.clientY - rect.top - pad) / cell);
    $("heat-hover").textContent = i >= 0 && j >= 0 && i < t && j < t
      ? `“${tokens[i]}” attends to “${tokens[j]}”: ${j > i ? "masked (the future)" : weights[i][j].toFixed(4)}` : "\u00a0";
  };
}

// --- logit lens ---------------------------------------------------------------------

function renderLens(tr) {
  const lens = tr.logit_lens;
  const labels = tr.next_token.kind === "class" ? tr.model.labels : null;
  const label = (p) => (labels && p.id < labels.length ? labels[p.id] : p.text);
  if (!lens) { $("lens").replaceChildren(el("p", { class: "caption", text: "not traced" })); return; }
  const head = el("tr", {}, el("th", { text: "after" }),
    ...tr.tokens.map((t, i) => el("th", { class: i === tr.tokens.length - 1 ? "last" : "" }, tokenNode(t.text))));
  const rows = lens.layers.map((layer) => el("tr", {},
    el("th", { class: "layer", text: `trf_blocks.${layer.layer}` }),
    ...layer.top.map((p, i) => {
      const alpha = Math.min(1, 0.08 + 0.92 * Math.sqrt(p.prob));
      return el("td", {
        class: i === layer.top.length - 1 ? "last" : "", title: `id ${p.id}: ${pct(p.prob)}`,
        // Opaque (orange blended into white): the sticky last column must hide what scrolls under it.
        style: { background: `rgb(${[217, 99, 30].map((c) => Math.round(255 + (c - 255) * alpha)).join(",")})`,
          color: alpha > 0.55 ? "#fff" : "#1f2937" },
      }, tokenNode(label(p)), el("span", { class: "lens-p", text: pct(p.prob) }));
    })));
  $("lens").replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

// --- the options -----------------------------------------------------------------------
// The controls come from the server's list (GET /api/model's `controls`): each option's one
// declaration (explain/options.py) also makes the CLI's flag and the API's field.

function control(c, nLayers) {
  const attrs = { id: `opt-${c.name}`, "data-option": c.name };
  const labelled = (...kids) => el("label", { class: "control", title: c.help }, c.label, ...kids);
  switch (c.control) {
    case "checkbox":
      return el("label", { class: "control check", title: c.help },
        el("input", { type: "checkbox", ...attrs, checked: Boolean(c.default) }), c.label);
    case "number":
      return labelled(el("input", { type: "number", ...attrs, min: c.min, max: c.max, value: c.default }));
    case "range":
      return labelled(el("input", { type: "range", ...attrs, min: c.min, max: c.max, step: c.step, value: c.default }),
        el("output", { id: `opt-${c.name}-value`, for: attrs.id, text: Number(c.default).toFixed(2) }));
    case "blocks":
      return labelled(el("select", attrs, ...Array.from({ length: nLayers },
        (_, i) => el("option", { value: i, text: `trf_blocks.${i}`, selected: i === c.default }))));
    default:
      return labelled(el("input", { type: "text", ...attrs, placeholder: c.placeholder || "", value: c.default || "",
        spellcheck: "false" }));
  }
}

function renderControls(lists, nLayers, rerun) {
  const drawn = (list) => list.filter((c) => c.control !== "always").map((c) => control(c, nLayers));
  $("trace-controls").replaceChildren(...drawn(lists.trace));
  $("why-controls").replaceChildren(...drawn(lists.why));
  for (const c of lists.trace.filter((c) => c.control !== "always")) {
    const input = $(`opt-${c.name}`);
    input.addEventListener(c.control === "range" ? "input" : "change", () => {
      if (c.control === "range") $(`opt-${c.name}-value`).textContent = Number(input.value).toFixed(2);
      rerun();
    });
  }
}

// Each option's value as the API takes it; "always": the page shows it in a panel of its own, so it asks every time.
function optionValues() {
  const out = {};
  for (const c of [...state.model.controls.trace, ...state.model.controls.why]) {
    const input = $(`opt-${c.name}`);
    if (c.control === "always") out[c.name] = true;
    else if (c.control === "checkbox") out[c.name] = input.checked;
    else if (c.control === "input") out[c.name] = input.value.trim() ? input.value : null;
    else out[c.name] = Number(input.value);
  }
  return out;
}

// --- why this token ---------------------------------------------------------------------

async function whyFor(target) {
  $("why-headline").textContent = "attributing…";
  const result = await api("/api/why", requestBody({ ids: state.ids, target }));
  if (!result) { $("why-headline").textContent = ""; return; }
  state.why = result.data;
  state.source = null;
  renderWhy();
}

function whyColor(v, most) {
  const t = most > 0 ? Math.min(1, Math.abs(v) / most) : 0;
  const end = v >= 0 ? [31, 111, 209] : [185, 28, 28];
  return `rgb(${end.map((e) => Math.round(255 + (e - 255) * t)).join(",")})`;
}

function renderWhy() {
  const tr = state.trace, w = state.why;
  if (!tr) return;
  const chosen = w ? w.target.id : null;
  $("why-candidates").replaceChildren(el("span", { class: "muted", text: "candidates: " }), ...tr.next_token.top.map((t) =>
    el("button", { type: "button", class: "chip why-candidate" + (t.id === chosen ? " chosen" : ""), "data-id": t.id,
      "data-focus": `why-${t.id}`, title: `${pct(t.prob)}: click to see what made it`,
      onclick: () => whyFor(t.id) }, tokenNode(t.text))));
  if (!w) {
    $("why-headline").textContent = "click a candidate to see which blocks, heads and prompt tokens made it";
    for (const id of ["why-grid", "why-sources", "why-patch", "why-top"]) $(id).replaceChildren();
    $("why-source").textContent = "";
    $("why-disagree").textContent = "";
    $("why-top-title").textContent = "";
    return;
  }
  const metric = w.versus ? `logit[${JSON.stringify(w.target.text)}] − logit[${JSON.stringify(w.versus.text)}]`
    : `logit[${JSON.stringify(w.target.text)}]`;
  $("why-headline").textContent = `${metric} = ${w.metric.toFixed(3)}: the largest parts are ` +
    [...w.parts].sort((a, b) => Math.abs(b.value) - Math.abs(a.value)).slice(0, 3)
      .map((p) => `${p.name} ${p.value >= 0 ? "+" : ""}${p.value.toFixed(3)}`).join(", ");
  renderWhyTop(w);
  renderWhyGrid(w);
  renderWhySources(w);
  $("why-disagree").textContent = disagreement(w);
  renderWhyPatch(w.patch);
}

function signed(v, digits = 3) {
  return `${v >= 0 ? "+" : "−"}${Math.abs(v).toFixed(digits)}`;
}

function renderWhyTop(w) {
  const terms = w.heads.flatMap((row, i) => row.map((v, h) => ({ name: `block ${i} head ${h}`, v })));
  const top = terms.sort((a, b) => Math.abs(b.v) - Math.abs(a.v)).slice(0, 5);
  $("why-top-title").textContent = "the five largest heads' terms:";
  $("why-top").replaceChildren(...top.map((t) => el("li", { class: "why-top-head", "data-value": t.v },
    `${t.name}: `, el("strong", { text: signed(t.v) }))));
}

// The prompt token whose two answers disagree most: its direct share (attention's straight path to the
// last position) has one sign, removing it moves the logit the other way (it mattered through later positions).
function disagreement(w) {
  const split = w.sources.filter((s) => s.causal.logit_change !== null && Math.abs(s.direct) > 1e-6 &&
    Math.sign(s.direct) === Math.sign(s.causal.logit_change) && s.causal.logit_change !== 0);
  if (!split.length) return "";
  const s = split.sort((a, b) => Math.abs(b.causal.logit_change) - Math.abs(a.causal.logit_change))[0];
  const moved = s.causal.logit_change < 0 ? "lowers" : "raises";
  return `${JSON.stringify(s.text)}: the two answers disagree. Its direct share is ${signed(s.direct)} ` +
    `(${s.direct < 0 ? "red" : "blue"}), yet removing it ${moved} the logit by ${Math.abs(s.causal.logit_change).toFixed(3)}: ` +
    "it matters through what later blocks read at other positions, which the direct share (attention's straight " +
    "path from this token to the last position) does not count.";
}

function renderWhyGrid(w) {
  const src = state.source;
  const value = (i, h) => (src === null ? w.heads[i][h] : w.by_source[i][h][src]);
  const nHeads = w.heads[0].length;
  const cells = w.heads.flatMap((row, i) => row.map((_, h) => value(i, h)));
  const most = Math.max(...cells.map(Math.abs), ...(src === null ? w.ff.map(Math.abs) : [0]));
  const grid = $("why-grid");
  grid.style.setProperty("--why-cols", nHeads + 1);
  const header = [el("span", { class: "why-label" }), ...Array.from({ length: nHeads }, (_, h) => el("span", {
    class: "why-col", text: `h${h}`, title: w.groups ? `query head ${h} reads key/value group ${w.groups[h]}` : null })),
    el("span", { class: "why-col", text: "ff" })];
  const rows = w.heads.flatMap((row, i) => [el("span", { class: "why-label", text: `block ${i}` }),
    ...row.map((_, h) => el("span", { class: "why-cell", "data-cell": `${i}.${h}`, title: `trf_blocks.${i}.att.head.${h}: ${value(i, h).toFixed(4)}`,
      style: { background: whyColor(value(i, h), most) } })),
    el("span", { class: "why-cell ff", title: src === null ? `trf_blocks.${i}.ff: ${w.ff[i].toFixed(4)}` : "a feed-forward reads no other position",
      style: { background: src === null ? whyColor(w.ff[i], most) : "#f3f4f6" } })]);
  grid.replaceChildren(...header, ...rows);
}

function renderWhySources(w) {
  const most = Math.max(...w.sources.map((s) => Math.abs(s.direct)));
  $("why-sources").replaceChildren(el("span", { class: "muted", text: "prompt: " }), ...w.sources.map((s) =>
    el("button", { type: "button", class: "chip why-source-token" + (s.position === state.source ? " chosen" : ""),
      "data-position": s.position, "data-focus": `src-${s.position}`, style: { background: whyColor(s.direct, most) },
      title: `position ${s.position}: click to see what it did`,
      onclick: keepingFocus(() => { state.source = state.source === s.position ? null : s.position; renderWhy(); }) },
    tokenNode(s.text), el("span", { class: "share", "data-value": s.direct, text: signed(s.direct) }))));
  const s = state.source === null ? null : w.sources[state.source];
  $("why-source").textContent = s === null
    ? "The grid shows each head's term and each feed-forward's. Click a prompt token to split the heads' terms over it."
    : `${JSON.stringify(s.text)} at position ${s.position}: direct share (through attention, all heads) ` +
      `${s.direct >= 0 ? "+" : ""}${s.direct.toFixed(4)}; causal: ` + (s.causal.prob_change === null ? s.causal.how
        : `${s.causal.how}, the probability changes by ${(100 * s.causal.prob_change).toFixed(2)} points and the logit by ` +
          `${s.causal.logit_change.toFixed(3)}`) + ". The grid now shows what each head carried from this token.";
}

function renderWhyPatch(patch) {
  if (!patch) { $("why-patch").replaceChildren(); return; }
  const head = el("tr", {}, el("th", { text: "patched" }), ...patch.positions.map((t) => el("th", {}, tokenNode(t))));
  const rows = patch.blocks.map((name, i) => el("tr", {}, el("th", { class: "layer", text: name }),
    ...patch.grid[i].map((v) => el("td", { class: "num", style: { background: whyColor(v, 1) }, text: v.toFixed(2) }))));
  $("why-patch").replaceChildren(el("p", { class: "caption", text: `Activation patching from ${JSON.stringify(patch.corrupted)}: ` +
    `the fraction of logit[${JSON.stringify(patch.clean_top.text)}] − logit[${JSON.stringify(patch.versus.text)}] restored by the clean input of each block at each position.` }),
  el("table", { class: "why-patch" }, el("thead", {}, head), el("tbody", {}, rows)));
}

// --- a rotary model (Qwen3, Llama 3.2, ...): explain/trace.py's FamilyTrace (the answer's `family`) ----


function renderFamily(tr) {
  const f = tr.family, a = f.answers, att = f.attention, c = f.config;
  const by = Object.fromEntries(f.stages.map((s) => [s.name, s]));
  const V = c.vocab_size, d = c.emb_dim;
  $("summary").replaceChildren(
    summaryStep("ids", by.ids.shape), arrow("tok_emb", "in"), summaryStep("hidden", by.tok_emb.shape),
    arrow(`${c.n_layers} × trf_blocks`, ""), summaryStep("hidden", by.final_norm.shape), arrow("out_head", "out"),
    summaryStep("logits", by.out_head.shape));
  const maxWidth = Math.max(...f.stages.map((s) => s.shape[s.shape.length - 1]));
  const view = { ...tr, embedding_check: a.one_hot, params: { ...tr.params, tied: a.tied } };
  $("flow").replaceChildren(...f.stages.map((s) => {
    if (s.name === "tok_emb" || s.name === "out_head") {
      const into = s.name === "tok_emb";
      return transitionStage({ ...s, transition: into ? "vocab->hidden" : "hidden->vocab", input_shape: into ? null : by.final_norm.shape,
        weight_shape: (into ? a.vocab_to_hidden : a.hidden_to_vocab).weight_shape, params: V * d,
        shared_with: !into && a.tied ? "tok_emb.weight" : null }, view, maxWidth);
    }
    return stageRow(s, maxWidth);
  }));
  const one = a.one_hot.equal_one_hot_matmul && a.one_hot.equal_linear;
  const tie = a.tied ? "one tensor: out_head.weight and tok_emb.weight share their storage (the same data_ptr)"
    : a.equal_values ? "two tensors with equal values: a copy, not a tie (different data_ptr), so training would move them apart"
      : "two separate tensors (untied)";
  const groups = att.groups.map((g, j) => el("span", { class: "chip kv-group", "data-group": j },
    el("strong", { text: `kv${j}` }), ` q${g[0]}…q${g[g.length - 1]}`));
  $("family").replaceChildren(
    el("h3", { text: `${f.architecture || f.family}: the four questions` }),
    el("ol", { class: "answers" },
      el("li", { "data-answer": "1", text: `Where does ${fmt(V)} become ${fmt(d)}? At tok_emb: a lookup in the ${shapeText(a.vocab_to_hidden.weight_shape)} weight.` }),
      el("li", { "data-answer": "2", text: `Where does ${fmt(d)} become ${fmt(V)}? At out_head: x @ W.T with W ${shapeText(a.hidden_to_vocab.weight_shape)}.` }),
      el("li", { "data-answer": "3", text: `Is nn.Embedding an nn.Linear on one-hot vectors? ${one ? "Yes: the lookup and one_hot(ids) @ W are identical here" : `Not bit for bit here (max difference ${a.one_hot.max_abs_diff})`}; the lookup skips the zeros.` }),
      el("li", { "data-answer": "4", text: `Are there weight matrices for both, and are they shared? ${tie}.` })),
    el("h3", { text: "Where positions enter" }),
    el("p", { class: "rope", text: `No pos_emb: tok_emb's output is the same for a token wherever it stands. Inside every attention ` +
      `the queries and keys (not the values) are rotated by RoPE, base ${fmt(att.rope_base)}` +
      (att.rope_scaled ? ", with Llama 3's frequency scaling" : "") + "." + (att.qk_norm ? " QK-norm: each query and key head is RMS-normed before the rotation." : "") }),
    el("h3", { text: "The heads" }),
    el("p", { class: "heads", text: `queries ${shapeText(att.q_shape)}, keys and values ${shapeText(att.kv_shape)}: ` +
      `${c.n_heads} query heads share ${c.n_kv_groups} key/value heads, ${att.group_size} each (repeat_interleave).` }),
    el("div", { class: "chips kv-groups" }, ...groups));
}

// --- parameters -----------------------------------------------------------------------

function renderParams(tr) {
  const p = tr.params;
  const rows = (tr.modules || []).map((m) => el("tr", {},
    el("td", { class: "mono" }, ...m.name.split(".").flatMap((part, i) => (i ? [el("wbr"), "." + part] : [part]))),
    el("td", { class: "mono", text: m.shape }),
    el("td", { class: "num", text: fmt(m.params) }), el("td", { text: m.note })));
  $("params").replaceChildren(
    el("p", {}, el("strong", { text: `${fmt(p.total)} parameters` }),
      p.tied ? ` (${fmt(p.total_untied)} if out_head had its own copy of tok_emb.weight instead of sharing it)`
        : " (out_head has its own weight: not tied)"),
    el("table", { class: "params" },
      el("thead", {}, el("tr", {}, el("th", { text: "module" }), el("th", { text: "weight" }), el("th", { text: "parameters" }), el("th", { text: "" }))),
      el("tbody", {}, rows)));
}

// --- wiring ----------------------------------------------------------------------------

function render() {
  const tr = state.trace;
  if (!tr) return;
  renderTokens(tr);
  $("family").hidden = !tr.family;
  if (tr.family) renderFamily(tr); else renderFlow(tr);
  renderNext(tr);
  renderNotes(tr);
  renderHead(tr);
  renderAttention(tr);
  renderLens(tr);
  renderParams(tr);
  renderWhy();
  renderWindows(tr);
  updateButtons();
}

// --- training windows: POST /api/windows (GPTDatasetV1's cut, computed by the server) -----------------

let windowsAsked = null;  // the latest request; an older answer arriving late is dropped

async function renderWindows(tr) {
  const n = tr.tokens.length;
  const length = Math.min(Number($("win-length").value) || 4, Math.max(1, n - 1));
  const stride = Number($("win-stride").value) || length;
  if (n < 2) {
    $("windows-overlap").textContent = "a window needs at least 2 tokens: its targets run one token further";
    $("windows").replaceChildren();
    return;
  }
  const asked = windowsAsked = JSON.stringify({ prompt: tr.prompt, max_length: length, stride });
  const res = await fetch("/api/windows", { method: "POST", headers: { "Content-Type": "application/json" }, body: asked });
  if (asked !== windowsAsked) return;
  const w = await res.json();
  if (!res.ok) { $("windows-overlap").textContent = w.error || res.statusText; $("windows").replaceChildren(); return; }
  $("windows-count").textContent = `${w.inputs.length} window${w.inputs.length === 1 ? "" : "s"}`;
  $("windows-overlap").textContent = `max_length ${w.max_length}, stride ${w.stride}: ` + (w.overlap > 0
    ? `each window shares ${w.overlap} input tokens with the next`
    : w.overlap === 0 ? "no overlap, every token in one window's inputs"
      : `${-w.overlap} tokens between windows are in no input`);
  const word = (id) => w.tokens[w.ids.indexOf(id)];
  const row = (cls, ids) => el("span", { class: `win-row ${cls}` },
    ...ids.map((id) => el("span", { class: "win-tok", title: `id ${id}` }, tokenNode(word(id)))));
  $("windows").replaceChildren(...w.inputs.slice(0, 12).map((x, k) => el("li", { class: "window", "data-window": k },
    el("span", { class: "win-label", text: `window ${k}` }), row("in", x), row("target", w.targets[k]))));
}

for (const id of ["win-length", "win-stride"]) {
  document.addEventListener("change", (ev) => { if (ev.target.id === id && state.trace) renderWindows(state.trace); });
}

async function downloadSvg(ev) {
  ev.preventDefault();
  const body = requestBody();
  const res = await fetch("/api/diagram.svg", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  if (!res.ok) { const d = await res.json().catch(() => ({})); showError(`${res.status}: ${d.error || res.statusText}`); return; }
  const url = URL.createObjectURL(await res.blob());
  const a = el("a", { href: url, download: "glassgpt-diagram.svg" });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function debounce(fn, ms) {
  let timer;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

async function start() {
  $("prompt-form").addEventListener("submit", (ev) => { ev.preventDefault(); state.edited = true; explain(); });
  $("prompt").addEventListener("input", () => { state.edited = true; updateButtons(); });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); state.edited = true; explain(); }
  });
  const rerun = debounce(() => { if (state.trace) explain(); }, 250);
  // After an edit, the chosen token is appended to the edited text, not to the trace on screen.
  $("append").addEventListener("click", () => explain({ ...promptPart(), token: state.chosen }, "/api/append"));
  $("sample").addEventListener("click", () => explain({ ...promptPart(), token: sampleTopK(state.trace) }, "/api/append"));
  $("undo").addEventListener("click", () => explain({ ids: state.ids.slice(0, -1) }));
  $("att-layer").addEventListener("change", keepingFocus((ev) => { state.layer = Number(ev.target.value); renderAttention(state.trace); }));
  $("att-head").addEventListener("change", keepingFocus((ev) => { state.head = Number(ev.target.value); renderAttention(state.trace); }));
  $("svg-link").addEventListener("click", downloadSvg);
  window.addEventListener("resize", debounce(() => state.trace && renderAttention(state.trace), 150));

  $("snapshot").addEventListener("input", () => renderSnapshot(Number($("snapshot").value)));

  const info = await api("/api/model");
  if (!info) return;
  state.model = info.data;
  renderModel(state.model);
  renderControls(state.model.controls, state.model.config.n_layers, rerun);
  if (state.model.run) {
    const snaps = await api("/api/snapshots");
    if (snaps) renderSnapshots(snaps.data);
  }
  await explain();
}

document.addEventListener("DOMContentLoaded", start);

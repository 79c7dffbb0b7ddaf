// The page's behaviour: filters -> the "fits in N GiB" cards, the tokens/s vs memory charts, the cell
// table, and a cell's detail. Data: the JSON element #site-data, written by bench/site/data.py.
"use strict";

const DATA = JSON.parse(document.getElementById("site-data").textContent);
const CELLS = DATA.cells; // one record per cell, source and GPU: the primary ones (bench/site/page.py)
const SVG_NS = "http://www.w3.org/2000/svg";
// Okabe-Ito and Tableau-like colours that stay apart for colour-blind readers, times four marker shapes:
// 40 stacks before a pair repeats.
const COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000", "#8C564B",
  "#7F7F7F", "#BCBD22"];
const SHAPES = ["circle", "square", "triangle", "diamond"];
const FILTERS = [
  ["gpu", "GPU", (c) => c.gpu],
  ["model", "model", (c) => c.model],
  ["seq_len", "sequence length", (c) => String(c.seq_len)],
  ["batch_size", "batch", (c) => String(c.batch_size)],
  ["stack", "stack", (c) => c.stack],
  ["technique", "technique contained", (c) => c.techniques],
  ["source", "measured / predicted", (c) => c.source],
];
const state = { filters: {}, budget: 24 };

// ---- small helpers -------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") node.addEventListener("click", v);
    else if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children.flat()) if (child) node.append(child instanceof Node ? child : String(child));
  return node;
}
const gib = (x) => (x === null || x === undefined ? "–" : x < 10 ? x.toFixed(2) : x.toFixed(1));
const tps = (x) => (x === null || x === undefined ? "–" : Math.round(x).toLocaleString("en"));
const pct = (x) => (x >= 0 ? "+" : "") + (100 * x).toFixed(2) + "%";
const sortNum = (a, b) => (isNaN(a) || isNaN(b) ? String(a).localeCompare(String(b)) : Number(a) - Number(b));
function groupBy(items, keyOf) {
  const groups = new Map();
  for (const item of items) {
    const key = keyOf(item);
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(item);
  }
  return groups;
}
function parseJson(text) {
  try { return text ? JSON.parse(text) : null; } catch (e) { return null; }
}

// ---- filters --------------------------------------------------------------------------------------
function matches(cell) {
  return FILTERS.every(([key, , valueOf]) => {
    const wanted = state.filters[key];
    if (!wanted) return true;
    const value = valueOf(cell);
    return Array.isArray(value) ? value.includes(wanted) : value === wanted;
  });
}
function shownCells() { return CELLS.filter(matches); }

function buildFilters() {
  const form = document.getElementById("filters");
  for (const [key, label, valueOf] of FILTERS) {
    const values = [...new Set(CELLS.flatMap((c) => [valueOf(c)].flat()))].sort(sortNum);
    const select = el("select", { name: key, id: "filter-" + key },
      el("option", { value: "" }, "all"), values.map((v) => el("option", { value: v }, v)));
    select.addEventListener("change", () => { state.filters[key] = select.value; renderAll(); });
    form.append(el("label", {}, label, select));
  }
}

// ---- what fits in N GiB -----------------------------------------------------------------------------
function predictorNote(cell) {
  if (cell.error !== null && cell.error !== undefined) return "predicted; this cell measured: error " + pct(cell.error);
  const method = (cell.row && cell.row.prediction_method) || "";
  if (method.startsWith("hybrid")) {
    return "predicted (hybrid: DeepSpeed's model-state accounting + the fake run); no measured ZeRO cell checks it yet";
  }
  if (cell.gpus > 1) return `predicted on a fake process group (${cell.gpus} ranks); no measured multi-GPU cell checks it yet`;
  const p = DATA.predictor;
  if (!p.cells) return "predicted; not yet checked against a measurement";
  const overall = `median ${(100 * p.median_abs_error).toFixed(2)}%, max ${(100 * p.max_abs_error).toFixed(2)}%`;
  if (cell.stack !== undefined && !p.stacks.includes(cell.stack)) {
    return `predicted; no measured cell of this stack checks it yet (error over ${p.cells} measured cells of ` +
      `other stacks: ${overall})`;
  }
  return `predicted; error over ${p.cells} measured cells: ${overall}`;
}

// The garbage collection threshold acts only under a memory fraction (torch.cuda.set_per_process_memory_fraction),
// so a prediction's smallest card for its stacks holds only where the training script sets one too.
const FRACTION_ONLY = "the smallest card the step runs on, with the garbage collection threshold collecting as it does " +
  "only under a memory fraction (torch.cuda.set_per_process_memory_fraction): without one it does nothing";

function needCell(c) {
  if (c.source !== "predicted" || !c.techniques.includes("garbage_collection_threshold")) {
    return el("td", {}, gib(c.need_gib));
  }
  return el("td", { class: "fraction-only", title: FRACTION_ONLY }, gib(c.need_gib) + "*");
}

// A predicted tokens/s's accuracy: the step time model's fit for the cell's GPU (bench/predict/steptime.py).
function stepTimeNote(cell) {
  const fit = DATA.stepTime[cell.gpu];
  if (cell.source !== "predicted" || !fit) return null;
  return `predicted tokens/s: the step time from the work the fake run counted, at the ${cell.gpu}'s rates fitted ` +
    `on ${fit.cells} measured cells (each left out of the fit: ${fit.left_out})`;
}
function tpsCell(c) {
  return el("td", c.tokens_per_s && c.source === "predicted" ? { title: stepTimeNote(c) } : {}, tps(c.tokens_per_s));
}

function fitsFor(cells) {
  // Per stack: the measured cell that fits with the most tokens/s, else the predicted one with the most predicted
  // tokens/s (then the largest batch: a stack whose step time is not predicted).
  const best = [];
  const faster = (a, b) => (b.tokens_per_s || -1) - (a.tokens_per_s || -1) || b.batch_size - a.batch_size;
  for (const group of groupBy(cells, (c) => c.stack).values()) {
    const measured = group.filter((c) => c.source === "measured").sort(faster);
    const predicted = group.filter((c) => c.source === "predicted").sort(faster);
    best.push(measured[0] || predicted[0]);
  }
  return best.sort((a, b) => (b.tokens_per_s || -1) - (a.tokens_per_s || -1) || a.need_gib - b.need_gib);
}

function renderFits() {
  const out = document.getElementById("fits-out");
  out.replaceChildren();
  const onCard = shownCells().filter((c) => c.gpu !== "CPU" && c.need_gib !== null && c.need_gib !== undefined
    && c.status === "ok");  // need_gib is the card the cell needs, of any kind
  const grid = el("div", { class: "fit-grid" });
  const groups = groupBy(onCard, (c) => `${c.model} · seq ${c.seq_len}`);
  for (const [title, group] of [...groups.entries()].sort()) {
    // an offload cell predicted to overflow its host (host_fits false) does not fit, whatever the card
    const fitting = group.filter((c) => c.need_gib <= state.budget && c.row.host_fits !== false);
    const stacks = new Set(group.map((c) => c.stack)).size;
    const rows = fitsFor(fitting);
    const fastest = rows.find((c) => c.source === "measured");
    const card = el("div", { class: "fit-card", "data-group": title },
      el("h3", {}, title),
      el("p", { class: rows.length ? "note" : "note none" },
        `${rows.length} of ${stacks} stacks fit in ${state.budget} GiB`));
    if (rows.length) {
      card.append(el("table", {},
        el("thead", {}, el("tr", {}, ["stack", "batch", "needs GiB", "tokens/s", ""].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows.map((c) => el("tr", {
          class: "clickable fit-row" + (c.source === "predicted" ? " predicted" : ""), "data-key": c.key,
          onclick: () => showDetail(c),
        },
        el("td", {}, c.stack), el("td", {}, c.batch_size), needCell(c),
        tpsCell(c),
        el("td", {}, c === fastest ? el("span", { class: "badge fastest" }, "fastest") : null,
          c.source === "predicted" ? el("span", { class: "badge predicted", title: predictorNote(c) }, "predicted")
            : null))))));
    }
    if (rows.some((c) => c.source === "predicted")) {
      card.append(el("p", { class: "note" }, "predicted: " + predictorNote({ error: null }).replace("predicted; ", "")));
      // one line a GPU kind: each has its own fitted rates
      const notes = new Set(rows.filter((c) => c.source === "predicted" && c.tokens_per_s).map(stepTimeNote));
      for (const note of notes) card.append(el("p", { class: "note step-time" }, note));
    }
    grid.append(card);
  }
  out.append(groups.size ? grid : el("p", { class: "note" }, "No GPU cell matches the filters."));
}

function setBudget(value) {
  const budget = Math.max(1, Number(value) || 1);
  state.budget = budget;
  document.getElementById("budget").value = String(Math.min(budget, 160));
  document.getElementById("budget-number").value = String(budget);
  document.getElementById("budget-label").textContent = String(budget);
  renderFits();
}

function buildBudget() {
  document.getElementById("budget").addEventListener("input", (e) => setBudget(e.target.value));
  document.getElementById("budget-number").addEventListener("change", (e) => setBudget(e.target.value));
  const presets = document.querySelector("#fits .presets");
  for (const size of [16, 24, 40, 48, 80, 141]) {
    presets.append(el("button", { type: "button", onclick: () => setBudget(size) }, `${size} GiB`));
  }
}

// ---- tokens/s vs peak memory ------------------------------------------------------------------------
function paretoFront(points) {
  // Sorted by memory, a point is on the front when it is faster than every smaller one.
  const front = [];
  let fastest = -Infinity;
  for (const p of [...points].sort((a, b) => a.peak_gib - b.peak_gib || b.tokens_per_s - a.tokens_per_s)) {
    if (p.tokens_per_s > fastest) { front.push(p); fastest = p.tokens_per_s; }
  }
  return front;
}

function marker(shape, x, y, r, attrs) {
  if (shape === "circle") return svg("circle", { cx: x, cy: y, r, ...attrs });
  if (shape === "square") return svg("rect", { x: x - r, y: y - r, width: 2 * r, height: 2 * r, ...attrs });
  const pts = shape === "triangle" ? [[x, y - r * 1.2], [x + r * 1.1, y + r * 0.8], [x - r * 1.1, y + r * 0.8]]
    : [[x, y - r * 1.3], [x + r * 1.1, y], [x, y + r * 1.3], [x - r * 1.1, y]];
  return svg("polygon", { points: pts.map((p) => p.join(",")).join(" "), ...attrs });
}

function niceTicks(lo, hi, count) {
  const step0 = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) ticks.push(+t.toFixed(6));
  return ticks;
}

function axes(box, xs, ys, xLabel, yLabel, integerX) {
  // Scale functions, and the grid and axes of a plot box {w, h, left, bottom, top, right}.
  const [x0, x1] = xs, [y0, y1] = ys;
  const sx = (x) => box.left + ((x - x0) / (x1 - x0 || 1)) * (box.w - box.left - box.right);
  const sy = (y) => box.h - box.bottom - ((y - y0) / (y1 - y0 || 1)) * (box.h - box.top - box.bottom);
  const grid = svg("g", { class: "grid" }), axis = svg("g", { class: "axis" });
  const bottom = box.h - box.bottom, right = box.w - box.right;
  for (const t of niceTicks(x0, x1, 6).filter((t) => !integerX || Number.isInteger(t))) {
    grid.append(svg("line", { x1: sx(t), x2: sx(t), y1: box.top, y2: bottom }));
    axis.append(svg("text", { x: sx(t), y: bottom + 14, "text-anchor": "middle" }, t.toLocaleString("en")));
  }
  for (const t of niceTicks(y0, y1, 5)) {
    grid.append(svg("line", { x1: box.left, x2: right, y1: sy(t), y2: sy(t) }));
    axis.append(svg("text", { x: box.left - 4, y: sy(t) + 4, "text-anchor": "end" }, t.toLocaleString("en")));
  }
  const midY = (box.top + bottom) / 2;
  axis.append(svg("line", { x1: box.left, x2: right, y1: bottom, y2: bottom }),
    svg("line", { x1: box.left, x2: box.left, y1: box.top, y2: bottom }),
    svg("text", { x: (box.left + right) / 2, y: box.h - 4, "text-anchor": "middle" }, xLabel),
    svg("text", { x: 12, y: midY, "text-anchor": "middle", transform: `rotate(-90 12 ${midY})` }, yLabel));
  return { sx, sy, g: svg("g", {}, grid, axis) };
}

function styleOf(stacks) {
  const style = new Map();
  stacks.forEach((stack, i) => style.set(stack, { colour: COLOURS[i % COLOURS.length],
    shape: SHAPES[Math.floor(i / COLOURS.length) % SHAPES.length] }));
  return style;
}

function scatter(points, capacity, style) {
  const box = { w: 720, h: 420, left: 64, right: 16, top: 12, bottom: 40 };
  const maxMem = Math.max(...points.map((p) => p.peak_gib), capacity || 0) * 1.05;
  const maxTps = Math.max(...points.map((p) => p.tokens_per_s)) * 1.08;
  const peakName = points[0].gpu === "CPU" ? "peak host RSS (GiB)" : "peak reserved GPU memory (GiB)";
  const { sx, sy, g } = axes(box, [0, maxMem], [0, maxTps], peakName, "tokens/s");
  const root = svg("svg", { viewBox: `0 0 ${box.w} ${box.h}`, role: "img", "aria-label": "tokens/s vs peak memory" }, g);
  if (capacity) {
    root.append(svg("line", { class: "capacity", x1: sx(capacity), x2: sx(capacity), y1: box.top, y2: box.h - box.bottom }),
      svg("text", { x: sx(capacity) - 4, y: box.top + 10, "text-anchor": "end", fill: "#b42318" },
        `capacity ${capacity.toFixed(1)} GiB`));
  }
  // one front a source: a measured front and a predicted one, never a line joining a measurement to a prediction
  const fronts = ["measured", "predicted"].map((source) => paretoFront(points.filter((p) => p.source === source)));
  for (const [i, front] of fronts.entries()) {
    if (front.length) {
      root.append(svg("polyline", { class: "front" + (i ? " predicted" : ""),
        points: front.map((p) => `${sx(p.peak_gib)},${sy(p.tokens_per_s)}`).join(" ") }));
    }
  }
  for (const p of points) {
    const { colour, shape } = style.get(p.stack);
    const x = sx(p.peak_gib), y = sy(p.tokens_per_s);
    const predicted = p.source === "predicted";
    const attrs = { fill: colour, class: "point" + (fronts.some((f) => f.includes(p)) ? " on-front" : ""),
      "data-key": p.key, tabindex: "0" };
    // a prediction is hollow, outlined in its stack's colour (a style: the stylesheet's outline would win over
    // an attribute)
    if (predicted) Object.assign(attrs, { fill: "#ffffff", style: `stroke:${colour}`, class: attrs.class + " predicted" });
    const node = marker(shape, x, y, 5.5, attrs);
    node.append(svg("title", {}, `${predicted ? "PREDICTED: " : ""}${p.stack}, batch ${p.batch_size}: ` +
      `${gib(p.peak_gib)} GiB, ${tps(p.tokens_per_s)} tokens/s` + (predicted ? ` (${stepTimeNote(p)})` : "")));
    node.addEventListener("click", () => showDetail(p));
    root.append(node, svg("text", { x: x + 7, y: y - 5, "font-size": "9" }, String(p.batch_size)));
  }
  return root;
}

function legend(stacks, style, withPredicted) {
  const item = (shape, attrs, text) => el("li", {}, svg("svg", { width: 14, height: 14, viewBox: "0 0 14 14" },
    marker(shape, 7, 7, 5, attrs)), text);
  const outline = { stroke: "#1b1f24", "stroke-width": 0.7 };
  const sources = withPredicted ? [item("circle", { fill: "#7F7F7F", ...outline }, "measured"),
    item("circle", { fill: "#ffffff", stroke: "#7F7F7F", "stroke-width": 1.8 }, "predicted (hollow)")] : [];
  return el("ul", { class: "legend", "aria-label": "stacks" }, sources, stacks.map((stack) => {
    const { colour, shape } = style.get(stack);
    return item(shape, { fill: colour, ...outline }, stack);
  }));
}

function renderCharts() {
  const out = document.getElementById("charts-out");
  out.replaceChildren();
  const timed = shownCells().filter((c) => c.status === "ok" && c.gpus === 1 && c.tokens_per_s && c.peak_gib);
  const groups = groupBy(timed, (c) => `${c.gpu} · ${c.model} · seq ${c.seq_len}`);
  for (const [title, points] of [...groups.entries()].sort()) {
    const stacks = [...new Set(points.map((p) => p.stack))].sort((a, b) => (a !== "baseline") - (b !== "baseline") || a.localeCompare(b));
    const style = styleOf(stacks);
    out.append(el("div", { class: "chart" }, el("h3", {}, title),
      el("div", { class: "chart-row" }, scatter(points, points[0].capacity_gib, style),
        legend(stacks, style, points.some((p) => p.source === "predicted")))));
  }
  if (!groups.size) out.append(el("p", { class: "note" }, "No cell with a measured or predicted tokens/s matches the filters."));
}

// ---- the cell table ---------------------------------------------------------------------------------
function renderCells() {
  const cells = shownCells().sort((a, b) => a.model.localeCompare(b.model) || a.seq_len - b.seq_len
    || a.batch_size - b.batch_size || a.stack.localeCompare(b.stack) || a.source.localeCompare(b.source));
  const head = ["source", "GPU", "model", "seq", "batch", "GPUs", "stack", "status", "peak GiB", "device GiB",
    "tokens/s", "prediction error"];
  const rows = cells.map((c) => {
    const values = [c.source, c.gpu, c.model, c.seq_len, c.batch_size, c.gpus, c.stack, c.status, gib(c.peak_gib),
      gib(c.device_gib), tps(c.tokens_per_s), c.error === null || c.error === undefined ? "" : pct(c.error)];
    return el("tr", { class: "clickable cell-row" + (c.source === "predicted" ? " predicted" : ""), "data-key": c.key,
      onclick: () => showDetail(c) }, values.map((v) => el("td", {}, v)));
  });
  document.getElementById("cells-out").replaceChildren(el("p", { class: "note" }, `${cells.length} cells`),
    el("div", { class: "scroll tall" }, el("table", { id: "cell-table" },
      el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))), el("tbody", {}, rows))));
}

// ---- a cell's detail --------------------------------------------------------------------------------
function lineChart(series, xLabel, yLabel) {
  // series: [{name, colour, points: [[x, y], ...]}]
  const box = { w: 640, h: 240, left: 60, right: 12, top: 10, bottom: 36 };
  const all = series.flatMap((s) => s.points);
  const ys = all.map((p) => p[1]);
  const lo = Math.min(...ys), hi = Math.max(...ys);
  const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.05 || 1;
  const { sx, sy, g } = axes(box, [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))],
    [lo - pad, hi + pad], xLabel, yLabel, true);
  const root = svg("svg", { viewBox: `0 0 ${box.w} ${box.h}`, role: "img", "aria-label": yLabel }, g);
  for (const s of series) {
    root.append(svg("polyline", { fill: "none", stroke: s.colour, "stroke-width": 1.6,
      points: s.points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" ") }));
    for (const [x, y] of s.points) root.append(svg("circle", { cx: sx(x), cy: sy(y), r: 2.2, fill: s.colour }));
  }
  const keys = el("p", { class: "note" }, series.map((s) => el("span", { style: `color:${s.colour}` }, "━ " + s.name + "  ")));
  return el("div", {}, root, keys);
}

function traceSection(cell) {
  const trace = parseJson(cell.row.step_trace_json);
  const parts = [];
  if (trace && trace.length && trace[0].allocated_gib !== undefined) {
    const series = [["allocated_gib", "allocated", "#0072B2"], ["reserved_gib", "reserved", "#D55E00"]]
      .filter(([key]) => trace.some((t) => t[key] !== undefined && t[key] !== null))
      .map(([key, name, colour]) => ({ name, colour, points: trace.map((t, i) => [i + 1, t[key]]).filter((p) => p[1] !== null && p[1] !== undefined) }));
    parts.push(el("h3", {}, (cell.source === "predicted" ? "Predicted memory" : "Memory") + " after each step"),
      lineChart(series, "step", "GiB"));
  }
  const losses = parseJson(cell.row.losses_json);
  if (losses && losses.length > 1) {
    parts.push(el("h3", {}, "Loss of every step (warm-up first)"),
      lineChart([{ name: "loss", colour: "#009E73", points: losses.map((l, i) => [i + 1, l]) }], "step", "loss"));
  }
  const timeline = parseJson(cell.row.phase_timeline_json);
  if (timeline && timeline.length) {
    const keys = [...new Set(timeline.flatMap((t) => Object.keys(t)))];
    parts.push(el("h3", {}, "Memory at the end of each phase (GiB)"), el("div", { class: "scroll" }, el("table", {},
      el("thead", {}, el("tr", {}, keys.map((k) => el("th", {}, k)))),
      el("tbody", {}, timeline.map((t) => el("tr", {}, keys.map((k) => el("td", {},
        typeof t[k] === "number" ? gib(t[k]) : (t[k] ?? "")))))))));
  }
  return parts;
}

function columnsTable(cell) {
  const rows = Object.entries(cell.row).map(([name, value]) => {
    const col = DATA.columns[name] || { unit: "", measured: "", predicted: "" };
    const definition = col[cell.source] || col.measured || col.predicted || "";
    const text = typeof value === "number" && !Number.isInteger(value) ? value.toPrecision(6) : String(value);
    return el("tr", {}, el("td", {}, el("code", {}, name)),
      el("td", {}, text.length > 160 ? el("details", {}, el("summary", {}, text.slice(0, 80) + "…"), el("pre", {}, text)) : text),
      el("td", {}, col.unit), el("td", {}, definition));
  });
  return el("div", { class: "scroll" }, el("table", { class: "columns" },
    el("thead", {}, el("tr", {}, ["column", "value", "unit", "definition"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows)));
}

function showDetail(cell) {
  const row = cell.row;
  const evidence = parseJson(row.evidence_json);
  const provenance = ["gpu_name", "gpu_kind", "cpu_name", "driver", "cuda", "torch_version", "transformers_version",
    "peft_version", "deepspeed_version", "liger_kernel_version", "bitsandbytes_version", "git_sha", "git_dirty",
    "started_at", "prediction_method"].filter((k) => row[k] !== undefined).map((k) => `${k}: ${row[k]}`).join("\n");
  const body = document.getElementById("detail-body");
  body.replaceChildren(
    el("h2", { id: "detail-title" }, `${cell.model}, seq ${cell.seq_len}, batch ${cell.batch_size}: ${cell.stack}`),
    el("p", {}, cell.source === "predicted" ? el("span", { class: "badge predicted" }, predictorNote(cell))
      : el("span", { class: "badge" }, "measured"), ` ${cell.gpu} · status ${cell.status} · run ${cell.run_id} · `,
    `peak ${gib(cell.peak_gib)} GiB · device ${gib(cell.device_gib)} GiB · ${tps(cell.tokens_per_s)} tokens/s`),
    cell.source === "predicted" && cell.tokens_per_s ? el("p", { class: "note" }, stepTimeNote(cell)) : null,
    el("h3", {}, "Re-run this cell"), el("pre", { class: "rerun" }, row.rerun_cmd || "–"),
    ...traceSection(cell),
    el("h3", {}, "Evidence that the stack applied"),
    el("pre", {}, evidence && Object.keys(evidence).length ? JSON.stringify(evidence, null, 1)
      : cell.source === "predicted" ? "(a prediction: the techniques were applied to the fake run)" : "(baseline: nothing to apply)"),
    el("h3", {}, "Provenance"), el("pre", {}, provenance),
    el("h3", {}, "Every column"), columnsTable(cell));
  const dialog = document.getElementById("detail");
  if (!dialog.open) dialog.showModal();
  dialog.scrollTop = 0;
}

// ---- wiring -----------------------------------------------------------------------------------------
function renderAll() { renderFits(); renderCharts(); renderCells(); }

buildFilters();
buildBudget();
document.getElementById("explore").hidden = false;
setBudget(24);
renderAll();

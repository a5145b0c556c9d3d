// The answer of POST /attend, drawn: the attention weights as heatmaps (one per batch row, and one per head
// for multi-head and self-attention), the positional encoding P when the answer has it, the outputs as tables.

import { curves, parseColumns } from "./curves.js";
import { BLUES, colourBar, formatNumber, heatmap, REDS } from "./heatmap.js";

const MAX_FIGURES = 40; // heatmaps drawn for one answer; the rest are counted, not drawn
const MAX_TABLE_ROWS = 64; // rows of one batch row's outputs table
const MAX_TABLE_COLS = 100;

function element(name, attributes = {}, text) {
  const el = document.createElement(name);
  Object.assign(el, attributes);
  if (text !== undefined) el.textContent = text;
  return el;
}

/** The valid length of batch row b, query q: null when none was sent (every key counts). */
function lengthOf(validLens, b, q) {
  if (validLens == null) return null;
  const row = validLens[b];
  return Array.isArray(row) ? row[q] : row;
}

/** Weights (batch, n_q, n_k) or (batch, heads, n_q, n_k) as a list of {batch, head, matrix}. */
function matrices(weights) {
  const withHeads = Array.isArray(weights[0]?.[0]?.[0]);
  return weights.flatMap((row, b) =>
    withHeads ? row.map((matrix, h) => ({ batch: b, head: h, matrix })) : [{ batch: b, head: null, matrix: row }]);
}

function maxUnmasked(list, validLens) {
  let max = 0;
  for (const { batch, matrix } of list) {
    matrix.forEach((row, q) => {
      const length = lengthOf(validLens, batch, q);
      row.forEach((v, k) => { if (length === null || k < length) max = Math.max(max, v); });
    });
  }
  return max > 0 ? max : 1;
}

/** The line that tells the value under the pointer. */
const readoutLine = () => element("p", { className: "readout", ariaLive: "polite" }, "Point at a cell to read it.");

export function renderWeights(container, weights, validLens) {
  container.replaceChildren();
  if (!weights) return;
  const readout = readoutLine();
  const list = matrices(weights);
  // One scale for every heatmap of the answer, 0 to the largest weight, so that they compare.
  const scale = { ramp: REDS, min: 0, max: maxUnmasked(list, validLens) };
  const withHeads = list[0]?.head !== null;
  container.append(element("h2", {}, "Attention weights"),
    colourBar(scale, { label: "weight", withMasked: validLens != null }), readout);
  // A line of heatmaps per batch row when there are heads; otherwise one line for the whole batch.
  let rowBox = null;
  list.slice(0, MAX_FIGURES).forEach(({ batch, head, matrix }) => {
    if (!rowBox || (withHeads && Number(rowBox.dataset.batch) !== batch)) {
      rowBox = element("div", { className: "batch-row" });
      if (withHeads) rowBox.dataset.batch = batch;
      container.append(rowBox);
    }
    const masked = (q, k) => {
      const length = lengthOf(validLens, batch, q);
      return length !== null && k >= length;
    };
    const where = withHeads ? `batch ${batch}, head ${head}` : `batch ${batch}`;
    rowBox.append(heatmap({
      rows: matrix.length, cols: matrix[0].length, value: (q, k) => matrix[q][k], masked, scale,
      xlabel: "Keys", ylabel: "Queries", caption: where,
      data: withHeads ? { batch, head } : { batch },
      describe: (q, k) => `${where}, query ${q}, key ${k}`, readout,
    }));
  });
  if (list.length > MAX_FIGURES) {
    container.append(element("p", { className: "muted" }, `${list.length - MAX_FIGURES} more heatmaps not drawn.`));
  }
}

/** P (positions x dimensions) as a heatmap, and the columns chosen in the box as curves. */
export function renderEncoding(container, P) {
  container.replaceChildren();
  if (!P) return;
  const readout = readoutLine();
  const all = P.flat();
  const scale = { ramp: BLUES, min: all.reduce((a, b) => Math.min(a, b)), max: all.reduce((a, b) => Math.max(a, b)) };
  const map = heatmap({
    rows: P.length, cols: P[0].length, value: (i, j) => P[i][j], scale, target: 480,
    xlabel: "Column (encoding dimension)", ylabel: "Row (position)", caption: "positional encoding P",
    data: { kind: "encoding" }, describe: (i, j) => `position ${i}, dimension ${j}`, readout,
  });
  map.id = "pe-heatmap";

  const box = element("input", { id: "pe-columns", value: P[0].length > 9 ? "6-9" : `0-${P[0].length - 1}` });
  const label = element("label", { htmlFor: "pe-columns" }, "Columns ");
  const error = element("p", { className: "field-error", role: "alert", hidden: true });
  error.dataset.errorFor = "columns";
  const plot = element("div", { id: "pe-curves" });
  const draw = () => {
    try {
      plot.replaceChildren(curves(P, parseColumns(box.value, P[0].length)));
      error.hidden = true;
    } catch (e) {
      error.textContent = e.message;
      error.hidden = false;
    }
  };
  box.addEventListener("input", draw);
  draw();
  const figures = element("div", { className: "encoding" });
  const right = element("div");
  right.append(label, box, error, plot);
  figures.append(map, right);
  container.append(element("h2", {}, "Positional encoding"),
    colourBar(scale, { label: "P" }), readout, figures);
}

/** The outputs (batch, n, size): a table per batch row, queries down, features across. */
export function renderOutputs(container, outputs) {
  container.replaceChildren();
  outputs.forEach((rows, b) => {
    const table = element("table", { className: "outputs" });
    table.dataset.batch = b;
    table.append(element("caption", {}, `batch ${b}`));
    const head = element("tr");
    head.append(element("th", {}, "query"));
    const cols = Math.min(rows[0]?.length ?? 0, MAX_TABLE_COLS);
    for (let j = 0; j < cols; j++) head.append(element("th", {}, String(j)));
    table.append(head);
    rows.slice(0, MAX_TABLE_ROWS).forEach((row, q) => {
      const tr = element("tr");
      tr.append(element("th", {}, String(q)));
      row.slice(0, cols).forEach((v, j) => {
        const td = element("td", { title: String(v) }, formatNumber(v));
        Object.assign(td.dataset, { row: q, col: j, value: String(v) });
        tr.append(td);
      });
      table.append(tr);
    });
    const scroll = element("div", { className: "table-scroll" });
    scroll.append(table);
    container.append(scroll);
    const hidden = [rows.length - MAX_TABLE_ROWS, (rows[0]?.length ?? 0) - MAX_TABLE_COLS];
    if (hidden.some((n) => n > 0)) {
      const what = [hidden[0] > 0 && `${hidden[0]} rows`, hidden[1] > 0 && `${hidden[1]} columns`].filter(Boolean);
      container.append(element("p", { className: "muted" }, `(${what.join(" and ")} more not shown)`));
    }
  });
}

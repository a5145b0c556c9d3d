// Heatmaps like the book's `d2l.show_heatmaps`: one matrix, one colour per cell from a shared scale, the
// value under the pointer. Masked keys (weight exactly 0 because of the valid lengths) are hatched grey,
// never a colour of the scale, so they cannot be read as a small weight.
//
// Up to MAX_SVG_CELLS cells a matrix is SVG, one <rect> per cell carrying its value (data-value, the number
// as the service sent it) and data-masked; larger ones are drawn on a canvas, which the DOM could not hold.

const SVG = "http://www.w3.org/2000/svg";
export const MAX_SVG_CELLS = 4096;

// matplotlib's "Reds" (the book's heatmaps of attention weights) and "Blues" (its heatmap of P).
export const REDS = ["#fff5f0", "#fee0d2", "#fcbba1", "#fc9272", "#fb6a4a", "#ef3b2c", "#cb181d", "#a50f15", "#67000d"];
export const BLUES = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"];

const rgbOf = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));

/** The colour of `value` on the scale {ramp, min, max}, as [r, g, b] (linear between the ramp's stops). */
export function colourOf(scale, value) {
  const span = scale.max - scale.min;
  const t = span > 0 ? Math.min(1, Math.max(0, (value - scale.min) / span)) : 0;
  const x = t * (scale.ramp.length - 1);
  const i = Math.min(Math.floor(x), scale.ramp.length - 2);
  const [a, b] = [rgbOf(scale.ramp[i]), rgbOf(scale.ramp[i + 1])];
  return a.map((c, k) => Math.round(c + (b[k] - c) * (x - i)));
}

const css = ([r, g, b]) => `rgb(${r}, ${g}, ${b})`;

function svgElement(name, attributes = {}) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  return element;
}

/** A side of a cell in pixels: about `target` pixels for the longer side of the matrix. */
const cellSize = (rows, cols, target) => Math.max(1, Math.min(28, Math.floor(target / Math.max(rows, cols))));

/**
 * A <figure class="heatmap"> of a rows x cols matrix.
 * options: value(i, j), masked(i, j) (optional), scale {ramp, min, max}, xlabel, ylabel, caption,
 * data (data- attributes of the figure), describe(i, j) (the readout's words), readout (an element), target (px).
 */
export function heatmap({ rows, cols, value, masked = () => false, scale, xlabel, ylabel, caption, data = {},
                          describe, readout, target = 280 }) {
  const figure = document.createElement("figure");
  figure.className = "heatmap";
  Object.assign(figure.dataset, data, { rows, cols });
  const size = cellSize(rows, cols, target);
  const plot = rows * cols <= MAX_SVG_CELLS
    ? svgMatrix(rows, cols, size, value, masked, scale)
    : canvasMatrix(rows, cols, size, value, masked, scale);
  figure.dataset.render = plot.localName;
  // The readout: which cell is under the pointer and its value (or that it is masked).
  const show = (i, j) => {
    const words = describe ? describe(i, j) : `row ${i}, column ${j}`;
    readout.textContent = masked(i, j) ? `${words}: masked, weight 0` : `${words}: ${value(i, j)}`;
  };
  plot.addEventListener("pointermove", (event) => {
    const box = plot.getBoundingClientRect();
    const j = Math.floor(((event.clientX - box.left) / box.width) * cols);
    const i = Math.floor(((event.clientY - box.top) / box.height) * rows);
    if (i >= 0 && i < rows && j >= 0 && j < cols) show(i, j);
  });

  // A grid: the y label and the first and last row numbers left of the matrix, the column numbers below it.
  const body = document.createElement("div");
  body.className = "heatmap-body";
  body.append(span("axis-label y", ylabel), ticks("ticks y", rows), plot, span(), span(), ticks("ticks x", cols));
  const title = document.createElement("figcaption");
  title.textContent = caption;
  figure.append(title, body, span("axis-label x", xlabel));
  return figure;
}

function span(className = "", text = "") {
  const element = document.createElement("span");
  element.className = className;
  element.textContent = text;
  return element;
}

/** The first and the last index of an axis, at its two ends. */
const ticks = (className, count) => {
  const box = span(className);
  box.append(span("", "0"), ...(count > 1 ? [span("", String(count - 1))] : []));
  return box;
};

function svgMatrix(rows, cols, size, value, masked, scale) {
  // Cells large enough get a thin white edge, so that equal neighbours still read as cells.
  const svg = svgElement("svg", { width: cols * size, height: rows * size, class: size >= 12 ? "matrix edged" : "matrix" });
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const isMasked = masked(i, j);
      const v = value(i, j);
      const rect = svgElement("rect", {
        x: j * size, y: i * size, width: size, height: size,
        fill: isMasked ? "url(#masked-hatch)" : css(colourOf(scale, v)),
        class: isMasked ? "cell masked" : "cell",
        "data-row": i, "data-col": j, "data-value": String(v), "data-masked": String(isMasked),
      });
      svg.append(rect);
    }
  }
  return svg;
}

function canvasMatrix(rows, cols, size, value, masked, scale) {
  const canvas = document.createElement("canvas");
  canvas.className = "matrix";
  canvas.width = cols * size;
  canvas.height = rows * size;
  const context = canvas.getContext("2d");
  const image = context.createImageData(cols, rows);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      // Masked keys: the hatch's grey, alternating by diagonal (a hatch at one pixel a cell).
      const rgb = masked(i, j) ? ((i + j) % 2 ? [138, 138, 138] : [212, 212, 212]) : colourOf(scale, value(i, j));
      image.data.set([...rgb, 255], 4 * (i * cols + j));
    }
  }
  // One pixel a cell, then scaled up without smoothing: crisp cells at any size.
  const small = new OffscreenCanvas(cols, rows);
  small.getContext("2d").putImageData(image, 0, 0);
  context.imageSmoothingEnabled = false;
  context.drawImage(small, 0, 0, canvas.width, canvas.height);
  return canvas;
}

/** The colour bar of `scale` (ticks at min, middle, max), with the masked swatch when `withMasked`. */
export function colourBar(scale, { label, withMasked = false }) {
  const bar = document.createElement("div");
  bar.className = "colour-bar";
  bar.dataset.min = String(scale.min);
  bar.dataset.max = String(scale.max);
  const stops = scale.ramp.map((colour, i) => `${colour} ${(100 * i) / (scale.ramp.length - 1)}%`).join(", ");
  const gradient = document.createElement("span");
  gradient.className = "gradient";
  gradient.style.background = `linear-gradient(to right, ${stops})`;
  const ticks = document.createElement("span");
  ticks.className = "ticks";
  for (const v of [scale.min, (scale.min + scale.max) / 2, scale.max]) {
    const tick = document.createElement("span");
    tick.textContent = formatNumber(v);
    ticks.append(tick);
  }
  const name = document.createElement("span");
  name.className = "muted";
  name.textContent = label;
  const scaleBox = document.createElement("span");
  scaleBox.className = "scale";
  scaleBox.append(gradient, ticks);
  bar.append(name, scaleBox);
  if (withMasked) {
    const swatch = document.createElement("span");
    swatch.className = "masked-swatch";
    swatch.innerHTML = '<svg width="28" height="14" aria-hidden="true"><rect width="28" height="14" fill="url(#masked-hatch)"></rect></svg>';
    swatch.append(" masked key (beyond the valid length): weight exactly 0");
    bar.append(swatch);
  }
  return bar;
}

/** Four significant digits, without a trailing exponent for ordinary sizes. */
export function formatNumber(v) {
  if (v === 0 || Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 1e-4 && Math.abs(v) < 1e6 ? String(Number(v.toPrecision(4))) : v.toExponential(3);
}

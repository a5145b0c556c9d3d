// Columns of a matrix as curves over its rows, like the book's `d2l.plot` of P[:, 6:10] (one line a
// column, a legend "Col 6", ...). Each <polyline> carries its column and values (data-column, data-values).

const SVG = "http://www.w3.org/2000/svg";
// matplotlib's first colours and the book's line styles ('-', 'm--', 'g-.', 'r:').
const STYLES = [
  { stroke: "#1f77b4" }, { stroke: "#bf00bf", dash: "6 3" }, { stroke: "#008000", dash: "8 3 2 3" },
  { stroke: "#ff0000", dash: "2 3" },
];
const [WIDTH, HEIGHT, LEFT, BOTTOM, TOP, RIGHT] = [560, 220, 44, 32, 10, 90];

function el(name, attributes = {}, text) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

/** An <svg class="curves"> of matrix[:, c] for each c of `columns` against the row index. */
export function curves(matrix, columns, { xlabel = "Row (position)" } = {}) {
  const rows = matrix.length;
  const series = columns.map((c) => matrix.map((row) => row[c]));
  const all = series.flat();
  const [low, high] = [Math.min(-1, ...all), Math.max(1, ...all)];
  const x = (i) => LEFT + (i / Math.max(1, rows - 1)) * (WIDTH - LEFT - RIGHT);
  const y = (v) => TOP + ((high - v) / (high - low)) * (HEIGHT - TOP - BOTTOM);

  const svg = el("svg", { class: "curves", width: WIDTH, height: HEIGHT, viewBox: `0 0 ${WIDTH} ${HEIGHT}` });
  // Axes, with ticks at the ends and the middle.
  svg.append(el("line", { x1: LEFT, y1: y(low), x2: WIDTH - RIGHT, y2: y(low), class: "axis" }));
  svg.append(el("line", { x1: LEFT, y1: y(low), x2: LEFT, y2: y(high), class: "axis" }));
  for (const v of [low, (low + high) / 2, high]) {
    svg.append(el("text", { x: LEFT - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, String(+v.toFixed(2))));
  }
  for (const i of [0, Math.floor((rows - 1) / 2), rows - 1]) {
    svg.append(el("text", { x: x(i), y: y(low) + 14, "text-anchor": "middle", class: "tick" }, String(i)));
  }
  svg.append(el("text", { x: (LEFT + WIDTH - RIGHT) / 2, y: HEIGHT - 4, "text-anchor": "middle", class: "label" },
    xlabel));

  series.forEach((values, k) => {
    const style = STYLES[k % STYLES.length];
    const points = values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    const line = el("polyline", { points, fill: "none", stroke: style.stroke, "stroke-width": 1.5,
      "data-column": columns[k], "data-values": JSON.stringify(values) });
    if (style.dash) line.setAttribute("stroke-dasharray", style.dash);
    svg.append(line);
    // The legend, right of the plot.
    const ly = TOP + 8 + 16 * k;
    const sample = el("line", { x1: WIDTH - RIGHT + 10, y1: ly, x2: WIDTH - RIGHT + 34, y2: ly, stroke: style.stroke,
      "stroke-width": 1.5 });
    if (style.dash) sample.setAttribute("stroke-dasharray", style.dash);
    svg.append(sample, el("text", { x: WIDTH - RIGHT + 38, y: ly + 4, class: "tick" }, `Col ${columns[k]}`));
  });
  return svg;
}

/** "6-9" or "6, 7, 8, 9" or "0-1, 12" as column numbers in 0..count-1; throws with the reason otherwise. */
export function parseColumns(text, count) {
  const columns = [];
  for (const part of text.split(",").map((p) => p.trim()).filter(Boolean)) {
    const match = part.match(/^(\d+)(?:\s*-\s*(\d+))?$/);
    if (!match) throw new Error(`"${part}" is not a column number or a range like 6-9`);
    const [from, to] = [Number(match[1]), Number(match[2] ?? match[1])];
    if (to < from) throw new Error(`the range ${part} runs backwards`);
    for (let c = from; c <= to; c++) {
      if (c >= count) throw new Error(`column ${c} is past the last one, ${count - 1}`);
      columns.push(c);
    }
  }
  if (!columns.length) throw new Error("name at least one column");
  if (columns.length > 12) throw new Error("at most 12 columns at a time");
  return columns;
}

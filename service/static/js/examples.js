// What the page sends: the book's example for each kind of model, or random inputs of chosen sizes.
//
// Everything is derived from the model's `inputs` in GET /models (name, dtype, shape with named dynamic
// axes), so a model of a kind the page does not know still gets controls and random inputs.

/** A seeded uniform generator in [0, 1) (mulberry32): the same example on every load. */
export function seeded(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), a | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** A standard normal draw (Box-Muller), rounded to 3 decimals so that the text stays readable. */
function normal(random) {
  const u = 1 - random();
  const z = Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * random());
  return Math.round(z * 1000) / 1000;
}

/** A nested array of `shape`, each element `at(index)` (index: the flat position). */
export function tensor(shape, at) {
  let flat = 0;
  const build = (depth) =>
    depth === shape.length ? at(flat++) : Array.from({ length: shape[depth] }, () => build(depth + 1));
  return build(0);
}

export function shapeOf(array) {
  const shape = [];
  for (let a = array; Array.isArray(a); a = a[0]) shape.push(a.length);
  return shape;
}

const DEFAULT_SIZES = { batch: 2, n_q: 3, n_k: 5, n: 6 };

/** The inputs that are float tensors (not the valid lengths). */
export const tensorInputs = (model) => model.inputs.filter((spec) => spec.name !== "valid_lens");
export const takesLens = (model) => model.inputs.some((spec) => spec.name === "valid_lens");

/** The named (dynamic) axes of the model's inputs, in order of first appearance. */
export function dynamicAxes(model) {
  const names = [];
  for (const spec of model.inputs) {
    for (const axis of spec.shape) if (typeof axis === "string" && !names.includes(axis)) names.push(axis);
  }
  return names;
}

export const defaultSize = (axis) => DEFAULT_SIZES[axis] ?? 4;

/** The axis the valid lengths count along: the keys' (the attention weights' last axis). */
function keyAxis(model) {
  const weights = model.outputs?.find((spec) => spec.name === "attention_weights");
  if (weights) return weights.shape.at(-1);
  return dynamicAxes(model).includes("n_k") ? "n_k" : model.inputs.find((s) => s.name === "valid_lens").shape[1];
}

const resolve = (shape, sizes) => shape.map((axis) => (typeof axis === "number" ? axis : sizes[axis]));

/** Random inputs of the sizes chosen (`sizes`: axis name to length) and valid lengths "none", "1d" or "2d". */
export function randomInputs(model, sizes, lensMode, random = Math.random) {
  const inputs = {};
  for (const spec of tensorInputs(model)) inputs[spec.name] = tensor(resolve(spec.shape, sizes), () => normal(random));
  if (takesLens(model) && lensMode !== "none") {
    const [batch, nQ] = resolve(model.inputs.find((s) => s.name === "valid_lens").shape, sizes);
    const nK = sizes[keyAxis(model)];
    const length = () => 1 + Math.floor(random() * nK); // 1..n_k: 0 (attend to nothing) only when typed
    inputs.valid_lens = lensMode === "1d" ? tensor([batch], length) : tensor([batch, nQ], length);
  }
  return inputs;
}

/** The feature size `name` has in `model`, or `fallback` where the model leaves it free. */
function featureSize(model, name, fallback) {
  const last = model.inputs.find((spec) => spec.name === name)?.shape.at(-1);
  return typeof last === "number" ? last : fallback;
}

const ones = (shape) => tensor(shape, () => 1);

/** The book's keys and values for additive and dot-product attention: ones, and arange(40) as (10, 4) twice. */
function bookKeysValues(model) {
  const valueSize = featureSize(model, "values", 4);
  return {
    keys: ones([2, 10, featureSize(model, "keys", 2)]),
    values: tensor([2, 10, valueSize], (i) => i % (10 * valueSize)),
    valid_lens: [2, 6],
  };
}

// The examples of the chapters ("Attention Scoring Functions", "Multi-Head Attention", "Self-Attention and
// Positional Encoding"), sized to the model where it fixes a size.
const BOOK = {
  additive: (model, random) => ({
    queries: tensor([2, 1, featureSize(model, "queries", 20)], () => normal(random)),
    ...bookKeysValues(model),
  }),
  dot_product: (model, random) => ({
    queries: tensor([2, 1, featureSize(model, "keys", 2)], () => normal(random)),
    ...bookKeysValues(model),
  }),
  multi_head: (model) => ({
    queries: ones([2, 4, featureSize(model, "queries", 100)]),
    keys: ones([2, 6, featureSize(model, "keys", 100)]),
    values: ones([2, 6, featureSize(model, "values", 100)]),
    valid_lens: [3, 2],
  }),
  self_attention: (model, random) => ({
    queries: tensor([2, 6, featureSize(model, "queries", 100)], () => normal(random)),
    valid_lens: [6, 2],
  }),
  // masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3]))
  masked_softmax: (model, random) => ({
    scores: tensor([2, 2, 4], () => Math.round(random() * 1000) / 1000),
    valid_lens: [2, 3],
  }),
  // The chapter's figures: P for 60 positions and 32 encoding dimensions (X = 0, so the outputs are P).
  positional_encoding: (model) => ({
    queries: tensor([1, 60, featureSize(model, "queries", 32)], () => 0),
  }),
};

/** The book's example for the model's kind; random inputs (1-D valid lengths) for a kind the book lacks. */
export function bookExample(model) {
  const random = seeded(0);
  const example = BOOK[model.kind];
  if (example) return example(model, random);
  const sizes = Object.fromEntries(dynamicAxes(model).map((axis) => [axis, defaultSize(axis)]));
  return randomInputs(model, sizes, "1d", random);
}

/** The axis sizes of a set of inputs, read back from their shapes (to show them in the controls). */
export function sizesOf(model, inputs) {
  const sizes = {};
  for (const spec of model.inputs) {
    const shape = inputs[spec.name] === undefined ? [] : shapeOf(inputs[spec.name]);
    spec.shape.forEach((axis, i) => {
      if (typeof axis === "string" && shape[i] !== undefined && sizes[axis] === undefined) sizes[axis] = shape[i];
    });
  }
  return sizes;
}

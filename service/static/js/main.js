// The page: choose a model of GET /models, fill its inputs (the book's example, random ones, or typed),
// send them to POST /attend, draw the answer. An error of the service is shown next to the field it names.
// On load it draws the book's example of the first model, so the page opens on a picture, not empty plots.
//
// <body data-state> says where the page is (loading, sending, shown, error): what a test waits for.

import { api, ApiError } from "./api.js";
import {
  bookExample, defaultSize, dynamicAxes, randomInputs, shapeOf, sizesOf, takesLens, tensorInputs,
} from "./examples.js";
import { renderEncoding, renderOutputs, renderWeights } from "./render.js";

const $ = (selector) => document.querySelector(selector);
const state = { models: [], model: null };

function setState(name, words = "") {
  document.body.dataset.state = name;
  $("#status").textContent = words;
}

// ---------------------------------------------------------------------------------------------- errors

function clearErrors() {
  for (const slot of document.querySelectorAll("#request .field-error")) {
    slot.hidden = true;
    slot.textContent = "";
  }
  for (const input of document.querySelectorAll("#request [aria-invalid]")) input.removeAttribute("aria-invalid");
}

/** The error next to its field (a textarea, the model, the valid lengths), or under Send if none is shown. */
function showError({ field, message, expected, received }) {
  const slot = document.querySelector(`#request .field-error[data-error-for="${CSS.escape(field ?? "")}"]`)
    ?? $('#request .field-error[data-error-for="request"]');
  const details = [expected !== undefined && `expected ${JSON.stringify(expected)}`,
    received !== undefined && `received ${JSON.stringify(received)}`].filter(Boolean);
  slot.textContent = details.length ? `${message} (${details.join(", ")})` : message;
  if (slot.dataset.errorFor === "request" && field) slot.textContent = `${field}: ${slot.textContent}`;
  slot.hidden = false;
  document.querySelector(`#request [name="${CSS.escape(field ?? "")}"]`)?.setAttribute("aria-invalid", "true");
}

// ---------------------------------------------------------------------------------------------- inputs

/** A labelled textarea for an input of the model: its shape from GET /models, its JSON, its error. */
function fieldBlock(spec, optional) {
  const block = document.createElement("div");
  block.className = "field";
  const label = document.createElement("label");
  label.htmlFor = `input-${spec.name}`;
  const name = document.createElement("code");
  name.textContent = spec.name;
  label.append(name, " ");
  const shape = document.createElement("span");
  shape.className = "muted";
  shape.textContent = `(${spec.name === "valid_lens" ? "absent, [batch] or [batch, n_q]" : spec.shape.join(", ")})`
    + (optional ? ", optional" : "");
  label.append(shape);
  const text = document.createElement("textarea");
  text.id = `input-${spec.name}`;
  text.name = spec.name;
  text.rows = 3;
  text.spellcheck = false;
  const got = document.createElement("span");
  got.className = "muted got";
  text.addEventListener("input", () => describeShape(text, got));
  const error = document.createElement("p");
  error.className = "field-error";
  error.dataset.errorFor = spec.name;
  error.setAttribute("role", "alert");
  error.hidden = true;
  block.append(label, text, got, error);
  return block;
}

function describeShape(text, got) {
  try {
    const value = text.value.trim() ? JSON.parse(text.value) : null;
    got.textContent = value === null ? "absent" : `shape [${shapeOf(value).join(", ")}]`;
  } catch {
    got.textContent = "not JSON yet";
  }
}

function fill(inputs) {
  for (const text of document.querySelectorAll("#fields textarea")) {
    const value = inputs[text.name];
    text.value = value === undefined ? "" : JSON.stringify(value);
    describeShape(text, text.parentElement.querySelector(".got"));
  }
  // The controls show the sizes of what was filled in, so "Generate" starts from them.
  const sizes = sizesOf(state.model, inputs);
  for (const box of document.querySelectorAll("#axes input")) {
    if (sizes[box.dataset.axis] !== undefined) box.value = sizes[box.dataset.axis];
  }
  const lens = inputs.valid_lens;
  const mode = lens === undefined ? "none" : Array.isArray(lens[0]) ? "2d" : "1d";
  document.querySelector(`input[name="lens"][value="${mode}"]`).checked = true;
}

function chooseModel(name) {
  const model = state.models.find((m) => m.name === name);
  state.model = model;
  const hp = Object.entries(model.hyperparameters ?? {}).map(([k, v]) => `${k} ${v}`).join(", ");
  $("#model-info").textContent = `${model.kind}${hp ? `: ${hp}` : ""}`;
  // One size box per named axis of the model's inputs (batch, n_q, n_k, n, d, value_size, ...).
  const axes = $("#axes");
  axes.replaceChildren();
  for (const axis of dynamicAxes(model)) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    Object.assign(box, { type: "number", min: 1, max: axis === "batch" ? 64 : 1000, value: defaultSize(axis),
      name: `axis-${axis}` });
    box.dataset.axis = axis;
    label.append(`${axis} `, box);
    axes.append(label);
  }
  $("#lens-mode").hidden = !takesLens(model);
  const fields = $("#fields");
  fields.replaceChildren(...tensorInputs(model).map((spec) => fieldBlock(spec, false)));
  if (takesLens(model)) fields.append(fieldBlock(model.inputs.find((s) => s.name === "valid_lens"), true));
  clearErrors();
  $("#result").hidden = true; // the last answer was another model's
  fill(bookExample(model));
}

function generate() {
  const sizes = {};
  for (const box of document.querySelectorAll("#axes input")) sizes[box.dataset.axis] = Math.max(1, box.valueAsNumber || 1);
  const mode = document.querySelector('input[name="lens"]:checked').value;
  clearErrors();
  fill(randomInputs(state.model, sizes, mode));
}

// ---------------------------------------------------------------------------------------------- send

/** The request body from the fields; null (with the error shown) when a field is not JSON. */
function requestBody() {
  const body = { model: state.model.name };
  for (const text of document.querySelectorAll("#fields textarea")) {
    if (!text.value.trim()) continue; // absent: the service says if it was needed
    try {
      body[text.name] = JSON.parse(text.value);
    } catch (e) {
      showError({ field: text.name, message: `${text.name} is not JSON: ${e.message}` });
      return null;
    }
  }
  return body;
}

async function send(event) {
  event?.preventDefault();
  clearErrors();
  const body = requestBody();
  if (!body) return setState("error", "not sent");
  setState("sending", "sending...");
  $("#result").hidden = true;
  try {
    const answer = await api("/attend", { method: "POST", body });
    // Masked keys are known from the valid lengths sent, not guessed from zeros in the answer.
    renderWeights($("#weights"), answer.attention_weights, body.valid_lens);
    renderEncoding($("#pe"), answer.P);
    renderOutputs($("#outputs"), answer.outputs);
    $("#result").hidden = false;
    setState("shown", `${answer.model}: done`);
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    showError(e.error);
    setState("error", `HTTP ${e.status}`);
  }
}

// ---------------------------------------------------------------------------------------------- start

async function start() {
  $("#request").addEventListener("submit", send);
  $("#book").addEventListener("click", () => { clearErrors(); fill(bookExample(state.model)); });
  $("#random").addEventListener("click", generate);
  $("#model").addEventListener("change", (event) => chooseModel(event.target.value));
  try {
    const { models } = await api("/models");
    state.models = models.filter((m) => m.status === "ready");
  } catch (e) {
    if (!(e instanceof ApiError)) throw e;
    showError({ field: "model", message: `GET /models: ${e.message}` });
    return setState("error", `HTTP ${e.status}`);
  }
  $("#model").replaceChildren(...state.models.map((m) => new Option(`${m.name} (${m.kind})`, m.name)));
  if (!state.models.length) return setState("error", "no model is ready");
  chooseModel(state.models[0].name);
  await send(); // the book's example, drawn without a click
}

start();

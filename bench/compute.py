"""Compute on long sequences (issue 25, "Long sequences"): for dot_product and multi_head at n = 16 to 2048,
the graph the service serves on the CPU (model.cpu.onnx: ONNX's `Attention` operator, export.fused), run by
ONNX Runtime as the service runs it, against the book's module in eager PyTorch, against the decomposed
graph traced from it (model.onnx: what every other execution provider runs), and against the floor
measured on this machine. Beside the served graph, its twin without the weights output
(model.cpu.outputs.onnx), which the service runs for a batch that returns no weights.

The floor is what no graph computing the weights can go below here: the GEMMs of the same shapes (Q K^T
and W V per head; for multi_head the four projections too), each timed alone as one ONNX Runtime MatMul
and as NumPy's matmul, the faster taken; plus one softmax over the weights' elements (ONNX Runtime's
Softmax of the same shape: one read, one write, the exponentials), the least a graph that returns the
weights must spend on them; plus one ONNX Runtime run's own cost, which each part timed through ONNX
Runtime is counted without (an Identity on one float). Each is the median of its own repeats.

One core (os.sched_setaffinity), one thread (torch.set_num_threads(1), ORT intra_op_num_threads=1, NumPy's
BLAS told so before it loads); random inputs, random valid lengths from 1 to n in both forms the service
feeds its graphs: one length an example (1-D lengths, the book's examples, and absent ones, where the
served graph builds no mask) and one a query (2-D, where it builds one); rows of valid length 0 are
checked apart, on a small case; the graphs, on both forms, alternate call by call and with eager
PyTorch block by block (a call right after torch's runs slower: caches), and a figure is the median of
the repeats: as many as fit in about 2 s a point and form (0.5 s a part of the floor), at least 5, at
most --repeats.
By default the models are exported afresh (seed 0, as `python -m export`) into a temporary repository, so
the graphs are this tree's; --repository times an existing one. The thread flushes denormals to zero, as
the service's do (ATTEND_FLUSH_DENORMALS, on by default). About two minutes on a quiet 2-core
machine; timings need the machine to themselves.

    python bench/compute.py [--repeats 2001] [--kinds dot_product multi_head] [--sizes 8x16 ... 1x2048]
                            [--lengths example query] [--repository DIR] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # NumPy's BLAS reads these when it loads: one thread, as the rest

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from export.build import build_module  # noqa: E402
from export.repository import default_hyperparameters, without_head_axis  # noqa: E402
from service.core import denormals  # noqa: E402
from service.core.runtime import Registry  # noqa: E402
from tests.load.report import write_section  # noqa: E402

SECTION = "compute"
# (batch, n): the batch shrinks as n grows.
SIZES = [(8, 16), (8, 64), (8, 128), (4, 256), (2, 512), (1, 1024), (1, 2048)]
D = 64  # dot_product's features (queries, keys and values)
POINT_SECONDS = 2.0  # about this long the three runs of a point: fewer repeats where a round is slow
PART_SECONDS = 0.5  # and each part of its floor


def session_options() -> ort.SessionOptions:
    """What service.core.runtime gives a model's session, with one thread."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


# The forms of valid lengths: one an example (what the service feeds for 1-D lengths and absent ones: each
# row one number) and one a query (2-D).
LENGTHS = {"example": "per example", "query": "per query"}


def inputs(kind: str, batch: int, n: int, hp: dict, rng: np.random.Generator,
           lens: np.ndarray | None = None, per: str = "query") -> dict[str, np.ndarray]:
    f = hp["num_hiddens"] if kind == "multi_head" else D
    feed = {name: rng.standard_normal((batch, n, f), dtype=np.float32) for name in ("queries", "keys", "values")}
    if lens is None:
        lens = rng.integers(1, n + 1, size=(batch, n if per == "query" else 1), dtype=np.int64)
    feed["valid_lens"] = np.array(np.broadcast_to(lens, (batch, n)))  # a copy: writable, as torch wants
    return feed


def torch_call(module: torch.nn.Module, feed: dict[str, np.ndarray]) -> Callable[[], tuple]:
    args = [torch.from_numpy(feed[name]) for name in ("queries", "keys", "values", "valid_lens")]

    def call() -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            out, weights = module(*args)
        return out.numpy(), weights.numpy()
    return call


def ort_call(session: ort.InferenceSession, feed: dict[str, np.ndarray], head_axis: bool = False
             ) -> Callable[[], list]:
    """A run of a graph that returns the weights; with `head_axis` (dot_product's CPU graph: the served
    model's `LoadedModel.head_axis`) they come with the axis of its one head, viewed away as the service
    does."""
    def call() -> list:
        out, weights = session.run(["outputs", "attention_weights"], feed)
        return [out, without_head_axis(weights) if head_axis else weights]
    return call


def outputs_call(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> Callable[[], list]:
    """A run of the graph without the weights (model.cpu.outputs.onnx)."""
    return lambda: session.run(["outputs"], feed)


def timed(calls: dict[str, Callable[[], object]], repeats: int, seconds: float = POINT_SECONDS) -> dict[str, float]:
    """Median ms per call of each, the calls alternating: one warm-up each first, which also sets how many
    rounds fit in `seconds` (at least 5, at most `repeats`). The order turns round by round, so that each
    follows each as often."""
    return timed_apart([calls], repeats, seconds)


def timed_apart(groups: list[dict[str, Callable[[], object]]], repeats: int,
                seconds: float = POINT_SECONDS, block: int = 10) -> dict[str, float]:
    """`timed` for groups of calls that must not follow one another: blocks of `block` rounds of one group,
    then of the next, each block after an untimed call of each of its calls. Eager PyTorch's calls leave
    the caches and predictors to themselves: the ONNX Runtime call right after one runs ~20 us slower at
    the smallest sizes, which a fixed order would charge to one graph alone (the service never runs torch)."""
    times: dict[str, list[float]] = {label: [] for calls in groups for label in calls}
    start = time.perf_counter()
    for calls in groups:
        for call in calls.values():
            call()
    repeats = max(5, min(repeats, int(seconds / max(time.perf_counter() - start, 1e-6))))
    done = 0
    while done < repeats:
        rounds = min(block, repeats - done)
        for calls in groups:
            order = list(calls.items())
            for _, call in order:
                call()  # untimed: what ran before was another group's
            for round_ in range(done, done + rounds):
                turn = round_ % len(order)
                for label, call in order[turn:] + order[:turn]:
                    start = time.perf_counter()
                    call()
                    times[label].append((time.perf_counter() - start) * 1e3)
        done += rounds
    return {label: statistics.median(values) for label, values in times.items()}


def _one_op(op: str, shapes: list[tuple[int, ...]], **attrs: int) -> Callable[[], object]:
    """One ONNX Runtime node of `op` on random inputs of `shapes`, as a call."""
    names = [f"x{i}" for i in range(len(shapes))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], op,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)) for name, shape in zip(names, shapes,
                                                                                                   strict=True)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in zip(names, shapes, strict=True)}
    return lambda: session.run(None, feed)


def run_overhead(repeats: int) -> float:
    """ms of an ONNX Runtime run that does nothing (an Identity on one float): each part of the floor timed
    through ONNX Runtime is counted without it, and the floor counts it once, as a served call pays it once."""
    return timed({"empty": _one_op("Identity", [(1,)])}, repeats, PART_SECONDS)["empty"]


def _gemm(a: tuple[int, ...], b: tuple[int, ...], repeats: int, overhead: float) -> float:
    """ms of the faster of ONNX Runtime's MatMul (less its run's overhead) and NumPy's matmul of a @ b."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(a, dtype=np.float32), rng.standard_normal(b, dtype=np.float32)
    ms = timed_apart([{"ort": _one_op("MatMul", [a, b])}, {"numpy": lambda: np.matmul(x, y)}], repeats, PART_SECONDS)
    return min(max(ms["ort"] - overhead, 0.0), ms["numpy"])


def floor(kind: str, batch: int, n: int, hp: dict, repeats: int, overhead: float) -> dict[str, float]:
    """The floor's parts, ms: the GEMMs, the softmax over the weights, one run's overhead."""
    heads = int(hp.get("num_heads", 1))
    head = D if kind == "dot_product" else hp["num_hiddens"] // heads
    softmax = timed({"softmax": _one_op("Softmax", [(batch, heads, n, n)], axis=-1)}, repeats,
                    PART_SECONDS)["softmax"]
    parts = {
        "Q K^T": _gemm((batch, heads, n, head), (batch, heads, head, n), repeats, overhead),
        "W V": _gemm((batch, heads, n, n), (batch, heads, n, head), repeats, overhead),
        "softmax": max(softmax - overhead, 0.0),
    }
    if kind == "multi_head":  # W_q, W_k, W_v and W_o: four GEMMs of the same shape (n_q = n_k)
        hidden = hp["num_hiddens"]
        parts["projections"] = 4 * _gemm((batch, n, hidden), (hidden, hidden), repeats, overhead)
    parts["run"] = overhead
    return parts


def diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def fully_masked(kind: str, hp: dict, module: torch.nn.Module,
                 sessions: dict[str, tuple[ort.InferenceSession, bool]]) -> str:
    """What each gives a query of valid length 0 (the timings have none): batch 2 x n 8, one row at 0."""
    lens = np.array([[3, 0, 8, 1, 5, 0, 2, 7], [0] * 8], dtype=np.int64)
    feed = inputs(kind, 2, 8, hp, np.random.default_rng(1), lens)
    runs = {"PyTorch": torch_call(module, feed)()}
    runs |= {label: ort_call(session, feed, head_axis)() for label, (session, head_axis) in sessions.items()}
    zero = lens == 0
    parts = []
    for label, (out, weights) in runs.items():
        out_rows = out[zero]
        w_rows = weights[zero] if weights.ndim == 3 else weights.transpose(0, 2, 1, 3)[zero]
        if np.isnan(out_rows).any() or np.isnan(w_rows).any():
            what = "NaN"
        elif not out_rows.any() and not w_rows.any():
            what = "zero output and weights"
        else:
            what = f"output max |{np.abs(out_rows).max():.3g}|, weights max {np.abs(w_rows).max():.3g}"
        parts.append(f"{label}: {what}")
    return f"{kind}, rows of valid length 0: " + "; ".join(parts)


def cpu() -> str:
    """The CPU's model and the vector extensions MLAS picks its kernels by: with AVX-512F, its softmax's exponential
    underflows on masked scores, which an Intel core pays for with a microcode assist (`python bench/underflow.py`)."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    return f"{model} ({', '.join(f for f in ('avx2', 'avx512f', 'amx_tile') if f in flags) or 'no AVX2'})"


def _repository(kinds: list[str], folder: Path) -> Path:
    """The kinds exported as `python -m export` does (seed 0), into `folder`."""
    from export.publish import export_model

    for kind in kinds:
        export_model(folder, kind, kind, default_hyperparameters(kind))
    return folder


def _size(text: str) -> tuple[int, int]:
    batch, _, n = text.partition("x")
    try:
        return int(batch), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxN, e.g. 8x128") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, help="an existing model repository (default: export afresh)")
    parser.add_argument("--repeats", type=int, default=2001,
                        help="most timed calls of each run per point (median); fewer where they would take "
                        f"more than {POINT_SECONDS:.0f} s")
    parser.add_argument("--kinds", nargs="+", default=["dot_product", "multi_head"],
                        choices=["dot_product", "multi_head"])
    parser.add_argument("--sizes", nargs="+", type=_size, default=SIZES, metavar="BATCHxN",
                        help="points to time (default: " + " ".join(f"{b}x{n}" for b, n in SIZES) + ")")
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS),
                        help="forms of valid lengths to time at each point: one an example (1-D), one a query "
                        "(2-D); default both")
    parser.add_argument("--out", type=Path, help=f"markdown file to write the table into (section {SECTION})")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="compute.") as tmp:
        repository = args.repository or _repository(args.kinds, Path(tmp) / "repo")
        registry = Registry.load(repository, "cpu", 1)
        denormals.set_flush(True)  # this thread runs every graph as a served run does (ATTEND_FLUSH_DENORMALS)
        overhead = run_overhead(args.repeats)
        rows, notes = [], []
        for kind in args.kinds:
            served = registry.get(kind)
            hp = dict(served.config.hyperparameters)
            folder = repository / kind
            torch.manual_seed(0)  # as export.publish does for the default repository (seed 0)
            module = build_module(kind, hp)
            decomposed = ort.InferenceSession(str(folder / served.config.model_file), session_options(),
                                              providers=["CPUExecutionProvider"])
            # Each graph, and whether its weights come with the axis of its one head (as the service views them).
            sessions = {"served": (served.session, served.head_axis is not None), "decomposed": (decomposed, False)}
            if served.model_file == served.config.model_file:
                notes.append(f"{kind}: the repository has no CPU graph; the service serves model.onnx "
                             "(export again for model.cpu.onnx)")
            rng = np.random.default_rng(0)
            for batch, n in args.sizes:
                shape = f"{batch} x {n} x {n} x {D}" if kind == "dot_product" else \
                    f"{batch} x {n} x {n} x {hp['num_hiddens']}, {hp['num_heads']} heads"
                parts = floor(kind, batch, n, hp, args.repeats, overhead)  # the same for either form
                least = sum(parts.values())
                # Both forms of lengths in one timing, call by call: their ratio is of the same seconds.
                feeds = {per: inputs(kind, batch, n, hp, rng, per=per) for per in args.lengths}
                graphs = {f"{label} {per}": ort_call(session, feed, head_axis) for per, feed in feeds.items()
                          for label, (session, head_axis) in sessions.items()}
                if served.session_without_weights is not None:  # what a batch that returns no weights runs
                    graphs |= {f"outputs {per}": outputs_call(served.session_without_weights, feed)
                               for per, feed in feeds.items()}
                eager = {f"torch {per}": torch_call(module, feed) for per, feed in feeds.items()}
                times = timed_apart([graphs, eager], args.repeats, POINT_SECONDS * len(feeds))
                for per in feeds:
                    ms = {label: times.get(f"{label} {per}", float("nan"))
                          for label in ("served", "decomposed", "torch", "outputs")}
                    ref_out, ref_w = eager[f"torch {per}"]()
                    s_out, s_w = graphs[f"served {per}"]()
                    rows.append(
                        f"| {kind} | {shape} | {LENGTHS[per]} | {ms['served']:.4g} | {ms['outputs']:.4g} "
                        f"| {ms['torch']:.4g} "
                        f"| {ms['decomposed']:.4g} | {least:.4g} | **{ms['served'] / ms['torch']:.2f}** "
                        f"| **{ms['served'] / least:.2f}** | {ms['decomposed'] / ms['served']:.2f} "
                        f"| {diff(s_out, ref_out):.1e} / {diff(s_w, ref_w):.1e} "
                        f"| {' + '.join(f'{v:.4g}' for v in parts.values())} |")
                    print(rows[-1], flush=True)
            notes.append(fully_masked(kind, hp, module, sessions))
            notes.append(f"{kind}: served {served.model_file} (opset {served.opset}), decomposed "
                         f"{served.config.model_file} (opset {served.config.opset}); floor parts: "
                         + " + ".join(parts))

    table = [
        "| model | batch x n_q x n_k x features | valid lengths | served ms | served without weights ms "
        "| eager PyTorch ms | decomposed ms | floor ms | served / eager | served / floor | decomposed / served "
        "| served max diff (outputs / weights) | floor parts ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"Medians of up to {args.repeats} calls each (about {POINT_SECONDS:.0f} s a point and form of lengths, "
        f"at least 5 calls), the graphs on both forms alternating call by call, and with eager PyTorch "
        f"block by block; one core, one thread; CPU: {cpu()}; "
        f"ONNX Runtime {ort.__version__}, torch {torch.__version__}, NumPy {np.__version__}; load "
        f"average {load:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end (the number of cores would be all busy). Served: the graph the "
        f"service runs on the CPU; without weights: model.cpu.outputs.onnx, what it runs for a batch that "
        f"returns no weights (timed with the others, call by call); decomposed: model.onnx, traced from the "
        f"module (what other execution providers run); floor: the GEMMs of the same shapes (ONNX Runtime's "
        f"MatMul or NumPy's, the faster) "
        f"plus one softmax over the weights (ONNX Runtime's Softmax), each timed alone less ONNX Runtime's "
        f"cost of a run ({overhead * 1e3:.0f} us), which the floor counts once. Max diffs are against the "
        f"PyTorch module's outputs and weights.",
        "",
        *[f"- {note}" for note in notes],
    ]
    print()
    print("\n".join(table))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.out:
        write_section(args.out, SECTION, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU graph (export.fused, `model.cpu.onnx`): one `Attention` node, written and validated beside
model.onnx, named in config.json, and the same numbers as the PyTorch module, the book's code and the
plain-math oracle, valid lengths 0 and full included. The same of its twin without the weights
(`model.cpu.outputs.onnx`) and of CUDA's graph without them (`model.cuda.outputs.onnx`: heads padded to a
multiple of 8), both run here on ONNX Runtime's CPU execution provider; and of that graph's fp16 form (a
bench's, bench/longseq.py), to fp16's precision."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.build import build_module, make_inputs
from export.cli import main
from export.errors import ExportError, ValidationError
from export.fused import FUSED_KINDS, HALF_TOLERANCE, _pad_heads, fused_graph, padded_head_size
from export.repository import (
    CONFIG_FILE,
    CPU_GRAPH_LOG_SEVERITY,
    KINDS,
    default_hyperparameters,
    one_head_axis,
    read_config,
    sha256_of,
    shape_agrees,
    signature,
    valid_lens_2d,
    without_head_axis,
)
from export.validate import _valid_lens, run_case, sweep
from tests import book
from tests.export.test_export import _default_module, _extra_cases
from tests.models import oracle

pytestmark = pytest.mark.slow


def _session(path_or_model):
    source = path_or_model.SerializeToString() if isinstance(path_or_model, onnx.ModelProto) else str(path_or_model)
    options = ort.SessionOptions()
    options.log_severity_level = CPU_GRAPH_LOG_SEVERITY  # as the service runs it
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", KINDS)
def test_config_names_the_cpu_graph_with_its_sha256(repository, kind):
    config = read_config(repository / kind)
    raw = json.loads((repository / kind / "1" / CONFIG_FILE).read_text())
    if kind not in FUSED_KINDS:
        assert config.variants == {} and raw["variants"] == {}
        assert config.graph_for(cpu=True) == ("1/model.onnx", config.sha256, config.opset)
        return
    variant = config.variants["cpu"]
    path = repository / kind / variant["file"]
    assert variant == {"file": "1/model.cpu.onnx", "sha256": sha256_of(path), "opset": 24}
    assert raw["variants"] == config.variants  # the version's own config.json says the same
    assert config.graph_for(cpu=True) == ("1/model.cpu.onnx", variant["sha256"], 24)
    assert config.graph_for(cpu=False) == ("1/model.onnx", config.sha256, config.opset)
    model = onnx.load(str(path))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("If") == 1 and not {"Attention", "Softmax", "Where"} & set(ops)
    # One `Attention` node a branch: lengths per example go in as nonpad_kv_seqlen (its 7th input) and no
    # mask is built; lengths per query as the mask (its 4th).
    choice = next(node for node in model.graph.node if node.op_type == "If")
    branches = {a.name: onnx.helper.get_attribute_value(a) for a in choice.attribute}
    for branch, built, mask, lengths in (("then_branch", {"Clip", "Attention"}, "", "kv_lens"),
                                         ("else_branch", {"Cast", "Unsqueeze", "Range", "Less", "Attention"},
                                          "mask", None)):
        nodes = branches[branch].node
        assert {node.op_type for node in nodes} == built, branch
        attention = next(node for node in nodes if node.op_type == "Attention")
        assert attention.input[3] == mask and (attention.input[6:] or [None])[0] == lengths, branch
        assert {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}["qk_matmul_output_mode"] == 3
    # The weights leave as the node makes them (through the If, no copy): dot_product's with the axis of its
    # one head.
    makers = {output: node.op_type for node in model.graph.node for output in node.output}
    assert makers["attention_weights"] == "If"
    # The session's signature is config.json's, axis names included, where ONNX Runtime does not report the
    # 0 that onnx's shape inference of `Attention` makes of n_k (the service checks it at load), and
    # dot_product's weights have that head's axis besides (the service views it away).
    session = _session(path)
    assert [(i.name, i.shape) for i in session.get_inputs()] == [(s["name"], s["shape"]) for s in config.inputs]
    assert [o.name for o in session.get_outputs()] == [s["name"] for s in config.outputs]
    for o, s in zip(session.get_outputs(), config.outputs, strict=True):
        head_axis = kind == "dot_product" and o.name == "attention_weights"
        assert (one_head_axis if head_axis else shape_agrees)(o.shape, s["shape"]), (o.name, o.shape, s["shape"])
        assert not (shape_agrees if head_axis else one_head_axis)(o.shape, s["shape"]), (o.name, o.shape)
    # The 0s: the last axis of the weights the node makes, and no other. (Once onnx sizes it right, none:
    # then the service's reading of 0 and the quiet log severity can go.)
    zeros = {o.name: [i for i, a in enumerate(o.shape) if a == 0] for o in session.get_outputs()}
    assert zeros == {"outputs": [], "attention_weights": [3]}


def test_a_reported_shape_agrees_with_a_declared_one():
    assert shape_agrees(["batch", 5, "n_q", "n_k"], ["batch", 5, "n_q", "n_k"])
    assert shape_agrees(["batch", 5, "n_q", 0], ("batch", 5, "n_q", "n_k"))  # onnx's 0 for a symbolic size
    assert not shape_agrees(["batch", 5, "n_q", 0], ["batch", 5, "n_q", 7])  # a number is a number
    assert not shape_agrees(["batch", 4, "n_q", "n_k"], ["batch", 5, "n_q", "n_k"])
    assert not shape_agrees(["batch", "n_q", "n_k"], ["batch", "n_q", "n_k", "x"])
    assert not shape_agrees(["batch", "n_q", "n"], ["batch", "n_q", "n_k"])


def test_a_one_head_axis_is_a_size_1_axis_after_the_first():
    assert one_head_axis(["batch", 1, "n_q", 0], ("batch", "n_q", "n_k"))  # dot_product's CPU graph's weights
    assert one_head_axis(["batch", 1, "n_q", "n_k"], ["batch", "n_q", "n_k"])
    assert not one_head_axis(["batch", 5, "n_q", "n_k"], ["batch", "n_q", "n_k"])  # five heads are not one
    assert not one_head_axis(["batch", "n_q", 1, "n_k"], ["batch", "n_q", "n_k"])  # not after the first
    assert not one_head_axis(["batch", 1, "n_q", "n_k"], ["batch", 1, "n_q", "n_k"])  # declared: no axis more
    assert not one_head_axis(["batch", 1, "n_q", "n"], ["batch", "n_q", "n_k"])
    weights = np.arange(24, dtype=np.float32).reshape(2, 1, 3, 4)
    viewed = without_head_axis(weights)
    assert viewed.shape == (2, 3, 4) and np.shares_memory(viewed, weights) and viewed.flags.c_contiguous
    assert np.array_equal(viewed, weights[:, 0])


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_the_cpu_graph_matches_pytorch_on_many_shapes(repository, kind):
    hp = default_hyperparameters(kind)
    torch.manual_seed(0)  # the exporter's default seed: the same weights
    module = build_module(kind, hp)
    session = _session(repository / kind / read_config(repository / kind).variants["cpu"]["file"])
    cases = sweep(kind, hp) + _extra_cases(kind)
    for seed, case in enumerate(cases):
        run_case(module, session, kind, hp, case, seed=seed)  # raises on any disagreement (1e-5)


def _lens(form, batch, n_q, n_k, rng):
    """Lengths with 0 and n_k among them (and one past n_k: every key)."""
    lens = rng.integers(0, n_k + 2, size=(batch,) if form == "1d" else (batch, n_q))
    flat = lens.reshape(-1)
    flat[0], flat[-1] = 0, n_k
    return lens


def _graph_lens(lens, n_q):
    return lens if lens.ndim == 2 else np.repeat(lens[:, None], n_q, axis=1)


@pytest.mark.parametrize("form", ["1d", "2d"])
def test_dot_product_cpu_graph_is_the_oracle_and_the_book(repository, form):
    rng = np.random.default_rng(5)
    batch, n_q, n_k, d, v = 3, 6, 17, 8, 5
    Q, K, V = (rng.standard_normal(s, dtype=np.float32) for s in ((batch, n_q, d), (batch, n_k, d), (batch, n_k, v)))
    lens = _lens(form, batch, n_q, n_k, rng)
    session = _session(repository / "dot_product" / "1" / "model.cpu.onnx")
    out, weights = session.run(None, {"queries": Q, "keys": K, "values": V, "valid_lens": _graph_lens(lens, n_q)})
    assert weights.shape == (batch, 1, n_q, n_k)  # with the axis of its one head
    weights = without_head_axis(weights)
    want_out, want_w = oracle.dot_product(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64), lens)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-5)
    zero = _graph_lens(lens, n_q) == 0
    assert zero.any() and np.all(out[zero] == 0) and np.all(weights[zero] == 0)  # attends to nothing: zeros
    # The book's code, on the rows it defines (its -1e6 fill makes a length-0 row uniform).
    theirs = book.DotProductAttention(0.0).eval()
    with torch.no_grad():
        book_out = theirs(*map(torch.from_numpy, (Q, K, V)), torch.from_numpy(lens)).numpy()
    np.testing.assert_allclose(out[~zero], book_out[~zero], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights[~zero], theirs.attention_weights.numpy()[~zero], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["1d", "2d"])
def test_multi_head_cpu_graph_is_the_oracle(repository, form):
    rng = np.random.default_rng(6)
    batch, n_q, n_k = 2, 5, 12
    Q, K, V = (rng.standard_normal((batch, n, 100), dtype=np.float32) for n in (n_q, n_k, n_k))
    lens = _lens(form, batch, n_q, n_k, rng)
    torch.manual_seed(0)
    module = build_module("multi_head", default_hyperparameters("multi_head"))
    W = [getattr(module, name).weight.detach().double().numpy() for name in ("W_q", "W_k", "W_v", "W_o")]
    session = _session(repository / "multi_head" / "1" / "model.cpu.onnx")
    out, weights = session.run(None, {"queries": Q, "keys": K, "values": V, "valid_lens": _graph_lens(lens, n_q)})
    want_out, want_w = oracle.multi_head(*W, 5, Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64),
                                         lens)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-5)
    zero = _graph_lens(lens, n_q) == 0
    assert zero.any() and np.all(out[zero] == 0) and np.all(weights.transpose(0, 2, 1, 3)[zero] == 0)


def _books_checkpoint(tmp_path):
    """The book's MultiHeadAttention with bias (3 heads of 4), saved and exported as "mha": (it, the repository)."""
    torch.manual_seed(3)
    theirs = book.MultiHeadAttention(6, 4, 5, 12, 3, 0.0, bias=True).eval()
    torch.save(theirs.state_dict(), tmp_path / "mha.pt")
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", "multi_head", "--name", "mha", "--checkpoint",
                 str(tmp_path / "mha.pt"), "--num-heads", "3"]) == 0
    return theirs, repo


def test_a_books_checkpoint_with_bias_gives_the_books_numbers_on_the_cpu_graph(tmp_path):
    theirs, repo = _books_checkpoint(tmp_path)
    config = read_config(repo / "mha")
    Q, K, V = torch.randn(2, 5, 4), torch.randn(2, 8, 6), torch.randn(2, 8, 5)
    lens = torch.tensor([[1, 2, 3, 8, 9], [4, 5, 6, 7, 8]])
    out, weights = _session(repo / "mha" / config.variants["cpu"]["file"]).run(None, {
        "queries": Q.numpy(), "keys": K.numpy(), "values": V.numpy(), "valid_lens": lens.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(out, theirs(Q, K, V, lens).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights.reshape(6, 5, 8), theirs.attention.attention_weights.numpy(),
                               rtol=1e-5, atol=1e-6)


def test_a_cpu_graph_that_fails_validation_publishes_nothing(tmp_path, monkeypatch):
    import export.publish as publish

    def wrong(module, kind, hp, path):  # another seed's weights: model.onnx validates, the CPU graph must not
        torch.manual_seed(1)
        onnx.save(fused_graph(kind, build_module(kind, hp), hp), str(path))
        return 23

    monkeypatch.setattr(publish, "export_fused", wrong)
    repo = tmp_path / "repo"
    with pytest.raises(ValidationError, match="differs from PyTorch"):
        publish.export_model(repo, "mha", "multi_head", default_hyperparameters("multi_head"))
    assert sorted(p.name for p in repo.iterdir()) == []


def test_only_the_dot_product_family_has_a_cpu_graph():
    hp = default_hyperparameters("additive")
    with pytest.raises(ExportError, match="no fused graph for kind 'additive'"):
        fused_graph("additive", build_module("additive", hp), hp)


def _nodes_run(path, feed, tmp_path):
    """Names of the nodes ONNX Runtime ran for `feed` (its profile: the If's branch's nodes included)."""
    options = ort.SessionOptions()
    options.log_severity_level = CPU_GRAPH_LOG_SEVERITY
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feed)
    events = json.loads(open(session.end_profiling()).read())
    return {e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node"}


@pytest.mark.parametrize("kind", FUSED_KINDS)
@pytest.mark.parametrize("graph", ["cpu", "cuda"])
def test_lengths_one_a_row_build_no_mask(repository, kind, graph, tmp_path):
    """Each row of valid_lens one number (1-D lengths, absent ones): the node takes them as its
    nonpad_kv_seqlen and no mask is built; one example with lengths per query is enough for the mask. On
    CUDA's graph that is the case its fused kernels take with no score matrix and no bias; its Where zeroes
    the rows of valid length 0."""
    rng = np.random.default_rng(7)
    batch, n = 3, 6
    f = 8 if kind == "dot_product" else 100
    feed = {name: rng.standard_normal((batch, n, f), dtype=np.float32) for name in ("queries", "keys", "values")}
    if kind == "self_attention":
        feed = {"queries": feed["queries"]}
    path = _cuda_path(repository, kind) if graph == "cuda" else \
        repository / kind / read_config(repository / kind).variants["cpu"]["file"]
    per_example = np.array([[0] * n, [n] * n, [4] * n])  # 0 and every key among them
    per_query = per_example.copy()
    per_query[2, 5] = 3
    for lens, ran, skipped in ((per_example, "y_by_length", "y_by_mask"), (per_query, "y_by_mask", "y_by_length")):
        nodes = _nodes_run(path, {**feed, "valid_lens": lens}, tmp_path)
        assert ran in nodes and skipped not in nodes and ("mask" in nodes) == (ran == "y_by_mask"), lens
        if graph == "cuda":
            assert "attended" in nodes  # the Where of the rows of valid length 0


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_the_cpu_graph_without_weights_is_the_cpu_graph_less_its_weights(repository, kind):
    """model.cpu.outputs.onnx: named in config.json with its sha256, the same nodes without the weights
    output (the `Attention` nodes' fourth, dot_product's Reshape of it), and the same outputs as
    model.cpu.onnx to the bit on the validator's sweep and more, both forms of lengths among them."""
    config = read_config(repository / kind)
    variant = config.variants["cpu_outputs"]
    path = repository / kind / variant["file"]
    assert variant == {"file": "1/model.cpu.outputs.onnx", "sha256": sha256_of(path), "opset": 24}
    assert config.graph_without_weights() == ("1/model.cpu.outputs.onnx", variant["sha256"], 24)
    model = onnx.load(str(path))
    assert [o.name for o in model.graph.output] == ["outputs"]
    choice = next(node for node in model.graph.node if node.op_type == "If")
    for branch in choice.attribute:
        attention = next(node for node in branch.g.node if node.op_type == "Attention")
        assert list(attention.output) == [attention.output[0]], branch.name  # Y alone
    without, whole = _session(path), _session(repository / kind / config.variants["cpu"]["file"])
    hp = default_hyperparameters(kind)
    inputs, _ = signature(kind, hp)
    for seed, case in enumerate(sweep(kind, hp) + _extra_cases(kind)):
        sizes = {"batch": case.batch, "n_q": case.n_q, "n_k": case.n_k, "n": case.n_q, "d": case.d,
                 "value_size": case.value_size}
        feed = {spec.name: t.numpy() for spec, t in zip(inputs, make_inputs(kind, hp, sizes, seed), strict=True)}
        lens = _valid_lens(case, case.n_k, np.random.default_rng(seed))
        feed["valid_lens"] = valid_lens_2d(lens, case.batch, case.n_q, case.n_k)
        (alone,) = without.run(["outputs"], feed)
        np.testing.assert_array_equal(alone, whole.run(["outputs"], feed)[0], err_msg=str(case))


def _cuda_path(repository, kind):
    return repository / kind / read_config(repository / kind).variants["cuda_outputs"]["file"]


def _attention_nodes(model):
    """The If's branches by name, each with its one `Attention` node."""
    choice = next(node for node in model.graph.node if node.op_type == "If")
    return {a.name: next(n for n in a.g.node if n.op_type == "Attention") for a in choice.attribute}


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_the_cuda_graph_is_named_in_config_and_pads_its_heads_to_a_multiple_of_8(repository, kind):
    """model.cuda.outputs.onnx: in config.json with its sha256; `outputs` alone; in each branch one `Attention`
    node with Y alone, no qk_matmul_output_mode, nonpad_kv_seqlen in one branch and the mask in the other;
    the book's multi-head heads of 20 padded to 24 (zero columns of W_q, W_k, W_v, zero rows of W_o) with
    the scale of 20; a Where after the If for the rows of valid length 0; the signature config.json's."""
    config = read_config(repository / kind)
    variant = config.variants["cuda_outputs"]
    path = _cuda_path(repository, kind)
    assert variant == {"file": "1/model.cuda.outputs.onnx", "sha256": sha256_of(path), "opset": 24}
    assert config.graph_without_weights(cpu=False) == ("1/model.cuda.outputs.onnx", variant["sha256"], 24)
    assert config.graph_without_weights() == config.graph_without_weights(cpu=True) != variant
    model = onnx.load(str(path))
    assert [o.name for o in model.graph.output] == ["outputs"]
    nodes = _attention_nodes(model)
    for branch, mask, lengths in (("then_branch", "", "kv_lens"), ("else_branch", "mask", None)):
        attention = nodes[branch]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
        assert list(attention.output) == [attention.output[0]] and "qk_matmul_output_mode" not in attrs, branch
        assert attention.input[3] == mask and (attention.input[6:] or [None])[0] == lengths, branch
        if kind == "dot_product":
            assert attrs == {"q_num_heads": 1, "kv_num_heads": 1}  # its head size is the caller's d: the default scale
        else:
            assert attrs == {"q_num_heads": 5, "kv_num_heads": 5, "scale": pytest.approx(1 / np.sqrt(20))}
    makers = {output: node for node in model.graph.node for output in node.output}
    assert makers["attended"].op_type == "Where" and makers[makers["attended"].input[1]].op_type == "If"
    if kind != "dot_product":
        weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        torch.manual_seed(0)
        module = build_module(kind, default_hyperparameters(kind))
        for name in ("W_q", "W_k", "W_v"):
            padded, real = weights[f"{name}.weight"], getattr(module, name).weight.detach().numpy().T
            assert padded.shape == (100, 120)
            heads = padded.reshape(100, 5, 24)
            assert np.array_equal(heads[:, :, :20], real.reshape(100, 5, 20)) and not heads[:, :, 20:].any()
        padded = weights["W_o.weight"].reshape(5, 24, 100)
        assert np.array_equal(padded[:, :20], module.W_o.weight.detach().numpy().T.reshape(5, 20, 100))
        assert not padded[:, 20:].any()
    session = _session(path)
    assert [(i.name, i.shape) for i in session.get_inputs()] == [(s["name"], s["shape"]) for s in config.inputs]
    assert [(o.name, o.shape) for o in session.get_outputs()] == [(s["name"], s["shape"]) for s in config.outputs
                                                                   if s["name"] == "outputs"]


def test_heads_are_padded_each_after_its_own_entries():
    assert [padded_head_size(h) for h in (1, 8, 20, 64, 100)] == [8, 8, 24, 64, 104]
    columns = np.arange(12, dtype=np.float32).reshape(2, 6)  # 2 rows, 3 heads of 2
    assert np.array_equal(_pad_heads(columns, 3, 2, 4, axis=1),
                          [[0, 1, 0, 0, 2, 3, 0, 0, 4, 5, 0, 0], [6, 7, 0, 0, 8, 9, 0, 0, 10, 11, 0, 0]])
    assert np.array_equal(_pad_heads(columns.T, 3, 2, 4, axis=0), _pad_heads(columns, 3, 2, 4, axis=1).T)
    assert np.array_equal(_pad_heads(np.array([1.0, 2.0]), 2, 1, 3, axis=0), [1, 0, 0, 2, 0, 0])
    with pytest.raises(ExportError, match="no attention_weights output"):
        hp = default_hyperparameters("multi_head")
        fused_graph("multi_head", build_module("multi_head", hp), hp, weights=True, cuda=True)


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_the_cuda_graph_matches_pytorch_and_the_cpu_graph_on_many_shapes(repository, kind):
    """On the CPU execution provider, which runs it too: the module's outputs (1e-5, the validator's
    tolerance) on the sweep and more, and the CPU graph's outputs but for the rounding of the padded heads'
    GEMMs."""
    hp = default_hyperparameters(kind)
    torch.manual_seed(0)
    module = build_module(kind, hp)
    cuda, cpu = _session(_cuda_path(repository, kind)), _session(repository / kind / "1" / "model.cpu.outputs.onnx")
    inputs, _ = signature(kind, hp)
    for seed, case in enumerate(sweep(kind, hp) + _extra_cases(kind)):
        run_case(module, cuda, kind, hp, case, seed=seed, weights=False)  # raises on any disagreement (1e-5)
        sizes = {"batch": case.batch, "n_q": case.n_q, "n_k": case.n_k, "n": case.n_q, "d": case.d,
                 "value_size": case.value_size}
        feed = {spec.name: t.numpy() for spec, t in zip(inputs, make_inputs(kind, hp, sizes, seed), strict=True)}
        feed["valid_lens"] = valid_lens_2d(_valid_lens(case, case.n_k, np.random.default_rng(seed)), case.batch,
                                           case.n_q, case.n_k)
        (got,), (want,) = cuda.run(["outputs"], feed), cpu.run(["outputs"], feed)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(case))
        if kind == "dot_product":  # the same nodes but the Where, which leaves the CPU's zeros as they are
            np.testing.assert_array_equal(got, want, err_msg=str(case))


@pytest.mark.parametrize("form", ["1d", "2d"])
def test_the_cuda_graph_is_the_oracle(repository, form):
    rng = np.random.default_rng(8)
    torch.manual_seed(0)
    mha = build_module("multi_head", default_hyperparameters("multi_head"))
    W = [getattr(mha, name).weight.detach().double().numpy() for name in ("W_q", "W_k", "W_v", "W_o")]
    for kind, batch, n_q, n_k, d, v in (("dot_product", 3, 6, 17, 8, 5), ("multi_head", 2, 5, 12, 100, 100)):
        Q, K, V = (rng.standard_normal(shape, dtype=np.float32)
                   for shape in ((batch, n_q, d), (batch, n_k, d), (batch, n_k, v)))
        lens = _lens(form, batch, n_q, n_k, rng)
        (out,) = _session(_cuda_path(repository, kind)).run(None, {"queries": Q, "keys": K, "values": V,
                                                                   "valid_lens": _graph_lens(lens, n_q)})
        args = [a.astype(np.float64) for a in (Q, K, V)]
        want, _ = oracle.dot_product(*args, lens) if kind == "dot_product" else oracle.multi_head(*W, 5, *args, lens)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=kind)
        zero = _graph_lens(lens, n_q) == 0
        assert zero.any() and np.all(out[zero] == 0), kind  # attends to nothing: zeros


def test_a_books_checkpoint_with_bias_gives_the_books_numbers_on_the_cuda_graph(tmp_path):
    """Heads of 4 (12 / 3) padded to 8: the bias of W_q, W_k and W_v padded with them, W_o's not."""
    theirs, repo = _books_checkpoint(tmp_path)
    Q, K, V = torch.randn(2, 5, 4), torch.randn(2, 8, 6), torch.randn(2, 8, 5)
    model = onnx.load(str(_cuda_path(repo, "mha")))
    assert {i.name: list(i.dims) for i in model.graph.initializer if i.name.startswith("W_")} == {
        "W_q.weight": [4, 24], "W_q.bias": [24], "W_k.weight": [6, 24], "W_k.bias": [24], "W_v.weight": [5, 24],
        "W_v.bias": [24], "W_o.weight": [24, 12], "W_o.bias": [12]}
    for lens in (torch.tensor([[1, 2, 3, 8, 9], [4, 5, 6, 7, 8]]), torch.tensor([[3] * 5, [8] * 5])):
        (out,) = _session(_cuda_path(repo, "mha")).run(None, {
            "queries": Q.numpy(), "keys": K.numpy(), "values": V.numpy(), "valid_lens": lens.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(out, theirs(Q, K, V, lens).numpy(), rtol=1e-5, atol=1e-6)


def test_a_cuda_graph_that_fails_validation_publishes_nothing(tmp_path, monkeypatch):
    import export.publish as publish

    real = publish.export_fused

    def wrong_on_cuda(module, kind, hp, path, weights=True, cuda=False):  # another seed's weights, CUDA's graph only
        if cuda:
            torch.manual_seed(1)
            module = build_module(kind, hp)
        return real(module, kind, hp, path, weights, cuda)

    monkeypatch.setattr(publish, "export_fused", wrong_on_cuda)
    repo = tmp_path / "repo"
    with pytest.raises(ValidationError, match="outputs differs from PyTorch"):
        publish.export_model(repo, "mha", "multi_head", default_hyperparameters("multi_head"))
    assert sorted(p.name for p in repo.iterdir()) == []


def _half(kind):
    hp, module = default_hyperparameters(kind), _default_module(kind)
    return module, hp, fused_graph(kind, module, hp, weights=False, cuda=True, half=True)


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_the_fp16_graph_is_the_cuda_graph_with_its_attention_in_fp16(repository, kind):
    """fp32 in and out, as CUDA's graph; Q, K and V cast to fp16 for each `Attention` node (its attributes
    CUDA's graph's), Y cast back before the Where; the module's outputs within HALF_TOLERANCE on the
    validator's sweep and more."""
    module, hp, model = _half(kind)
    onnx.checker.check_model(model, full_check=True)
    fp32 = onnx.load(str(_cuda_path(repository, kind)))
    assert model.graph.input == fp32.graph.input and model.graph.output == fp32.graph.output
    makers = {output: node for node in model.graph.node for output in node.output}
    for branch, attention in _attention_nodes(model).items():
        assert attention.attribute == _attention_nodes(fp32)[branch].attribute, branch
        for name in attention.input[:3]:
            cast = makers[name]
            assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT16, (branch, name)
    assert makers[makers["attended"].input[1]].op_type == "Cast"  # Y back to fp32, then the Where
    with pytest.raises(ExportError, match="only the CUDA graph"):
        fused_graph(kind, module, hp, weights=False, half=True)
    session = _session(model)
    for seed, case in enumerate(sweep(kind, hp) + _extra_cases(kind)):
        run_case(module, session, kind, hp, case, seed=seed, weights=False, tolerance=HALF_TOLERANCE)


@pytest.mark.parametrize("form", ["1d", "2d"])
def test_the_fp16_graph_keeps_masked_keys_out_within_fp16s_range(form):
    """No -1e6 in fp16: keys past every query's length (+-1000: scores of about 1e4) leave the outputs as
    they were, bit for bit, and a row of valid length 0 stays zeros. Past fp16's range (1e6) such a key
    becomes inf and, on the CPU's kernel, NaN in the outputs: the graph may only run requests whose
    values and scores fit fp16 (+-65504; at 6e4 a masked key's score overflows and wins the mask's row)."""
    _, _, model = _half("dot_product")
    session = _session(model)
    rng = np.random.default_rng(9)
    batch, n_q, n_k = 3, 4, 8
    Q, K, V = (rng.standard_normal(s, dtype=np.float32) for s in ((batch, n_q, 8), (batch, n_k, 8), (batch, n_k, 5)))
    lens = np.array([[0] * n_q, [3] * n_q, [n_k] * n_q]) if form == "1d" else \
        np.array([[0, 1, 2, 3], [3, 2, 3, 1], [n_k, 4, 4, 4]])
    (base,) = session.run(None, {"queries": Q, "keys": K, "values": V, "valid_lens": lens})
    assert np.isfinite(base).all() and not base[lens == 0].any() and base[lens > 0].all()
    for big, same in ((1e3, True), (1e6, False)):
        K2, V2 = K.copy(), V.copy()
        for i, longest in enumerate(lens.max(axis=1)):
            K2[i, longest:], V2[i, longest:] = big, -big
        (out,) = session.run(None, {"queries": Q, "keys": K2, "values": V2, "valid_lens": lens})
        assert np.array_equal(out, base) is same and np.isnan(out).any() is not same, big

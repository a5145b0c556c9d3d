"""The exporter: the repository it writes, ONNX Runtime against PyTorch on many shapes, the
checkpoint path, and that nothing half-made is ever published."""

import contextlib
import fcntl
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch

import models
from export.build import build_module, export_onnx
from export.cli import main
from export.errors import ValidationError
from export.repository import CONFIG_FILE, KINDS, default_hyperparameters, read_config, sha256_of
from export.validate import Case, run_case, sweep, validate
from models import masked_softmax
from tests import book
from tests.server import ROOT

pytestmark = pytest.mark.slow


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _default_module(kind):
    torch.manual_seed(0)  # the exporter's default seed: the same weights as the exported model
    return build_module(kind, default_hyperparameters(kind))


def _entries(repo):
    return sorted(p.name for p in repo.iterdir())


# --- the default repository -----------------------------------------------------------------

def test_default_repository_has_the_books_configurations(repository):
    assert _entries(repository) == sorted(KINDS)
    hp = {kind: read_config(repository / kind).hyperparameters for kind in KINDS}
    assert hp["additive"] == {"key_size": 2, "query_size": 20, "num_hiddens": 8}
    assert hp["multi_head"] == {"key_size": 100, "query_size": 100, "value_size": 100, "num_hiddens": 100,
                                "num_heads": 5, "bias": False}
    assert hp["self_attention"] == {"num_hiddens": 100, "num_heads": 5, "max_len": 1000, "bias": False}
    assert hp["dot_product"] == {} and hp["masked_softmax"] == {}
    assert hp["positional_encoding"] == {"max_len": 1000}


@pytest.mark.parametrize("kind", KINDS)
def test_config_describes_the_file(repository, kind):
    config = read_config(repository / kind)
    raw = json.loads((repository / kind / CONFIG_FILE).read_text())
    model = repository / kind / config.model_file
    assert config.model_file == "1/model.onnx" and model.is_file()
    assert sha256_of(model) == config.sha256
    assert raw["versions"]["torch"].startswith("2.13.0") and raw["versions"]["onnx"]
    assert config.opset >= 18
    session = _session(model)
    # The session's own signature is the one config.json declares.
    assert [(i.name, i.shape) for i in session.get_inputs()] == [(s["name"], s["shape"]) for s in config.inputs]
    assert [(o.name, o.shape) for o in session.get_outputs()] == [(s["name"], s["shape"]) for s in config.outputs]
    # valid_lens, where the kind has lengths, comes last, as int64
    assert [i.type for i in session.get_inputs()][-1] == ("tensor(float)" if kind == "positional_encoding"
                                                          else "tensor(int64)")


def test_dynamic_axes_include_every_unfixed_feature_size(repository):
    axes = {kind: read_config(repository / kind).dynamic_axes for kind in KINDS}
    assert axes["dot_product"]["queries"] == {"0": "batch", "1": "n_q", "2": "d"}
    assert axes["dot_product"]["keys"] == {"0": "batch", "1": "n_k", "2": "d"}
    assert axes["dot_product"]["values"] == {"0": "batch", "1": "n_k", "2": "value_size"}
    assert axes["additive"]["queries"] == {"0": "batch", "1": "n_q"}
    assert axes["additive"]["values"] == {"0": "batch", "1": "n_k", "2": "value_size"}
    assert axes["multi_head"]["attention_weights"] == {"0": "batch", "2": "n_q", "3": "n_k"}
    assert axes["self_attention"]["queries"] == {"0": "batch", "1": "n"}
    assert axes["masked_softmax"]["scores"] == {"0": "batch", "1": "n_q", "2": "n_k"}
    assert axes["positional_encoding"]["queries"] == {"0": "batch", "1": "n", "2": "d"}
    assert axes["positional_encoding"]["P"] == {"0": "n", "1": "d"}


# --- ONNX Runtime against PyTorch, on shapes the export never saw ----------------------------

def _extra_cases(kind, count=12):
    """Random shapes beyond the validator's sweep: batch, n_q, n_k, d and value size all vary."""
    rng = np.random.default_rng(sum(map(ord, kind)))
    cases = []
    for i in range(count):
        batch, n_q, n_k = (int(x) for x in rng.integers(1, 12, size=3))
        lens, d = ("none", "1d", "2d")[i % 3], int(rng.integers(1, 70))
        if kind in ("self_attention", "positional_encoding"):
            n_k = n_q
        if kind == "positional_encoding":  # no lengths; an even d
            lens, d = "none", d + d % 2
        cases.append(Case(batch, n_q, n_k, lens, d=d, value_size=int(rng.integers(1, 70))))
    return cases


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_runtime_matches_pytorch_on_many_shapes(repository, kind):
    hp = default_hyperparameters(kind)
    module = _default_module(kind)
    session = _session(repository / kind / read_config(repository / kind).model_file)
    cases = sweep(kind, hp) + _extra_cases(kind)
    assert len(cases) >= 20
    for seed, case in enumerate(cases):
        run_case(module, session, kind, hp, case, seed=seed)  # raises on any disagreement


def test_run_case_detects_different_weights(repository):
    # The comparison must be able to fail: another seed's weights disagree.
    torch.manual_seed(1)
    other = build_module("additive", default_hyperparameters("additive"))
    session = _session(repository / "additive" / "1" / "model.onnx")
    with pytest.raises(ValidationError, match="differs from PyTorch on case batch=2 n_q=3 n_k=5"):
        run_case(other, session, "additive", default_hyperparameters("additive"), Case(2, 3, 5, "2d"))


def test_exported_additive_reproduces_the_toy_example(repository):
    session = _session(repository / "additive" / "1" / "model.onnx")
    values = np.arange(40, dtype=np.float32).reshape(1, 10, 4).repeat(2, axis=0)
    out, weights = session.run(None, {
        "queries": np.random.default_rng(0).normal(size=(2, 1, 20)).astype(np.float32),
        "keys": np.ones((2, 10, 2), np.float32),
        "values": values,
        "valid_lens": np.array([[2], [6]], dtype=np.int64),
    })
    np.testing.assert_allclose(out, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-5)
    np.testing.assert_allclose(weights[1, 0], [1 / 6] * 6 + [0] * 4, rtol=1e-5)
    assert np.all(weights[0, 0, 2:] == 0)


# --- the two traps: the validator catches them -----------------------------------------------

class _FrozenScale(torch.nn.Module):
    """Dot-product attention with the book's math.sqrt: the scale freezes to the example's d."""

    def forward(self, queries, keys, values, valid_lens):
        scores = torch.matmul(queries, keys.transpose(1, 2)) / math.sqrt(queries.shape[-1])
        weights = masked_softmax(scores, valid_lens)
        return torch.matmul(weights, values), weights


class _RepeatInterleave(torch.nn.Module):
    """Multi-head-style mask built with repeat_interleave over a symbolic count."""

    def forward(self, queries, keys, values, valid_lens):
        scores = torch.matmul(queries, keys.transpose(1, 2)) * torch.rsqrt(
            torch.tensor(queries.shape[-1], dtype=queries.dtype))
        if valid_lens is None:
            valid_lens = torch.full(scores.shape[:1], scores.shape[-1])
        lens = valid_lens if valid_lens.dim() == 1 else valid_lens[:, 0]  # (batch,)
        lens = torch.repeat_interleave(lens, scores.shape[1])  # (batch * n_q,): the book's 1-D path
        keep = torch.arange(scores.shape[-1])[None, :] < lens[:, None]
        flat = scores.reshape(-1, scores.shape[-1]).masked_fill(~keep, -1e6)
        weights = torch.softmax(flat.reshape(scores.shape), -1)
        return torch.matmul(weights, values), weights


@pytest.mark.parametrize("module, message", [
    (_FrozenScale(), "on case batch=2 n_q=3 n_k=5 d=7"),  # the first case where the scale matters (d is not 8)
    (_RepeatInterleave(), "on case"),
])
def test_validator_catches_the_known_export_traps(tmp_path, module, message):
    path = tmp_path / "model.onnx"
    export_onnx(module.eval(), "dot_product", {}, path)  # the exporter takes both traps; the validator must not
    with pytest.raises(ValidationError, match=message):
        validate(module, "dot_product", {}, path)


# --- a user's checkpoint --------------------------------------------------------------------

def test_checkpoint_round_trip_additive(tmp_path):
    torch.manual_seed(7)
    theirs = book.AdditiveAttention(key_size=3, query_size=5, num_hiddens=7, dropout=0.1).eval()
    ckpt = tmp_path / "additive.pt"
    torch.save(theirs.state_dict(), ckpt)
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", "additive", "--name", "mine", "--checkpoint", str(ckpt)]) == 0
    config = read_config(repo / "mine")
    assert config.kind == "additive" and config.hyperparameters == {"key_size": 3, "query_size": 5, "num_hiddens": 7}
    Q, K, V = torch.randn(4, 3, 5), torch.randn(4, 6, 3), torch.randn(4, 6, 2)
    lens = torch.tensor([1, 6, 0, 3])
    out, weights = _session(repo / "mine" / config.model_file).run(None, {
        "queries": Q.numpy(), "keys": K.numpy(), "values": V.numpy(),
        "valid_lens": lens[:, None].expand(4, 3).contiguous().numpy()})
    expected = theirs(Q, K, V, lens).detach().numpy()
    # Rows with a length are the book's; the length-0 example attends to nothing (ours: zeros).
    np.testing.assert_allclose(out[[0, 1, 3]], expected[[0, 1, 3]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights[[0, 1, 3]], theirs.attention_weights.detach().numpy()[[0, 1, 3]],
                               rtol=1e-5, atol=1e-6)
    assert np.all(out[2] == 0) and np.all(weights[2] == 0)


def test_checkpoint_round_trip_multi_head_with_bias(tmp_path):
    torch.manual_seed(3)
    theirs = book.MultiHeadAttention(6, 4, 5, 12, 3, 0.5, bias=True).eval()
    ckpt = tmp_path / "mha.pt"
    torch.save(theirs.state_dict(), ckpt)
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", "multi_head", "--name", "mha", "--checkpoint", str(ckpt),
                 "--num-heads", "3"]) == 0
    config = read_config(repo / "mha")
    assert config.hyperparameters == {"key_size": 6, "query_size": 4, "value_size": 5, "num_hiddens": 12,
                                      "num_heads": 3, "bias": True}
    Q, K, V = torch.randn(2, 5, 4), torch.randn(2, 8, 6), torch.randn(2, 8, 5)
    lens = torch.tensor([[1, 2, 3, 8, 8], [4, 5, 6, 7, 8]])
    out, weights = _session(repo / "mha" / config.model_file).run(None, {
        "queries": Q.numpy(), "keys": K.numpy(), "values": V.numpy(), "valid_lens": lens.numpy()})
    np.testing.assert_allclose(out, theirs(Q, K, V, lens).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights.reshape(6, 5, 8), theirs.attention.attention_weights.detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_mismatched_checkpoint_is_named_and_nothing_is_written(tmp_path, capsys):
    state = book.AdditiveAttention(key_size=3, query_size=5, num_hiddens=7, dropout=0).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["w_v.weight"]
    ckpt = tmp_path / "bad.pt"
    torch.save(state, ckpt)
    repo = tmp_path / "repo"
    code = main(["--repository", str(repo), "--kind", "additive", "--name", "mine", "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert code == 1
    assert "missing keys: w_v.weight" in err
    assert "unexpected keys: extra.weight" in err
    assert "Traceback" not in err
    assert not repo.exists() or _entries(repo) == []


def test_a_checkpoint_whose_shapes_disagree_is_named(tmp_path, capsys):
    state = book.AdditiveAttention(key_size=3, query_size=5, num_hiddens=7, dropout=0).state_dict()
    state["W_q.weight"] = torch.zeros(8, 5)  # W_k says 7 hidden units
    ckpt = tmp_path / "bad.pt"
    torch.save(state, ckpt)
    assert main(["--repository", str(tmp_path / "repo"), "--kind", "additive", "--checkpoint", str(ckpt)]) == 1
    assert "W_q.weight: expected shape (7, 5), checkpoint has (8, 5)" in capsys.readouterr().err


def _book_module(kind):
    """A module of the book's classes with sizes none of the defaults have, and the flags that
    shapes cannot tell."""
    if kind == "dot_product":
        return book.DotProductAttention(0.0), []
    if kind == "masked_softmax":
        return models.MaskedSoftmax(), []
    if kind == "positional_encoding":
        return book.PositionalEncoding(32, 0.0, max_len=50), ["--max-len", "50"]
    if kind == "additive":
        return book.AdditiveAttention(key_size=4, query_size=9, num_hiddens=6, dropout=0.0), []
    if kind == "multi_head":
        return book.MultiHeadAttention(3, 7, 11, 10, 2, 0.0, bias=False), ["--num-heads", "2"]
    return book.MultiHeadAttention(12, 12, 12, 12, 4, 0.0, bias=True), ["--num-heads", "4", "--max-len", "50"]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_of_any_size_export_without_size_flags(tmp_path, kind):
    torch.manual_seed(11)
    module, flags = _book_module(kind)
    ckpt = tmp_path / "ck.pt"
    torch.save(module.eval().state_dict(), ckpt)
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", kind, "--name", "mine", "--checkpoint", str(ckpt), *flags]) == 0
    config = read_config(repo / "mine")
    expected = {
        "dot_product": {},
        "additive": {"key_size": 4, "query_size": 9, "num_hiddens": 6},
        "multi_head": {"key_size": 3, "query_size": 7, "value_size": 11, "num_hiddens": 10, "num_heads": 2,
                       "bias": False},
        "self_attention": {"num_hiddens": 12, "num_heads": 4, "max_len": 50, "bias": True},
        "masked_softmax": {},
        "positional_encoding": {"max_len": 50},
    }[kind]
    assert config.hyperparameters == expected
    # The exported graph computes what the book's module does, on sizes of the checkpoint's own.
    rng = np.random.default_rng(0)
    d_q = expected.get("query_size", expected.get("num_hiddens", 5))
    d_k = expected.get("key_size", expected.get("num_hiddens", 5))
    d_v = expected.get("value_size", expected.get("num_hiddens", 3))
    Q = rng.standard_normal((2, 3, d_q), dtype=np.float32)
    K = rng.standard_normal((2, 4, d_k), dtype=np.float32)
    V = rng.standard_normal((2, 4, d_v), dtype=np.float32)
    lens = np.array([2, 4])
    session = _session(repo / "mine" / config.model_file)
    with torch.no_grad():
        if kind == "masked_softmax":
            S = rng.standard_normal((2, 3, 4), dtype=np.float32)
            want = module(torch.from_numpy(S), torch.from_numpy(lens))[0].numpy()
            got, _ = session.run(None, {"scores": S, "valid_lens": np.repeat(lens[:, None], 3, axis=1)})
        elif kind == "positional_encoding":  # the book's class, at its own d of 32
            X = rng.standard_normal((2, 3, 32), dtype=np.float32)
            want = module(torch.from_numpy(X)).numpy()
            got, _ = session.run(None, {"queries": X})
        elif kind == "self_attention":
            X = torch.from_numpy(Q) + models.sinusoidal_table(50, 12)[:3]
            want = module(X, X, X, torch.from_numpy(lens)).numpy()
            got, _ = session.run(None, {"queries": Q, "valid_lens": np.repeat(lens[:, None], 3, axis=1)})
        else:
            want = module(*map(torch.from_numpy, (Q, K, V)), torch.from_numpy(lens)).numpy()
            got, _ = session.run(None, {"queries": Q, "keys": K, "values": V,
                                        "valid_lens": np.repeat(lens[:, None], 3, axis=1)})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, flags, message", [
    ("multi_head", [], "--num-heads needed: a checkpoint's shapes do not tell num_heads (num_hiddens = 10); "
     "e.g. --num-heads N"),
    ("self_attention", [], "--num-heads needed: a checkpoint's shapes do not tell num_heads (num_hiddens = 12)"),
    ("additive", ["--key-size", "5"], "--key-size 5 contradicts the checkpoint: W_k.weight has shape (6, 4), so "
     "key_size is 4; leave the flag out or fix it"),
    ("multi_head", ["--num-heads", "2", "--bias"], "--bias (given) contradicts the checkpoint: W_q.bias is absent, "
     "so bias is False"),
    ("self_attention", ["--num-heads", "4", "--max-len", "50", "--num-hiddens", "8"],
     "--num-hiddens 8 contradicts the checkpoint: W_q.weight has shape (12, 12), so num_hiddens is 12"),
])
def test_what_a_checkpoint_cannot_tell_or_contradicts_is_named(tmp_path, capsys, kind, flags, message):
    module, _ = _book_module(kind)
    ckpt = tmp_path / "ck.pt"
    torch.save(module.state_dict(), ckpt)
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", kind, "--checkpoint", str(ckpt), *flags]) == 1
    assert message in capsys.readouterr().err
    assert not repo.exists() or _entries(repo) == []


@pytest.mark.parametrize("kind, flags", [("self_attention", ["--num-heads", "4"]), ("positional_encoding", [])])
def test_a_book_checkpoint_exports_with_the_books_max_len_said_in_one_line(tmp_path, capsys, kind, flags):
    """The book's PositionalEncoding keeps P out of the state_dict and defaults max_len to 1000: a checkpoint
    exports as the book made it, without --max-len, and the exporter says which max_len it took."""
    module = (book.MultiHeadAttention(12, 12, 12, 12, 4, 0.0, bias=True) if kind == "self_attention"
              else book.PositionalEncoding(32, 0.0))
    ckpt = tmp_path / "ck.pt"
    torch.save(module.state_dict(), ckpt)
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", kind, "--name", "mine", "--checkpoint", str(ckpt), *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    said = ("max_len: 1000, the book's default (PositionalEncoding(num_hiddens, dropout, max_len=1000)); "
            "--max-len overrides")
    assert out[0] == said and said not in out[1:]
    assert read_config(repo / "mine").hyperparameters["max_len"] == 1000
    # A flag still overrides, and nothing is said.
    assert main(["--repository", str(repo), "--kind", kind, "--name", "mine", "--checkpoint", str(ckpt), *flags,
                 "--max-len", "64"]) == 0
    assert "max_len:" not in capsys.readouterr().out
    assert read_config(repo / "mine").hyperparameters["max_len"] == 64


@pytest.mark.parametrize("content", [b"not a checkpoint", None])
def test_unreadable_checkpoint_is_an_error(tmp_path, capsys, content):
    ckpt = tmp_path / "c.pt"
    if content is not None:
        ckpt.write_bytes(content)
    assert main(["--repository", str(tmp_path / "repo"), "--kind", "dot_product", "--checkpoint", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {ckpt} ") and err.count("\n") == 1, err  # not torch's paragraph


@pytest.mark.parametrize("saved, message", [
    ("module", "holds a models.attention.MultiHeadAttention object, not only tensors (torch.save(model)?), and it is "
               "loaded with weights_only: save model.state_dict() instead"),
    ("nested", "is not a state_dict (a mapping of names to tensors): its entry 'model' is one; save that alone"),
])
def test_a_checkpoint_saved_otherwise_says_what_to_save(tmp_path, capsys, saved, message):
    """Before: torch's weights_only paragraph for a module saved whole, no word of the state_dict inside."""
    module = models.MultiHeadAttention(8, 8, 8, 8, 2)
    ckpt = tmp_path / "c.pt"
    torch.save(module if saved == "module" else {"model": module.state_dict(), "epoch": 3}, ckpt)
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", "multi_head", "--checkpoint", str(ckpt)]) == 1
    assert capsys.readouterr().err == f"error: checkpoint {ckpt} {message}\n"
    assert not repo.exists()


def test_a_repository_or_model_folder_that_is_a_file_is_said_before_the_export(tmp_path, capsys):
    """Before: FileExistsError's traceback, after the export and its validation."""
    (tmp_path / "repo").write_text("")
    assert main(["--repository", str(tmp_path / "repo"), "--kind", "dot_product"]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'repo'} is a file, not a folder\n"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "dp").write_text("")
    assert main(["--repository", str(tmp_path / "other"), "--kind", "dot_product", "--name", "dp"]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'other' / 'dp'} is a file, not a folder\n"
    assert _entries(tmp_path / "other") == ["dp"]


def test_a_repository_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path):
    """A full disk, as a file size limit (RLIMIT_FSIZE: EFBIG, as ENOSPC would be). Before: onnx's traceback."""
    repo = tmp_path / "repo"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))  # noqa: E731 (multi_head: 160 kB)
    export = subprocess.run([sys.executable, "-m", "export", "--repository", str(repo), "--kind", "multi_head"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert (export.returncode, export.stderr) == (1, f"error: cannot write to the repository {repo}: File too large\n")
    assert _entries(repo) == []


def test_failed_validation_publishes_nothing(tmp_path, monkeypatch):
    import export.publish as publish

    monkeypatch.setattr(publish, "build_module", lambda kind, hp: _FrozenScale().eval())
    repo = tmp_path / "repo"
    with pytest.raises(ValidationError):
        publish.export_model(repo, "dp", "dot_product", {})
    assert _entries(repo) == []  # neither the model folder nor the hidden staging folder


def test_re_export_adds_a_version(tmp_path):
    repo = tmp_path / "repo"
    assert main(["--repository", str(repo), "--kind", "dot_product", "--name", "dp"]) == 0
    assert main(["--repository", str(repo), "--kind", "dot_product", "--name", "dp"]) == 0
    config = read_config(repo / "dp")
    assert config.version == 2 and config.model_file == "2/model.onnx"
    assert _entries(repo / "dp") == ["1", "2", CONFIG_FILE]


def _export_in_a_process(repo, kind="masked_softmax"):
    return subprocess.Popen([sys.executable, "-m", "export", "--repository", str(repo), "--kind", kind], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@contextlib.contextmanager
def _holding_lock(folder):
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def test_an_export_removes_the_folders_of_exports_gone_and_nothing_else(tmp_path):
    """Before, the hidden folder of an export SIGKILLed (or out of memory) stayed in the repository for good."""
    repo = tmp_path / "repo"
    repo.mkdir()
    abandoned, running, theirs = repo / ".dp.k3_9xq0a", repo / ".dp.a0b1c2d3", repo / ".dp.zzzzzzzz"
    for folder in (abandoned, running, theirs):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"half")
    (theirs / "notes.txt").write_text("not an export's")
    (repo / ".snapshot.daily").mkdir()
    with _holding_lock(running):  # as its exporter does while it runs
        assert main(["--repository", str(repo), "--kind", "masked_softmax"]) == 0
    assert _entries(repo) == [".dp.a0b1c2d3", ".dp.zzzzzzzz", ".snapshot.daily", "masked_softmax"]


def test_sigterm_ends_an_export_with_its_folder_removed(tmp_path):
    """Before: SIGTERM's default action (exit -15) left the hidden folder behind."""
    repo = tmp_path / "repo"
    export = _export_in_a_process(repo, "multi_head")
    _until(lambda: repo.is_dir() and any(p.name.startswith(".multi_head.") for p in repo.iterdir()),
           "the export never began")
    export.send_signal(signal.SIGTERM)
    assert export.wait(timeout=60) == 143, export.stderr.read()
    assert _entries(repo) == [] and "Traceback" not in export.stderr.read()


def test_an_export_publishes_with_the_repository_locked(tmp_path):
    """Two exports at once each pick a version and write config.json under the lock. Before, two could pick
    the same number, or leave config.json naming the older."""
    repo = tmp_path / "repo"
    repo.mkdir()
    export = _export_in_a_process(repo)
    staged = lambda: [p for p in repo.iterdir() if p.name.startswith(".masked_softmax.")]  # noqa: E731
    _until(lambda: staged(), "the export never began")
    with _holding_lock(repo):
        _until(lambda: not staged() or (staged()[0] / "model.onnx").exists(), "no model.onnx")
        time.sleep(3.0)  # its validation: about 2 s on this machine
        assert not (repo / "masked_softmax").exists() and export.poll() is None
    assert export.wait(timeout=60) == 0, export.stderr.read()
    assert read_config(repo / "masked_softmax").version == 1


def test_an_export_leaves_onnx_runtime_telemetry_off(tmp_path):
    """The exporter's validation runs ONNX Runtime: before, it kept a device id and queued usage events in
    ~/.cache/Microsoft (the service's test, tests/service/test_lifecycle.py, also shows the opt-in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ORT_RUNNING_UNIT_TESTS", "XDG_CACHE_HOME",
                                                           "ORT_DISABLE_TELEMETRY")} | {"HOME": str(tmp_path)}
    export = subprocess.run([sys.executable, "-m", "export", "--repository", str(tmp_path / "repo"), "--kind",
                             "masked_softmax"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    assert not (tmp_path / ".cache" / "Microsoft").exists()


@pytest.mark.parametrize("argv, message", [
    (["--kind", "additive", "--num-heads", "2"], "--num-heads do(es) not apply to kind additive"),
    (["--kind", "multi_head", "--num-hiddens", "10", "--num-heads", "3"], "multiple of num_heads"),
    (["--kind", "dot_product", "--name", "../escape"], "model name '../escape'"),
    (["--num-hiddens", "4"], "need --kind"),
    (["--kind", "additive", "--key-size", "0"], "--key-size must be positive"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, argv, message):
    assert main(["--repository", str(tmp_path / "repo"), *argv]) == 1
    assert message in capsys.readouterr().err


def test_published_files_are_readable_by_other_users(repository):
    # The service may run as another user than the exporter (the container does).
    for path in [repository / "additive" / "config.json", repository / "additive" / "1",
                 repository / "additive" / "1" / "model.onnx", repository / "multi_head" / "1" / "model.cpu.onnx"]:
        assert path.stat().st_mode & 0o004, path

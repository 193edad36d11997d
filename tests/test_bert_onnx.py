"""The ONNX graph builder: our int8 quantiser against onnxruntime's, on a tiny BERT.

The builder writes int8 weights itself (no fp32 graph, no onnxruntime quantiser:
the build's peak memory, issue 11); these tests hold it to the exact arithmetic
and graph of ``onnxruntime.quantization.quantize_dynamic`` (per channel, int8
weights), which the parity figures in the README were measured with.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import numpy_helper

from reachy_memory.embedding.graph import BertShape, LazyWeights, build_graph, quantize_per_channel, save_model

TINY = BertShape(hidden=8, heads=2, layers=2)
VOCAB, POSITIONS, INTERMEDIATE = 30, 16, 16


def tiny_weights(seed: int) -> dict[str, np.ndarray]:
    """Random weights with the names and shapes of a Hugging Face BERT checkpoint."""
    rng = np.random.default_rng(seed)
    h = TINY.hidden
    w = {"embeddings.word_embeddings.weight": rng.normal(size=(VOCAB, h)),
         "embeddings.position_embeddings.weight": rng.normal(size=(POSITIONS, h)),
         "embeddings.token_type_embeddings.weight": rng.normal(size=(2, h))}
    w |= _norm("embeddings.LayerNorm", h, rng)
    for i in range(TINY.layers):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            w |= _dense(f"{p}.attention.self.{name}", h, h, rng)
        w |= _dense(f"{p}.attention.output.dense", h, h, rng) | _norm(f"{p}.attention.output.LayerNorm", h, rng)
        w |= _dense(f"{p}.intermediate.dense", h, INTERMEDIATE, rng)
        w |= _dense(f"{p}.output.dense", INTERMEDIATE, h, rng) | _norm(f"{p}.output.LayerNorm", h, rng)
    w["encoder.layer.0.output.dense.weight"][3] = 0.0  # an all-zero output channel: scale 1.0
    return {k: v.astype(np.float32) for k, v in w.items()}


def _dense(prefix: str, n_in: int, n_out: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"{prefix}.weight": rng.normal(scale=0.3, size=(n_out, n_in)), f"{prefix}.bias": rng.normal(size=n_out)}


def _norm(prefix: str, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"{prefix}.weight": 1 + 0.1 * rng.normal(size=n), f"{prefix}.bias": 0.1 * rng.normal(size=n)}


def _saved(weights: dict[str, np.ndarray], precision: str, path: Path) -> Path:
    save_model(build_graph(weights, TINY, precision), path)
    return path


def _ort_int8(fp32: Path, out: Path) -> Path:
    """onnxruntime's own quantisation of the fp32 graph's weight MatMuls (the old build)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(fp32)).graph
    weights = {i.name for i in graph.initializer}
    matmuls = [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    quantize_dynamic(str(fp32), str(out), op_types_to_quantize=["MatMul"], nodes_to_quantize=matmuls,
                     per_channel=True, weight_type=QuantType.QInt8,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # onnx cannot type Attention's output
    return out


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def _embed(path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]


def on_int8_grid(table: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A word table int8 holds exactly: integers, each row reaching 127 (its scale is 1.0)."""
    grid = np.round(np.clip(table * 40, -127, 127))
    grid[np.arange(len(grid)), rng.integers(0, grid.shape[1], len(grid))] = 127.0
    return grid.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])  # three random tiny BERTs
def test_int8_build_equals_onnxruntime_quantiser(tmp_path: Path, seed: int) -> None:
    """The three weight MatMuls of a layer equal onnxruntime's quantiser bit for bit;
    the QKV weights of QAttention are quantised by the same arithmetic (which
    onnxruntime's quantiser would write with 7-bit weights).  The word table is put
    on the int8 grid so that its lookup is exact and only the QKV product differs."""
    weights = tiny_weights(seed)
    name = "embeddings.word_embeddings.weight"
    weights[name] = on_int8_grid(weights[name], np.random.default_rng(seed))
    ours = _saved(weights, "int8", tmp_path / "ours.onnx")
    theirs = _ort_int8(_saved(weights, "fp32", tmp_path / "fp32.onnx"), tmp_path / "ort.onnx")
    mine, ref = _initializers(ours), _initializers(theirs)
    quantised = [name for name in ref if name.endswith(("_quantized", "_scale", "_zero_point"))]
    assert len(quantised) == 3 * 3 * TINY.layers  # weight, scale, zero point of 3 MatMuls a layer
    for name in quantised:
        assert mine[name].dtype == ref[name].dtype and np.array_equal(mine[name], ref[name]), name
    for i in range(TINY.layers):  # QKV from the checkpoint's own tensors, not from our fp32 graph
        parts = [weights[f"encoder.layer.{i}.attention.self.{name}.weight"] for name in ("query", "key", "value")]
        q, scale = quantize_per_channel(np.concatenate(parts).T)
        assert np.array_equal(mine[f"encoder.layer.{i}.qkv.wT_quantized"], q)
        assert np.array_equal(mine[f"encoder.layer.{i}.qkv.wT_scale"], scale)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (3, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0  # a padded row
    cos = (_embed(ours, ids, mask) * _embed(theirs, ids, mask)).sum(axis=1)
    assert cos.min() > 0.999  # int8 QKV against fp32 QKV; a wrong head split or mask gives far less


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_attention_ignores_padding(tmp_path: Path, precision: str) -> None:
    """A row padded in a batch embeds as it does alone: the fused attention op skips
    the masked keys (in int8 up to the batch's shared activation scale)."""
    model = _saved(tiny_weights(6), precision, tmp_path / "m.onnx")
    ops = [n.op_type for n in onnx.load(str(model)).graph.node]
    assert ops.count("QAttention" if precision == "int8" else "Attention") == TINY.layers
    ids = np.array([[3, 9, 14, 2, 7, 21, 5, 11], [3, 9, 14, 2, 0, 0, 0, 0]], np.int64)
    mask = np.array([[1] * 8, [1] * 4 + [0] * 4], np.int64)
    padded = _embed(model, ids, mask)[1]
    alone = _embed(model, ids[1:, :4], mask[1:, :4])[0]
    np.testing.assert_allclose(padded, alone, atol=1e-6 if precision == "fp32" else 0.05)
    if precision == "fp32":  # the control: the row with its padding attended to is another vector
        assert np.abs(_embed(model, ids[1:], np.ones_like(mask[1:]))[0] - alone).max() > 1e-3


def test_int8_word_table_is_quantised_per_row(tmp_path: Path) -> None:
    weights = tiny_weights(4)
    table = weights["embeddings.word_embeddings.weight"]
    found = _initializers(_saved(weights, "int8", tmp_path / "m.onnx"))
    assert "word_emb" not in found and found["word_emb_quantized"].dtype == np.int8
    restored = found["word_emb_quantized"].astype(np.float32) * found["word_emb_scale"][:, None]
    assert np.abs(restored - table).max() <= np.abs(table).max(axis=1).max() / 127 / 2 + 1e-6


def test_int8_graph_is_smaller_and_close_to_fp32(tmp_path: Path) -> None:
    weights = tiny_weights(5)
    fp32, int8 = _saved(weights, "fp32", tmp_path / "a.onnx"), _saved(weights, "int8", tmp_path / "b.onnx")
    ops = {n.op_type for n in onnx.load(str(int8)).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger", "QAttention"} <= ops
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    cos = (_embed(fp32, ids, np.ones_like(ids)) * _embed(int8, ids, np.ones_like(ids))).sum(axis=1)
    assert cos.min() > 0.95


@pytest.mark.parametrize("column", [
    np.array([0.5, -1.0, 0.25], np.float32),  # absmax from a negative value
    np.array([0.0, 0.0, 0.0], np.float32),  # all zero: scale 1.0, no division by zero
    np.array([1e-30, -2e-30, 0.0], np.float32),  # denormal range: scale below tiny, 1.0
    np.array([3.0, 3.0, 3.0], np.float32),  # one-sided range still symmetric
])
def test_quantize_per_channel_matches_onnxruntime(column: np.ndarray) -> None:
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    weight = np.stack([column, column * 0.5], axis=1)
    ours_q, ours_scale = quantize_per_channel(weight)
    for c in range(weight.shape[1]):
        zero, scale, q = quantize_data(weight[:, c], TensorProto.INT8, symmetric=True)
        assert int(zero) == 0 and ours_scale[c] == scale and np.array_equal(ours_q[:, c], q)


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="fp32 or int8"):
        build_graph(tiny_weights(0), TINY, "int4")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_saved_graph_lets_onnxruntime_fuse_skip_layer_norm(tmp_path: Path, precision: str) -> None:
    """save_model records tensor shapes: without them onnxruntime leaves Add +
    LayerNormalization unfused (the old fp32 graph) and int8 runs a different kernel."""
    model = _saved(tiny_weights(3), precision, tmp_path / "m.onnx")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimised.onnx")).graph.node]
    assert ops.count("SkipLayerNormalization") == 2 * TINY.layers


# -- reading safetensors (our reader, the reference writer) ---------------------------

_ARRAYS = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float16, np.float64, np.int64, np.int32, np.int8, np.uint8]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))


@settings(max_examples=60, deadline=None)
@given(tensors=st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=8), _ARRAYS, max_size=5))
def test_lazy_weights_round_trip_with_the_reference_writer(tmp_path_factory: pytest.TempPathFactory,
                                                          tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("st") / "w.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    read = LazyWeights(path)
    assert set(read) == set(tensors) and len(read) == len(tensors)
    for name, array in tensors.items():
        got = read[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)
    with pytest.raises(KeyError):
        read["not there"]


def _safetensors(header: object, data: bytes = b"", size: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return (len(raw) if size is None else size).to_bytes(8, "little") + raw + data


_F32 = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(("content", "match"), [
    (b"", "header size 0"),  # empty file
    (_safetensors(_F32, size=1 << 40), "header size"),  # a hostile header length
    (_safetensors(_F32)[:20], "header size"),  # header cut short: longer than the file
    ((10).to_bytes(8, "little") + b"{bad json}" + bytes(8), "unreadable safetensors header"),  # not JSON
    (_safetensors(["not", "a", "dict"]), "not a JSON object"),  # JSON, wrong shape
    (b"\x40\x42\x0f\x00\x00\x00\x00\x00" + b"[" * 1_000_000, "unreadable safetensors header"),  # nesting
])
def test_lazy_weights_refuses_a_broken_header(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        LazyWeights(path)


def _entry(dtype: object = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict[str, object]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


@pytest.mark.parametrize(("header", "match"), [
    ({"w": 5}, "not a JSON object"),
    ({"w": _entry(dtype="BF16")}, "BF16"),  # numpy has no bf16
    ({"w": _entry(dtype=["F32"])}, "tensor type"),  # not even a string
    ({"w": _entry(shape="2")}, "shape"),
    ({"w": _entry(shape=(-2,), offsets=(0, 0))}, "shape"),
    ({"w": _entry(shape=[True, 2])}, "shape"),  # a bool is not a dimension
    ({"w": _entry(shape=[2.0])}, "shape"),
    ({"w": _entry(shape=(1,) * 9 + (2,))}, "shape"),  # more dimensions than a weight has
    ({"w": _entry(shape=(1 << 40, 1 << 40))}, "over the"),  # absurd dims, refused before np.empty
    ({"w": _entry(shape=(1,))}, "does not match"),  # offsets disagree with the shape
    ({"w": _entry(offsets=(0,))}, "data_offsets"),
    ({"w": _entry(offsets=(0, 16))}, "data_offsets"),  # beyond the data: the file is cut short
    ({"w": _entry(offsets=(8, 0))}, "data_offsets"),
    ({"w": _entry(offsets=(-8, 0))}, "data_offsets"),
    ({"w": _entry(offsets="0-8")}, "data_offsets"),
    ({"a": _entry(), "b": _entry(shape=(1,), offsets=(4, 8))}, "overlap"),
    ({"__metadata__": [], "w": _entry()}, "__metadata__"),
    ({"__metadata__": {"format": 1}, "w": _entry()}, "__metadata__"),
])
def test_lazy_weights_checks_every_entry_at_open(tmp_path: Path, header: dict[str, Any], match: str) -> None:
    """Each hostile entry is refused when the file is opened, before any tensor is read."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(_safetensors(header, bytes(8)))
    with pytest.raises(ValueError, match=match):
        LazyWeights(path)


def _sparse(path: Path, header: object, total: int, size: int | None = None) -> Path:
    """A safetensors file of ``total`` bytes, most of them a hole (no disk, no RAM)."""
    path.write_bytes(_safetensors(header, size=size))
    os.truncate(path, total)
    return path


def test_lazy_weights_refuses_a_tensor_over_1_gib_without_allocating_it(tmp_path: Path) -> None:
    n = (1 << 28) + 1  # float32: just over 1 GiB, and the file really holds that many bytes
    path = _sparse(tmp_path / "w.safetensors", {"w": _entry(shape=(n,), offsets=(0, 4 * n))}, 4 * n + 200)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="1073741828 bytes, over the 1073741824 allowed"):
            LazyWeights(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_lazy_weights_refuses_a_header_over_8_mib(tmp_path: Path) -> None:
    path = _sparse(tmp_path / "w.safetensors", {}, 16 << 20, size=(8 << 20) + 1)
    with pytest.raises(ValueError, match="header size"):
        LazyWeights(path)


@pytest.mark.timeout(20)  # a FIFO opened for reading would block until a writer comes
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_lazy_weights_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "w.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")  # endless: a symlink is followed, and its target refused
    with pytest.raises(ValueError, match="not a regular file"):
        LazyWeights(path)


def test_lazy_weights_reads_through_a_symlink(tmp_path: Path) -> None:
    """The Hugging Face cache links every file into its blob store."""
    (tmp_path / "blob").write_bytes(_safetensors(_F32, np.array([1.5, -2], "<f4").tobytes()))
    (tmp_path / "w.safetensors").symlink_to(tmp_path / "blob")
    np.testing.assert_array_equal(LazyWeights(tmp_path / "w.safetensors")["w"], [1.5, -2])


def test_lazy_weights_says_when_the_file_shrank_after_open(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_safetensors(_F32, bytes(8)))
    weights = LazyWeights(path)
    os.truncate(path, path.stat().st_size - 4)
    with pytest.raises(ValueError, match="cut short"):
        weights["w"]


# -- refusing weights and configs a graph cannot be built from -------------------------

@pytest.mark.parametrize(("name", "value"), [
    ("embeddings.word_embeddings.weight", np.nan),
    ("encoder.layer.1.attention.self.key.weight", np.inf),  # read into the fused QKV
    ("encoder.layer.0.output.LayerNorm.bias", -np.inf),
])
def test_weights_that_are_not_finite_are_refused_by_name(name: str, value: float) -> None:
    weights = tiny_weights(0)
    weights[name].flat[-1] = value
    for precision in ("fp32", "int8"):
        with pytest.raises(ValueError, match=re.escape(f"weight {name} holds NaN or infinite")):
            build_graph(weights, TINY, precision)


_CONFIG = {"hidden_size": 384, "num_attention_heads": 12, "num_hidden_layers": 6, "layer_norm_eps": 1e-12}


def test_config_gives_the_shape() -> None:
    assert BertShape.from_config(_CONFIG) == BertShape()
    assert BertShape.from_config(_CONFIG | {"layer_norm_eps": 1e-5}).eps == 1e-5
    assert BertShape.from_config({k: v for k, v in _CONFIG.items() if k != "layer_norm_eps"}).eps == 1e-12


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_size": None}, "hidden_size"),  # missing (None: dropped below)
    ({"hidden_size": "384"}, "hidden_size"),
    ({"hidden_size": 384.0}, "hidden_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": 1 << 20}, "hidden_size"),  # a graph too large to build
    ({"num_attention_heads": None}, "num_attention_heads"),
    ({"num_attention_heads": 5}, "num_attention_heads 5 does not divide"),
    ({"num_attention_heads": -12}, "num_attention_heads"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": 10_000}, "num_hidden_layers"),
    ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
    ({"layer_norm_eps": -1e-12}, "layer_norm_eps"),
    ({"layer_norm_eps": float("nan")}, "layer_norm_eps"),
    ({"layer_norm_eps": float("inf")}, "layer_norm_eps"),
    ({"layer_norm_eps": "1e-12"}, "layer_norm_eps"),
])
def test_config_fields_are_checked_by_name(change: dict[str, Any], field: str) -> None:
    config = {k: v for k, v in (_CONFIG | change).items() if v is not None}
    with pytest.raises(ValueError, match=f"config.json: {field}"):
        BertShape.from_config(config)


@pytest.mark.parametrize("content", [b"[384, 12, 6]", b"null", b"[" * 100_000, b"{" + b" " * (1 << 20) + b"}"])
def test_config_file_that_is_not_a_small_json_object_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="config"):
        BertShape.from_file(path)


@pytest.mark.timeout(20)
def test_config_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ValueError, match="not a regular file"):
        BertShape.from_file(tmp_path / "config.json")

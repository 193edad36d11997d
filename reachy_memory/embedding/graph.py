"""Build a sentence-embedding ONNX graph from BERT safetensors weights, no torch.

The graph takes ``input_ids`` and ``attention_mask`` (int64, batch x seq) and
returns ``sentence_embedding`` (float32, batch x hidden): BERT embeddings (token
type 0 folded into the position table), N encoder layers, mean pooling over
the attention mask and L2 normalisation, as sentence-transformers'
all-MiniLM-L6-v2 pipeline does.  Each layer's self-attention (QKV projection,
heads, mask, softmax) is one onnxruntime contrib op, ``Attention`` or
``QAttention`` in int8: one kernel instead of ~14 nodes, 5-15% off a query's
embedding (README, issue 11).  Exact erf GELU.

With ``int8`` the weight MatMuls are written already quantised (per output
channel, symmetric, the arithmetic of onnxruntime's ``quantize_dynamic``:
the same initializers and the same DynamicQuantizeLinear -> MatMulInteger ->
Cast -> Mul pattern, which onnxruntime fuses at load), the QKV weights of
``QAttention`` the same way; the word-embedding table is int8 too, one scale
per row.  Quantising while building means no
fp32 graph is written, loaded and copied again: the build's peak memory is
the int8 graph plus one weight at a time.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17
_CONTRIB = "com.microsoft"  # onnxruntime's own ops (Attention, QAttention)


_MAX_HIDDEN, _MAX_LAYERS = 4096, 48  # far above any sentence encoder we would run on a robot
_MAX_CONFIG = 1 << 20


@dataclass(frozen=True)
class BertShape:
    """The hyper-parameters the graph needs (from the model's config.json)."""

    hidden: int = 384
    heads: int = 12
    layers: int = 6
    eps: float = 1e-12

    @classmethod
    def from_config(cls, config: object) -> BertShape:
        """Checked field by field: ``hidden_size`` (<= 4096), ``num_attention_heads``
        (dividing it) and ``num_hidden_layers`` (<= 48) positive ints, ``layer_norm_eps``
        (default 1e-12) a number in (0, 1).  Raises ValueError naming the field."""
        if not isinstance(config, dict):
            raise ValueError(f"config.json must hold a JSON object, not {type(config).__name__}")
        hidden = _config_int(config, "hidden_size", _MAX_HIDDEN)
        heads = _config_int(config, "num_attention_heads", hidden)
        if hidden % heads:
            raise ValueError(f"config.json: num_attention_heads {heads} does not divide hidden_size {hidden}")
        eps = config.get("layer_norm_eps", 1e-12)
        if type(eps) not in (int, float) or not 0 < eps < 1:  # NaN and inf fail the range too
            raise ValueError(f"config.json: layer_norm_eps must be a number in (0, 1), not {eps!r}")
        return cls(hidden, heads, _config_int(config, "num_hidden_layers", _MAX_LAYERS), float(eps))

    @classmethod
    def from_file(cls, path: Path) -> BertShape:
        """:meth:`from_config` of a config.json: a regular file of at most 1 MiB, or ValueError."""
        with _open_regular(path) as fh:
            raw = fh.read(_MAX_CONFIG + 1)
        if len(raw) > _MAX_CONFIG:
            raise ValueError(f"{path} is over {_MAX_CONFIG} bytes: not a model config")
        try:
            return cls.from_config(json.loads(raw))
        except RecursionError as exc:  # deeply nested JSON
            raise ValueError(f"{path} is not a readable config: {exc}") from exc


def _config_int(config: dict[str, Any], field: str, cap: int) -> int:
    value = config.get(field)
    if type(value) is not int or not 1 <= value <= cap:  # type(): True is an int to isinstance
        raise ValueError(f"config.json: {field} must be an integer in [1, {cap}], not {value!r}")
    return value


def _open_regular(path: Path) -> io.BufferedReader:
    """``path`` opened for reading if it is a regular file (after symlinks), else
    ValueError.  Opened non-blocking and checked on the open file: a FIFO neither
    blocks the open nor slips in between a check and the open."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


class _Unprefixed:
    """``weights[name]`` or ``weights["bert." + name]``, read on access: with lazily
    loaded weights each tensor lives only until it is copied into the graph."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self._weights = weights
        self._prefix = "bert." if any(k.startswith("bert.") for k in weights) else ""

    def __getitem__(self, name: str) -> np.ndarray:
        return _finite(name, self._weights[self._prefix + name])


def _finite(name: str, array: np.ndarray) -> np.ndarray:
    """``array``, or ValueError naming the tensor when it holds NaN or inf (a graph
    built from them would embed every text as NaN).  Checked in slices: no
    temporary as large as the 47 MB word table."""
    if array.dtype.kind == "f":
        flat = array.reshape(-1)
        for start in range(0, flat.size, 1 << 20):
            if not np.isfinite(flat[start:start + (1 << 20)]).all():
                raise ValueError(f"weight {name} holds NaN or infinite values")
    return array


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 8 << 20  # the 90 MB MiniLM's header is 13 KB
_MAX_TENSOR = 1 << 30  # bytes: the largest tensor we allocate (the MiniLM word table is 47 MB)
_MAX_DIMS = 8


@dataclass(frozen=True)
class _Entry:
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    begin: int
    end: int


class LazyWeights(Mapping[str, np.ndarray]):
    """The tensors of a safetensors file, each read from disk when asked for (not kept).

    Read with plain file reads, not a memory map: the pages of a mapped 90 MB
    file count in the build's resident set once touched.  The whole header is
    checked at open, so a read allocates only what the file holds.  Raises
    ValueError for a path that is not a regular file, a file that is not
    safetensors, a header whose entries disagree with the data (types, shapes,
    offsets, overlaps), a tensor over 1 GiB or of a type numpy lacks (bf16)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        with _open_regular(path) as fh:
            data_size = os.fstat(fh.fileno()).st_size - 8
            size = int.from_bytes(fh.read(8), "little")
            if not 2 <= size <= min(_MAX_HEADER, data_size):
                raise ValueError(f"{path} is not a safetensors file (header size {size})")
            try:
                header = json.loads(fh.read(size))
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{path} has an unreadable safetensors header: {exc}") from exc
        if not isinstance(header, dict):
            raise ValueError(f"{path} has an unreadable safetensors header: not a JSON object")
        self._entries = _check_header(header, data_size - size, path)
        self._data_start = 8 + size

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]  # KeyError for a missing name, as a Mapping promises
        array = np.empty(entry.shape, entry.dtype)
        with _open_regular(self._path) as fh:
            fh.seek(self._data_start + entry.begin)
            if fh.readinto(array.reshape(-1).view(np.uint8)) != array.nbytes:  # type: ignore[arg-type]  # stubs lack __buffer__
                raise ValueError(f"tensor {name} of {self._path} is cut short")  # the file shrank since open
        return array.astype(entry.dtype.newbyteorder("="), copy=False)  # a no-op on little-endian machines

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _check_header(header: dict[str, Any], data_size: int, path: Path) -> dict[str, _Entry]:
    """The header's tensors, checked against the ``data_size`` bytes after it: no two
    tensors share bytes, so together they never claim more than the file holds."""
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ must map names to strings")
    entries = {name: _check_entry(name, raw, data_size, path) for name, raw in header.items()}
    end = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < end:
            raise ValueError(f"{path}: tensors overlap at byte {entry.begin}")
        end = entry.end
    return entries


def _check_entry(name: str, raw: object, data_size: int, path: Path) -> _Entry:
    """One header entry as an :class:`_Entry`, or ValueError saying what is wrong."""
    where = f"tensor {name} of {path}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: entry is not a JSON object")
    kind = raw.get("dtype")
    if not isinstance(kind, str) or kind not in _DTYPES:
        raise ValueError(f"{where}: tensor type {kind!r} is not readable")
    dtype = np.dtype(_DTYPES[kind]).newbyteorder("<")  # safetensors: little-endian
    shape, offsets = raw.get("shape"), raw.get("data_offsets")
    if not _ints(shape) or len(shape) > _MAX_DIMS:
        raise ValueError(f"{where}: shape {shape!r} is not a list of at most {_MAX_DIMS} non-negative integers")
    if not _ints(offsets) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= data_size:
        raise ValueError(f"{where}: data_offsets {offsets!r} are not within the {data_size} data bytes")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _MAX_TENSOR:
        raise ValueError(f"{where}: shape {shape} takes {nbytes} bytes, over the {_MAX_TENSOR} allowed")
    if nbytes != offsets[1] - offsets[0]:
        raise ValueError(f"{where}: shape {shape} ({nbytes} bytes) does not match data_offsets {offsets}")
    return _Entry(dtype, tuple(shape), offsets[0], offsets[1])


def _ints(value: object) -> TypeGuard[list[int]]:
    """A list of non-negative ints (not bools, which are ints to isinstance)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def quantize_per_channel(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(int8 weight, float32 scale per column)`` of a ``(in, out)`` float32 weight,
    symmetric with zero point 0, as onnxruntime's quantiser computes them: the
    scale is ``2 * absmax / 254`` (in float64, stored as float32; 1.0 for an
    all-zero column) and values are ``round(w / scale)`` clipped to int8."""
    weight = np.asarray(weight, np.float32)
    absmax = np.maximum(np.maximum(weight.max(axis=0), -weight.min(axis=0)), np.float32(0))
    span = (absmax - (-absmax)).astype(np.float64)  # rmax - rmin in float32, then float64 as onnxruntime
    scale = (span / 254.0).astype(np.float32)
    scale[scale < np.finfo(np.float32).tiny] = 1.0
    scaled = np.divide(weight, scale)  # one temporary, rounded and clipped in place: the word table is 47 MB
    np.clip(np.round(scaled, out=scaled), -128, 127, out=scaled)
    return scaled.astype(np.int8), scale


class _Graph:
    """Accumulates nodes and initializers with unique names; ``int8`` writes the
    weight MatMuls quantised."""

    def __init__(self, weights: Mapping[str, np.ndarray], int8: bool = False) -> None:
        self.w = _Unprefixed(weights)
        self.model = onnx.ModelProto()
        self.nodes: list[onnx.NodeProto] = []
        self.int8 = int8
        self._n = 0

    def const(self, name: str, value: np.ndarray) -> str:
        """Add ``value`` as an initializer straight into the model (one copy of the bytes)."""
        value = np.ascontiguousarray(value)
        tensor = self.model.graph.initializer.add()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
        tensor.dims.extend(value.shape)
        tensor.raw_data = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
        return name

    def op(self, op_type: str, inputs: list[str], domain: str = "", **attrs: Any) -> str:
        self._n += 1
        out = f"{op_type.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self._n}_{op_type}", domain=domain,
                                           **attrs))
        return out

    def linear(self, x: str, prefix: str) -> str:
        """x @ W.T + b for the HF Linear ``prefix`` (W quantised when ``int8``)."""
        weight = self.w[f"{prefix}.weight"].T.astype(np.float32, copy=False)
        if self.int8:
            out = self._int8_matmul(x, prefix, weight)
        else:
            out = self.op("MatMul", [x, self.const(f"{prefix}.wT", weight)])
        return self.op("Add", [out, self.const(f"{prefix}.b", self.w[f"{prefix}.bias"].astype(np.float32))])

    def _int8_matmul(self, x: str, prefix: str, weight: np.ndarray) -> str:
        """x @ weight with the activation quantised at run time (uint8, per tensor)
        and the weight here (int8, per column): the pattern onnxruntime fuses."""
        wq, wscale, wzero = self.int8_weight(prefix, weight)
        xq, xscale, xzero = self.quantize_input(x)
        scales = self.op("Mul", [xscale, wscale])
        product = self.op("MatMulInteger", [xq, wq, xzero, wzero])
        return self.op("Mul", [self.op("Cast", [product], to=TensorProto.FLOAT), scales])

    def int8_weight(self, prefix: str, weight: np.ndarray) -> tuple[str, str, str]:
        """The initializers of ``weight`` (in, out) quantised per column: values, scales, zero points."""
        quantised, scale = quantize_per_channel(weight)
        return (self.const(f"{prefix}.wT_quantized", quantised), self.const(f"{prefix}.wT_scale", scale),
                self.const(f"{prefix}.wT_zero_point", np.zeros(scale.shape, np.int8)))

    def quantize_input(self, x: str) -> tuple[str, str, str]:
        """``x`` quantised at run time (uint8, one scale and zero point for the tensor)."""
        self._n += 1
        names = (f"{x}_quantized", f"{x}_scale", f"{x}_zero_point")
        self.nodes.append(helper.make_node("DynamicQuantizeLinear", [x], list(names), name=f"n{self._n}_dql"))
        return names

    def layer_norm(self, x: str, prefix: str, eps: float) -> str:
        gamma = self.const(f"{prefix}.g", self.w[f"{prefix}.weight"])
        beta = self.const(f"{prefix}.beta", self.w[f"{prefix}.bias"])
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=eps)


def build_graph(weights: Mapping[str, np.ndarray], shape: BertShape, precision: str = "fp32") -> onnx.ModelProto:
    """The ONNX model in ``precision`` (``fp32`` or ``int8``); check it with
    :func:`save_model`, which checks the saved file rather than a second copy in RAM."""
    if precision not in ("fp32", "int8"):
        raise ValueError(f"precision must be fp32 or int8, not {precision!r}")
    g = _Graph(weights, int8=precision == "int8")
    x = _embeddings(g, shape)
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.INT32)  # the (batch, seq) 0/1 mask Attention takes
    for i in range(shape.layers):
        x = _encoder_layer(g, x, mask, f"encoder.layer.{i}", shape)
    out = _pool_and_normalise(g, x)
    model = g.model  # built in place: copying a graph proto would copy every weight
    graph = model.graph
    graph.name = "minilm_sentence_embedding"
    graph.node.extend(g.nodes)
    graph.input.extend([helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])])
    graph.output.extend([helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", shape.hidden])])
    model.opset_import.extend([helper.make_opsetid("", OPSET), helper.make_opsetid(_CONTRIB, 1)])
    model.producer_name = "reachy-memory"
    model.ir_version = 8
    return model


def _embeddings(g: _Graph, shape: BertShape) -> str:
    table = g.w["embeddings.word_embeddings.weight"].astype(np.float32, copy=False)
    words = _int8_lookup(g, table) if g.int8 else g.op("Gather", [g.const("word_emb", table), "input_ids"])
    # Token type is always 0 for single sentences: fold it into the positions.
    positions = g.w["embeddings.position_embeddings.weight"] + g.w["embeddings.token_type_embeddings.weight"][0]
    pos = g.const("pos_emb", positions.astype(np.float32))
    seq_len = g.op("Shape", ["input_ids"], start=1, end=2)
    zero = g.const("zero_1d", np.array([0], np.int64))
    pos_slice = g.op("Slice", [pos, zero, seq_len, zero])
    summed = g.op("Add", [words, pos_slice])
    return g.layer_norm(summed, "embeddings.LayerNorm", shape.eps)


def _int8_lookup(g: _Graph, table: np.ndarray) -> str:
    """The word vectors of ``input_ids`` from an int8 table with one scale per row.

    The fp32 table is 47 of the int8 graph's 59 MB; in int8 the loaded model
    costs ~33 MB less RSS, with the same parity and LoCoMo recall (README)."""
    quantised, scale = quantize_per_channel(table.T)  # a row of the table is a column of its transpose
    rows = g.op("Gather", [g.const("word_emb_quantized", np.ascontiguousarray(quantised.T)), "input_ids"])
    scales = g.op("Gather", [g.const("word_emb_scale", scale), "input_ids"])
    scales = g.op("Unsqueeze", [scales, g.const("axes_last", np.array([-1], np.int64))])
    return g.op("Mul", [g.op("Cast", [rows], to=TensorProto.FLOAT), scales])


def _encoder_layer(g: _Graph, x: str, mask: str, p: str, s: BertShape) -> str:
    attn = g.linear(_attention(g, x, mask, p, s), f"{p}.attention.output.dense")
    x1 = g.layer_norm(g.op("Add", [attn, x]), f"{p}.attention.output.LayerNorm", s.eps)
    hidden = g.linear(x1, f"{p}.intermediate.dense")
    out = g.linear(_gelu(g, hidden), f"{p}.output.dense")
    return g.layer_norm(g.op("Add", [out, x1]), f"{p}.output.LayerNorm", s.eps)


def _attention(g: _Graph, x: str, mask: str, p: str, s: BertShape) -> str:
    """Layer ``p``'s self-attention context (batch, seq, hidden): one ``Attention``
    op, or ``QAttention`` on ``x`` quantised at run time in int8.  Both scale the
    scores by 1/sqrt(head size) and ignore the keys ``mask`` (int32) zeroes."""
    parts = [f"{p}.attention.self.{name}" for name in ("query", "key", "value")]
    weight = np.concatenate([g.w[f"{part}.weight"] for part in parts]).T.astype(np.float32)  # (in, Q|K|V)
    bias = g.const(f"{p}.qkv.b", np.concatenate([g.w[f"{part}.bias"] for part in parts]).astype(np.float32))
    if not g.int8:
        return g.op("Attention", [x, g.const(f"{p}.qkv.wT", weight), bias, mask], _CONTRIB, num_heads=s.heads)
    wq, wscale, wzero = g.int8_weight(f"{p}.qkv", weight)
    xq, xscale, xzero = g.quantize_input(x)
    return g.op("QAttention", [xq, wq, bias, xscale, wscale, mask, xzero, wzero], _CONTRIB, num_heads=s.heads)


def _gelu(g: _Graph, x: str) -> str:
    """Exact GELU, x * 0.5 * (1 + erf(x / sqrt 2)); onnxruntime fuses the pattern."""
    erf = g.op("Erf", [g.op("Div", [x, g.const(f"sqrt2_{len(g.nodes)}", np.array(math.sqrt(2.0), np.float32))])])
    one_plus = g.op("Add", [erf, g.const(f"one_{len(g.nodes)}", np.array(1.0, np.float32))])
    return g.op("Mul", [g.op("Mul", [x, one_plus]), g.const(f"half_{len(g.nodes)}", np.array(0.5, np.float32))])


def _pool_and_normalise(g: _Graph, x: str) -> str:
    mask = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT),
                              g.const("axes_2", np.array([2], np.int64))])
    axis1 = g.const("axes_1", np.array([1], np.int64))
    summed = g.op("ReduceSum", [g.op("Mul", [x, mask]), axis1], keepdims=0)
    count = g.op("Max", [g.op("ReduceSum", [mask, axis1], keepdims=0), g.const("tiny", np.array(1e-9, np.float32))])
    mean = g.op("Div", [summed, count])
    norm = g.op("ReduceL2", [mean], axes=[1], keepdims=1)
    norm = g.op("Max", [norm, g.const("eps12", np.array(1e-12, np.float32))])
    out = g.op("Div", [mean, norm])
    g.nodes.append(helper.make_node("Identity", [out], ["sentence_embedding"], name="output"))
    return "sentence_embedding"


def save_model(model: onnx.ModelProto, path: Path, weights: str | None = None) -> None:
    """Serialise ``model`` to ``path`` and empty it, record the tensor shapes and
    check the file (the caller handles atomicity).  With ``weights`` (a file name),
    the tensors go to that file beside ``path`` instead: onnxruntime then maps them
    rather than parsing a copy, ~12 MB less RSS for the int8 graph (README).  Both
    files are flushed to disk.  Raises onnx's ValidationError or InferenceError for
    a malformed graph."""
    if weights is None:
        onnx.save_model(model, str(path))
    else:
        # Tensors under 1 KiB (shapes, scalars) stay in the graph, where shape inference reads them.
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=weights, size_threshold=1024)
        path.with_name(weights).touch()  # a graph too small to have one still gets its (empty) file
        # onnx creates it 0600: give it the graph's mode, so whoever may load the graph may map its tensors.
        path.with_name(weights).chmod(stat.S_IMODE(path.stat().st_mode))
    model.Clear()  # its bytes are on disk: free them before the checks load the file
    # The shapes let onnxruntime fuse Add + LayerNormalization into
    # SkipLayerNormalization at load; done file to file, no second copy in RAM.
    onnx.shape_inference.infer_shapes_path(str(path), str(path), check_type=True, strict_mode=True)
    onnx.checker.check_model(str(path))
    for written in (path, path.with_name(weights)) if weights else (path,):
        _fsync(written)


def _fsync(path: Path) -> None:
    """Flush ``path``'s bytes to disk: the cache is renamed into place after this, and a
    graph cut short by a power loss would otherwise pass for a built one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

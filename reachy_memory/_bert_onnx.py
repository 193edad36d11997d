"""Build a sentence-embedding ONNX graph from BERT safetensors weights, no torch.

The graph takes ``input_ids`` and ``attention_mask`` (int64, batch x seq) and
returns ``sentence_embedding`` (float32, batch x hidden): BERT embeddings (token
type 0 folded into the position table), N encoder layers (fused QKV projection,
exact erf GELU), mean pooling over the attention mask and L2 normalisation,
as sentence-transformers' all-MiniLM-L6-v2 pipeline does.

With ``int8`` the weight MatMuls are written already quantised (per output
channel, symmetric, the arithmetic of onnxruntime's ``quantize_dynamic``:
the same initializers and the same DynamicQuantizeLinear -> MatMulInteger ->
Cast -> Mul pattern, which onnxruntime fuses at load); the word-embedding
table is int8 too, one scale per row.  Quantising while building means no
fp32 graph is written, loaded and copied again: the build's peak memory is
the int8 graph plus one weight at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17


@dataclass(frozen=True)
class BertShape:
    """The hyper-parameters the graph needs (from the model's config.json)."""

    hidden: int = 384
    heads: int = 12
    layers: int = 6
    eps: float = 1e-12

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BertShape:
        return cls(config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"],
                   float(config.get("layer_norm_eps", 1e-12)))


class _Unprefixed:
    """``weights[name]`` or ``weights["bert." + name]``, read on access: with lazily
    loaded weights each tensor lives only until it is copied into the graph."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self._weights = weights
        self._prefix = "bert." if any(k.startswith("bert.") for k in weights) else ""
        self._derived: dict[str, np.ndarray] = {}  # tensors computed while building (fused QKV)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._derived:
            return self._derived.pop(name)  # read once, by the op that uses it
        return self._weights[self._prefix + name]

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._derived[name] = value


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 << 20


class LazyWeights(Mapping[str, np.ndarray]):
    """The tensors of a safetensors file, each read from disk when asked for (not kept).

    Read with plain file reads, not a memory map: the pages of a mapped 90 MB
    file count in the build's resident set once touched.  Raises ValueError for
    a file that is not safetensors or holds a tensor type numpy lacks (bf16)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 2 <= size <= _MAX_HEADER:
                raise ValueError(f"{path} is not a safetensors file (header size {size})")
            try:
                header = json.loads(fh.read(size))
            except ValueError as exc:
                raise ValueError(f"{path} has an unreadable safetensors header: {exc}") from exc
        if not isinstance(header, dict):
            raise ValueError(f"{path} has an unreadable safetensors header")
        header.pop("__metadata__", None)
        self._entries: dict[str, dict[str, Any]] = header
        self._data_start = 8 + size

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]  # KeyError for a missing name, as a Mapping promises
        dtype = np.dtype(_DTYPES.get(str(entry.get("dtype")), np.void)).newbyteorder("<")  # safetensors: little-endian
        begin, end = entry["data_offsets"]
        array = np.empty(entry["shape"], dtype)
        if dtype.kind == "V" or end - begin != array.nbytes:
            raise ValueError(f"tensor {name} of {self._path}: type {entry.get('dtype')} or size not readable")
        with open(self._path, "rb") as fh:
            fh.seek(self._data_start + begin)
            if fh.readinto(array.reshape(-1).view(np.uint8)) != array.nbytes:  # type: ignore[arg-type]  # stubs lack __buffer__
                raise ValueError(f"tensor {name} of {self._path} is cut short")
        return array.astype(dtype.newbyteorder("="), copy=False)  # a no-op on little-endian machines

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


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

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        self._n += 1
        out = f"{op_type.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self._n}_{op_type}", **attrs))
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
        quantised, scale = quantize_per_channel(weight)
        wq = self.const(f"{prefix}.wT_quantized", quantised)
        wscale = self.const(f"{prefix}.wT_scale", scale)
        wzero = self.const(f"{prefix}.wT_zero_point", np.zeros(scale.shape, np.int8))
        self._n += 1
        xq, xscale, xzero = (f"{x}_quantized", f"{x}_scale", f"{x}_zero_point")
        self.nodes.append(helper.make_node("DynamicQuantizeLinear", [x], [xq, xscale, xzero], name=f"n{self._n}_dql"))
        scales = self.op("Mul", [xscale, wscale])
        product = self.op("MatMulInteger", [xq, wq, xzero, wzero])
        return self.op("Mul", [self.op("Cast", [product], to=TensorProto.FLOAT), scales])

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
    mask_bias = _mask_bias(g)
    for i in range(shape.layers):
        x = _encoder_layer(g, x, mask_bias, f"encoder.layer.{i}", shape)
    out = _pool_and_normalise(g, x)
    model = g.model  # built in place: copying a graph proto would copy every weight
    graph = model.graph
    graph.name = "minilm_sentence_embedding"
    graph.node.extend(g.nodes)
    graph.input.extend([helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])])
    graph.output.extend([helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", shape.hidden])])
    model.opset_import.extend([helper.make_opsetid("", OPSET)])
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


def _mask_bias(g: _Graph) -> str:
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    mask4 = g.op("Unsqueeze", [mask, g.const("axes_1_2", np.array([1, 2], np.int64))])
    inverted = g.op("Sub", [g.const("one", np.array(1.0, np.float32)), mask4])
    return g.op("Mul", [inverted, g.const("neg_big", np.array(-10000.0, np.float32))])


def _encoder_layer(g: _Graph, x: str, mask_bias: str, p: str, s: BertShape) -> str:
    head_dim = s.hidden // s.heads
    scale = 1.0 / math.sqrt(head_dim)  # folded into the query projection
    w = g.w
    qkv_w = np.concatenate([w[f"{p}.attention.self.query.weight"] * scale,
                            w[f"{p}.attention.self.key.weight"], w[f"{p}.attention.self.value.weight"]])
    qkv_b = np.concatenate([w[f"{p}.attention.self.query.bias"] * scale,
                            w[f"{p}.attention.self.key.bias"], w[f"{p}.attention.self.value.bias"]])
    g.w[f"{p}.qkv.weight"], g.w[f"{p}.qkv.bias"] = qkv_w, qkv_b
    qkv = g.linear(x, f"{p}.qkv")
    split = g.const(f"{p}.split", np.array([s.hidden] * 3, np.int64))
    g.nodes.append(helper.make_node("Split", [qkv, split], [f"{p}.q", f"{p}.k", f"{p}.v"], axis=2, name=f"{p}.split"))
    heads = g.const(f"{p}.heads_shape", np.array([0, 0, s.heads, head_dim], np.int64))
    q = g.op("Transpose", [g.op("Reshape", [f"{p}.q", heads])], perm=[0, 2, 1, 3])
    k = g.op("Transpose", [g.op("Reshape", [f"{p}.k", heads])], perm=[0, 2, 3, 1])
    v = g.op("Transpose", [g.op("Reshape", [f"{p}.v", heads])], perm=[0, 2, 1, 3])
    probs = g.op("Softmax", [g.op("Add", [g.op("MatMul", [q, k]), mask_bias])], axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const(f"{p}.merge_shape", np.array([0, 0, s.hidden], np.int64))])
    attn = g.linear(ctx, f"{p}.attention.output.dense")
    x1 = g.layer_norm(g.op("Add", [attn, x]), f"{p}.attention.output.LayerNorm", s.eps)
    hidden = g.linear(x1, f"{p}.intermediate.dense")
    gelu = _gelu(g, hidden)
    out = g.linear(gelu, f"{p}.output.dense")
    return g.layer_norm(g.op("Add", [out, x1]), f"{p}.output.LayerNorm", s.eps)


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


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Serialise ``model`` to ``path`` and empty it, record the tensor shapes and
    check the file (the caller handles atomicity).  Raises onnx's ValidationError
    or InferenceError for a malformed graph."""
    onnx.save_model(model, str(path))
    model.Clear()  # its bytes are on disk: free them before the checks load the file
    # The shapes let onnxruntime fuse Add + LayerNormalization into
    # SkipLayerNormalization at load; done file to file, no second copy in RAM.
    onnx.shape_inference.infer_shapes_path(str(path), str(path), check_type=True, strict_mode=True)
    onnx.checker.check_model(str(path))

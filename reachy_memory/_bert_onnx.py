"""Build a sentence-embedding ONNX graph from BERT safetensors weights, no torch.

The graph takes ``input_ids`` and ``attention_mask`` (int64, batch x seq) and
returns ``sentence_embedding`` (float32, batch x hidden): BERT embeddings (token
type 0 folded into the position table), N encoder layers (fused QKV projection,
exact erf GELU), mean pooling over the attention mask and L2 normalisation,
as sentence-transformers' all-MiniLM-L6-v2 pipeline does.
"""

from __future__ import annotations

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


class LazyWeights(Mapping[str, np.ndarray]):
    """The tensors of a safetensors file, each read from disk when asked for (not kept)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="numpy")

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._file.get_tensor(name)  # type: ignore[no-any-return]
        except Exception as exc:  # safetensors raises its own error types for a missing name
            raise KeyError(name) from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self._file.keys())

    def __len__(self) -> int:
        return len(self._file.keys())


class _Graph:
    """Accumulates nodes and initializers with unique names."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.w = _Unprefixed(weights)
        self.model = onnx.ModelProto()
        self.nodes: list[onnx.NodeProto] = []
        self.weight_matmuls: list[str] = []
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

    def linear(self, x: str, prefix: str, scale: float = 1.0) -> str:
        """x @ W.T + b for the HF Linear ``prefix``; recorded for int8 quantisation."""
        weight = self.const(f"{prefix}.wT", (self.w[f"{prefix}.weight"].T * scale).astype(np.float32))
        bias = self.const(f"{prefix}.b", (self.w[f"{prefix}.bias"] * scale).astype(np.float32))
        out = self.op("MatMul", [x, weight])
        self.weight_matmuls.append(self.nodes[-1].name)
        return self.op("Add", [out, bias])

    def layer_norm(self, x: str, prefix: str, eps: float) -> str:
        gamma = self.const(f"{prefix}.g", self.w[f"{prefix}.weight"])
        beta = self.const(f"{prefix}.beta", self.w[f"{prefix}.bias"])
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=eps)


def build_graph(weights: Mapping[str, np.ndarray], shape: BertShape) -> tuple[onnx.ModelProto, list[str]]:
    """The ONNX model and the names of its weight MatMul nodes (check it with
    :func:`save_model`, which checks the saved file rather than a second copy in RAM)."""
    g = _Graph(weights)
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
    return model, g.weight_matmuls


def _embeddings(g: _Graph, shape: BertShape) -> str:
    words = g.const("word_emb", g.w["embeddings.word_embeddings.weight"])
    # Token type is always 0 for single sentences: fold it into the positions.
    positions = g.w["embeddings.position_embeddings.weight"] + g.w["embeddings.token_type_embeddings.weight"][0]
    pos = g.const("pos_emb", positions.astype(np.float32))
    seq_len = g.op("Shape", ["input_ids"], start=1, end=2)
    zero = g.const("zero_1d", np.array([0], np.int64))
    pos_slice = g.op("Slice", [pos, zero, seq_len, zero])
    summed = g.op("Add", [g.op("Gather", [words, "input_ids"]), pos_slice])
    return g.layer_norm(summed, "embeddings.LayerNorm", shape.eps)


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
    """Serialise ``model`` to ``path`` and check the file (the caller handles atomicity).
    Raises onnx's ValidationError for a malformed graph."""
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))


def quantize_int8(src: Path, dst: Path, weight_matmuls: list[str]) -> None:
    """Dynamic int8 quantisation of the weight MatMuls only, per channel.

    Quantising every op (attention scores included) costs up to 0.25 cosine on
    some texts; weights only keeps parity at >= 0.97 (see README).
    """
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser logs dozens of INFO lines on the root logger
    try:
        quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], nodes_to_quantize=weight_matmuls,
                         per_channel=True, weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)

"""On-device sentence embeddings: all-MiniLM-L6-v2 on onnxruntime, no torch.

:func:`load_embedder` returns an :class:`OnnxEmbedder` (``dim``, ``identity``,
``embed(texts)``), the object :class:`~reachy_memory.MemoryStore` plugs in.
Texts are tokenised with the model's ``tokenizer.json`` and truncated at 256
tokens, as sentence-transformers' ``max_seq_length`` does; vectors are
mean-pooled and L2-normalised inside the graph.  Repeated texts are served
from a small LRU cache.  onnxruntime errors surface as :class:`ModelError`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from reachy_memory._threads import TRIM_TOKENS, release_free_heap
from reachy_memory.config import Config, load_config
from reachy_memory.embedding.model_files import ModelFiles, ensure_model
from reachy_memory.errors import ModelError

log = logging.getLogger(__name__)
BATCH = 8  # texts per onnxruntime run, sorted by length; larger batches spill out of cache and run slower


class OnnxEmbedder:
    """A loaded model. ``embed`` is thread-safe."""

    def __init__(self, files: ModelFiles, *, threads: int = 1, max_seq_length: int = 256,
                 lru_size: int = 512, spin: bool = False) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.identity = dict(files.identity)
        self.dim = int(self.identity["dim"])
        try:
            self._tokenizer = Tokenizer.from_file(str(files.tokenizer))
            self._tokenizer.no_padding()
            self._tokenizer.enable_truncation(max_length=max_seq_length)
            options = ort.SessionOptions()
            options.intra_op_num_threads = max(1, threads)
            options.inter_op_num_threads = 1
            # The arena keeps the peak of every batch shape ever seen: without
            # it the loaded model costs ~60-100 MB less and runs as fast.
            options.enable_cpu_mem_arena = False
            # Spinning threads keep both cores busy after every call: bad for a
            # robot whose control loop shares the CPU (see embedding.spin).
            options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
            self._session = ort.InferenceSession(str(files.onnx), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # tokenizers and onnxruntime raise their own types
            raise ModelError(f"cannot load the model from {files.onnx}: {exc}") from exc
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lru_size = lru_size
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32 L2-normalised embeddings. Raises ModelError."""
        out = np.empty((len(texts), self.dim), np.float32)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, text in enumerate(texts):
                hit = self._cache.get(text)
                if hit is None:
                    missing.setdefault(text, []).append(i)
                else:
                    self._cache.move_to_end(text)
                    out[i] = hit
        if missing:
            fresh = self._run(list(missing))
            self._remember(missing, fresh, out)
        return out

    def _remember(self, missing: dict[str, list[int]], fresh: np.ndarray, out: np.ndarray) -> None:
        with self._lock:
            for (text, positions), vec in zip(missing.items(), fresh, strict=True):
                out[positions] = vec
                if self._lru_size and len(text) <= 2048:
                    self._cache[text] = vec
                    if len(self._cache) > self._lru_size:
                        self._cache.popitem(last=False)

    def _run(self, texts: list[str]) -> np.ndarray:
        try:
            encodings = self._tokenizer.encode_batch(texts) if len(texts) > 1 else [self._tokenizer.encode(texts[0])]
        except Exception as exc:
            raise ModelError(f"tokenisation failed: {exc}") from exc
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        result = np.empty((len(texts), self.dim), np.float32)
        tokens = 0
        for start in range(0, len(order), BATCH):
            chunk = order[start : start + BATCH]
            result[chunk] = self._infer([encodings[i].ids for i in chunk])
            tokens += len(chunk) * len(encodings[chunk[-1]].ids)  # sorted: the last is the widest
        if tokens >= TRIM_TOKENS:
            release_free_heap()  # the freed activations would otherwise keep RSS at this call's peak
        return result

    def _infer(self, ids_list: list[list[int]]) -> np.ndarray:
        width = max(len(ids) for ids in ids_list)
        ids = np.zeros((len(ids_list), width), np.int64)
        mask = np.zeros((len(ids_list), width), np.int64)
        for row, token_ids in enumerate(ids_list):
            ids[row, : len(token_ids)] = token_ids
            mask[row, : len(token_ids)] = 1
        try:
            return self._session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        except Exception as exc:
            raise ModelError(f"onnxruntime failed: {exc}") from exc


def load_embedder(config: Config | None = None, *, data_dir: str | Path | None = None) -> OnnxEmbedder:
    """The configured embedder, built into the cache on first use.

    Raises ModelUnavailableError (with the command that fixes it) when no model
    can be found, ModelError when it cannot be loaded.
    """
    config = config or load_config()
    files = ensure_model(config, Path(data_dir).expanduser() if data_dir else None)
    emb = config.embedding
    return OnnxEmbedder(files, threads=emb.threads, max_seq_length=emb.max_seq_length, lru_size=emb.lru_size,
                        spin=emb.spin)


def describe(embedder: Any) -> dict[str, Any]:
    """A JSON-friendly description of an embedder (for stats and health)."""
    if embedder is None:
        return {"state": "unavailable"}
    return {"state": "ready", **dict(getattr(embedder, "identity", {"dim": embedder.dim}))}

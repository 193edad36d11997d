"""Text to vectors: all-MiniLM-L6-v2 on onnxruntime, no torch.

* ``graph``: builds the ONNX graph (fp32 or int8) from the model's weights;
* ``model_files``: finds, fetches, checks and caches the model's files;
* ``embedder``: ``OnnxEmbedder``, the tokenizer and session that embed text.
"""

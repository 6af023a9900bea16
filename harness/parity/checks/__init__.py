"""The parity job's checks. Each measures and returns :class:`harness.parity.result.Figure` objects
(and facts for the report); none applies a gate.

* :mod:`.reference`: the reference against the oracle (transformers), against itself (cached vs
  uncached, GGUF F32 vs safetensors) and the quantized loaders against ``gguf.quants``;
* :mod:`.fast`: the fast path against the reference (fp32, bf16), batched vs solo, chunked vs one-shot;
* :mod:`.llamacpp`: llama.cpp against the reference;
* :mod:`.gemma3_real`: the real Gemma 3 270M GGUF;
* :mod:`.tokenizer`: the tokenizer checks as gated figures.
"""

"""Tokenizers: building test vocabularies, tokenizer engines side by side, and the tokenizer checks.

* :mod:`.build`: tokenizer files and metadata (GGUF ``tokenizer.ggml.*`` from ``tokenizer.json`` or
  ``tokenizer.model``; the gemma4-type test vocabulary; the Gemma 3 ``tokenizer.json`` derived from the
  carried ``tokenizer.model``);
* :mod:`.engines`: tokenizer engines behind one interface (ours, HF tokenizers, sentencepiece,
  transformers' GGUF conversion, llama.cpp in a worker) and their comparison over corpora;
* :mod:`.checks`: the parity job's tokenizer checks, one small function each.
"""

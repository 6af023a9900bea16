"""What llama.cpp (as vendored in llama-cpp-python :data:`~harness.engines.llamacpp.LLAMA_CPP_PYTHON_VERSION`) can
run, judged from a file's header alone: the ``file_check`` of its registry row
(:data:`harness.core.engine_kinds.KINDS`), which ``g4h inspect`` (:func:`harness.inspect.runnable.engine_rows`) and
the sweep's plan read. It needs a ``tokenizer.ggml.model`` key and type ids its ggml knows
(:data:`LLAMACPP_TYPE_IDS`), and its KV donor rule must give each shared layer a cache of the right shape
(:func:`llamacpp_donors`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from gemma4_harness.reference.config import ModelConfig

from . import INSTALL_MSG, LLAMA_CPP_PYTHON_VERSION

#: GGML type ids the ggml of llama-cpp-python 0.3.36 reads: ``enum ggml_type`` in ``ggml/include/ggml.h``,
#: 0..42 without the removed ids 4, 5 (Q4_2, Q4_3), 31-33 (Q4_0_4_4 ..) and 36-38 (IQ4_NL_4_4 ..).
#: Id 42 (Q2_0) is one gguf 0.19 does not know.
LLAMACPP_TYPE_IDS = frozenset(range(43)) - {4, 5, 31, 32, 33, 36, 37, 38}


def llamacpp_donors(cfg: ModelConfig) -> dict[int, int]:
    """The layer whose KV cache llama.cpp gives each KV-shared layer of a gemma4 model.

    llama.cpp's rule (``llama-model.cpp``, the ``reuse`` callback for LLM_ARCH_GEMMA4): with
    ``n_kv = n_layer - shared_kv_layers``, a layer ``il >= n_kv`` reuses layer ``n_kv - 2`` when it is a
    sliding layer, else ``n_kv - 1``. Its sliding and full layers live in two caches
    (``llama_kv_cache_iswa``), so a donor of the other type is not found and llama.cpp aborts
    (``GGML_ASSERT(map_layer_ids.find(il_reuse) != ...)``, ``llama-kv-cache.cpp``; seen on the built-in
    case ``edge-keqv-shared-donor``). transformers' rule (the last non-shared layer of the same type,
    :func:`reference.config.kv_donors`) is the tie-breaker; the two agree on the usual layouts.

    Returns:
        shared layer index -> llama.cpp's donor (empty without shared layers).
    """
    n_kv = cfg.n_layer - cfg.n_kv_shared
    return {L.index: n_kv - (2 if L.is_sliding else 1) for L in cfg.layers if L.index >= n_kv}


def file_check(info: Any, cfg: ModelConfig | None) -> tuple[bool, str | None, list[str]]:
    """Whether llama.cpp can run the inspected GGUF ``info`` (a :class:`harness.inspect.model.Inspection`, its
    ``format`` already ``gguf``) of config ``cfg``: ``(can_run, why not, the differences it will show)``."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False, INSTALL_MSG, []
    unknown = [t.type for t in info.tensor_types if t.type_id not in LLAMACPP_TYPE_IDS]
    if unknown:
        return False, f"type {unknown[0]} is not one llama.cpp {LLAMA_CPP_PYTHON_VERSION}'s ggml reads", []
    if info.tokenizer.get("model") is None:
        return False, "no tokenizer.ggml.model key: llama.cpp's vocabulary loader needs one", []
    notes = []
    if cfg is not None and cfg.arch == "gemma4":
        n_kv = cfg.n_layer - cfg.n_kv_shared
        if n_kv < 2:
            return False, (f"{n_kv} non-shared layer(s): llama.cpp asserts n_layer_kv_from_start >= 2 for gemma4 "
                           "and aborts"), []
        if not any(L.is_sliding for L in cfg.layers):
            return False, "no sliding layer: llama.cpp asserts one for gemma4 (its iSWA cache) and aborts", []
        for il, d in llamacpp_donors(cfg).items():
            L, D, T = cfg.layers[il], cfg.layers[d], cfg.layers[il].kv_donor
            if D.is_sliding != L.is_sliding:
                kind = {True: "sliding", False: "full"}
                return False, (f"llama.cpp's KV donor rule gives {kind[L.is_sliding]} shared layer {il} the cache of "
                               f"{kind[D.is_sliding]} layer {d} (transformers: layer {T}); its sliding and full caches "
                               "are apart, so it aborts (GGML_ASSERT in llama-kv-cache.cpp)"), []
            if (D.head_dim, D.n_kv_head) != (L.head_dim, L.n_kv_head):
                return False, (f"llama.cpp's KV donor rule gives shared layer {il} (head_dim {L.head_dim}, "
                               f"{L.n_kv_head} KV heads) the cache of layer {d} (head_dim {D.head_dim}, "
                               f"{D.n_kv_head} KV heads; transformers: layer {T}): the shapes differ"), []
            if d != T:
                notes.append(f"shared layer {il} reads layer {d}'s KV cache in llama.cpp, layer {T}'s in "
                             "transformers: its output differs")
        if cfg.final_logit_softcap is None:
            notes.append("applies a final softcap of 30 (its default) where the file has none")
    return True, None, notes

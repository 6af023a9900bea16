"""The Gemma 4 assistant (MTP drafter) in float64 NumPy: its config, its binding to a target, its forward.

A Gemma 4 assistant drafts tokens for speculative decoding from the target's own state. One draft step at
position ``p`` (the position of the last token ``x``, which the target has not read yet):

1. input ``concat(E_target[x] * sqrt(H_target), h_prev)`` ``[2 H_target]``, where ``h_prev`` is the target's
   post-final-norm hidden state at the position that produced ``x`` (``result_norm``), or, from the second step
   of a round on, the drafter's own ``h_next``;
2. ``nextn.pre_projection`` into the drafter's width ``H_a``;
3. L ordinary Gemma 4 text layers with Q only: K and V come from the target's cache. Sliding layers read the
   target's last non-shared sliding layer, full layers its last non-shared full layer (the "store" layers of
   transformers' ``kv_sharing_modes``); the query sits at ``p`` and sees the target's keys at positions ``< p``
   (within the window on sliding layers);
4. the final norm; logits from the drafter's own tied head, with no softcap, or from the centroid-masked head
   (``use_ordered_embeddings``: the E2B/E4B assistants); ``nextn.post_projection`` gives ``h_next``.

Every draft step of a round uses the same position ``p``. The drafter's layers are exactly
:func:`reference.model.decoder_layer` with ``has_kv = False`` and ``kv_donor`` = the target's store layer of
their type (:func:`bind`), so the math is the specification's own.

Sources: transformers 5.23 ``models/gemma4_assistant/modeling_gemma4_assistant.py``
(``Gemma4AssistantForCausalLM``, ``Gemma4AssistantMaskedEmbedder``) and
``generation/candidate_generator.py`` (``SinglePositionMultiTokenCandidateGenerator``); llama.cpp
``src/models/gemma4-assistant.cpp`` and ``common/speculative.cpp`` (``draft-mtp``, ``is_mem_shared``).

The two disagree on the keys a sliding layer sees once the context reaches the window. llama.cpp masks the
drafter's query at ``p`` like a target query: keys ``p-W+1 .. p-1`` (W-1 of them) of the rolled-back cache.
transformers applies a bidirectional window ``|i-j| <= W`` to the tail of whatever its sliding store holds: the
last W+1 entries (measured on e2b-assistant, W = 16, a 32-token prompt: its drafter given all 32 keys equals it
given the last 17 to 2e-6 and differs from it given the last 15 by 15 in the logits), and after a verify round
those include rejected drafts. This specification follows llama.cpp's rule (what a target token at ``p``
would see, minus ``p`` itself); the comparison with transformers hands it exactly those keys.

Shapes: T = rows (draft tokens, usually 1), H_t = target hidden, H_a = drafter hidden, V = vocab,
C = centroids, S = the target's cached keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .config import ModelConfig, expected_tensors
from .config_gguf import attach_rope_freqs, config_from_gguf
from .config_hf import config_from_hf
from .errors import ConfigError, PromptError
from .model import KVCache, TraceFn, decoder_layer, embed, forward, linear, no_trace, rms_norm

GGUF_ARCH = "gemma4-assistant"
"""``general.architecture`` of an assistant GGUF (llama.cpp ``LLM_ARCH_GEMMA4_ASSISTANT``)."""

UNBOUND = -1
"""``kv_donor`` of a drafter layer before :func:`bind` names the target's store layer."""


@dataclass(frozen=True)
class DrafterConfig:
    """A Gemma 4 assistant: its decoder (a :class:`~reference.config.ModelConfig`) plus the MTP fields.

    Attributes:
        source: the file it came from (for messages).
        text: the drafter's decoder; ``hidden_size`` is H_a; every layer has ``has_kv = False`` and, once bound,
            ``kv_donor`` = the index of the target layer whose K/V it reads (:data:`UNBOUND` before).
        backbone_hidden_size: H_t, the target hidden size it was trained against.
        backbone_key: the field or key that states it (``backbone_hidden_size`` or
            ``gemma4-assistant.embedding_length_out``), for messages.
        use_ordered_embeddings: the centroid-masked head (HF ``Gemma4AssistantMaskedEmbedder``).
        num_centroids: clusters of the ordered vocabulary (``V % C == 0``).
        centroid_top_k: clusters scored per step.
        target: the source of the target it is bound to, or None.
    """

    source: str
    text: ModelConfig
    backbone_hidden_size: int
    backbone_key: str
    use_ordered_embeddings: bool = False
    num_centroids: int = 0
    centroid_top_k: int = 0
    target: str | None = None

    @property
    def n_layer(self) -> int:
        """Drafter layers."""
        return self.text.n_layer

    def summary(self) -> dict[str, Any]:
        """A JSON-able description (for reports)."""
        return {"hidden_size": self.text.hidden_size, "backbone_hidden_size": self.backbone_hidden_size,
                "n_layer": self.n_layer, "layer_types": ["S" if L.is_sliding else "F" for L in self.text.layers],
                "reads_target_layer": [L.kv_donor for L in self.text.layers],
                "use_ordered_embeddings": self.use_ordered_embeddings, "num_centroids": self.num_centroids,
                "centroid_top_k": self.centroid_top_k}


# --------------------------------------------------------------------------- config


def _shared_to_none(cfg: ModelConfig) -> ModelConfig:
    """Every layer Q-only (``has_kv = False``, no V projection, donor :data:`UNBOUND`); no final softcap."""
    layers = tuple(dataclasses.replace(L, has_kv=False, has_v_proj=False, kv_donor=UNBOUND) for L in cfg.layers)
    return dataclasses.replace(cfg, layers=layers, n_kv_shared=cfg.n_layer, final_logit_softcap=None)


def _check_centroids(vocab: int, n_centroids: int, top_k: int, source: str) -> None:
    if n_centroids <= 0 or vocab % n_centroids:
        raise ConfigError(f"{source}: num_centroids = {n_centroids}: expected a positive divisor of vocab_size {vocab}")
    if not 0 < top_k <= n_centroids:
        raise ConfigError(f"{source}: centroid_intermediate_top_k = {top_k}: expected 1..num_centroids ({n_centroids})")


def drafter_config_from_hf(raw: Mapping[str, Any], source: str) -> DrafterConfig:
    """The drafter config from an HF ``config.json`` (``model_type`` ``gemma4_assistant``).

    The per-layer table comes from :func:`reference.config_hf.config_from_hf` on ``text_config`` read as an
    unshared decoder (transformers forces ``num_kv_shared_layers = num_hidden_layers``; here every layer is
    made Q-only instead).

    Raises:
        ConfigError: another model_type; PLE, MoE, a double-wide MLP or an untied head (what
            ``Gemma4AssistantConfig.validate_architecture`` refuses, plus the untied head, which no assistant
            has); bad centroid sizes; any text-config error (the field is named).

    Source: transformers ``Gemma4AssistantConfig``.
    """
    if raw.get("model_type") != "gemma4_assistant":
        raise ConfigError(f"{source}: model_type = {raw.get('model_type')!r}: expected 'gemma4_assistant'")
    tc = raw.get("text_config")
    if not isinstance(tc, Mapping):
        raise ConfigError(f"{source}: text_config: expected an object (the drafter's Gemma4TextConfig)")
    tc = dict(tc)
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if tc.get(key):
            raise ConfigError(f"{source}: text_config.{key} = {tc[key]!r}: a Gemma 4 assistant has none")
    if not raw.get("tie_word_embeddings", True):
        raise ConfigError(f"{source}: tie_word_embeddings = false: a Gemma 4 assistant's head is its embed_tokens")
    tc.update(model_type="gemma4_text", num_kv_shared_layers=0, tie_word_embeddings=True)
    text = _shared_to_none(config_from_hf(tc, source))
    backbone = raw.get("backbone_hidden_size", 1536)
    if isinstance(backbone, bool) or not isinstance(backbone, int) or backbone <= 0:
        raise ConfigError(f"{source}: backbone_hidden_size = {backbone!r}: expected a positive integer")
    ordered = bool(raw.get("use_ordered_embeddings", False))
    n_c, top_k = int(raw.get("num_centroids", 2048)), int(raw.get("centroid_intermediate_top_k", 32))
    if ordered:
        _check_centroids(text.vocab_size, n_c, top_k, source)
    return DrafterConfig(source=source, text=text, backbone_hidden_size=backbone, backbone_key="backbone_hidden_size",
                         use_ordered_embeddings=ordered, num_centroids=n_c if ordered else 0,
                         centroid_top_k=top_k if ordered else 0)


def drafter_config_from_gguf(meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], source: str,
                             rope_freqs: np.ndarray | None = None) -> DrafterConfig:
    """The drafter config from a ``gemma4-assistant`` GGUF's key/values and tensor table.

    The ``gemma4-assistant.*`` keys are the ``gemma4.*`` keys of :func:`reference.config_gguf.config_from_gguf` plus
    ``embedding_length_out`` (H_t) and ``nextn_predict_layers`` (= ``block_count``); the per-layer table is
    derived there, from the keys read as an unshared ``gemma4`` decoder. A GGUF carries no centroid-head
    hyper-parameters (llama.cpp's converter drops ``masked_embedding.*``), so a GGUF drafter always uses the
    full head, as llama.cpp does.

    Raises:
        ConfigError: another architecture; ``embedding_length_out`` missing; ``nextn_predict_layers`` not
            ``block_count``; any ``gemma4`` key error (the key is named with its ``gemma4-assistant.`` prefix).

    Source: llama.cpp ``conversion/gemma.py`` ``Gemma4AssistantModel`` and ``src/models/gemma4-assistant.cpp``.
    """
    arch = meta.get("general.architecture")
    if arch != GGUF_ARCH:
        raise ConfigError(f"{source}: general.architecture = {arch!r}: expected {GGUF_ARCH!r}")
    pre = f"{GGUF_ARCH}."
    renamed = {("gemma4." + k[len(pre):] if k.startswith(pre) else k): v for k, v in meta.items()}
    renamed["general.architecture"] = "gemma4"
    renamed["gemma4.attention.shared_kv_layers"] = 0
    renamed.pop("gemma4.final_logit_softcapping", None)
    try:
        text = config_from_gguf(renamed, tensors, source)
        if rope_freqs is not None:
            text = attach_rope_freqs(text, rope_freqs)
    except ConfigError as e:
        raise ConfigError(str(e).replace("gemma4.", pre)) from None
    out_key = f"{pre}embedding_length_out"
    backbone = meta.get(out_key)
    if isinstance(backbone, bool) or not isinstance(backbone, (int, np.integer)) or backbone <= 0:
        raise ConfigError(f"{source}: {out_key} = {backbone!r}: expected the target's hidden size (a positive integer)")
    n_next = meta.get(f"{pre}nextn_predict_layers", text.n_layer)
    if n_next != text.n_layer:
        raise ConfigError(f"{source}: {pre}nextn_predict_layers = {n_next}: expected block_count {text.n_layer}")
    return DrafterConfig(source=source, text=_shared_to_none(text), backbone_hidden_size=int(backbone),
                         backbone_key=out_key)


def drafter_expected_tensors(d: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter reads, canonical name -> numpy shape (linear ``[out, in]``).

    The decoder's tensors (:func:`reference.config.expected_tensors` of its Q-only layers: no ``attn_k``,
    ``attn_v``, ``attn_k_norm``), the projections ``nextn.pre_projection`` ``[H_a, 2 H_t]`` and
    ``nextn.post_projection`` ``[H_t, H_a]``, and with the centroid head ``masked_embd_centroids`` ``[C, H_a]``
    and ``masked_embd_ordering`` ``[V]``. Source: llama.cpp ``llama_model_gemma4_assistant::load_arch_tensors``.
    """
    h, ht = d.text.hidden_size, d.backbone_hidden_size
    t = expected_tensors(d.text)
    t["nextn.pre_projection.weight"] = (h, 2 * ht)
    t["nextn.post_projection.weight"] = (ht, h)
    if d.use_ordered_embeddings:
        t["masked_embd_centroids.weight"] = (d.num_centroids, h)
        t["masked_embd_ordering"] = (d.text.vocab_size,)
    return t


# --------------------------------------------------------------------------- binding to a target


def store_layers(target: ModelConfig) -> dict[bool, int]:
    """The target layers a drafter reads: ``{is_sliding: index}`` of the last non-shared layer of each type.

    Source: transformers ``Gemma4TextConfig.kv_sharing_modes`` ("store"); llama.cpp's share map
    (``llama-model.cpp``: SWA -> target layer n_layer-2, full -> n_layer-1, resolved through the target's reuse
    map) agrees when the target's unshared layers end ``[sliding, full]``.
    """
    out: dict[bool, int] = {}
    for L in target.layers:
        if L.has_kv:
            out[L.is_sliding] = L.index
    return out


def bind(d: DrafterConfig, target: ModelConfig) -> DrafterConfig:
    """The drafter with every layer's ``kv_donor`` set to the target's store layer of its type.

    Raises:
        ConfigError: not a Gemma 4 target; the drafter's backbone size or vocabulary differs from the target's;
            a drafter layer whose type the target does not store; a head_dim, KV-head count, RoPE or sliding
            window that differs from the store layer it would read. One line, naming both files.
    """
    src, tsrc = d.source, target.source
    if target.arch != "gemma4":
        raise ConfigError(f"{src}: a Gemma 4 assistant needs a Gemma 4 target, got arch {target.arch!r} ({tsrc})")
    if d.backbone_hidden_size != target.hidden_size:
        raise ConfigError(f"{src}: {d.backbone_key} = {d.backbone_hidden_size} does not match the target's hidden "
                          f"size {target.hidden_size} ({tsrc})")
    if d.text.vocab_size != target.vocab_size:
        raise ConfigError(f"{src}: vocabulary of {d.text.vocab_size} tokens, the target has {target.vocab_size} ({tsrc})")
    stores = store_layers(target)
    layers = []
    for L in d.text.layers:
        kind = "sliding" if L.is_sliding else "full"
        if L.is_sliding not in stores:
            raise ConfigError(f"{src}: drafter layer {L.index} is {kind} but the target has no non-shared {kind} "
                              f"layer to read ({tsrc})")
        T = target.layers[stores[L.is_sliding]]
        if (L.head_dim, L.n_kv_head) != (T.head_dim, T.n_kv_head):
            raise ConfigError(f"{src}: drafter layer {L.index} ({kind}, head_dim {L.head_dim}, kv heads {L.n_kv_head}) "
                              f"cannot read target layer {T.index} (head_dim {T.head_dim}, kv heads {T.n_kv_head}) ({tsrc})")
        same_ff = (L.rope_freq_factors is None) == (T.rope_freq_factors is None) and (
            L.rope_freq_factors is None or np.array_equal(L.rope_freq_factors, T.rope_freq_factors))
        if (L.rope_base, L.n_rot, L.rope_scale) != (T.rope_base, T.n_rot, T.rope_scale) or not same_ff:
            raise ConfigError(f"{src}: drafter layer {L.index} ({kind}) rotates with other RoPE parameters than target "
                              f"layer {T.index} whose keys it reads (base {L.rope_base} vs {T.rope_base}, n_rot "
                              f"{L.n_rot} vs {T.n_rot}) ({tsrc})")
        layers.append(dataclasses.replace(L, kv_donor=T.index))
    if any(L.is_sliding for L in d.text.layers) and d.text.sliding_window != target.sliding_window:
        raise ConfigError(f"{src}: sliding window {d.text.sliding_window}, the target's is {target.sliding_window} ({tsrc})")
    return dataclasses.replace(d, text=dataclasses.replace(d.text, layers=tuple(layers)), target=tsrc)


# --------------------------------------------------------------------------- operations and blocks


def drafter_input(target: ModelConfig, TW, ids: np.ndarray, h_prev: np.ndarray) -> np.ndarray:
    """``concat(E_target[ids] * sqrt(H_t), h_prev)``. [T], [T, H_t] -> [T, 2 H_t].

    Source: transformers ``SinglePositionMultiTokenCandidateGenerator.get_candidates``; llama.cpp
    ``gemma4-assistant.cpp`` (``inp_embd_target``, ``inp_xh``).
    """
    return np.concatenate([embed(target, TW, ids), h_prev], axis=-1)


def centroid_head(W, h: np.ndarray, n_centroids: int, top_k: int) -> np.ndarray:
    """The centroid-masked head: logits of the tokens in the ``top_k`` best clusters, ``min - 1`` elsewhere.

    ``c = h @ centroids.T``; the ``top_k`` clusters with the largest ``c`` (ties: lowest index); their tokens
    ``ordering.reshape(C, V/C)[cluster]`` get ``h @ E[token]``; every other token gets the smallest of those
    minus 1 (per row). [T, H_a] -> [T, V]. Source: transformers ``Gemma4AssistantMaskedEmbedder.forward``.
    """
    E = W["token_embd.weight"]
    V = E.shape[0]
    order = np.asarray(W["masked_embd_ordering"]).astype(np.int64).reshape(n_centroids, V // n_centroids)
    scores = linear(h, W["masked_embd_centroids.weight"])  # [T, C]
    out = np.empty((h.shape[0], V))
    for t in range(h.shape[0]):
        top = np.argsort(-scores[t], kind="stable")[:top_k]
        sel = order[top].reshape(-1)  # [top_k * V/C]
        s = E[sel] @ h[t]
        out[t] = s.min() - 1.0
        out[t, sel] = s
    return out


def drafter_head(d: DrafterConfig, W, h: np.ndarray) -> np.ndarray:
    """Logits from the drafter's own tied head (no softcap), or the :func:`centroid_head`. [T, H_a] -> [T, V].

    Source: transformers ``Gemma4AssistantForCausalLM.forward``; llama.cpp always the full head.
    """
    if d.use_ordered_embeddings:
        return centroid_head(W, h, d.num_centroids, d.centroid_top_k)
    return linear(h, W["token_embd.weight"])


def drafter_forward(d: DrafterConfig, DW, target: ModelConfig, TW, ids: Sequence[int], h_prev: np.ndarray,
                    position: int, cache: KVCache, trace: TraceFn | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One draft step: logits and ``h_next`` for each row, every row at ``position``.

    Args:
        d: the drafter config, bound to ``target`` (:func:`bind`).
        DW: the drafter's weights (:func:`reference.drafter_weights.load_drafter`).
        target, TW: the target's config and weights (its embedding table is the drafter's input).
        ids: the token of each row (the last token of the sequence, or the previous draft).
        h_prev: [T, H_t] the target's ``result_norm`` at the position that produced the token, or the previous
            step's ``h_next``.
        position: the position of the sequence's last token; the target's cache holds exactly the positions
            before it.
        cache: the target's cache (its store layers' K/V are read, never written).
        trace: callback ``(point, layer, array)``; points ``inp_embd_target``, ``inp_xh``, ``pre_proj``, per
            drafter layer ``attn_out``, ``ffn_out``, ``l_out``, then ``result_norm``, ``result_output``,
            ``h_nextn`` (llama.cpp's names).

    Returns:
        ``(logits [T, V], h_next [T, H_t])`` float64.

    Raises:
        ValueError: the drafter is not bound, ``position`` is 0, or it is not the number of tokens in ``cache``.
        PromptError: a token id outside the vocabulary.
    """
    trace = trace or no_trace
    if any(L.kv_donor == UNBOUND for L in d.text.layers):
        raise ValueError(f"{d.source}: drafter not bound to a target (reference.drafter.bind)")
    if position < 1:
        raise ValueError("draft position 0: a drafter reads the target's keys before its position, and there are none")
    if position != cache.n_past:
        raise ValueError(f"draft position {position}: the target's cache holds {cache.n_past} tokens; a drafter runs at "
                         "the position of the token the target has not read")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= target.vocab_size)]
    if bad.size:
        raise PromptError(f"token id {int(bad[0])} is outside the vocabulary [0, {target.vocab_size})")
    h_prev = np.asarray(h_prev, dtype=np.float64).reshape(ids.shape[0], d.backbone_hidden_size)
    positions = np.full(ids.shape[0], position, dtype=np.int64)
    trace("inp_embd_target", -1, embed(target, TW, ids))
    xh = drafter_input(target, TW, ids, h_prev)  # [T, 2 H_t]
    trace("inp_xh", -1, xh)
    x = linear(xh, DW["nextn.pre_projection.weight"])  # [T, H_a]
    trace("pre_proj", -1, x)
    for layer in d.text.layers:
        x = decoder_layer(d.text, layer, DW, x, positions, cache.pos, cache, None, trace)
    x = rms_norm(x, DW["output_norm.weight"], d.text.rms_eps)
    trace("result_norm", -1, x)
    logits = drafter_head(d, DW, x)
    trace("result_output", -1, logits)
    h_next = linear(x, DW["nextn.post_projection.weight"])  # [T, H_t]
    trace("h_nextn", -1, h_next)
    return logits, h_next


def draft(d: DrafterConfig, DW, target: ModelConfig, TW, cache: KVCache, token: int, h_prev: np.ndarray,
          n: int) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """``n`` greedy draft tokens of one round, all at position ``cache.n_past``.

    Args:
        token: the sequence's last token (not yet read by the target).
        h_prev: [H_t] the target's ``result_norm`` at the position that produced ``token``.
        n: drafts to make.

    Returns:
        ``(tokens, logits [V] per step, h_next [H_t] per step)``; ties go to the lowest id.

    Source: transformers ``SinglePositionMultiTokenCandidateGenerator.get_candidates``.
    """
    tokens, logits_all, hs = [], [], []
    tok, h = int(token), np.asarray(h_prev, dtype=np.float64).reshape(1, -1)
    for _ in range(n):
        logits, h = drafter_forward(d, DW, target, TW, [tok], h, cache.n_past, cache)
        tok = int(np.argmax(logits[0]))
        tokens.append(tok)
        logits_all.append(logits[0])
        hs.append(h[0])
    return tokens, logits_all, hs


def after_prefill(target: ModelConfig, TW, prompt: Sequence[int]) -> tuple[KVCache, int, np.ndarray]:
    """The state of a first draft round: the target has read ``prompt`` and chosen its next token greedily.

    Returns:
        ``(cache, token, h_prev [H_t])``: the cache holds positions ``[0, T)``; ``token`` is the argmax of the
        last position's logits (ties: lowest id), at position ``T``; ``h_prev`` is ``result_norm`` at ``T - 1``,
        the position that produced it.

    Raises:
        PromptError: see :func:`reference.model.check_prompt`.

    Source: transformers ``SinglePositionMultiTokenCandidateGenerator.get_candidates`` (first round).
    """
    cache = KVCache(target)
    rec: dict[str, np.ndarray] = {}

    def keep(point: str, layer: int, array: np.ndarray) -> None:
        if point == "result_norm":
            rec[point] = array

    logits = forward(target, TW, prompt, cache, trace=keep)
    return cache, int(np.argmax(logits[-1])), rec["result_norm"][-1]

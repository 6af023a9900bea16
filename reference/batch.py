"""Many forwards over one read of the weights: :func:`forward_chains`, layer-outer.

:func:`reference.model.forward` reads every weight once per call, and on a quantized model most of a call's
time is that read: dequantizing to float64. A job that runs many forwards on one model (the parity job's
prompts, their greedy steps, a prefill continued one token at a time) runs them here instead, layer by
layer: every call's layer ``i`` runs while layer ``i``'s weights are held (:meth:`reference.weights.Weights.hold`),
then they are dropped. The LM head is read once, a row block at a time, for every call.

Same values, bit for bit: each call runs exactly the operations :func:`reference.model.forward` runs for it,
on arrays of exactly the same shapes, with the same weights; only the order in which different calls'
operations interleave changes, and no operation reads another call's arrays. Rows are never stacked across
calls, because a BLAS product of stacked rows can round differently from the same rows alone (OpenBLAS takes
GEMV for one row and GEMM for more, and small products take other kernels). ``tests/test_batch.py`` checks
the bits against :func:`reference.model.forward` on every model family.

A *chain* is a list of calls on one KV cache, in order: a prefill, then continuations (a prompt prefilled in
two halves, or one token at a time: each call is what one ``forward(cfg, W, ids, cache)`` would be). A call
``c`` of a chain sees the cache exactly as it would after calls ``0..c-1``: at layer ``i`` the chain's calls
run in order, each appending its own K/V; a KV-shared layer reads its donor's K/V only up to the call's own
last token (the donor layer already holds every call's, :class:`_CallCache`).

Shapes: T = new tokens of a call, h = hidden_size, V = vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import numpy as np

from . import model as m
from .config import ModelConfig
from .model import KVCache, TraceFn


@dataclass
class Chain:
    """Forward calls that continue one KV cache, in order.

    Attributes:
        calls: token ids of each call (the first continues ``cache``; each later one continues the previous).
        cache: the KV cache the calls continue and fill (:class:`reference.model.KVCache`; a fresh one by default).
        traces: a :data:`reference.model.TraceFn` per call, or None for no trace (default: none).
        heads: per call, whether its logits are wanted (default: every call's); a call whose logits are not
            wanted skips the LM head (its layers still run: a later call needs its K/V).
        numerics: a context manager factory entered around every operation of this chain (the harness's
            emulations swap :func:`reference.model.gelu_tanh` with it); default none.
    """

    calls: list[Sequence[int]]
    cache: KVCache | None = None
    traces: list[TraceFn | None] | None = None
    heads: list[bool] | None = None
    numerics: Callable[[], ContextManager] = contextlib.nullcontext
    _state: list["_Call"] = field(default_factory=list, repr=False)


@dataclass
class _Call:
    ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    k_pos: np.ndarray  # [S]: every key the call's queries may see after it appended its own
    x: np.ndarray  # [T, h]
    ple: np.ndarray | None  # [T, L, P]
    trace: TraceFn
    head: bool
    view: "_CallCache"


class _Prefix:
    """``cache.k`` (or ``.v``) as a call sees it: each layer's rows up to the call's own last token."""

    def __init__(self, rows: dict[int, np.ndarray], n: int):
        self.rows, self.n = rows, n

    def __getitem__(self, il: int) -> np.ndarray:
        return self.rows[il][:self.n]


class _CallCache:
    """The KV cache as one call of a chain sees it (:func:`reference.model.attention_block` reads ``k``, ``v``
    and calls ``append``): its own layer appends go to the chain's cache; a donor's K/V ends at the call's
    last token, as it would had the calls run one whole forward after another."""

    def __init__(self, cache: KVCache, n: int):
        self.cache, self.n = cache, n

    def append(self, il: int, k: np.ndarray, v: np.ndarray) -> None:
        self.cache.append(il, k, v)

    @property
    def k(self) -> _Prefix:
        return _Prefix(self.cache.k, self.n)

    @property
    def v(self) -> _Prefix:
        return _Prefix(self.cache.v, self.n)


def _begin(cfg: ModelConfig, W, chain: Chain) -> None:
    """Check every call's ids, lay out its positions, embed it and compute its PLE inputs (forward's start)."""
    chain.cache = chain.cache if chain.cache is not None else KVCache(cfg)
    n_calls = len(chain.calls)
    traces = chain.traces or [None] * n_calls
    heads = chain.heads or [True] * n_calls
    if len(traces) != n_calls or len(heads) != n_calls:
        raise ValueError(f"chain of {n_calls} calls with {len(traces)} traces and {len(heads)} head flags")
    k_pos, chain._state = chain.cache.pos, []
    for ids, trace, head in zip(chain.calls, traces, heads):
        ids = m.check_prompt(cfg, ids, k_pos.shape[0])
        positions = k_pos.shape[0] + np.arange(ids.shape[0], dtype=np.int64)
        k_pos = np.concatenate([k_pos, positions])  # [S]
        trace = trace or m.no_trace
        x = m.embed(cfg, W, ids)  # [T, h]
        trace("inp_scaled", -1, x)
        ple = None
        if cfg.ple_dim:
            ple = m.per_layer_inputs(cfg, W, ids, x)  # [T, L, P]
            trace("inp_per_layer", -1, ple)
        chain._state.append(_Call(ids, positions, k_pos, x, ple, trace, bool(head),
                                  _CallCache(chain.cache, k_pos.shape[0])))


def forward_chains(cfg: ModelConfig, W, chains: Sequence[Chain]) -> list[list[np.ndarray | None]]:
    """Every call of every chain, as :func:`reference.model.forward` computes it, reading each weight once.

    Args:
        cfg: model config.
        W: canonical weights with :meth:`reference.weights.Weights.hold` (a plain mapping works too: then
            nothing is held, and the result is the same).
        chains: the calls (:class:`Chain`); text only (no multimodal injection).

    Returns:
        per chain, per call: float64 ``[T, V]`` logits (after the final softcap when the model has one), or
        None for a call whose head was not wanted. Each chain's cache holds its calls' K/V afterwards (as
        after the same forwards one by one), so a later :func:`forward_chains` or ``forward`` continues it.

    Raises:
        PromptError: an invalid call (:func:`reference.model.check_prompt`), before any layer runs.
        ValueError: a chain whose ``traces`` or ``heads`` do not have one entry per call.

    Source: :func:`reference.model.forward`, whose operations each call runs in the same order.
    """
    hold = getattr(W, "hold", None) or contextlib.nullcontext
    with hold():  # per_layer_model_proj, read by every call's PLE inputs
        for chain in chains:
            with chain.numerics():
                _begin(cfg, W, chain)
    for layer in cfg.layers:
        with hold():  # this layer's weights, dequantized once for every call
            for chain in chains:
                with chain.numerics():
                    for c in chain._state:
                        c.x = m.decoder_layer(cfg, layer, W, c.x, c.positions, c.k_pos, c.view,
                                              None if c.ple is None else c.ple[:, layer.index], c.trace)
    wanted = []
    for chain in chains:
        if chain._state:
            chain.cache.pos = chain._state[-1].k_pos
            chain.cache.open_block = False  # text calls: as forward leaves it
        with chain.numerics():
            for c in chain._state:
                c.x = m.rms_norm(c.x, W["output_norm.weight"], cfg.rms_eps)
                c.trace("result_norm", -1, c.x)
        wanted += [c for c in chain._state if c.head]
    logits = dict(zip(map(id, wanted), lm_head_many(cfg, W, [c.x for c in wanted])))
    out = []
    for chain in chains:
        row = []
        for c in chain._state:
            z = logits.get(id(c))
            if z is not None:
                c.trace("result_output", -1, z)
            row.append(z)
        out.append(row)
        chain._state = []
    return out


def lm_head_many(cfg: ModelConfig, W, xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """:func:`reference.model.lm_head` of each ``x`` in ``xs``, the head read once: for every row block
    (``W.row_blocks``), every ``x``'s product with it. [T_i, h] each -> [T_i, V] each.

    Each ``x``'s logits are the same products, concatenated and soft-capped the same way, as
    ``lm_head(cfg, W, x)`` alone. Source: :func:`reference.model.lm_head`.
    """
    if not xs:
        return []
    name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    parts: list[list[np.ndarray]] = [[] for _ in xs]
    for block in W.row_blocks(name):
        for part, x in zip(parts, xs):
            part.append(m.linear(x, block))
    out = []
    for part in parts:
        logits = np.concatenate(part, axis=1)  # [T, V]
        out.append(m.softcap(logits, cfg.final_logit_softcap) if cfg.final_logit_softcap is not None else logits)
    return out

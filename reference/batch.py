"""Many forwards over one read of the weights: :func:`forward_chains`, layer-outer.

:func:`reference.model.forward` reads every weight once per call, and on a quantized model most of a call's
time is that read: dequantizing to float64. A job that runs many forwards on one model (the parity job's
prompts, their greedy steps, a prefill continued one token at a time) runs them here instead, layer by
layer: every call's layer ``i`` runs while layer ``i``'s weights are held (:meth:`reference.weights.Weights.hold`),
then they are dropped. The LM head is read once, a row block at a time, for every call.

Same values, bit for bit: each call runs the operations :func:`reference.model.forward` runs for it, in its
order, with the same weights; only the order in which different calls' operations interleave changes. A matrix
product may take several calls' rows at once (below), and only where that gives each row the bits of the call's
own product: a BLAS product of stacked rows can round differently from the same rows alone (OpenBLAS takes GEMV
for one row and GEMM for more, and small products take other kernels). ``tests/test_batch.py`` checks the bits
against :func:`reference.model.forward` on every model family.

A *chain* is a list of calls on one KV cache, in order: a prefill, then continuations (a prompt prefilled in
two halves, or one token at a time: each call is what one ``forward(cfg, W, ids, cache)`` would be; a call may be
re-seeded, ``forward``'s ``layer_inputs``: the parity job's ``local_median`` forwards,
``ReferenceRuns.reseeded_many`` in ``harness/parity/checks/reference_runs.py``). A call
``c`` of a chain sees the cache exactly as it would after calls ``0..c-1``: at layer ``i`` the chain's calls
run in order, each appending its own K/V; a KV-shared layer reads its donor's K/V only up to the call's own
last token (the donor layer already holds every call's, :class:`_CallCache`).

Every call goes through a layer with the others, operation by operation (:func:`_layer`: the operations of
:func:`reference.model.decoder_layer` in its order, for each call), so that each matrix product of the layer is
made for all calls at once (:func:`linear_many`):

* a call of one token is a matrix-vector product, bound by reading the float64 matrix: one after another, each
  streams the whole matrix from memory again. Here every such vector is multiplied with a block of the matrix's
  rows while the block is in the CPU's cache (:func:`linear_rows`);
* a call of several tokens is a matrix product that BLAS packs the whole matrix for, whatever the number of rows
  (OpenBLAS: about 1 GB/s of float64 weights at 5 rows). Here the rows of every such call go through one product
  (:func:`linear_stacked`).

* a MoE layer's experts (:func:`_moe`): every call's rows routed to an expert go through one product of tiles
  (:func:`expert_products`, :func:`reference.model.expert_product`), the expert read alone and dropped after it
  (:meth:`reference.weights.Weights.expert`): one read and one GEMM per expert per layer, whatever the calls.

Either form gives each call's rows bit for bit as ``linear(x, w)`` alone does, where a check on this machine says
so for the shapes at hand (:func:`rows_split_exact`, :func:`stack_exact`: which kernels a BLAS runs depends on the
shapes and its thread count, not on the values, so one comparison per shape with random inputs and the matrix
itself settles it); where it does not, that matrix is multiplied call by call, as ``forward`` does.

Shapes: T = new tokens of a call, h = hidden_size, V = vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Mapping, Sequence

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
            emulations swap :func:`reference.model.gelu_tanh` with it); default none. An emulation that draws
            random numbers (the ``jitter_sums`` null, :func:`reference.model.linear_output`) must draw from one
            stream across the entries (one ``numpy.random.Generator`` per chain): then a chain of one call draws
            what :func:`reference.model.forward` inside one entry draws, in the same order and shapes, since the
            call's products run in ``forward``'s order (in a chain of several calls, the calls' draws interleave
            layer by layer: not ``forward``'s order).
        layer_inputs: per call, ``forward``'s ``layer_inputs`` (a re-seeded forward: ``{layer index: [T, h]}``, the
            index ``n_layer`` for the stream that enters the final norm), or None; default none for every call.
    """

    calls: list[Sequence[int]]
    cache: KVCache | None = None
    traces: list[TraceFn | None] | None = None
    heads: list[bool] | None = None
    numerics: Callable[[], ContextManager] = contextlib.nullcontext
    layer_inputs: list[Mapping[int, np.ndarray] | None] | None = None
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
    seeds: dict[int, np.ndarray] = field(default_factory=dict)  # layer index -> [T, h]: forward's layer_inputs


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


REWRITTEN = ("forward", "decoder_layer", "attention_block", "ffn_block", "gelu_ffn", "ple_block", "lm_head", "linear",
             "moe_block", "moe_experts", "expert_ffn", "expert_linear")
"""The functions of :mod:`reference.model` whose work :func:`forward_chains` does itself (it calls the others
through the module, so a replacement of those is seen)."""

_ORIGINALS = {name: getattr(m, name) for name in REWRITTEN}


def replaced() -> list[str]:
    """The names of :data:`REWRITTEN` that are replaced now (a ``--spec`` variant's override, a test's patch).
    While any is, :func:`forward_chains` would not compute what :func:`reference.model.forward` computes: run
    ``forward`` call by call instead."""
    return [name for name, fn in _ORIGINALS.items() if getattr(m, name) is not fn]


def _begin(cfg: ModelConfig, W, chain: Chain) -> None:
    """Check every call's ids and re-seeded streams, lay out its positions, embed it and compute its PLE inputs
    (forward's start; a re-seeded call's PLE from its ``layer_inputs[0]`` where given, as ``forward``)."""
    chain.cache = chain.cache if chain.cache is not None else KVCache(cfg)
    n_calls = len(chain.calls)
    traces = chain.traces or [None] * n_calls
    heads = chain.heads or [True] * n_calls
    seeds = chain.layer_inputs or [None] * n_calls
    if len(traces) != n_calls or len(heads) != n_calls or len(seeds) != n_calls:
        raise ValueError(f"chain of {n_calls} calls with {len(traces)} traces, {len(heads)} head flags and "
                         f"{len(seeds)} layer_inputs")
    k_pos, chain._state = chain.cache.pos, []
    for ids, trace, head, given in zip(chain.calls, traces, heads, seeds):
        ids = m.check_prompt(cfg, ids, k_pos.shape[0])
        positions = k_pos.shape[0] + np.arange(ids.shape[0], dtype=np.int64)
        k_pos = np.concatenate([k_pos, positions])  # [S]
        seeded = {il: m.reseed(given[il], (ids.shape[0], cfg.hidden_size), il)
                  for il in sorted(given or {}) if il in range(cfg.n_layer + 1)}  # checked before any layer runs
        trace = trace or m.no_trace
        x = m.embed(cfg, W, ids)  # [T, h]
        trace("inp_scaled", -1, x)
        ple = None
        if cfg.ple_dim:
            ple = m.per_layer_inputs(cfg, W, ids, seeded.get(0, x))  # [T, L, P]
            trace("inp_per_layer", -1, ple)
        chain._state.append(_Call(ids, positions, k_pos, x, ple, trace, bool(head),
                                  _CallCache(chain.cache, k_pos.shape[0]), seeded))


def forward_chains(cfg: ModelConfig, W, chains: Sequence[Chain],
                   on_layer: Callable[[int, int], None] | None = None) -> list[list[np.ndarray | None]]:
    """Every call of every chain, as :func:`reference.model.forward` computes it, reading each weight once.

    Args:
        cfg: model config.
        W: canonical weights with :meth:`reference.weights.Weights.hold` (a plain mapping works too: then
            nothing is held, and the result is the same).
        chains: the calls (:class:`Chain`); text only (no multimodal injection). A call with ``layer_inputs`` is
            re-seeded as ``forward(..., layer_inputs=...)`` re-seeds it: the given stream enters those layers (and
            the final norm) in place of the one before.
        on_layer: called ``on_layer(i, n)`` after layer ``i`` (1 to ``n``, the model's layers) ran for every call
            (a caller's progress display; it computes nothing).

    Returns:
        per chain, per call: float64 ``[T, V]`` logits (after the final softcap when the model has one), or
        None for a call whose head was not wanted. Each chain's cache holds its calls' K/V afterwards (as
        after the same forwards one by one), so a later :func:`forward_chains` or ``forward`` continues it.

    Raises:
        PromptError: an invalid call (:func:`reference.model.check_prompt`), before any layer runs.
        ValueError: a chain whose ``traces``, ``heads`` or ``layer_inputs`` do not have one entry per call; a
            ``layer_inputs`` array that is not ``[T, h]`` (before any layer runs).
        RuntimeError: a function of :data:`REWRITTEN` is replaced (:func:`replaced`).

    Source: :func:`reference.model.forward`, whose operations each call runs in the same order.
    """
    if replaced():
        raise RuntimeError(f"forward_chains cannot follow replaced reference.model functions: {replaced()}")
    hold = getattr(W, "hold", None) or contextlib.nullcontext
    with hold():  # per_layer_model_proj, read by every call's PLE inputs
        for chain in chains:
            with chain.numerics():
                _begin(cfg, W, chain)
    group = [(chain, c) for chain in chains for c in chain._state]  # chain by chain, each in call order
    for i, layer in enumerate(cfg.layers, 1):
        for _, c in group:  # a re-seeded call enters the layer with the given stream (forward's layer_inputs)
            c.x = c.seeds.get(layer.index, c.x)
        with hold():  # this layer's weights, dequantized once for every call
            if group:
                _layer(cfg, layer, W, group)
        if on_layer is not None:
            on_layer(i, len(cfg.layers))
    wanted, numerics = [], []
    for chain in chains:
        if chain._state:
            chain.cache.pos = chain._state[-1].k_pos
            chain.cache.open_block = False  # text calls: as forward leaves it
        with chain.numerics():
            for c in chain._state:
                c.x = m.rms_norm(c.seeds.get(cfg.n_layer, c.x), W["output_norm.weight"], cfg.rms_eps)
                c.trace("result_norm", -1, c.x)
        wanted += [c for c in chain._state if c.head]
        numerics += [chain.numerics for c in chain._state if c.head]
    logits = dict(zip(map(id, wanted), lm_head_many(cfg, W, [c.x for c in wanted], numerics)))
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


def lm_head_many(cfg: ModelConfig, W, xs: Sequence[np.ndarray],
                 numerics: Sequence[Callable[[], ContextManager]] | None = None) -> list[np.ndarray]:
    """:func:`reference.model.lm_head` of each ``x`` in ``xs``, the head read once: for every row block
    (``W.row_blocks``), every ``x``'s product with it. [T_i, h] each -> [T_i, V] each. ``numerics``: per ``x``, the
    context its chain's emulations run in (its input to each product, :func:`reference.model.linear_input`, its
    offset and its output, :func:`reference.model.linear_output`, are taken there); default none.

    Each ``x``'s logits are the same products, concatenated and soft-capped the same way, as
    ``lm_head(cfg, W, x)`` alone. Source: :func:`reference.model.lm_head`.
    """
    if not xs:
        return []
    name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    parts: list[list[np.ndarray]] = [[] for _ in xs]
    for block in W.row_blocks(name):
        ins = xs if numerics is None else [_input(n, x, block) for n, x in zip(numerics, xs)]
        ys = linear_many(ins, block)
        if numerics is not None:
            ys = _output(numerics, block, _offset(numerics, xs, block, ys))
        for part, y in zip(parts, ys):
            part.append(y)
    out = []
    for i in range(len(parts)):
        logits = np.concatenate(parts[i], axis=1)  # [T, V]
        parts[i] = []  # each call's blocks go once joined: the head's memory is about one copy of the logits
        out.append(m.softcap(logits, cfg.final_logit_softcap) if cfg.final_logit_softcap is not None else logits)
    return out


def _input(numerics: Callable[[], ContextManager], x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`reference.model.linear_input` of ``x`` for ``w`` under ``numerics`` (a chain's emulations)."""
    with numerics():
        return m.linear_input(x, w)


def _offset(numerics: Sequence[Callable[[], ContextManager]], xs: Sequence[np.ndarray], w: np.ndarray,
            ys: list[np.ndarray]) -> list[np.ndarray]:
    """Each product ``ys[i]`` of ``xs[i]`` (its input as :func:`_input` took it) with ``w``, plus
    :func:`reference.model.linear_offset` of ``xs[i]`` under ``numerics[i]`` where that gives one (llama.cpp's
    Q4_1 / Q5_1 block sums): what :func:`reference.model.linear` adds, in the same order. [T_i, out] each."""
    out = []
    for n, x, y in zip(numerics, xs, ys):
        with n():
            extra = m.linear_offset(x, w)
        out.append(y if extra is None else y + extra)
    return out


def _output(numerics: Sequence[Callable[[], ContextManager]], w: np.ndarray, ys: list[np.ndarray]) -> list[np.ndarray]:
    """Each product ``ys[i]`` (with its offset: :func:`_offset`) through :func:`reference.model.linear_output` under
    ``numerics[i]``: the last step of :func:`reference.model.linear` (the ``jitter_sums`` null moves it there).
    [T_i, out] each."""
    out = []
    for n, y in zip(numerics, ys):
        with n():
            out.append(m.linear_output(y, w))
    return out


# --------------------------------------------------------------------------- a layer, operation by operation

#: Bytes of float64 rows a block of :func:`linear_rows` holds at most (it stays in a core's L2 cache while every
#: vector passes), and the least rows a block has; blocks hold a multiple of ``ROW_ALIGN`` rows.
ROW_BLOCK_BYTES, ROW_ALIGN = 1 << 20, 64

_split_exact: dict[tuple, bool] = {}


def row_bounds(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    """The row ranges :func:`linear_rows` multiplies a ``[n_rows, n_cols]`` matrix in: a multiple of
    :data:`ROW_ALIGN` rows each, within :data:`ROW_BLOCK_BYTES` where that allows; a short last block is merged
    into the one before (a one-row remainder would be a dot product, another kernel)."""
    rows = ROW_ALIGN
    while rows * 2 * n_cols * 8 <= ROW_BLOCK_BYTES:
        rows *= 2
    bounds = [(a, min(a + rows, n_rows)) for a in range(0, n_rows, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < rows:
        bounds[-2:] = [(bounds[-2][0], n_rows)]
    return bounds


def rows_split_exact(w: np.ndarray) -> bool:
    """Whether ``x @ w.T`` for one row ``x`` equals, bit for bit, the same product made a block of rows at a time
    (:func:`row_bounds`) here: checked once per shape and BLAS thread count, with ``w`` itself and a random ``x``.

    Why once per shape is enough: which kernels a BLAS runs, and how it splits the rows among its threads, depends
    on the shapes and the thread count, not on the values (OpenBLAS's GEMV computes each output as one dot product
    whose order depends on the columns only; measured here it differs for a one-row remainder, which is a dot
    product, and on 2 threads for a row count not a multiple of 64, where the threads' split is not aligned).
    """
    key = (w.shape, _blas_threads())
    if key not in _split_exact:
        x = np.random.default_rng(0).standard_normal((1, w.shape[1]))
        whole = m.linear(x, w)
        split = np.concatenate([m.linear(x, w[a:b]) for a, b in row_bounds(*w.shape)], axis=1)
        _split_exact[key] = len(row_bounds(*w.shape)) > 1 and bool(np.array_equal(whole, split))
    return _split_exact[key]


_blas_threads = m._blas_threads


def linear_rows(xs: Sequence[np.ndarray], w: np.ndarray) -> list[np.ndarray]:
    """:func:`reference.model.linear` of each one-row ``x`` in ``xs`` with ``w``, every ``x`` multiplied with a
    block of ``w``'s rows while the block is in the cache (where :func:`rows_split_exact` holds; else each whole).
    [1, in] each, [out, in] -> [1, out] each; the same bits as ``linear(x, w)``."""
    if not xs:
        return []
    if not rows_split_exact(w):
        return [m.linear(x, w) for x in xs]
    parts: list[list[np.ndarray]] = [[] for _ in xs]
    for a, b in row_bounds(*w.shape):
        block = w[a:b]
        for part, x in zip(parts, xs):
            part.append(m.linear(x, block))
    return [np.concatenate(part, axis=1) for part in parts]


def stack_exact(w: np.ndarray, rows: tuple[int, ...]) -> bool:
    """Whether the rows of ``concatenate(xs) @ w.T`` equal each ``xs[i] @ w.T`` bit for bit here, for inputs of
    ``rows`` rows each (all > 1): checked once per shape, row counts and BLAS thread count, with ``w`` itself
    (OpenBLAS's GEMM computes every output over the columns in one fixed order whatever the number of rows, except
    in its small-matrix kernels, which a product of few rows and a narrow matrix takes)."""
    key = ("stack", w.shape, rows, _blas_threads())
    if key not in _split_exact:
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((r, w.shape[1])) for r in rows]
        alone = [m.linear(x, w) for x in xs]
        together = np.split(m.linear(np.concatenate(xs), w), np.cumsum(rows)[:-1])
        _split_exact[key] = all(np.array_equal(a, b) for a, b in zip(alone, together))
    return _split_exact[key]


def linear_stacked(xs: Sequence[np.ndarray], w: np.ndarray) -> list[np.ndarray]:
    """:func:`reference.model.linear` of each ``x`` in ``xs`` (more than one row each) with ``w``, as one product of
    their rows stacked where :func:`stack_exact` holds (else each alone). [T_i, in] each -> [T_i, out] each; the
    same bits as ``linear(x, w)``."""
    rows = tuple(x.shape[0] for x in xs)
    if len(xs) < 2 or not stack_exact(w, rows):
        return [m.linear(x, w) for x in xs]
    return np.split(m.linear(np.concatenate(xs), w), np.cumsum(rows)[:-1])


def linear_many(xs: Sequence[np.ndarray], w: np.ndarray) -> list[np.ndarray]:
    """:func:`reference.model.linear` of every ``x`` in ``xs`` with ``w``: the one-row ones through
    :func:`linear_rows`, the others through :func:`linear_stacked`. The same bits as ``linear(x, w)`` for each."""
    out: list[np.ndarray | None] = [None] * len(xs)
    for pick, fn in ((lambda x: x.shape[0] == 1, linear_rows), (lambda x: x.shape[0] != 1, linear_stacked)):
        idx = [i for i, x in enumerate(xs) if pick(x)]
        for i, y in zip(idx, fn([xs[i] for i in idx], w)):
            out[i] = y
    return out


def expert_products(xs: Sequence[np.ndarray], w: np.ndarray) -> list[np.ndarray]:
    """:func:`reference.model.expert_product` of each ``x`` in ``xs`` (the rows of one call routed to the expert
    ``w``, already :func:`reference.model.linear_input`'s): the one-row ones through :func:`linear_rows` (each block
    of ``w`` once for all of them), the others in one product of their rows stacked (padded to a multiple of
    :data:`reference.model.EXPERT_TILE`) where :func:`reference.model.tiles_exact` holds for that many rows, else
    each alone. [n_i, in] each, [out, in] -> [n_i, out] each; the same bits as ``expert_product(x, w)``.

    A row of a tile product has the same bits wherever it sits (the check), so stacking every call's rows reads
    and packs the expert once for all of them: in the parity job's first pass, each expert once per layer.
    """
    out: list[np.ndarray | None] = [None] * len(xs)
    ones = [i for i, x in enumerate(xs) if x.shape[0] == 1]
    for i, y in zip(ones, linear_rows([xs[i] for i in ones], w)):
        out[i] = y
    many = [i for i, x in enumerate(xs) if x.shape[0] > 1]
    rows = [xs[i].shape[0] for i in many]
    total = -(-sum(rows) // m.EXPERT_TILE) * m.EXPERT_TILE
    if len(many) < 2 or not m.tiles_exact(w, total):
        for i in many:
            out[i] = m.expert_product(xs[i], w)
        return out
    padded = np.zeros((total, w.shape[1]))
    padded[:sum(rows)] = np.concatenate([xs[i] for i in many])
    for i, y in zip(many, np.split((padded @ w.T)[:sum(rows)], np.cumsum(rows)[:-1])):
        out[i] = y
    return out


def _moe(cfg: ModelConfig, layer, W, group: list[tuple[Chain, "_Call"]], a: list[np.ndarray], each) -> list[np.ndarray]:
    """:func:`reference.model.moe_block` for every call (its residual ``a[i]``): each call routed and normed under
    its chain's numerics, then for each expert the rows every call routed to it through
    :func:`expert_products` (each call's input and offset under its own numerics, as
    :func:`reference.model.expert_linear`; its GELU too), then each call's :func:`reference.model.expert_sum`
    and ``post_ffw_norm_2``. The experts are read one at a time and not held (:meth:`reference.weights.Weights.expert`):
    each is used once, for every call's rows. [T_i, h] each -> [T_i, h] each; the same bits as ``moe_block`` call by call."""
    b, eps = f"blk.{layer.index}.", cfg.rms_eps
    numerics = [chain.numerics for chain, _ in group]
    route = each(lambda c, y: m.moe_route(y, W[b + "ffn_gate_inp.weight"], W[b + "ffn_gate_inp.scale"],
                                          W[b + "ffn_down_exps.scale"], cfg.n_expert_used, eps), a)
    xe = each(lambda c, y: m.rms_norm(y, W[b + "pre_ffw_norm_2.weight"], eps), a)
    chosen = np.concatenate([idx.ravel() for idx, _ in route])
    one = getattr(W, "expert", None)  # one expert at a time, not held (Weights.expert): each is used once here

    def expert(name, e):
        return one(name, int(e)) if one is not None else m.expert_weights(W, name, np.array([e]))[e]

    ys = [np.empty(idx.shape + (x.shape[1],)) for (idx, _), x in zip(route, xe)]  # [T_i, K, h]
    for e in np.unique(chosen):
        picks = [np.nonzero(idx == e) for idx, _ in route]  # per call: (tokens ascending, slot)
        live = [i for i, (t, _) in enumerate(picks) if t.size]
        ns = [numerics[i] for i in live]
        xs = [xe[i][picks[i][0]] for i in live]
        w = expert(b + "ffn_gate_up_exps.weight", e)
        gu = _offset(ns, xs, w, expert_products([_input(n, x, w) for n, x in zip(ns, xs)], w))
        w = expert(b + "ffn_down_exps.weight", e)
        F = w.shape[1]
        g = []
        for n, y in zip(ns, gu):
            with n():
                g.append(m.gelu_tanh(y[:, :F]) * y[:, F:])
        out = _offset(ns, g, w, expert_products([_input(n, x, w) for n, x in zip(ns, g)], w))
        for i, y in zip(live, out):
            ys[i][picks[i]] = y
    moe = [m.expert_sum(y, wgt) for y, (_, wgt) in zip(ys, route)]
    return each(lambda c, y: m.rms_norm(y, W[b + "post_ffw_norm_2.weight"], eps), moe)


def _layer(cfg: ModelConfig, layer, W, group: list[tuple[Chain, _Call]]) -> None:
    """:func:`reference.model.decoder_layer` for every call, operation by operation across them: its operations
    (those of :func:`reference.model.attention_block`, :func:`reference.model.ffn_block`,
    :func:`reference.model.ple_block`) in its order for each call, the matrix products through :func:`linear_many`,
    each call's K/V appended in chain order and its attention over its own prefix of the cache. Updates ``c.x``.

    Keep in step with :func:`reference.model.decoder_layer` (``tests/test_batch.py`` compares every model family
    bit for bit).
    """
    b, il, eps = f"blk.{layer.index}.", layer.index, cfg.rms_eps
    calls = [c for _, c in group]

    def each(fn, items):  # fn(call, item) for each call, under its chain's numerics (llama.cpp's GELU, say)
        out = []
        for (chain, c), item in zip(group, items):
            with chain.numerics():
                out.append(fn(c, item))
        return out

    def lin(xs, name):  # each call's input as its chain's numerics take it (llama.cpp's quantized activations)
        w = W[b + name]
        ns = [chain.numerics for chain, _ in group]
        ys = linear_many([_input(n, x, w) for n, x in zip(ns, xs)], w)
        return _output(ns, w, _offset(ns, xs, w, ys))

    def norm(ys, name):  # each call's RMSNorm under its chain's numerics (llama.cpp's float32 norm, say)
        w = None if name is None else W[b + name]
        return each(lambda c, y: m.rms_norm(y, w, eps), ys)

    H, Hkv, D = layer.n_head, layer.n_kv_head, layer.head_dim
    inv = m.rope_inv_freq(layer)
    rope = [m.rope_angles(c.positions, inv) for c in calls]
    h = norm([c.x for c in calls], "attn_norm.weight")
    q = [m.apply_rope(y, *cs, layer.n_rot)
         for y, cs in zip(norm([y.reshape(-1, H, D) for y in lin(h, "attn_q.weight")], "attn_q_norm.weight"), rope)]
    if layer.has_kv:
        k_raw = [y.reshape(-1, Hkv, D) for y in lin(h, "attn_k.weight")]
        v = [y.reshape(-1, Hkv, D) for y in lin(h, "attn_v.weight")] if layer.has_v_proj else k_raw
        k = [m.apply_rope(y, *cs, layer.n_rot) for y, cs in zip(norm(k_raw, "attn_k_norm.weight"), rope)]
        if cfg.has_v_norm:
            v = norm(v, None)
        for c, kc, vc in zip(calls, k, v):  # in chain order: each call's own prefix is the cache it would see
            c.view.append(il, kc, vc)
    window = cfg.sliding_window if layer.is_sliding else None
    att = each(lambda c, qc: m.attention(qc, c.view.k[layer.kv_donor], c.view.v[layer.kv_donor], c.positions,
                                         c.k_pos, window, cfg.attn_scale), q)  # a KV-cache emulation swaps it
    a = [c.x + o for c, o in zip(calls, norm(lin(att, "attn_output.weight"), "post_attention_norm.weight"))]
    for c, y in zip(calls, a):
        c.trace("attn_out", il, y)
    fx = norm(a, "ffn_norm.weight")
    gate = each(lambda c, y: m.gelu_tanh(y), lin(fx, "ffn_gate.weight"))
    mlp = lin([g * u for g, u in zip(gate, lin(fx, "ffn_up.weight"))], "ffn_down.weight")
    if layer.has_moe:
        mlp = norm(mlp, "post_ffw_norm_1.weight")
        moe = _moe(cfg, layer, W, group, a, each)
        for c, y, z in zip(calls, mlp, moe):
            c.trace("ffn_mlp", il, y)
            c.trace("ffn_moe", il, z)
        mlp = [y + z for y, z in zip(mlp, moe)]
    for c, f in zip(calls, mlp):
        c.trace("ffn_out", il, f)
    ys = [y + f for y, f in zip(a, norm(mlp, "post_ffw_norm.weight"))]
    if calls[0].ple is not None:
        g = each(lambda c, y: m.gelu_tanh(y) * c.ple[:, il], lin(ys, "inp_gate.weight"))
        p = norm(lin(g, "proj.weight"), "post_norm.weight")
        for c, pc in zip(calls, p):
            c.trace("per_layer_embd_out", il, pc)
        ys = [y + pc for y, pc in zip(ys, p)]
    for c, y in zip(calls, ys):
        c.x = m.layer_scale(cfg, layer, W, y)
        c.trace("l_out", il, c.x)

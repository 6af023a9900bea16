"""Greedy decoding with static shapes: a dense KV cache, positions held on the device, one CUDA graph a step.

Why: at batch 1 a decode step of :class:`fast.model.FastModel` launches a few hundred small kernels, and on a
GPU the host's time to launch them, not the weight read, sets the pace (E4B has 42 layers of about ten
kernels each). A CUDA graph records the step once and replays it as one launch. A graph needs a step whose
shapes, buffers and control flow never change and that never reads a value back to the host; the paged
cache of :mod:`fast.kvcache` (page tables, ring lengths and masks built in Python from host integers) and the
MoE loop over the chosen experts (:func:`fast.model.moe_experts`) are neither. This module runs the same
layers (:meth:`FastModel.decoder_layer` and the blocks it calls, the same weights) with three parts
swapped for static ones:

* **The cache** (:class:`StaticCache`): per KV-owning layer a dense ``[B, S, Hkv, D]`` K and V, float32 as in
  :mod:`fast.kvcache`, with ``S = max_len``; position ``p`` of row ``b`` lives at ``[b, p]``. A sliding layer
  keeps all ``S`` positions too (a ring would be overwritten inside one prefill chunk) and masks to its
  window. KV-shared layers read their donor's tensors. A ``k_eq_v`` layer stores its K (``rope(V * k_norm)``,
  the same value the paged cache rebuilds from V) beside V.
* **Attention** (:func:`static_attention`): every query reads all ``S`` slots of its row under the mask
  ``k_pos <= q_pos`` (and ``q_pos - k_pos < window`` on sliding layers). Slots beyond a row's length hold
  stale or zero values and are masked; their softmax weight is exactly 0. Positions come from a device
  tensor, so the step's kernels are the same at every position.
* **MoE** (:func:`fast.model.moe_experts_static`): every (token, chosen expert) pair gathers its expert's matrices by
  index and runs as one batched product; with many tokens, every expert runs on every token and the
  routing weights (0 for an expert not chosen) combine them. Which of the two depends on the shapes only.

Token embeddings and the PLE table are gathered without their host-side range check
(:func:`fast.model.embed_rows` ``check=False``): :meth:`StaticDecoder.decode` checks the ids itself before
they enter the graph, and a step's own argmax is always in range.

Numerics: the same formulas in the same float32 as :meth:`FastModel.step`; attention sums over ``S``
slots instead of the cached keys, and MoE batches its products differently, so logits agree with the
paged path up to float32 summation order (checked in ``tests/test_static_decode.py``), not bit for bit.

Not covered: image/audio soft tokens, traces, speculative decoding and rollback; those stay on the paged path.

Shapes: B = rows (sequences), T = new tokens per row, S = ``max_len``, h = hidden, H/Hkv = query/KV
heads, D = head_dim, V = vocab.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from gemma4_harness.reference.config import LayerSpec
from gemma4_harness.reference.errors import InputError

from . import cpu_kernels
from .model import FastModel, linear, rms_norm, rope_angles, rope_full_tables


class StaticCache:
    """Dense K/V for every KV-owning layer: ``k[il]``, ``v[il]``, float32 ``[B, S, Hkv, D]`` on the model's device.

    Args:
        cfg: the model config.
        batch: rows (B).
        max_len: positions per row (S).
        device: where.
        dtype: cache dtype (float32, as :mod:`fast.kvcache` keeps it).

    Raises:
        InputError: ``batch`` or ``max_len`` below 1.
    """

    def __init__(self, cfg, batch: int, max_len: int, device: torch.device, dtype: torch.dtype = torch.float32):
        if batch < 1 or max_len < 1:
            raise InputError(f"static cache: batch {batch} and max_len {max_len} must be >= 1")
        self.batch, self.max_len = batch, max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for L in cfg.layers:
            if L.has_kv:
                shape = (batch, max_len, L.n_kv_head, L.head_dim)
                self.k[L.index] = torch.zeros(shape, device=device, dtype=dtype)
                self.v[L.index] = torch.zeros(shape, device=device, dtype=dtype)

    def nbytes(self) -> int:
        """Bytes the cache occupies."""
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


def static_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None,
                     scale: float) -> torch.Tensor:
    """GQA of each row's queries over all ``S`` slots of its cache row, masked by position.

    Slot ``j`` holds position ``j``; query at position ``p`` sees ``j <= p`` and, with a window,
    ``p - j < window`` (:func:`fast.model.attention_mask`). Scores and softmax in float32.
    [B, T, H, D], [B, S, Hkv, D], [B, S, Hkv, D], int64 [B, T], window, scale -> [B, T, H*D].
    Source: transformers ``eager_attention_forward`` (the formula); the masking as in :func:`fast.model.attention`.
    """
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    qg = q.reshape(B, T, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * T, D)
    scores = torch.matmul(qg.to(k.dtype), k.permute(0, 2, 3, 1)).float()  # [B, Hkv, group*T, S]
    if scale != 1.0:
        scores.mul_(scale)
    k_pos = torch.arange(S, device=q.device)
    dist = q_pos[:, :, None] - k_pos[None, None, :]  # [B, T, S]
    allowed = dist >= 0
    if window is not None:
        allowed &= dist < window
    scores = scores.view(B, Hkv, group, T, S).masked_fill_(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(B, Hkv, group * T, S)
    out = torch.matmul(p, v.transpose(1, 2))  # [B, Hkv, group*T, D]
    return out.view(B, Hkv, group, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D).to(q.dtype)


class _Rows:
    """What :meth:`StaticDecoder._attention_block` reads in one forward: cache rows, positions, rotary factors."""

    def __init__(self, rows: slice, q_pos: torch.Tensor):
        self.rows = rows
        self.q_pos = q_pos  # [b, T]
        self.rope: dict = {}


class StaticDecoder:
    """Greedy decoding of ``batch`` sequences at once with static shapes; on CUDA each step is one graph replay.

    Args:
        model: the :class:`fast.model.FastModel` whose weights and layers run.
        batch: sequences decoded together (B).
        max_len: the most positions a sequence may reach (prompt plus generated tokens).
        graphs: capture the decode step as a CUDA graph (default: when the model is on CUDA). On the CPU the
            same static step runs eagerly (that is how it is tested without a GPU).

    Use::

        dec = StaticDecoder(model, batch=8, max_len=640)
        logits = dec.prefill(prompts)         # [B, V] float32, each prompt's last position
        for _ in range(n):
            logits = dec.decode(logits.argmax(-1))

    Raises:
        InputError: ``batch``/``max_len`` below 1, graphs asked for off CUDA, or a model with vision/audio-only
            needs this path does not serve (see the module docstring).
    """

    def __init__(self, model: FastModel, batch: int, max_len: int, graphs: bool | None = None):
        self.model = model
        self.cfg = model.cfg
        dev = model.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        if self.graphs and dev.type != "cuda":
            raise InputError(f"static decoder: CUDA graphs need a CUDA device, the model is on {dev}")
        self.cache = StaticCache(self.cfg, batch, max_len, dev)
        self.batch, self.max_len = batch, max_len
        self.lengths = [0] * batch  # host copy of each row's cached positions
        self._ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self._pos = torch.zeros(batch, dtype=torch.long, device=dev)
        self._graph = None
        self._out: torch.Tensor | None = None
        # rotary factors of every position, per table (layers sharing inv_freq share it): gathered by position
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for L in self.cfg.layers:
            key = (id(model.inv_freq[L.index]), L.n_rot, L.head_dim)
            if key not in self._rope:
                cos, sin = rope_angles(torch.arange(max_len), model.inv_freq[L.index])
                c, s = rope_full_tables(cos, sin, L.n_rot, L.head_dim)  # [S, 1, D] x2
                self._rope[key] = (c.to(dev), s.to(dev))

    # ------------------------------------------------------------------ the forward

    def _attention_block(self, layer: LayerSpec, x: torch.Tensor, st: _Rows) -> torch.Tensor:
        """Q/K/V, write the new K/V into the static cache, attend over the row's slots. [b*T, h] -> [b*T, h].

        Source: :meth:`fast.model.FastModel.attention_block` (the same :meth:`~fast.model.FastModel.project_qkv`)."""
        m = self.model
        nb, T = st.q_pos.shape
        N = nb * T
        H, Hkv, D = layer.n_head, layer.n_kv_head, layer.head_dim
        key = (id(m.inv_freq[layer.index]), layer.n_rot, layer.head_dim)
        if key not in st.rope:
            c, s = self._rope[key]
            st.rope[key] = (c[st.q_pos.reshape(-1)], s[st.q_pos.reshape(-1)])  # [N, 1, D]
        q, k, v = m.project_qkv(layer, x, *st.rope[key])
        if layer.has_kv:
            rows = torch.arange(nb, device=x.device)[:, None]
            kc, vc = self.cache.k[layer.index][st.rows], self.cache.v[layer.index][st.rows]
            kc[rows, st.q_pos] = k.view(nb, T, Hkv, D).to(kc.dtype)
            vc[rows, st.q_pos] = v.view(nb, T, Hkv, D).to(vc.dtype)
        donor = layer.kv_donor
        window = self.cfg.sliding_window if layer.is_sliding else None
        out = static_attention(q.view(nb, T, H, D), self.cache.k[donor][st.rows], self.cache.v[donor][st.rows],
                               st.q_pos, window, self.cfg.attn_scale)
        return linear(out.reshape(N, H * D), m.w[f"blk.{layer.index}.attn_output.weight"])

    def _forward(self, ids: torch.Tensor, start: torch.Tensor, rows: slice) -> torch.Tensor:
        """``T`` new tokens of ``b`` cache rows from positions ``start``; float32 logits of each row's last token.

        int64 [b, T], int64 [b], rows -> [b, V]. No host reads: this is what a graph records.
        """
        m, cfg = self.model, self.cfg
        nb, T = ids.shape
        q_pos = start[:, None] + torch.arange(T, device=ids.device)[None, :]  # [b, T]
        st = _Rows(rows, q_pos)
        flat = ids.reshape(-1)
        x = m.embed(flat, check=False)
        ple = m.per_layer_inputs(flat, x, check=False) if cfg.ple_dim else None
        m.static_shapes = True  # MoE layers take moe_experts_static for this forward
        try:
            for layer in cfg.layers:
                x = m.decoder_layer(layer, x, st, None if ple is None else ple[:, layer.index],
                                    attention_block=self._attention_block)
        finally:
            m.static_shapes = False
        x = x.view(nb, T, -1)[:, -1]
        return m.lm_head(rms_norm(x, m.w["output_norm.weight"], cfg.rms_eps))

    # ------------------------------------------------------------------ public

    def reset(self) -> None:
        """Forget every row (lengths back to 0); the cache's stale slots are masked until rewritten."""
        self.lengths = [0] * self.batch
        self._pos.zero_()

    def prefill(self, prompts: Sequence[Sequence[int]], chunk: int = 512) -> torch.Tensor:
        """Run each row's prompt (row ``i`` takes ``prompts[i]``), eagerly, in chunks; ``reset`` first.

        Returns: float32 ``[B, V]``, the logits of each prompt's last token.
        Raises: InputError for the wrong number of prompts, an empty prompt, a prompt beyond ``max_len`` or an id
        outside the vocabulary.
        """
        if len(prompts) != self.batch:
            raise InputError(f"static decoder: {len(prompts)} prompts for batch {self.batch}")
        self.reset()
        outs = []
        with torch.no_grad():
            for i, p in enumerate(prompts):
                ids = self._check_ids(np.asarray(p, dtype=np.int64).reshape(-1), f"prompt {i}")
                if ids.numel() == 0 or ids.numel() > self.max_len:
                    raise InputError(f"static decoder: prompt {i} has {ids.numel()} tokens; expected 1..{self.max_len}")
                logit = None
                for s0 in range(0, ids.numel(), chunk):
                    part = ids[s0:s0 + chunk][None]
                    logit = self._forward(part, torch.tensor([s0], device=ids.device), slice(i, i + 1))
                outs.append(logit)
                self.lengths[i] = ids.numel()
            self._pos.copy_(torch.tensor(self.lengths))
        return torch.cat(outs, 0)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """One greedy step of every row: ``ids`` go in at each row's next position. int [B] -> float32 [B, V].

        The result is the graph's output buffer: the next call overwrites it (clone it to keep it).
        Raises: InputError for a wrong shape, an id outside the vocabulary (checked on the host unless the ids
        are already on the device, as a step's own argmax is), or a row beyond ``max_len``.
        """
        if tuple(ids.shape) != (self.batch,):
            raise InputError(f"static decoder: decode takes [{self.batch}] ids, got {tuple(ids.shape)}")
        if ids.device.type == "cpu":
            self._check_ids(ids.numpy(), "decode ids")
        if max(self.lengths) >= self.max_len:
            raise InputError(f"static decoder: a row reached max_len {self.max_len}")
        small = self.model.device.type == "cpu" and self.batch <= cpu_kernels.MAX_ROWS
        with torch.no_grad(), cpu_kernels.small_step_threads() if small else contextlib.nullcontext():
            self._ids.copy_(ids)
            if not self.graphs:
                self._out = self._forward(self._ids[:, None], self._pos, slice(None))
            else:
                if self._graph is None:
                    self._capture()
                self._graph.replay()
            self._pos.add_(1)
        self.lengths = [n + 1 for n in self.lengths]
        return self._out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of ``max_new_tokens`` tokens for each prompt (all rows decode together).

        Raises: InputError (see :meth:`prefill`, :meth:`decode`).
        """
        logits = self.prefill(prompts)
        out = []
        for _ in range(max_new_tokens):
            tok = logits.argmax(-1)
            out.append(tok)
            if len(out) < max_new_tokens:
                logits = self.decode(tok)
        return torch.stack(out, 1).cpu().tolist() if out else [[] for _ in prompts]

    def _check_ids(self, ids: np.ndarray, what: str) -> torch.Tensor:
        V = self.cfg.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            raise InputError(f"static decoder: {what}: token id outside [0, {V})")
        return torch.as_tensor(ids, dtype=torch.long).to(self.model.device)

    def _capture(self) -> None:
        """Record one decode step as a CUDA graph (after two eager warm-up runs on a side stream, which
        compute exactly the step the graph will replay first: same ids, same positions)."""
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._out = self._forward(self._ids[:, None], self._pos, slice(None))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._forward(self._ids[:, None], self._pos, slice(None))
        self._graph = graph


def kv_bytes(cfg, batch: int, max_len: int, elem: int = 4) -> int:
    """Bytes of a :class:`StaticCache` of ``batch`` rows and ``max_len`` positions (``elem`` bytes an element)."""
    per = sum(2 * L.n_kv_head * L.head_dim for L in cfg.layers if L.has_kv)
    return int(per * batch * max_len * elem)


__all__ = ["StaticCache", "StaticDecoder", "static_attention", "kv_bytes"]

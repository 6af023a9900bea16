"""The Gemma 4 assistant (MTP drafter) in torch: the twin of :mod:`reference.drafter`, over the target's paged cache.

:class:`FastDrafter` is a :class:`fast.model.FastModel` over the drafter's decoder (its layers Q-only, bound to the
target's store layers by :func:`reference.drafter.bind`), so its layers are the target's own blocks
(``decoder_layer``, ``attention_block`` ...): a Q-only layer reads ``batch.views[kv_donor]``, which the drafter
fills from the *target's* cache, read only (:meth:`fast.kvcache.PagedKVCache.read`), once per draft round
(every draft step of a round sits at the same position, so its keys do not change). The same names as the
reference: ``drafter_input``, ``centroid_head``, ``drafter_head``, ``drafter_forward``, ``draft``.

Shapes: n = sequences drafting, H_t = target hidden, H_a = drafter hidden, V = vocab, C = centroids.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gemma4_harness.reference.drafter import UNBOUND, DrafterConfig
from gemma4_harness.reference.model import TraceFn

from .kvcache import PagedKVCache
from .model import FastModel, SeqStep, StepBatch, linear, rms_norm


class FastDrafter(FastModel):
    """A bound drafter beside its target.

    Args:
        d: the drafter config, bound to ``target.cfg`` (:func:`reference.drafter.bind`).
        DW: the drafter's weights (:func:`reference.drafter_weights.load_drafter`).
        target: the target's :class:`FastModel` (its embedding table is the drafter's input; its derive-K
            functions rebuild the K of a k_eq_v store layer).

    Raises:
        ValueError: the drafter is not bound.
    """

    def __init__(self, d: DrafterConfig, DW, target: FastModel):
        if any(L.kv_donor == UNBOUND for L in d.text.layers):
            raise ValueError(f"{d.source}: drafter not bound to a target (reference.drafter.bind)")
        super().__init__(d.text, DW, target.device, target.dtype)
        self.d = d
        self.target = target
        self.order = None
        if d.use_ordered_embeddings:
            V = d.text.vocab_size
            self.order = self.w["masked_embd_ordering"].round().long().view(d.num_centroids, V // d.num_centroids)

    # ------------------------------------------------------------------ blocks

    def drafter_input(self, ids: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        """``concat(E_target[ids] * sqrt(H_t), h_prev)``. [n], [n, H_t] -> [n, 2 H_t]. Source: reference
        ``drafter_input``."""
        return torch.cat([self.target.embed(ids), h_prev.float()], dim=-1)

    def centroid_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the tokens in the ``top_k`` best clusters, the row's smallest of those minus 1 elsewhere.

        [n, H_a] -> [n, V]. Source: reference ``centroid_head`` (transformers ``Gemma4AssistantMaskedEmbedder``).
        """
        d = self.d
        E = self.w["token_embd.weight"]
        scores = linear(h, self.w["masked_embd_centroids.weight"]).float()  # [n, C]
        top = torch.topk(scores, d.centroid_top_k, dim=-1).indices  # [n, k]
        sel = self.order[top].flatten(1)  # [n, k * V/C]
        s = torch.einsum("nh,nsh->ns", h.float(), E[sel].float())
        out = (s.min(dim=-1, keepdim=True).values - 1.0).expand(-1, d.text.vocab_size).clone()
        return out.scatter_(1, sel, s)

    def drafter_head(self, h: torch.Tensor) -> torch.Tensor:
        """The tied head without softcap, or :meth:`centroid_head`. [n, H_a] -> [n, V] float32."""
        if self.order is not None:
            return self.centroid_head(h)
        return linear(h, self.w["token_embd.weight"]).float()

    # ------------------------------------------------------------------ steps

    def views(self, cache: PagedKVCache, slots: Sequence[int], positions: Sequence[int]) -> dict:
        """Per target store layer, per sequence, the ``(k, v, k_pos)`` a query at its position sees (read only)."""
        out = {}
        for il in sorted({L.kv_donor for L in self.cfg.layers}):
            derive = self.target._derive_k(self.target.cfg.layers[il])
            out[il] = [cache.read(il, s, p, derive) for s, p in zip(slots, positions)]
        return out

    def drafter_forward(self, cache: PagedKVCache, slots: Sequence[int], ids: torch.Tensor, h_prev: torch.Tensor,
                        positions: Sequence[int], views: dict | None = None,
                        trace: TraceFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step of ``n`` sequences, each at its own position.

        Args:
            cache: the target's cache (holding exactly the positions before each sequence's position).
            slots, positions: each sequence's cache slot and the position of its last token.
            ids: [n] each sequence's last token or previous draft.
            h_prev: [n, H_t] the target's ``result_norm`` that produced it, or the previous ``h_next``.
            views: :meth:`views` of the round (computed here when None).
            trace: callback for a single sequence (llama.cpp's names, as the reference).

        Returns:
            ``(logits [n, V] float32, h_next [n, H_t] float32)``.

        Source: reference ``drafter_forward``.
        """
        dev, cfg = self.device, self.cfg
        tr = (lambda p, il, t: None) if trace is None else (
            lambda p, il, t: trace(p, il, t.detach().double().cpu().numpy()))
        if trace is not None and len(slots) != 1:
            raise ValueError("tracing is for single-sequence steps")
        ids = ids.to(dev)
        n = ids.shape[0]
        seqs = [SeqStep(s, ids[i:i + 1], int(p)) for i, (s, p) in enumerate(zip(slots, positions))]
        batch = StepBatch(seqs, torch.as_tensor(list(positions), dtype=torch.long, device=dev), np.arange(n + 1),
                          cache, views if views is not None else self.views(cache, slots, positions))
        tr("inp_embd_target", -1, self.target.embed(ids))
        xh = self.drafter_input(ids, h_prev.to(dev))
        tr("inp_xh", -1, xh)
        x = linear(xh, self.w["nextn.pre_projection.weight"]).float()
        tr("pre_proj", -1, x)
        for layer in cfg.layers:
            x = self.decoder_layer(layer, x, batch, None, tr)
        x = rms_norm(x, self.w["output_norm.weight"], cfg.rms_eps)
        tr("result_norm", -1, x)
        logits = self.drafter_head(x)
        tr("result_output", -1, logits)
        h_next = linear(x, self.w["nextn.post_projection.weight"]).float()
        tr("h_nextn", -1, h_next)
        return logits, h_next

    def draft(self, cache: PagedKVCache, slots: Sequence[int], ids: Sequence[int], h_prev: torch.Tensor,
              positions: Sequence[int], n_draft: Sequence[int]) -> list[list[int]]:
        """Greedy drafts for several sequences at once: ``n_draft[i]`` tokens for sequence ``i``, all at its position.

        Every step runs the sequences that still want drafts as one batch; the round's K/V views are read once.

        Returns:
            one list of draft tokens per sequence (ties: the lowest id, as ``torch.argmax``).

        Source: reference ``draft``.
        """
        out: list[list[int]] = [[] for _ in slots]
        live = [i for i, k in enumerate(n_draft) if k > 0]
        if not live:
            return out
        views_all = self.views(cache, [slots[i] for i in live], [positions[i] for i in live])
        tok = torch.as_tensor([int(ids[i]) for i in live], dtype=torch.long)
        h = h_prev[live]
        rows = list(range(len(live)))
        while rows:
            sel = [live[r] for r in rows]
            views = {il: [v[r] for r in rows] for il, v in views_all.items()}
            logits, h_new = self.drafter_forward(cache, [slots[i] for i in sel], tok[rows], h[rows],
                                                 [positions[i] for i in sel], views)
            best = torch.argmax(logits, dim=-1).cpu()
            tok, h = tok.clone(), h.clone()
            for j, r in enumerate(rows):
                tok[r] = best[j]
                h[r] = h_new[j].to(h.device)
                out[live[r]].append(int(best[j]))
            rows = [r for r in rows if len(out[live[r]]) < n_draft[live[r]]]
        return out

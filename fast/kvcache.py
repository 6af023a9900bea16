"""Paged KV cache with per-layer heterogeneity.

* Each KV-owning layer gets storage shaped for its own ``head_dim`` and KV head count.
* A full-attention layer stores keys/values in fixed-size pages drawn from a pool;
  each sequence owns a page table (vLLM's PagedAttention layout, gathered per step).
* A sliding layer stores exactly ``sliding_window`` tokens per sequence in a ring
  (position p lives at slot p % window), so it never holds more than its window.
* A KV-shared layer allocates nothing: its entry *is* its donor's storage object.
* A k_eq_v layer (V is the K projection) stores one tensor, the normed V; the
  cached K is rebuilt as ``rope(V * k_norm.weight)`` when attended.

Shapes: S = keys attended, Hkv = KV heads, D = head_dim, P = page size, W = window.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from reference.config import ModelConfig
from reference.errors import PromptError

DeriveK = Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None


class PagedStore:
    """Page pool for one full-attention layer: ``[n_pages, P, Hkv, D]`` for K (unless k_eq_v) and V."""

    def __init__(self, n_pages: int, page_size: int, n_kv: int, head_dim: int, store_k: bool, max_seqs: int,
                 device, dtype):
        self.page_size = page_size
        shape = (n_pages, page_size, n_kv, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype) if store_k else None
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.free_pages = list(range(n_pages - 1, -1, -1))
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]
        self.length = [0] * max_seqs

    def tensors(self) -> list[torch.Tensor]:
        """The storage this layer allocated."""
        return [t for t in (self.k, self.v) if t is not None]

    def release(self, slot: int) -> None:
        """Return a sequence's pages to the pool."""
        self.free_pages.extend(reversed(self.tables[slot]))
        self.tables[slot] = []
        self.length[slot] = 0

    def attend_and_append(self, slot: int, start: int, k_new, v_new, derive_k: DeriveK):
        """Keys/values of positions ``[0, start + T)``; stores the T new ones. -> ([S,Hkv,D] x2, [S])."""
        if start != self.length[slot]:
            raise ValueError(f"slot {slot}: step starts at {start}, cache holds {self.length[slot]}")
        T, P = k_new.shape[0], self.page_size
        table = self.tables[slot]
        if start:
            pages = torch.tensor(table, device=self.v.device)
            v_old = self.v[pages].flatten(0, 1)[:start]
            pos_old = torch.arange(start, device=self.v.device)
            k_old = self.k[pages].flatten(0, 1)[:start] if self.k is not None else derive_k(v_old, pos_old)
            k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
        else:
            k_all, v_all = k_new, v_new
        need = math.ceil((start + T) / P)
        while len(table) < need:
            if not self.free_pages:
                raise PromptError("KV cache is full: no free page (raise max_tokens / max_seqs)")
            table.append(self.free_pages.pop())
        pos = torch.arange(start, start + T, device=self.v.device)
        page = torch.tensor(table, device=self.v.device)[pos // P]  # a page holds P consecutive positions
        if self.k is not None:
            self.k[page, pos % P] = k_new
        self.v[page, pos % P] = v_new
        self.length[slot] = start + T
        return k_all, v_all, torch.arange(start + T, device=v_all.device)


class RingStore:
    """Sliding-window storage for one layer: ``[max_seqs, W, Hkv, D]``; position p at slot p % W."""

    def __init__(self, window: int, n_kv: int, head_dim: int, store_k: bool, max_seqs: int, device, dtype):
        self.window = window
        shape = (max_seqs, window, n_kv, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype) if store_k else None
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = [0] * max_seqs

    def tensors(self) -> list[torch.Tensor]:
        """The storage this layer allocated."""
        return [t for t in (self.k, self.v) if t is not None]

    def release(self, slot: int) -> None:
        """Forget a sequence (its ring is reused as is)."""
        self.length[slot] = 0

    def held(self, slot: int) -> int:
        """Tokens the ring holds for ``slot`` (never more than the window)."""
        return min(self.length[slot], self.window)

    def attend_and_append(self, slot: int, start: int, k_new, v_new, derive_k: DeriveK):
        """Keys of positions ``[max(0, start-W+1), start + T)``; stores the last W. -> ([S,Hkv,D] x2, [S])."""
        if start != self.length[slot]:
            raise ValueError(f"slot {slot}: step starts at {start}, cache holds {self.length[slot]}")
        W, T, dev = self.window, k_new.shape[0], self.v.device
        lo = max(0, start - W + 1)
        pos_old = torch.arange(lo, start, device=dev)
        if start > lo:
            idx = pos_old % W
            v_old = self.v[slot, idx]
            k_old = self.k[slot, idx] if self.k is not None else derive_k(v_old, pos_old)
            k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
        else:
            k_all, v_all = k_new, v_new
        keep = min(T, W)
        pos_keep = torch.arange(start + T - keep, start + T, device=dev)
        if self.k is not None:
            self.k[slot, pos_keep % W] = k_new[T - keep:]
        self.v[slot, pos_keep % W] = v_new[T - keep:]
        self.length[slot] = start + T
        return k_all, v_all, torch.arange(lo, start + T, device=dev)


class PagedKVCache:
    """The whole model's cache: one store per KV-owning layer; shared layers alias their donor's store.

    Args:
        cfg: model config (per-layer head_dim, KV heads, window, donors).
        max_seqs: concurrent sequences (slots).
        max_tokens: longest sequence; sizes the page pool of full layers.
        page_size: tokens per page.

    Raises:
        PromptError: a step that needs more pages than the pool has.
    """

    def __init__(self, cfg: ModelConfig, max_seqs: int, max_tokens: int, page_size: int, device, dtype):
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.stores: dict[int, PagedStore | RingStore] = {}
        for L in cfg.layers:
            if not L.has_kv:
                self.stores[L.index] = self.stores[L.kv_donor]  # alias: no allocation, no copy
                continue
            store_k = L.has_v_proj or not cfg.has_v_norm
            if L.is_sliding:
                self.stores[L.index] = RingStore(cfg.sliding_window, L.n_kv_head, L.head_dim, store_k, max_seqs,
                                                 device, dtype)
            else:
                n_pages = max_seqs * math.ceil(max_tokens / page_size)
                self.stores[L.index] = PagedStore(n_pages, page_size, L.n_kv_head, L.head_dim, store_k, max_seqs,
                                                  device, dtype)
        self.free_slots = list(range(max_seqs - 1, -1, -1))

    def alloc(self) -> int:
        """A free sequence slot.

        Raises:
            PromptError: every slot is taken.
        """
        if not self.free_slots:
            raise PromptError(f"KV cache has no free sequence slot ({self.max_seqs} in use)")
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        """Retire a sequence: its pages go back to the pool, its slot to the free list."""
        for il, store in self.stores.items():
            if self.cfg.layers[il].has_kv:
                store.release(slot)
        self.free_slots.append(slot)

    def attend_and_append(self, il: int, slot: int, start: int, k_new, v_new, derive_k: DeriveK = None):
        """See :meth:`PagedStore.attend_and_append` / :meth:`RingStore.attend_and_append`."""
        return self.stores[il].attend_and_append(slot, start, k_new, v_new, derive_k)

    def allocated_bytes(self) -> dict[int, int]:
        """Bytes each layer allocated itself (0 for a layer that aliases its donor)."""
        out = {}
        for L in self.cfg.layers:
            st = self.stores[L.index]
            out[L.index] = sum(t.numel() * t.element_size() for t in st.tensors()) if L.has_kv else 0
        return out

"""Paged KV cache with per-layer heterogeneity.

* Each KV-owning layer gets storage shaped for its own ``head_dim`` and KV head count.
* A full-attention layer stores keys/values in fixed-size pages drawn from a pool;
  each sequence owns a page table (vLLM's PagedAttention layout, gathered per step).
* A sliding layer stores ``sliding_window + extra`` tokens per sequence in a ring
  (position p lives at slot p % (window + extra)): exactly its window by default, and ``extra`` more for
  speculative decoding, so that rolling back up to ``extra + 1`` rejected tokens finds the window before
  them still there (llama.cpp keeps ``n_swa + n_ubatch`` cells for the same reason).
* Rollback (:meth:`PagedKVCache.truncate`) forgets a sequence's last positions: a page table gives back
  its pages beyond the new length, a ring only moves its length back (it refuses a rollback beyond
  ``extra + 1`` tokens, whose window it no longer holds).
* A KV-shared layer allocates nothing: its entry *is* its donor's storage object.
* A k_eq_v layer (V is the K projection) stores one tensor, the normed V; the
  cached K is rebuilt as ``rope(V * k_norm.weight)`` when attended.

Shapes: S = keys attended, Hkv = KV heads, D = head_dim, P = page size, W = window.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.errors import PromptError

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

    def read(self, slot: int, end: int, derive_k: DeriveK):
        """Keys/values of positions ``[0, end)`` without storing anything. -> ([S,Hkv,D] x2, [S]).

        Raises:
            ValueError: ``end`` beyond what the slot holds.
        """
        if not 0 <= end <= self.length[slot]:
            raise ValueError(f"slot {slot}: read up to {end}, cache holds {self.length[slot]}")
        pages = torch.tensor(self.tables[slot], device=self.v.device, dtype=torch.long)
        pos = torch.arange(end, device=self.v.device)
        v = self.v[pages].flatten(0, 1)[:end]
        k = self.k[pages].flatten(0, 1)[:end] if self.k is not None else derive_k(v, pos)
        return k, v, pos

    def check_truncate(self, slot: int, length: int) -> None:
        """Raise ValueError when :meth:`truncate` to ``length`` is impossible (beyond what the slot holds)."""
        if not 0 <= length <= self.length[slot]:
            raise ValueError(f"slot {slot}: truncate to {length}, cache holds {self.length[slot]}")

    def truncate(self, slot: int, length: int) -> None:
        """Forget positions ``>= length``; pages no longer needed go back to the pool.

        Raises:
            ValueError: ``length`` beyond what the slot holds.
        """
        self.check_truncate(slot, length)
        keep = math.ceil(length / self.page_size)
        table = self.tables[slot]
        self.free_pages.extend(reversed(table[keep:]))
        del table[keep:]
        self.length[slot] = length

    def attend_and_append(self, slot: int, start: int, k_new, v_new, derive_k: DeriveK):
        """Keys/values of positions ``[0, start + T)``; stores the T new ones. -> ([S,Hkv,D] x2, [S])."""
        if start != self.length[slot]:
            raise ValueError(f"slot {slot}: step starts at {start}, cache holds {self.length[slot]}")
        T, P = k_new.shape[0], self.page_size
        table = self.tables[slot]
        if self.k is not None:
            view = self._append_then_view(slot, start, k_new, v_new)
            if view is not None:
                return view
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


    def _append_then_view(self, slot: int, start: int, k_new, v_new):
        """Store the new K/V first, then hand back positions ``[0, start + T)`` as views of the pool (no gather,
        no concatenation) when the slot's pages are consecutive and ascending, as a lone or first sequence's are.
        None (nothing stored) when they are not. Same values as the gather-and-concatenate path."""
        T, P = k_new.shape[0], self.page_size
        table = self.tables[slot]
        need = math.ceil((start + T) / P)
        extra = max(0, need - len(table))
        pages = table + self.free_pages[::-1][:extra]  # pop() hands out the end of the free list first
        if len(pages) < need or pages != list(range(pages[0], pages[0] + need)):
            return None
        first = pages[0]
        for _ in range(extra):
            table.append(self.free_pages.pop())
        pos = torch.arange(start, start + T, device=self.v.device)
        self.k[first + pos // P, pos % P] = k_new
        self.v[first + pos // P, pos % P] = v_new
        self.length[slot] = start + T
        end = start + T
        return (self.k[first:first + need].flatten(0, 1)[:end], self.v[first:first + need].flatten(0, 1)[:end],
                torch.arange(end, device=self.v.device))


class RingStore:
    """Sliding-window storage for one layer: ``[max_seqs, W + extra, Hkv, D]``; position p at slot p % (W + extra)."""

    def __init__(self, window: int, n_kv: int, head_dim: int, store_k: bool, max_seqs: int, device, dtype,
                 extra: int = 0, max_tokens: int | None = None):
        self.window = window
        self.extra = extra
        # A sequence of at most max_tokens tokens never wraps a ring of that many slots; reads gather by position
        # (:meth:`read`), so the keys, their order and every result are the same as with the whole window.
        self.capacity = window + extra if max_tokens is None else max(1, min(window + extra, max_tokens))
        #: True when the ring is shorter than the window: a sequence longer than it would overwrite positions its
        #: queries still see, so :meth:`attend_and_append` refuses it instead.
        self.bounded = self.capacity < window + extra
        shape = (max_seqs, self.capacity, n_kv, head_dim)
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
        """Tokens the ring holds for ``slot`` (never more than its capacity, window + extra)."""
        return min(self.length[slot], self.capacity)

    def _oldest(self, slot: int) -> int:
        return max(0, self.length[slot] - self.capacity)

    def read(self, slot: int, end: int, derive_k: DeriveK):
        """Keys/values of positions ``[max(0, end-W+1), end)`` (what a query at ``end`` sees) without storing.

        -> ([S,Hkv,D] x2, [S]). Raises ValueError: ``end`` beyond the held positions, or part of its window
        already overwritten.
        """
        lo = max(0, end - self.window + 1)
        if end > self.length[slot] or lo < self._oldest(slot):
            raise ValueError(f"slot {slot}: window of position {end} is not held (ring holds "
                             f"[{self._oldest(slot)}, {self.length[slot]}))")
        pos = torch.arange(lo, end, device=self.v.device)
        idx = pos % self.capacity
        v = self.v[slot, idx]
        k = self.k[slot, idx] if self.k is not None else derive_k(v, pos)
        return k, v, pos

    def truncate(self, slot: int, length: int) -> None:
        """Forget positions ``>= length`` (speculative rollback).

        Raises:
            ValueError: ``length`` beyond what the slot holds, or so far back that the window of position
                ``length`` was overwritten (a rollback of more than ``extra + 1`` tokens).
        """
        self.check_truncate(slot, length)
        self.length[slot] = length

    def check_truncate(self, slot: int, length: int) -> None:
        """Raise ValueError when :meth:`truncate` to ``length`` is impossible (see there)."""
        lo = max(0, length - self.window + 1)
        if not 0 <= length <= self.length[slot] or lo < self._oldest(slot):
            raise ValueError(f"slot {slot}: cannot roll back from {self.length[slot]} to {length} tokens: the ring "
                             f"keeps {self.extra} beyond its window of {self.window}")

    def _append_then_view(self, slot: int, start: int, k_new, v_new):
        """Decode's path (one new token): store it first (its slot held position ``start - C``, which no query at
        ``start`` sees), then hand back the held positions in order: a view of the ring until it wraps, after
        that its two halves joined (one copy). Attention then takes the window as a slice of these, the same keys
        in the same order as the gathering path gives. [1, Hkv, D] x2 -> ([S,Hkv,D] x2, [S]), S = min(start + 1, C).
        """
        C, dev = self.capacity, self.v.device
        self.k[slot, start % C] = k_new[0]
        self.v[slot, start % C] = v_new[0]
        self.length[slot] = start + 1
        if start + 1 <= C:
            return self.k[slot, :start + 1], self.v[slot, :start + 1], torch.arange(start + 1, device=dev)
        s = (start + 1) % C  # the oldest held position's slot
        k, v = self.k[slot], self.v[slot]
        if s:
            k, v = torch.cat([k[s:], k[:s]]), torch.cat([v[s:], v[:s]])
        return k, v, torch.arange(start + 1 - C, start + 1, device=dev)

    def attend_and_append(self, slot: int, start: int, k_new, v_new, derive_k: DeriveK):
        """Keys of positions ``[max(0, start-W+1), start + T)``; stores the last W + extra. -> ([S,Hkv,D] x2, [S]).

        One new token with K stored: :meth:`_append_then_view` (the held slots as views, no copy).

        Raises:
            ValueError: ``start`` is not the slot's length, or a ring bounded below its window (``max_tokens``)
                would hold more than ``max_tokens`` positions.
        """
        if start != self.length[slot]:
            raise ValueError(f"slot {slot}: step starts at {start}, cache holds {self.length[slot]}")
        W, C, T, dev = self.window, self.capacity, k_new.shape[0], self.v.device
        if self.bounded and start + T > C:
            raise ValueError(f"slot {slot}: {start + T} tokens do not fit a ring bounded to {C} (max_tokens) of a "
                             f"window of {W}: it would overwrite positions the queries still see")
        if T == 1 and self.k is not None:
            return self._append_then_view(slot, start, k_new, v_new)
        lo = max(0, start - W + 1)
        pos_old = torch.arange(lo, start, device=dev)
        if start > lo:
            idx = pos_old % C
            v_old = self.v[slot, idx]
            k_old = self.k[slot, idx] if self.k is not None else derive_k(v_old, pos_old)
            k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
        else:
            k_all, v_all = k_new, v_new
        keep = min(T, C)
        pos_keep = torch.arange(start + T - keep, start + T, device=dev)
        if self.k is not None:
            self.k[slot, pos_keep % C] = k_new[T - keep:]
        self.v[slot, pos_keep % C] = v_new[T - keep:]
        self.length[slot] = start + T
        return k_all, v_all, torch.arange(lo, start + T, device=dev)


class PagedKVCache:
    """The whole model's cache: one store per KV-owning layer; shared layers alias their donor's store.

    Args:
        cfg: model config (per-layer head_dim, KV heads, window, donors).
        max_seqs: concurrent sequences (slots).
        max_tokens: longest sequence; sizes the page pool of full layers.
        page_size: tokens per page.
        ring_extra: slots a sliding layer's ring keeps beyond its window (speculative decoding: the most
            tokens a round may roll back, minus one, or more).
        bounded: ``max_tokens`` bounds every sequence (a prefill of known prompts): a sliding layer's ring holds at
            most that many positions, not its whole window. The 31B shape's window of 1,024 made a ring of 33.5 MB per
            sequence and layer: 13.4 GB for the fast oracle's group of 8 prompts of about 40 tokens. A sequence that
            outgrows it fails loudly (:meth:`RingStore.attend_and_append`, :meth:`RingStore.read`), never silently.

    Raises:
        PromptError: a step that needs more pages than the pool has.
    """

    def __init__(self, cfg: ModelConfig, max_seqs: int, max_tokens: int, page_size: int, device, dtype,
                 ring_extra: int = 0, bounded: bool = False):
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
                                                 device, dtype, extra=ring_extra,
                                                 max_tokens=max_tokens if bounded else None)
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

    def read(self, il: int, slot: int, end: int, derive_k: DeriveK = None):
        """What a query at position ``end`` of ``slot`` sees in layer ``il``'s storage, read only (a drafter's
        view of its target). See :meth:`PagedStore.read` / :meth:`RingStore.read`."""
        return self.stores[il].read(slot, end, derive_k)

    def length(self, slot: int) -> int:
        """Tokens cached for ``slot``."""
        return next(st.length[slot] for il, st in self.stores.items() if self.cfg.layers[il].has_kv)

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` tokens in every layer (speculative decoding's rejection).

        Raises:
            ValueError: see :meth:`PagedStore.truncate` / :meth:`RingStore.truncate` (checked for every layer
                before any changes).
        """
        own = [st for il, st in self.stores.items() if self.cfg.layers[il].has_kv]
        for st in own:
            st.check_truncate(slot, length)
        for st in own:
            st.truncate(slot, length)

    def allocated_bytes(self) -> dict[int, int]:
        """Bytes each layer allocated itself (0 for a layer that aliases its donor)."""
        out = {}
        for L in self.cfg.layers:
            st = self.stores[L.index]
            out[L.index] = sum(t.numel() * t.element_size() for t in st.tensors()) if L.has_kv else 0
        return out

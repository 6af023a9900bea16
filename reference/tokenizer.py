"""A minimal tokenizer for GGUF ``tokenizer.ggml.model == "llama"`` vocabularies (SentencePiece BPE).

This is the Gemma 3 case: the GGUF stores the SentencePiece pieces as
``tokenizer.ggml.tokens`` with ``tokenizer.ggml.scores`` and
``tokenizer.ggml.token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte). The algorithm is SentencePiece's ``bpe_model.cc`` ``Encode``:

1. Escape: every space becomes ``▁`` (U+2581). A ``▁`` is put in front only when
   ``tokenizer.ggml.add_space_prefix`` is true (Gemma 3 sets it false).
2. Split into symbols, left to right: at each position the longest *special
   piece* that matches becomes one frozen symbol (never merged), otherwise one
   Unicode character becomes a symbol. Special pieces are the user-defined
   tokens (type 4: ``\\n`` runs, space runs, HTML tags, ...) and the control
   tokens (type 3) other than BOS / EOS / padding / unknown. This reproduces
   ``sentencepiece`` on the Gemma 3 model, where ``<start_of_turn>``,
   ``<unusedN>`` and ``<mask>`` are user-defined pieces that the GGUF converter
   re-labelled as control, while ``<bos>``/``<eos>``/``<pad>`` are real control
   pieces that text can never produce. (llama.cpp matches type-3 text only with
   ``parse_special``; HF ``tokenizers`` also matches ``<bos>``/``<eos>``.)
   Space runs are stored as literal spaces in the GGUF and as ``▁`` runs in
   ``tokenizer.model``; both match the escaped text here.
3. Merge: repeatedly join the adjacent pair of non-frozen symbols whose
   concatenation is a normal (type 1) token with the highest score; on equal
   scores the leftmost pair wins.
4. Map symbols to ids; a symbol that is not a token (necessarily one character)
   becomes one ``<0xHH>`` byte token per UTF-8 byte (byte fallback), or the
   unknown id when the vocabulary has no byte tokens.
5. ``add_bos``: BOS is put in front exactly once (not again when the text
   already produced it, which it cannot for Gemma 3).

``decode`` maps ids back to pieces, turns ``▁`` into spaces, reassembles runs of
byte tokens as UTF-8 (invalid bytes become U+FFFD) and drops control tokens.

Not covered (a full tokenizer comes later, DESIGN.md tokenizer row / issue 5):
the ``gemma4`` BPE-with-merges model and its newline-run split; unused (type 5)
pieces and SentencePiece's re-segmentation of them (Gemma 3 has none); a
SentencePiece normaliser (``precompiled_charsmap``; Gemma 3 uses none);
``add_eos``; a switch for llama.cpp's ``parse_special=False`` behaviour; chat
templates.
"""

from __future__ import annotations

import heapq
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError, ModelFileError

SPACE = "\u2581"  # ▁

# llama.cpp llama_token_type / gguf-py TokenType.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _byte_of(piece: str) -> int | None:
    """``<0xHH>`` -> HH, anything else -> None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


class GGUFTokenizer:
    """SentencePiece-BPE tokenizer from GGUF metadata (see the module docstring for the rules).

    Args:
        metadata: GGUF key -> value (as :func:`reference.weights.gguf_metadata`
            returns; ``weights.metadata`` after :func:`reference.weights.load_gguf`).
        source: file name, for messages.

    Raises:
        ConfigError: ``tokenizer.ggml.model`` is not ``llama``; tokens, scores and
            types missing or of different lengths.
    """

    def __init__(self, metadata: Mapping[str, Any], source: str = "<gguf>"):
        model = metadata.get("tokenizer.ggml.model")
        if model != "llama":
            raise ConfigError(f"{source}: tokenizer.ggml.model = {model!r}: this tokenizer handles 'llama' only")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ConfigError(f"{source}: missing key tokenizer.ggml.tokens")
        n = len(tokens)
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * n
        types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * n
        for key, arr in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
            if len(arr) != n:
                raise ConfigError(f"{source}: {key} has {len(arr)} entries, tokenizer.ggml.tokens has {n}")
        self.tokens: list[str] = [str(t) for t in tokens]
        self.scores: list[float] = [float(s) for s in scores]
        self.types: list[int] = [int(t) for t in types]
        self.bos_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.unk_id: int | None = metadata.get("tokenizer.ggml.unknown_token_id")
        self.pad_id: int | None = metadata.get("tokenizer.ggml.padding_token_id")
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        self.add_space_prefix: bool = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))

        # Merge targets: normal tokens only (SentencePiece never merges into control/byte pieces).
        self.normal: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            if ty == NORMAL:
                self.normal.setdefault(t, i)
        # Special pieces matched whole in text, keyed by escaped text.
        never = {self.bos_id, self.eos_id, self.unk_id, self.pad_id}
        self.special: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            if t and (ty == USER_DEFINED or (ty == CONTROL and i not in never)):
                self.special.setdefault(t.replace(" ", SPACE), i)
        self._special_lengths: dict[str, list[int]] = {}  # first char -> lengths, longest first
        for s in self.special:
            self._special_lengths.setdefault(s[0], []).append(len(s))
        for lengths in self._special_lengths.values():
            lengths.sort(reverse=True)
        self.byte_ids: dict[int, int] = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            b = _byte_of(t) if ty == BYTE else None
            if b is not None:
                self.byte_ids[b] = i

    @property
    def vocab_size(self) -> int:
        """Number of tokens."""
        return len(self.tokens)

    # ------------------------------------------------------------------ encode

    def _split(self, text: str) -> list[tuple[str, bool]]:
        """Escaped text -> initial symbols ``(piece, frozen)``: longest special piece, else one character."""
        out: list[tuple[str, bool]] = []
        i = 0
        while i < len(text):
            for length in self._special_lengths.get(text[i], ()):
                cand = text[i:i + length]
                if len(cand) == length and cand in self.special:
                    out.append((cand, True))
                    i += length
                    break
            else:
                out.append((text[i], False))
                i += 1
        return out

    def _merge(self, symbols: list[tuple[str, bool]]) -> list[str]:
        """SentencePiece BPE: merge the best-scoring adjacent pair until none is a token.

        A heap of candidate pairs ordered by (score desc, left position asc);
        entries made stale by an earlier merge are skipped when popped. Source:
        sentencepiece ``bpe_model.cc`` ``Model::Encode``.
        """
        pieces = [s for s, _ in symbols]
        frozen = [f for _, f in symbols]
        n = len(pieces)
        prev = list(range(-1, n - 1))  # linked list over live symbols; -1 = none
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            merged = pieces[left] + pieces[right]
            tid = self.normal.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-self.scores[tid], left, right, merged))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if nxt[left] != right or pieces[left] + pieces[right] != merged:
                continue  # stale: one side has changed since this pair was queued
            pieces[left], pieces[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out, i = [], 0 if n else -1
        while i >= 0:
            out.append(pieces[i])
            i = nxt[i]
        return out

    def _piece_ids(self, piece: str, frozen_id: int | None) -> list[int]:
        """Ids of one final symbol: the token, else byte fallback (else unknown)."""
        if frozen_id is not None:
            return [frozen_id]
        tid = self.normal.get(piece)
        if tid is not None:
            return [tid]
        if self.byte_ids:
            return [self.byte_ids[b] for b in piece.encode("utf-8")]
        return [] if self.unk_id is None else [self.unk_id]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Text -> token ids (rules in the module docstring).

        Args:
            text: the input.
            add_bos: put BOS in front (exactly once) when the vocabulary has one.

        Returns:
            the ids.
        """
        escaped = text.replace(" ", SPACE)
        if self.add_space_prefix and escaped and not escaped.startswith(SPACE):
            escaped = SPACE + escaped
        ids: list[int] = []
        symbols = self._split(escaped)
        # Frozen symbols split the text into runs that merge independently.
        run: list[tuple[str, bool]] = []
        for sym in symbols + [("", True)]:
            if sym[1]:
                for piece in self._merge(run) if run else []:
                    ids.extend(self._piece_ids(piece, None))
                run = []
                if sym[0]:
                    ids.append(self.special[sym[0]])
            else:
                run.append(sym)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    # ------------------------------------------------------------------ decode

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text: ``▁`` -> space, byte tokens as UTF-8, control tokens dropped."""
        out: list[str] = []
        pending = bytearray()
        for tid in ids:
            tid = int(tid)
            ty = self.types[tid]
            if ty == BYTE and _byte_of(self.tokens[tid]) is not None:
                pending.append(_byte_of(self.tokens[tid]))
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if ty == CONTROL:
                continue
            out.append(self.tokens[tid].replace(SPACE, " "))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_text(self, tid: int) -> str:
        """The stored piece of ``tid`` (for reports)."""
        return self.tokens[int(tid)]


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/values of a little-endian GGUF (v2/v3), read directly; tensors are not touched.

    Same values as :func:`reference.weights.gguf_metadata` (arrays as lists) but
    in well under a second for a 262k-token vocabulary, where ``gguf.GGUFReader``
    takes seconds building one memmap view per string.

    Raises:
        ModelFileError: not a GGUF file, big-endian or unknown version, truncated
            key/value section, unknown value type.

    Source: GGUF specification (ggml ``docs/gguf.md``), gguf-py ``GGUFValueType``.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read: {e}") from None
    try:
        if buf[:4] != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version not in (2, 3):
            raise ModelFileError(f"{path}: GGUF version {version} (or big-endian): expected little-endian 2 or 3")
        n_kv = struct.unpack_from("<Q", buf, 16)[0]
        pos = 24

        def string(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            if p + 8 + n > len(buf):
                raise struct.error("string past end of file")
            return buf[p + 8:p + 8 + n].decode("utf-8", errors="replace"), p + 8 + n

        def value(vtype: int, p: int) -> tuple[Any, int]:
            if vtype == _STRING:
                return string(p)
            if vtype in _SCALAR:
                fmt = _SCALAR[vtype]
                return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
            if vtype == _ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if etype in _SCALAR:
                    dt = np.dtype(_SCALAR[etype].replace("?", "b1"))
                    arr = np.frombuffer(buf, dtype=dt, count=count, offset=p)
                    return arr.tolist(), p + count * dt.itemsize
                items = []
                for _ in range(count):
                    item, p = value(etype, p)
                    items.append(item)
                return items, p
            raise ModelFileError(f"{path}: metadata value type {vtype} is unknown")

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = value(vtype, pos + 4)
        return meta
    except (struct.error, ValueError) as e:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF metadata ({e})") from None
    finally:
        buf.close()


def tokenizer_from_gguf(path: str | os.PathLike) -> GGUFTokenizer:
    """Build the tokenizer of a GGUF file from its metadata alone (fast; tensors untouched).

    Raises:
        ModelFileError: see :func:`read_gguf_metadata`; ConfigError: see :class:`GGUFTokenizer`.
    """
    return GGUFTokenizer(read_gguf_metadata(path), str(path))

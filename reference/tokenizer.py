"""Tokenizers from GGUF metadata alone: ``tokenizer.ggml.model`` = ``llama`` and ``gemma4``.

Both models store the vocabulary as ``tokenizer.ggml.tokens`` with
``tokenizer.ggml.token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte; llama.cpp ``llama_token_type`` / gguf-py ``TokenType``) and
``tokenizer.ggml.scores``.

``llama`` (Gemma 3 files): SentencePiece BPE by scores
------------------------------------------------------
The algorithm is SentencePiece's ``bpe_model.cc`` ``Encode``:

1. Escape: every space becomes ``▁`` (U+2581). A ``▁`` is put in front only when
   ``tokenizer.ggml.add_space_prefix`` is true (Gemma 3 sets it false): in front of
   the whole text by default (SentencePiece), and with ``parse_special`` set (the
   llama.cpp modes) in front of each run of text that starts the text or follows a
   special token, as llama.cpp does (``"<bos>Hi"``: ``<bos> ▁Hi``).
2. Split into symbols, left to right: at each position the longest *special
   piece* that matches becomes one frozen symbol (never merged), otherwise one
   Unicode character becomes a symbol. Which pieces are special depends on
   ``parse_special`` (below). By default (``None``) they are the user-defined
   tokens (type 4: ``\\n`` runs, space runs, HTML tags, ...) and the control
   tokens (type 3) other than BOS / EOS / padding / unknown. This reproduces
   ``sentencepiece`` on the Gemma 3 model, where ``<start_of_turn>``,
   ``<unusedN>`` and ``<mask>`` are user-defined pieces that the GGUF converter
   re-labelled as control, while ``<bos>``/``<eos>``/``<pad>`` are real control
   pieces that text can never produce. Space runs are stored as literal spaces
   in the GGUF and as ``▁`` runs in ``tokenizer.model``; both match the escaped
   text here.
3. Merge: repeatedly join the adjacent pair of non-frozen symbols whose
   concatenation is a normal (type 1) token with the highest score; on equal
   scores the leftmost pair wins.
4. Map symbols to ids; a symbol that is not a token (necessarily one character)
   becomes one ``<0xHH>`` byte token per UTF-8 byte (byte fallback), or the
   unknown id when the vocabulary has no byte tokens.

``gemma4`` (Gemma 4 files): BPE with merges, SentencePiece-style
----------------------------------------------------------------
Learned from llama.cpp ``llama-vocab.cpp`` (``LLAMA_VOCAB_PRE_TYPE_GEMMA4``:
regex ``[^\\n]+|[\\n]+``, ``byte_encode = false``), from transformers'
``GemmaTokenizer`` (``tokenizers`` BPE with ``byte_fallback``, normalizer
``Replace(" ", "▁")``) and from HF ``tokenizers``' ``BPE`` model
(``Word::merge_all``):

1. Special tokens are cut out of the *raw* text first, leftmost-longest (HF
   ``AddedVocabulary``; llama.cpp ``tokenizer_st_partition``). Which tokens
   are special depends on ``parse_special`` (below).
2. Each remaining fragment: every space becomes ``▁``; then the fragment is
   split into runs of newlines and runs of anything else (``[^\\n]+|\\n+``).
3. Each run is BPE-merged on raw Unicode characters: repeatedly join the
   adjacent pair with the lowest *rank* (its index in ``tokenizer.ggml.merges``,
   each entry ``"LEFT RIGHT"``); on equal ranks (the same pair twice) the
   leftmost wins. Scores are not used.
4. Symbols map to ids; one that is not a token becomes ``<0xHH>`` byte tokens
   (byte fallback), else the unknown id.

llama.cpp differs in two corners that do not occur with the Gemma
vocabularies tested here: it partitions specials longest-token-first over the
whole text rather than leftmost-longest, and it emits a newline run whole when
the run itself is a token (ggml-org/llama.cpp#21343), which BPE by rank also
produces for runs of 1..31 newlines on the Gemma vocabulary.

``parse_special`` (both models)
-------------------------------
* ``True``: control, user-defined and unknown tokens are all matched in text
  (llama.cpp ``parse_special=true``; HF ``tokenizers``, which always matches its
  added tokens).
* ``False``: only user-defined tokens are matched (llama.cpp's default for
  plain text; HF with ``encode_special_tokens=True`` when user-defined tokens
  are non-special added tokens).
* ``None`` (default): ``llama`` -> the SentencePiece rule of step 2 above;
  ``gemma4`` -> ``False``.

BOS is put in front when asked (``add_bos``; default: the file's
``tokenizer.ggml.add_bos_token``, true when absent), also when the text itself
starts with ``<bos>`` parsed as the special token: ``"<bos>hi"`` is
``[bos, bos, ...]``, as llama.cpp ``llama_tokenize(add_special=true,
parse_special=true)`` (src/llama-vocab.cpp ``tokenize``: BOS pushed before the
text's tokens; it only warns about the double BOS) and transformers' Gemma
tokenizer (its post-processor puts ``<bos>`` before whatever the text gave)
both give. A caller whose text already holds its BOS (a rendered chat template)
asks for none (``add_bos=False``).

``decode`` maps ids back to pieces, turns ``▁`` into spaces, reassembles runs of
byte tokens as UTF-8 (invalid bytes become U+FFFD) and drops control tokens
(and, for ``gemma4``, the unknown token) unless ``special=True``.

Not covered: unused (type 5) pieces and SentencePiece's re-segmentation of
them (Gemma has none); a SentencePiece normaliser (``precompiled_charsmap``;
Gemma uses none); ``add_eos``; ``lstrip``/``rstrip`` attributes of special
tokens; other ``tokenizer.ggml.model`` values (``gpt2``, ``t5``, ...).
"""

from __future__ import annotations

import heapq
import math
import os
import re
from typing import Any, Mapping, Sequence

from .errors import ConfigError
from .gguf_check import check_gguf

SPACE = "\u2581"  # ▁

# llama.cpp llama_token_type / gguf-py TokenType.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: ``tokenizer.ggml.model`` values this module implements.
SUPPORTED_MODELS = ("llama", "gemma4")

_RUNS = re.compile(r"[^\n]+|\n+")  # llama.cpp LLAMA_VOCAB_PRE_TYPE_GEMMA4


def _byte_of(piece: str) -> int | None:
    """``<0xHH>`` -> HH, anything else -> None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


class _Matcher:
    """Leftmost-longest matching of a fixed set of strings (the special tokens of one mode)."""

    def __init__(self, table: dict[str, int]):
        self.table = table
        sets: dict[str, set[int]] = {}
        for s in table:
            sets.setdefault(s[0], set()).add(len(s))
        # first char -> the distinct lengths of the specials starting with it, longest first
        self.lengths: dict[str, list[int]] = {c: sorted(ls, reverse=True) for c, ls in sets.items()}

    def split(self, text: str) -> list[tuple[str, int | None]]:
        """``text`` -> fragments ``(text, None)`` and matched specials ``(text, id)``, in order."""
        out: list[tuple[str, int | None]] = []
        start = i = 0
        n = len(text)
        lengths = self.lengths
        while i < n:
            for length in lengths.get(text[i], ()):
                cand = text[i:i + length]
                if len(cand) == length and cand in self.table:
                    if start < i:
                        out.append((text[start:i], None))
                    out.append((cand, self.table[cand]))
                    i += length
                    start = i
                    break
            else:
                i += 1
        if start < n:
            out.append((text[start:], None))
        return out


def merge_pairs(pieces: list[str], priority) -> list[str]:
    """Merge adjacent symbols, best pair first, until no pair has a priority; returns the final symbols.

    ``priority(left, right, merged)`` gives a sort key for merging symbols ``left`` and ``right``
    (indices into ``pieces``, which is updated in place) into ``merged``, or None when they must not
    merge; the smallest key wins, ties go to the leftmost pair. A heap holds candidate pairs;
    entries made stale by an earlier merge are skipped when popped. Both SentencePiece BPE (key
    = -score) and merges-based BPE (key = rank) are this loop. Sources: sentencepiece
    ``bpe_model.cc`` ``Model::Encode``; HF ``tokenizers`` ``Word::merge_all``.
    """
    n = len(pieces)
    prev = list(range(-1, n - 1))  # linked list over live symbols; -1 = none
    nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
    heap: list[tuple] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = pieces[left] + pieces[right]
        key = priority(left, right, merged)
        if key is not None:
            heapq.heappush(heap, (key, left, right, merged))

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


TOKEN_TYPES = range(0, 7)
"""Token types llama.cpp knows (``llama_token_type``: 0 undefined, 1 normal ... 6 byte)."""


def _check_tables(source: str, metadata: Mapping[str, Any], tokens, scores, types) -> None:
    """The vocabulary tables as a tokenizer can use them, or one line naming the key and the item.

    Refused: a token that is not a string, was not valid UTF-8 in the file (:class:`reference.gguf_check.Metadata`),
    is empty, or repeats an earlier one (two ids for one text: encoding would pick one silently); a token type
    llama.cpp does not know; a score that is NaN or +Inf (scores rank merges; -Inf ranks last).

    Raises:
        ConfigError: ``<file>: tokenizer.ggml.<table>[i] ...``.
    """
    bad_utf8 = getattr(metadata, "invalid_utf8", {}).get("tokenizer.ggml.tokens")
    if bad_utf8 is not None:
        raise ConfigError(f"{source}: tokenizer.ggml.tokens[{bad_utf8}] is not valid UTF-8 (expected text)")
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not isinstance(t, str):
            raise ConfigError(f"{source}: tokenizer.ggml.tokens[{i}] = {t!r:.40}: expected a string")
        if not t:
            raise ConfigError(f"{source}: tokenizer.ggml.tokens[{i}] is empty (expected the token's text)")
        j = seen.setdefault(t, i)
        if j != i:
            raise ConfigError(f"{source}: tokenizer.ggml.tokens[{i}] = {t!r:.40} repeats tokens[{j}] (expected "
                              "distinct tokens)")
    for i, ty in enumerate(types):
        if isinstance(ty, bool) or not isinstance(ty, int) or ty not in TOKEN_TYPES:
            raise ConfigError(f"{source}: tokenizer.ggml.token_type[{i}] = {ty!r:.40}: expected a token type 0-6 "
                              "(llama_token_type)")
    for i, sc in enumerate(scores):
        v = float(sc) if isinstance(sc, (int, float)) and not isinstance(sc, bool) else math.nan
        if math.isnan(v) or v == math.inf:
            raise ConfigError(f"{source}: tokenizer.ggml.scores[{i}] = {sc!r:.40}: expected a finite number (or -inf)")


class GGUFTokenizer:
    """Tokenizer from GGUF metadata: ``llama`` (SentencePiece BPE) or ``gemma4`` (BPE with merges).

    The rules are in the module docstring.

    Args:
        metadata: GGUF key -> value (as :func:`read_gguf_metadata` or
            :func:`reference.gguf_check.check_gguf` returns them).
        source: file name, for messages.

    Raises:
        ConfigError: no ``tokenizer.ggml.model`` key (a GGUF without a
            tokenizer); a model other than ``llama``/``gemma4``; tokens missing;
            scores or types of a different length; a special-token id out of
            range; ``gemma4`` without ``tokenizer.ggml.merges``, or a merge that
            is not ``"LEFT RIGHT"`` with LEFT, RIGHT and LEFT+RIGHT all tokens.
    """

    def __init__(self, metadata: Mapping[str, Any], source: str = "<gguf>"):
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ConfigError(f"{source}: no tokenizer in this file (key tokenizer.ggml.model is missing)")
        if model not in SUPPORTED_MODELS:
            raise ConfigError(f"{source}: tokenizer.ggml.model = {model!r} is not supported "
                              f"(expected one of {', '.join(repr(m) for m in SUPPORTED_MODELS)})")
        self.model: str = model
        self.source = source
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ConfigError(f"{source}: missing key tokenizer.ggml.tokens")
        n = len(tokens)
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * n
        types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * n
        for key, arr in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
            if len(arr) != n:
                raise ConfigError(f"{source}: {key} has {len(arr)} entries, tokenizer.ggml.tokens has {n}")
        _check_tables(source, metadata, tokens, scores, types)
        self.tokens: list[str] = [str(t) for t in tokens]
        self.scores: list[float] = [float(s) for s in scores]
        self.types: list[int] = [int(t) for t in types]

        def special_id(key: str) -> int | None:
            v = metadata.get(f"tokenizer.ggml.{key}")
            if v is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n:
                raise ConfigError(f"{source}: tokenizer.ggml.{key} = {v!r} is not a token id (vocabulary of {n})")
            return v

        self.bos_id: int | None = special_id("bos_token_id")
        self.eos_id: int | None = special_id("eos_token_id")
        self.unk_id: int | None = special_id("unknown_token_id")
        self.pad_id: int | None = special_id("padding_token_id")
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        self.add_space_prefix: bool = bool(metadata.get("tokenizer.ggml.add_space_prefix", model == "llama"))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")

        # Text -> id for the pieces merging may produce: normal tokens (llama: SentencePiece merges
        # into normal pieces only), or any token (gemma4: HF BPE and llama.cpp look the final
        # symbols up in the whole vocabulary).
        self.normal: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            if ty == NORMAL or model == "gemma4":
                self.normal.setdefault(t, i)
        self.byte_ids: dict[int, int] = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            b = _byte_of(t) if ty == BYTE else None
            if b is not None:
                self.byte_ids[b] = i

        # The special tokens of each parse_special mode (text as matched -> id).
        never = {self.bos_id, self.eos_id, self.unk_id, self.pad_id}
        key = (lambda t: t.replace(" ", SPACE)) if model == "llama" else (lambda t: t)
        modes: dict[Any, dict[str, int]] = {True: {}, False: {}, None: {}}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            if not t:
                continue
            k = key(t)
            if ty in (CONTROL, USER_DEFINED, UNKNOWN):
                modes[True].setdefault(k, i)
            if ty == USER_DEFINED:
                modes[False].setdefault(k, i)
            if model == "llama" and (ty == USER_DEFINED or (ty == CONTROL and i not in never)):
                modes[None].setdefault(k, i)
        if model == "gemma4":
            modes[None] = modes[False]
        self._matchers = {m: _Matcher(tab) for m, tab in modes.items()}
        #: The special pieces of the default mode (kept for callers of the ``llama``-only version).
        self.special: dict[str, int] = modes[None]

        self.ranks: dict[str, int] = {}
        self.n_merges = 0
        if model == "gemma4":
            self._load_merges(metadata.get("tokenizer.ggml.merges"))
        self._cache: dict[str, list[int]] = {}

    def _load_merges(self, merges: Any) -> None:
        """``tokenizer.ggml.merges`` -> rank of each ``"LEFT RIGHT"`` (first occurrence wins, as llama.cpp).

        A merge is split at its first space after the first character (llama.cpp
        ``llm_tokenizer_bpe``); LEFT, RIGHT and LEFT+RIGHT must all be tokens.
        """
        src = self.source
        if not merges:
            raise ConfigError(f"{src}: tokenizer.ggml.model = 'gemma4' needs tokenizer.ggml.merges (missing or empty)")
        merges = [str(m) for m in merges]
        vocab = set(self.tokens)
        # Fast path (set operations over all merges); the loop below names the first bad one.
        parts = [m.partition(" ") for m in merges]
        ok = (all(p[1] and p[0] and p[2] for p in parts)
              and not {p[0] for p in parts} - vocab and not {p[2] for p in parts} - vocab
              and not {p[0] + p[2] for p in parts} - vocab)
        if not ok:
            for i, m in enumerate(merges):
                sep = m.find(" ", 1)
                if sep < 0 or sep == len(m) - 1:
                    raise ConfigError(f"{src}: tokenizer.ggml.merges[{i}] = {m!r}: "
                                      "expected two tokens separated by a space")
                left, right = m[:sep], m[sep + 1:]
                for part in (left, right):
                    if part not in vocab:
                        raise ConfigError(f"{src}: tokenizer.ggml.merges[{i}] = {m!r} names {part!r}, "
                                          "which is not in tokenizer.ggml.tokens")
                if left + right not in vocab:
                    raise ConfigError(f"{src}: tokenizer.ggml.merges[{i}] = {m!r}: the merged piece "
                                      f"{left + right!r} is not in tokenizer.ggml.tokens")
        n = len(merges)
        self.ranks = dict(zip(reversed(merges), range(n - 1, -1, -1)))  # first occurrence wins
        self.n_merges = n

    @property
    def vocab_size(self) -> int:
        """Number of tokens."""
        return len(self.tokens)

    # ------------------------------------------------------------------ encode (llama)

    def _prefixed(self, symbols: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """``symbols`` with ``▁`` in front of each run of text symbols that starts the text or follows a frozen
        (special) symbol, when ``add_space_prefix`` (a run that already starts with ``▁`` keeps its own): llama.cpp
        ``llama_vocab::impl::tokenize`` (src/llama-vocab.cpp, ``LLAMA_VOCAB_TYPE_SPM``: ``is_prev_special``), so
        ``"<bos>Hi"`` is ``<bos> ▁Hi``, not ``▁ <bos> Hi``."""
        if not self.add_space_prefix:
            return symbols
        out: list[tuple[str, bool]] = []
        prev_special = True
        for sym in symbols:
            if not sym[1] and prev_special and sym[0] != SPACE:
                out.append((SPACE, False))
            out.append(sym)
            prev_special = sym[1]
        return out

    def _split(self, text: str, parse_special: bool | None = None) -> list[tuple[str, bool]]:
        """Escaped text -> initial symbols ``(piece, frozen)``: longest special piece, else one character."""
        out: list[tuple[str, bool]] = []
        for frag, sid in self._matchers[parse_special].split(text):
            if sid is not None:
                out.append((frag, True))
            else:
                out.extend((c, False) for c in frag)
        return out

    def _merge(self, symbols: list[tuple[str, bool]]) -> list[str]:
        """SentencePiece BPE: merge the best-scoring adjacent pair until none is a token.

        A heap of candidate pairs ordered by (score desc, left position asc);
        entries made stale by an earlier merge are skipped when popped. Source:
        sentencepiece ``bpe_model.cc`` ``Model::Encode``.
        """
        frozen = [f for _, f in symbols]
        scores, normal = self.scores, self.normal

        def priority(left: int, right: int, merged: str) -> float | None:
            if frozen[left] or frozen[right]:
                return None
            tid = normal.get(merged)
            return None if tid is None else -scores[tid]

        return merge_pairs([s for s, _ in symbols], priority)

    def _piece_ids(self, piece: str, frozen_id: int | None) -> list[int]:
        """Ids of one final symbol: the token, else byte fallback (else unknown)."""
        if frozen_id is not None:
            return [frozen_id]
        tid = self.normal.get(piece)
        if tid is not None:
            return [tid]
        try:
            raw = piece.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate is not text
            raw = None
        if raw is not None and self.byte_ids and all(b in self.byte_ids for b in raw):
            return [self.byte_ids[b] for b in raw]
        return [] if self.unk_id is None else [self.unk_id]

    def _encode_llama(self, text: str, parse_special: bool | None) -> list[int]:
        escaped = text.replace(" ", SPACE)
        if parse_special is None:  # SentencePiece: one dummy prefix, in front of the whole text
            if self.add_space_prefix and escaped and not escaped.startswith(SPACE):
                escaped = SPACE + escaped
            symbols = self._split(escaped, parse_special)
        else:  # llama.cpp (parse_special set): the prefix goes on each text run that starts the text or follows a
            symbols = self._prefixed(self._split(escaped, parse_special))  # special token (llama-vocab.cpp SPM)
        ids: list[int] = []
        table = self._matchers[parse_special].table
        run: list[tuple[str, bool]] = []
        # Frozen symbols split the text into runs that merge independently.
        for sym in symbols + [("", True)]:
            if sym[1]:
                for piece in self._merge(run) if run else []:
                    ids.extend(self._piece_ids(piece, None))
                run = []
                if sym[0]:
                    ids.append(table[sym[0]])
            else:
                run.append(sym)
        return ids

    # ------------------------------------------------------------------ encode (gemma4)

    def _bpe_ranked(self, word: str) -> list[int]:
        """One newline-free (or newline-only) run -> ids, merging the lowest-rank pair first.

        Source: HF ``tokenizers`` ``Word::merge_all`` (priority queue on
        (rank, position); stale entries skipped) and llama.cpp
        ``llm_tokenizer_bpe_session::tokenize``.
        """
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ranks = self.ranks

        def priority(left: int, right: int, merged: str) -> int | None:
            return ranks.get(pieces[left] + " " + pieces[right])

        pieces = list(word)
        ids: list[int] = []
        for piece in merge_pairs(pieces, priority):
            ids.extend(self._piece_ids(piece, None))
        if len(word) <= 64:
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[word] = ids
        return ids

    def _encode_gemma4(self, text: str, parse_special: bool | None) -> list[int]:
        ids: list[int] = []
        for frag, sid in self._matchers[parse_special].split(text):
            if sid is not None:
                ids.append(sid)
                continue
            for run in _RUNS.findall(frag.replace(" ", SPACE)):
                ids.extend(self._bpe_ranked(run))
        return ids

    # ------------------------------------------------------------------ public

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool | None = None) -> list[int]:
        """Text -> token ids (rules in the module docstring).

        Args:
            text: the input (a Python ``str``; lone surrogates are not text and
                fall back to the unknown id).
            add_bos: put BOS in front, also when the text itself starts with
                BOS (module docstring: llama.cpp and transformers do).
                ``None``: the file's ``tokenizer.ggml.add_bos_token`` (true when
                absent). Ignored when the vocabulary has no BOS.
            parse_special: which special tokens are matched in the text:
                ``True`` control + user-defined + unknown, ``False`` user-defined
                only, ``None`` the model's default (module docstring).

        Returns:
            the ids (a new list).

        Raises:
            TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        if parse_special not in (True, False, None):
            parse_special = bool(parse_special)
        if self.model == "gemma4":
            ids = self._encode_gemma4(text, parse_special)
        else:
            ids = self._encode_llama(text, parse_special)
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """Token ids -> text: ``▁`` -> space, byte tokens reassembled as UTF-8.

        Args:
            ids: token ids.
            special: also render control tokens (and the unknown token) as their
                text; by default they are dropped (``gemma4``: control and
                unknown; ``llama``: control), as llama.cpp
                ``token_to_piece(special=false)`` and HF
                ``decode(skip_special_tokens=True)`` do.

        Returns:
            the text; invalid UTF-8 from byte tokens becomes U+FFFD.

        Raises:
            IndexError: an id outside the vocabulary.
        """
        out: list[str] = []
        pending = bytearray()
        drop = (CONTROL, UNKNOWN) if self.model == "gemma4" else (CONTROL,)
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < len(self.tokens):
                raise IndexError(f"token id {tid} outside the vocabulary of {len(self.tokens)}")
            ty = self.types[tid]
            if ty == BYTE and _byte_of(self.tokens[tid]) is not None:
                pending.append(_byte_of(self.tokens[tid]))
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if ty in drop and not special:
                continue
            out.append(self.tokens[tid].replace(SPACE, " "))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_text(self, tid: int) -> str:
        """The stored piece of ``tid`` (for reports)."""
        return self.tokens[int(tid)]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The stored pieces of ``ids`` (for reports)."""
        return [self.tokens[int(i)] for i in ids]

    def token_id(self, text: str) -> int | None:
        """The id whose stored piece is exactly ``text`` (first one), else None."""
        if not hasattr(self, "_by_text"):
            self._by_text: dict[str, int] = {}
            for i, t in enumerate(self.tokens):
                self._by_text.setdefault(t, i)
        return self._by_text.get(text)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/values of a GGUF file (arrays as lists), through the one validating reader.

    Raises:
        ModelFileError: see :func:`reference.gguf_check.check_gguf` (the file, key or tensor at fault is named).
    """
    return check_gguf(path).metadata


def tokenizer_from_gguf(path: str | os.PathLike) -> GGUFTokenizer:
    """Build the tokenizer of a GGUF file (``llama`` or ``gemma4``) from its metadata alone (tensors untouched).

    Raises:
        ModelFileError: see :func:`read_gguf_metadata`; ConfigError: see :class:`GGUFTokenizer`.
    """
    return GGUFTokenizer(read_gguf_metadata(path), str(path))

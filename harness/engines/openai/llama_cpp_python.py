"""llama-cpp-python's server dialect (``python -m llama_cpp.server``, observed on 0.3.36).

``POST /v1/completions`` takes text prompts only (a token id list is a 500), and names tokens by their text. Prompts
go as the server's own detokenization of the ids, checked to tokenize back to the same ids
(:meth:`LlamaCppPython.prompt_text`); generated texts are mapped back to ids through its tokenizer and checked
(:meth:`LlamaCppPython.ids`). Stops at EOS. Prompt log-probs through ``echo``; ``/extras/tokenize``,
``/extras/detokenize``. What it answers is in ``docs/server-dialects.md``.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Mapping, Sequence

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import BYTE, NORMAL, USER_DEFINED, tokenizer_from_gguf

from .dialect import Dialect, ServerGenerated, first_choice, int_list, text_field
from .http import ServerCrashed, ServerError, ServerFailure, bad_shape


class LlamaCppPython(Dialect):
    """llama-cpp-python's server, as :class:`~harness.engines.openai.dialect.Dialect` describes a dialect.

    What it learns from the server is kept: the ids an empty text tokenizes to with specials (BOS), each token's
    text and each text's token.
    """

    name = "llama-cpp-python"
    text_only = True
    offers_prompt_logprobs = True

    def __init__(self, eng: Any) -> None:
        super().__init__(eng)
        self._bos: list[int] | None = None
        self._text_id: dict[str, int | None] = {}  # token text -> id
        self._id_text: dict[int, str] = {}
        self._texts: dict[str, int] | None = None  # the model file's unique token texts
        self._texts_lock = threading.Lock()

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        """``/extras/tokenize`` always adds BOS: without ``add_special`` that BOS is dropped."""
        url = self.eng.root + "/extras/tokenize"
        ids = int_list(url, self.eng.http.call(url, {"input": text}), "tokens")
        if not add_special:
            if self._bos is None:
                self._bos = int_list(url, self.eng.http.call(url, {"input": ""}), "tokens")
            ids = ids[len(self._bos):] if self._bos and ids[:len(self._bos)] == self._bos else ids
        return ids

    def detokenize(self, ids: list[int]) -> str:
        url = self.eng.root + "/extras/detokenize"
        return text_field(url, self.eng.http.call(url, {"tokens": ids}), "text")

    def prompt_text(self, ids: list[int]) -> str:
        """The text llama-cpp-python must be sent for prompt ``ids`` (it takes no id prompts), checked to tokenize back:
        the server's detokenization of the ids after BOS, without its leading space (or ``▁``, where byte tokens spell
        it) where the vocabulary adds one back (SentencePiece's ``add_space_prefix``, as the synthetic vocabularies do).

        Raises:
            ServerError: the ids do not survive the round trip ids -> text -> ids on this server.
        """
        if self._bos is None:
            self._bos = self.tokenize("", add_special=True)
        bos = self._bos
        body = ids[len(bos):] if bos and ids[:len(bos)] == bos else ids
        try:
            text = self.detokenize(body)
        except ServerFailure as e:  # its detokenizer refuses these ids (bytes that are no UTF-8): no text to send
            if isinstance(e, ServerCrashed):
                raise
            raise ServerError(f"{self.eng.base}/completions: llama-cpp-python takes text prompts only, and cannot turn "
                              f"the prompt {ids[:8]} into text ({e})") from None
        back = self.tokenize(text, add_special=True)  # what the server evaluates: it adds BOS to a text prompt
        if back != ids and text[:1] in (" ", "\u2581"):  # a vocabulary that adds a space prefix (add_space_prefix)
            text, back = text[1:], self.tokenize(text[1:], add_special=True)
        if back != ids:
            raise ServerError(f"{self.eng.base}/completions: llama-cpp-python takes text prompts only, and the prompt "
                              f"{ids[:8]} comes back as {back[:8]} after its text round trip")
        return text

    def generate(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                 gaps: bool) -> ServerGenerated:
        url = self.eng.base + "/completions"  # it has no ignore_eos: it always stops at EOS
        body = {"model": self.eng.model, "prompt": self.prompt_text(ids), "max_tokens": n, "temperature": 0,
                "logprobs": top_n, "repeat_penalty": 1.0, "stream": stream, **extra}
        g = ServerGenerated()
        texts: list[str] = []
        tops: list[dict] = []
        generated = 0  # usage.completion_tokens of a whole answer
        for part in self.parts(url, body, stream):
            choice = first_choice(url, part)
            g.text += choice.get("text") or ""
            g.finish_reason = choice.get("finish_reason") or g.finish_reason
            usage = part.get("usage") if isinstance(part, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                generated = usage["completion_tokens"]
            lp = choice.get("logprobs")
            if not lp and (stream or not choice.get("text")):
                continue  # a stream's closing event; an empty completion (EOS first)
            try:
                texts += [str(t) for t in lp["tokens"]]
                g.logprobs += [float(x) for x in lp["token_logprobs"]]
                tops += [{str(k): float(v) for k, v in d.items()} for d in lp["top_logprobs"]]
            except (KeyError, TypeError, ValueError, AttributeError):
                raise bad_shape(url, 'logprobs {"tokens": [str], "token_logprobs", "top_logprobs": '
                                     '[{str: logprob}]}', lp) from None
        hint, hint_top = self.eng.hints.get(tuple(ids), (None, None))
        if not stream:  # a stream lists a generated BOS (as an empty text); a whole answer's log-probs leave it out
            texts, tops, g.logprobs = self.restore_bos(texts, tops, g.logprobs, hint, generated - len(texts))
        # It generates past max_tokens while a UTF-8 character is incomplete (its multibyte_fix, which skips its
        # length test) and may then stop at EOS: keep the first n, which ended by length.
        if len(texts) >= n and g.finish_reason == "stop" and not extra.get("stop"):
            g.finish_reason = "length"
        texts, tops, g.logprobs = texts[:n], tops[:n], g.logprobs[:n]
        g.tokens, named_by_hint = self.ids(url, texts, hint, hint_top, g.logprobs)
        g.pieces = [t if isinstance(t, str) else "" for t in texts]
        for k, d in enumerate(tops):
            if k in named_by_hint:  # its text names no single token: its step's candidates cannot be named either
                g.top.append([])
                g.missing.append(k)
                g.logprobs[k] = math.nan
                continue
            pairs = [(g.tokens[k] if piece == texts[k] else self.id_of(piece), v)
                     for piece, v in sorted(d.items(), key=lambda kv: -kv[1])]
            g.top.append([(i, v) for i, v in pairs if i is not None][:top_n])
        return g

    def restore_bos(self, texts: list, tops: list, lps: list, hint: Sequence[int] | None,
                    dropped: int | None = None) -> tuple[list, list, list]:
        """llama-cpp-python leaves a generated BOS out of a whole completion's log-prob lists (``_create_completion``
        in ``llama_cpp/llama.py``: ``if token == bos_token_id: continue``; a stream lists it, as an empty text). Where
        the hint (the oracle's stream) has BOS at a step and the server's list, agreeing with the hint so far, names
        the hint's next token there (or ends), the BOS is put back: its id as the step's "text" (:meth:`ids`
        takes it as named), no log-probs. ``dropped``: how many tokens the answer's lists leave out (its
        ``usage.completion_tokens`` minus their length; None: not known), at most that many are put back."""
        if not hint or not texts or dropped == 0 or (dropped is not None and dropped < 0):
            return texts, tops, lps
        if self._bos is None:
            self._bos = self.tokenize("", add_special=True)
        if not self._bos:
            return texts, tops, lps
        bos = self._bos[0]
        out_t, out_top, out_lp, k = [], [], [], 0
        for j, want in enumerate(hint):
            nxt = hint[j + 1] if j + 1 < len(hint) else None
            if want == bos and (dropped is None or dropped > 0) and \
                    (k >= len(texts) or (nxt is not None and self.text_of(int(nxt)) == texts[k])):
                dropped = None if dropped is None else dropped - 1
                out_t.append(bos)
                out_top.append({})
                out_lp.append(math.nan)
                continue
            if k >= len(texts) or self.text_of(int(want)) != texts[k]:
                break  # parted from the hint: nothing more to restore
            out_t.append(texts[k])
            out_top.append(tops[k])
            out_lp.append(lps[k])
            k += 1
        return out_t + texts[k:], out_top + tops[k:], out_lp + lps[k:]

    def ids(self, url: str, texts: list, hint: Sequence[int] | None = None,
            hint_top: Sequence[Mapping[int, float]] | None = None,
            lps: Sequence[float] | None = None) -> tuple[list[int], set[int]]:
        """Token ids of generated tokens that llama-cpp-python names by text: its tokenization of the whole text when
        that gives one token per named text (each checked by detokenizing it), else one lookup per text
        (:meth:`id_of`).

        A text that is no single token (llama-cpp-python names every byte token that is not a whole UTF-8 character
        ``''``, its ``detokenize(...).decode(errors="ignore")``) is named by the oracle (``hint``: its greedy tokens
        for this prompt, ``hint_top``: its top-N ``{id: log-prob}`` at each step, :attr:`OpenAIEngine.hints`) while
        the stream agrees with the oracle's: by the oracle's greedy token when it has that text on this server, else
        by the token of the oracle's top-N there that has it (of several, the one whose oracle log-prob is nearest the
        server's own for its token, ``lps``); with none, the step is left unnamed (-1) for the greedy comparison to
        judge (a token of no name in the oracle's top-N parts from it as a fault), as is every such step after the
        stream parted from the oracle's. Returns the ids and the steps so named (or unnamed), whose log-probs cannot be
        named either; an int among ``texts`` is an id already known (a restored BOS).

        Raises:
            ServerFailure: a text that is no single token of this model, without an oracle to name it by (its
                ``step`` set): the server generated a token this client cannot name.
        """
        if texts and all(isinstance(t, str) for t in texts):
            ids = self.tokenize("".join(texts), add_special=False)
            if len(ids) == len(texts) and all(self.text_of(i) == t for i, t in zip(ids, texts)):
                return ids, set()
        out: list[int] = []
        by_hint: set[int] = set()
        for k, piece in enumerate(texts):
            if isinstance(piece, int):  # a BOS put back (:meth:`restore_bos`)
                out.append(piece)
                by_hint.add(k)
                continue
            tid = self.id_of(piece)
            if tid is None:
                if hint is None:
                    raise ServerFailure(f"{url}: llama-cpp-python names step {k}'s token only by the text {piece!r}, "
                                        f"which is no single token of this model").at(step=k)
                tid = -1
                if len(hint) > k and list(hint[:k]) == out:
                    if self.text_of(int(hint[k])) == piece:  # the oracle's own token: the likeliest by far
                        tid = int(hint[k])
                    else:  # the oracle's top-N token of that text whose log-prob is nearest the server's own
                        top = hint_top[k] if hint_top and len(hint_top) > k else {}
                        named = [int(t) for t in top if self.text_of(int(t)) == piece]
                        mine = lps[k] if lps is not None and k < len(lps) else math.nan
                        if len(named) > 1 and mine == mine:
                            named = [min(named, key=lambda t: abs(top[t] - mine))]
                        tid = named[0] if len(named) == 1 else -1
                by_hint.add(k)
            out.append(tid)
        return out, by_hint

    def text_of(self, tid: int) -> str:
        """The text llama-cpp-python gives token ``tid`` in a completion's log-probs: its detokenization; for a token
        whose bytes are no whole UTF-8 text, which ``/extras/detokenize`` refuses (HTTP 500, "codec can't decode"),
        what its completions show, the bytes decoded with ``errors="ignore"`` (the empty text for a lone byte)."""
        if tid not in self._id_text:
            try:
                self._id_text[tid] = self.detokenize([tid])
            except ServerFailure as e:
                if "codec can't decode" not in str(e):
                    raise
                self._id_text[tid] = ""
        return self._id_text[tid]

    def id_of(self, piece: str) -> int | None:
        """The one token id whose text is ``piece``, checked back on the server (its detokenization of the id is
        ``piece``): its tokenizer's id for the text, else the one vocabulary entry of the model file that renders as
        that text (:meth:`_vocab_texts`: a tokenizer need not produce every piece from text, SentencePiece merges
        reach only pieces whose prefixes are pieces); None when neither names it (a text of several tokens, or one
        that several tokens share, such as the empty text of byte tokens)."""
        if piece not in self._text_id:
            ids = self.tokenize(piece, add_special=False) if piece else []
            tid = ids[0] if len(ids) == 1 and self.text_of(ids[0]) == piece else None
            if tid is None and piece:
                cand = self._vocab_texts().get(piece)
                tid = cand if cand is not None and self.text_of(cand) == piece else None
            self._text_id[piece] = tid
        return self._text_id[piece]

    def _vocab_texts(self) -> dict[str, int]:
        """Text -> id for every token of the model file (a GGUF) whose text, as llama.cpp renders one token without
        specials (a normal piece with ``▁`` as a space, a byte token's byte where it is a whole UTF-8 character; a
        user-defined piece as it is), is non-empty and no other token's; empty for another model form. Read once,
        under a lock: a request in flight that asks while another reads it waits for the whole table."""
        with self._texts_lock:
            if self._texts is None:
                self._texts = self._read_vocab_texts()
        return self._texts

    def _read_vocab_texts(self) -> dict[str, int]:
        """:meth:`_vocab_texts`, read from the model file."""
        path = getattr(self.eng, "path", None)
        if path is None or not str(path).endswith(".gguf"):
            return {}
        try:
            tok = tokenizer_from_gguf(path)
        except InputError:
            return {}
        seen: dict[str, int | None] = {}
        for i, (t, ty) in enumerate(zip(tok.tokens, tok.types)):
            if ty == NORMAL:
                text = t.replace("\u2581", " ")
            elif ty == BYTE and len(t) == 6 and t.startswith("<0x"):
                text = bytes([int(t[3:5], 16)]).decode("utf-8", "ignore")
            elif ty == USER_DEFINED:
                text = t
            else:
                continue
            if text:
                seen[text] = None if text in seen else i
        return {k: v for k, v in seen.items() if v is not None}

    def prompt_logprobs(self, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        url = self.eng.base + "/completions"
        ans = self.eng.http.call(url, {"model": self.eng.model, "prompt": self.prompt_text(ids), "max_tokens": 1,
                                       "temperature": 0, "logprobs": top_n, "echo": True, "repeat_penalty": 1.0})
        lp = first_choice(url, ans).get("logprobs") or {}
        try:
            token_lp, tops = lp["token_logprobs"], lp["top_logprobs"]
        except (KeyError, TypeError):
            raise bad_shape(url, 'logprobs {"token_logprobs", "top_logprobs"}', lp) from None
        # The echo lists the prompt without a leading BOS (its first entry null), then the generated tokens: one,
        # or more where the first ends inside a UTF-8 character (its multibyte_fix), as usage.completion_tokens says;
        usage = ans.get("usage") if isinstance(ans, dict) else None
        # None generated where the first token is an end-of-generation one: it stops there without listing it.
        generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
        generated = generated if isinstance(generated, int) and generated >= 0 else 1
        skip = len(ids) - (len(token_lp) - generated)
        if skip not in (0, 1):
            raise bad_shape(url, f"{len(ids) - 1} or {len(ids)} prompt entries and {generated} generated",
                            f"{len(token_lp)} entries")
        out = [None] * (skip + 1)
        for k in range(skip + 1, len(ids)):
            d = tops[k - skip] or {}
            pairs = [(ids[k] if p == lp["tokens"][k - skip] else self.id_of(p), v)
                     for p, v in sorted(d.items(), key=lambda kv: -kv[1])]
            out.append((float(token_lp[k - skip]), [(i, float(v)) for i, v in pairs if i is not None][:top_n]))
        return out


"""The generic OpenAI dialect (``openai``): any server of OpenAI's ``POST /v1/completions`` that none of the others
names (transformers serve among them), judged on what that API promises.

A prompt goes as text with OpenAI's own fields only (:meth:`Generic.prompt_text`, made and checked with our
tokenizer: the API has no tokenizer endpoint); text comes back, its tokens named by the oracle's
(:meth:`Generic.ids`); no log-probs, no tokenizer. What it answers is in ``docs/server-dialects.md``.
"""

from __future__ import annotations

import codecs
import math
from typing import Mapping, Sequence

from gemma4_harness.reference.tokenizer import BYTE, NORMAL, USER_DEFINED

from .dialect import Dialect, ServerGenerated, first_choice
from .http import ServerError, ServerFailure, bad_shape


class Generic(Dialect):
    """The generic OpenAI dialect, as :class:`~harness.engines.openai.dialect.Dialect` describes a dialect."""

    name = "openai"
    text_only = True
    model_list_optional = True  # transformers serve lists only its hub cache (a 500 without one)
    no_logprobs = ("the generic OpenAI dialect reads no log-probabilities (OpenAI's completions API returns "
                   "text; transformers serve ignores logprobs): tokens only, named by the text")

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        raise ServerError(f"{self.eng.root}: the generic OpenAI dialect has no tokenizer endpoint")

    def detokenize(self, ids: list[int]) -> str:
        raise ServerError(f"{self.eng.root}: the generic OpenAI dialect has no detokenizer endpoint")

    def prompt_logprobs(self, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        raise ServerError(f"{self.eng.root}: the generic OpenAI dialect reads no prompt log-probabilities")

    def piece_bytes(self, tid: int) -> bytes:
        """The bytes a server's text holds for token ``tid`` (a byte token's byte, a normal or user-defined piece with
        ``▁`` as a space); empty for the others (control tokens: a server decodes with ``skip_special_tokens``)."""
        tok = self.eng.local_tok()
        if not 0 <= tid < len(tok.tokens):
            return b""
        ty, piece = tok.types[tid], tok.tokens[tid]
        if ty == BYTE and piece.startswith("<0x") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        if ty in (NORMAL, USER_DEFINED):
            return piece.replace("\u2581", " ").encode("utf-8")
        return b""

    def prompt_text(self, ids: list[int]) -> str:
        """The text sent for prompt ``ids`` on the generic dialect: our tokenizer's text of the ids after BOS (the
        server adds BOS to a text prompt, as transformers' tokenizers and llama.cpp do), checked to encode back to
        ``ids`` with our tokenizer (the server's cannot be asked: OpenAI's API has no tokenizer endpoint).

        Raises:
            ServerError: the ids have no text that encodes back to them (``--prompts`` with ``{"text"}`` prompts).
        """
        tok = self.eng.local_tok()
        body = ids[1:] if ids and tok.bos_id is not None and ids[0] == tok.bos_id else ids
        raw = b"".join(self.piece_bytes(t) for t in body)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or tok.encode(text, add_bos=ids[:1] == [tok.bos_id], parse_special=True) != ids:
            raise ServerError(f"{self.eng.base}/completions: the generic OpenAI dialect takes text prompts only, and "
                              f"the prompt {ids[:8]} has no text that our tokenizer turns back into it (give text "
                              "prompts: --prompts FILE with {\"text\": ...} lines)")
        return text

    def generate(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                 gaps: bool) -> ServerGenerated:
        """OpenAI's ``POST /v1/completions`` with a text prompt and only the fields OpenAI defines (transformers
        serve answers 422 to any other): greedy is ``temperature`` 0; the answer is text, and its tokens are named
        by the oracle (:meth:`ids`). No log-probs are read (transformers serve ignores ``logprobs``)."""
        url = self.eng.base + "/completions"
        body = {**({"model": self.eng.model} if self.eng.model is not None else {}), "prompt": self.prompt_text(ids),
                "max_tokens": n, "temperature": 0, "stream": stream, **extra}
        g = ServerGenerated()
        count = None
        for part in self.parts(url, body, stream):
            if isinstance(part, dict) and "error" in part and "choices" not in part:  # an error event mid-stream
                err = part["error"]
                msg = " ".join(str(err.get("message") if isinstance(err, dict) else err).split())[:300]
                if stream and gaps:  # the stream check judges it against the answer without streaming
                    g.stream_error = msg
                    break
                raise ServerFailure(f"{url}: the {'stream' if stream else 'answer'} carries an error instead of "
                                    f"choices: {msg}").at(last_error=msg)
            choice = first_choice(url, part)
            text = choice.get("text")
            if text is not None and not isinstance(text, str):
                raise bad_shape(url, '{"choices": [{"text": str, "finish_reason"}]}', part)
            g.text += text or ""
            g.finish_reason = choice.get("finish_reason") or g.finish_reason
            usage = part.get("usage") if isinstance(part, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                count = usage["completion_tokens"]
        hint, hint_top = self.eng.hints.get(tuple(ids), (None, None))
        g.tokens = self.ids(g.text, n, count, g.finish_reason, hint, hint_top)
        g.logprobs = [math.nan] * len(g.tokens)
        g.top = [[] for _ in g.tokens]
        g.missing = list(range(len(g.tokens)))
        return g

    def ids(self, text: str, n: int, count: int | None, finish: str | None, hint: Sequence[int] | None,
            hint_top: Sequence[Mapping[int, float]] | None) -> list[int]:
        """Token ids of a generated ``text`` on the generic dialect (OpenAI's API returns text, not ids): step by
        step, the oracle's token (``hint``) while its text agrees with the server's (:func:`_text_agrees`), else the
        first of the oracle's top-N there (best first) whose text does; the first step none explains is -1 (unknown:
        the greedy comparison fails it, as a token outside the oracle's top-N). Control tokens render as nothing (a
        server decodes with ``skip_special_tokens``).

        A ``stop`` ends where the text is explained (the end-of-generation token is appended after:
        :meth:`OpenAIEngine._end_with_eog`); a ``length`` finish has ``min(n, count)`` steps (``count``: the server's
        ``usage.completion_tokens``), those the text does not explain -1. Without a hint every step is -1."""
        total = (min(n, count) if count is not None else n) if finish == "length" else None
        out: list[int] = []
        raw = b""
        explained = text == ""
        while len(out) < n and not (total is None and explained) and not (total is not None and len(out) >= total):
            k = len(out)
            if not hint or k >= len(hint):
                break
            top = hint_top[k] if hint_top and k < len(hint_top) else {}
            cands = [int(hint[k])] + [int(t) for t in sorted(top, key=lambda t: -top[t]) if int(t) != int(hint[k])]
            got = next((c for c in cands if c not in self.eng.eog_ids  # an end-of-generation id is the stop, not text
                        and _text_agrees(raw + self.piece_bytes(c), text)), None)
            if got is None:
                break
            out.append(got)
            raw += self.piece_bytes(got)
            explained = _text_agrees(raw, text, whole=True)
        if not explained:
            out.append(-1)  # the step where the text parts from every candidate (or no oracle to name it by)
        if total is not None:
            out += [-1] * (total - len(out))
        return out[:n]


def _text_agrees(raw: bytes, text: str, whole: bool = False) -> bool:
    """Whether ``raw`` (the bytes of some tokens) may begin ``text`` (a server's decoded generation), or be all of it
    (``whole``). Decoders differ on bytes that are no whole UTF-8 character: Python's ``errors="replace"`` gives one
    U+FFFD per bad sequence, HF tokenizers' ``ByteFallback`` a U+FFFD for every byte of a run of byte tokens that is
    not valid UTF-8 as a whole (seen on transformers serve: the valid ``_`` and ``9`` of such a run shown as U+FFFD).
    So a U+FFFD of the server's stands for any one character of ours; bytes of an unfinished character at the end of
    ``raw`` must begin the server's next character (or a U+FFFD) there."""
    def like(ours: str) -> bool:
        return len(ours) <= len(text) and all(a == b or b == "\ufffd" for a, b in zip(ours, text))

    if whole:  # the end of the text: an unfinished character there was decoded as U+FFFD
        ours = raw.decode("utf-8", "replace")
        return like(ours) and len(ours) == len(text)
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    ours = dec.decode(raw, final=False)
    pending = dec.getstate()[0]
    if not like(ours):
        return False
    nxt = text[len(ours):len(ours) + 1]
    return not pending or (bool(nxt) and (nxt == "\ufffd" or nxt.encode("utf-8").startswith(pending)))


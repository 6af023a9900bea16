"""llama-server's dialect (llama.cpp's ``tools/server``): ``POST /completion`` with the prompt as token ids,
``n_probs`` and ``return_tokens``; ``/tokenize``, ``/detokenize``, ``/apply-template``; no prompt log-probs.

It reports a step's log-probs only once the generated text ends in complete UTF-8 (its ``validate_utf8``): the other
steps get an empty ``top`` entry, placed by replaying that rule over the token pieces (:meth:`LlamaServer.place`).
What it answers is in ``docs/server-dialects.md``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .dialect import Dialect, ServerGenerated, int_list, text_field
from .http import ServerError, ServerFailure, bad_shape


def utf8_cut(text: bytes) -> bool:
    """True when ``text`` ends inside a multi-byte UTF-8 character, by llama-server's own test (``validate_utf8``
    in ``tools/server/server-common.cpp``: a lead byte among the last 4 with fewer bytes after it than it needs)."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if ((c & 0xE0) == 0xC0 and i < 2) or ((c & 0xF0) == 0xE0 and i < 3) or ((c & 0xF8) == 0xF0 and i < 4):
            return True
    return False



class LlamaServer(Dialect):
    """llama-server, as :class:`~harness.engines.openai.dialect.Dialect` describes a dialect.

    Attributes:
        pieces: token id -> its text's bytes, learnt from the log-prob entries' candidates (or the whole vocabulary
            at once, :meth:`learn_pieces`) where a step must be placed.
    """

    name = "llama-server"
    probes_prompt_logprobs = True
    names_its_stop = True

    def __init__(self, eng: Any) -> None:
        super().__init__(eng)
        self.pieces: dict[int, bytes] = {}

    context_said = "/props n_ctx"

    def context(self) -> int | None:
        """``GET /props``' ``default_generation_settings.n_ctx``: the context of one slot (``server_context::
        n_ctx_slot`` in ``tools/server/server-context.cpp``: ``llama_n_ctx_seq``, which is ``-c`` divided by
        ``--parallel`` unless ``--kv-unified``, capped by the model's training context); a request whose prompt
        fills it is refused (HTTP 400, "exceeds the available context size"). None where it is not a positive
        integer, or ``/props`` answers an HTTP error (a server that does not say)."""
        try:
            ans = self.eng.http.call(self.eng.root + "/props")
        except ServerError as e:
            if "HTTP " not in str(e):
                raise  # down or silent: not a server this client can use
            return None
        settings = ans.get("default_generation_settings") if isinstance(ans, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        return n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else None

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        url = self.eng.root + "/tokenize"
        body = {"content": text, "add_special": add_special, "parse_special": True}
        return int_list(url, self.eng.http.call(url, body), "tokens")

    def detokenize(self, ids: list[int]) -> str:
        url = self.eng.root + "/detokenize"
        return text_field(url, self.eng.http.call(url, {"tokens": ids}), "content")

    def apply_template(self, messages: Sequence[dict[str, str]]) -> str:
        url = self.eng.root + "/apply-template"
        return text_field(url, self.eng.http.call(url, {"messages": list(messages)}), "prompt")

    def chat_ids(self, messages: Sequence[dict[str, str]], kwargs: dict) -> tuple[list[int], str | None]:
        """``/apply-template`` (which drops a leading BOS text when its tokenizer adds BOS), then ``/tokenize`` of that
        text with BOS added, as its chat endpoint does."""
        url = self.eng.root + "/apply-template"
        prompt = text_field(url, self.eng.http.call(url, {"messages": list(messages), **kwargs}), "prompt")
        return self.tokenize(prompt, add_special=True), prompt

    def prompt_logprobs(self, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        raise ServerError(f"{self.eng.root}: llama-server returns no prompt log-probabilities (/v1/completions "
                          "ignores echo; /completion reports generated tokens only)")

    def generate(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                 gaps: bool) -> ServerGenerated:
        url = self.eng.root + "/completion"
        body = {"prompt": ids, "n_predict": n, "n_probs": top_n, "temperature": 0, "return_tokens": True,
                "ignore_eos": ignore_eos, "stream": stream, **extra,
                "cache_prompt": False}  # no reuse: a request's numbers must not depend on what its slot held
        g = ServerGenerated()
        if stream:
            placed: dict[int, dict] = {}
            for part in self.eng.http.stream(url, body):
                if not isinstance(part, dict):
                    raise bad_shape(url, "a JSON object per event", part)
                g.text += part.get("content") or ""
                for step in part.get("completion_probabilities") or []:
                    placed[int(part.get("tokens_predicted", 0)) - 1] = step
                if part.get("stop"):
                    g.finish_reason = "stop" if part.get("stop_type") in ("eos", "word") else "length"
                    n = int(part.get("tokens_predicted", n))
            left_out = [i for i in range(n) if i not in placed]
            if left_out and not gaps:
                raise ServerError(f"{url}: the stream left out steps {left_out[:8]} (llama-server sends a step only "
                                  f"once the text is complete UTF-8) and with them their token ids; use stream=False")
            steps: list[dict | None] = [placed.get(i) for i in range(n)]
            g.tokens = [-1 if s is None else _entry_id(url, s) for s in steps]
        else:
            ans = self.eng.http.call(url, body)
            tokens = ans.get("tokens") if isinstance(ans, dict) else None
            entries = ans.get("completion_probabilities", []) if isinstance(ans, dict) else None  # absent when none
            if not isinstance(tokens, list) or not isinstance(entries, list) or \
                    len(tokens) != ans.get("tokens_predicted"):
                raise bad_shape(url, '{"tokens": [...] (return_tokens was sent), "tokens_predicted", '
                                     '"completion_probabilities": [...]}', ans)
            g.tokens = [int(t) for t in tokens]
            g.text = ans.get("content") or ""
            g.finish_reason = "stop" if ans.get("stop_type") in ("eos", "word") else "length"
            steps = self.place(url, g.tokens, entries)
        for i, step in enumerate(steps):
            if step is None:
                g.missing.append(i)
                g.logprobs.append(math.nan)
                g.top.append([])
                continue
            try:
                g.logprobs.append(float(step["logprob"]))
                g.top.append([(int(c["id"]), float(c["logprob"])) for c in step["top_logprobs"]])
            except (KeyError, TypeError, ValueError):
                raise bad_shape(url, 'completion_probabilities [{"id", "logprob", "top_logprobs": '
                                     '[{"id", "logprob"}]}]', step) from None
        return g

    def place(self, url: str, tokens: list[int], entries: list[Any]) -> list[dict | None]:
        """llama-server's log-prob entries placed at their steps (None where it reported nothing).

        It appends an entry only when the generated text so far ends in complete UTF-8 (:func:`utf8_cut`);
        replaying that rule over the tokens' texts (their bytes, from the entries' candidates, or from the
        whole vocabulary once: :meth:`learn_pieces`) says which steps the entries belong to.

        Raises:
            ServerFailure: the entries do not fit the tokens under that rule.
        """
        ids = [_entry_id(url, e) for e in entries]
        if ids == tokens:
            return list(entries)
        if not entries:  # a server that reports no log-probs (tokens only): every step without
            return [None] * len(tokens)
        for e in entries:
            for c in e.get("top_logprobs") or []:
                if isinstance(c, dict) and isinstance(c.get("bytes"), list):
                    self.pieces.setdefault(int(c["id"]), bytes(c["bytes"]))
        if any(t not in self.pieces for t in tokens):
            self.learn_pieces()
        out: list[dict | None] = []
        text, k = b"", 0
        for t in tokens:
            if t not in self.pieces:
                raise ServerFailure(f"{url}: token {t} has no text in the vocabulary llama-server reported")
            text += self.pieces[t]
            if not utf8_cut(text) and k < len(entries):
                if ids[k] != t:
                    break
                out.append(entries[k])
                k += 1
            else:
                out.append(None)
        if k != len(entries) or len(out) != len(tokens):
            raise ServerFailure(f"{url}: {len(entries)} log-prob entries (ids {ids[:6]}) do not fit the {len(tokens)} "
                                f"tokens {tokens[:6]} under llama-server's complete-UTF-8 rule")
        return out

    def learn_pieces(self) -> None:
        """The bytes of every token's text, from one request: one forced greedy step (``logit_bias``) whose
        ``top_logprobs`` list the whole vocabulary (``n_probs`` = ``n_vocab`` from ``/v1/models``)."""
        url = self.eng.root + "/completion"
        try:
            n_vocab = int(self.eng.model_list["data"][0]["meta"]["n_vocab"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise bad_shape(self.eng.base + "/models", 'data[0].meta.n_vocab', self.eng.model_list) from None
        a = self.tokenize("a", add_special=False)[-1]  # any token whose text is complete UTF-8
        ans = self.eng.http.call(url, {"prompt": [a], "n_predict": 1, "n_probs": n_vocab, "temperature": 0,
                                       "logit_bias": [[a, 1000.0]], "return_tokens": True})
        try:
            for c in ans["completion_probabilities"][0]["top_logprobs"]:
                self.pieces[int(c["id"])] = bytes(c["bytes"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise bad_shape(url, "one step with n_vocab top_logprobs carrying bytes", ans) from None


def _entry_id(url: str, entry: Any) -> int:
    try:
        return int(entry["id"])
    except (KeyError, TypeError, ValueError):
        raise bad_shape(url, 'completion_probabilities [{"id", "logprob", "top_logprobs"}]', entry) from None

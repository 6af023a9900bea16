"""vLLM's dialect (written to its documented API, not run here): ``POST /v1/completions`` with token ids,
``return_tokens_as_token_ids`` (tokens named ``token_id:N``), ``ignore_eos``; prompt log-probs through
``prompt_logprobs``; ``/tokenize``, ``/detokenize``. What it answers is in ``docs/server-dialects.md``.
"""

from __future__ import annotations

from typing import Sequence

from .dialect import Dialect, ServerGenerated, first_choice, int_list, text_field
from .http import bad_shape


class Vllm(Dialect):
    """vLLM, as :class:`~harness.engines.openai.dialect.Dialect` describes a dialect."""

    name = "vllm"
    offers_prompt_logprobs = True
    names_its_stop = True

    context_said = "/v1/models max_model_len"

    def context(self) -> int | None:
        """``GET /v1/models``' ``max_model_len`` of the model served (its entry whose ``id`` is the model sent, else
        the first): the most tokens a request may hold, prompt and completion together (``ModelCard.max_model_len``
        in ``vllm/entrypoints/openai/protocol.py``, from ``--max-model-len``); a longer request is refused with HTTP
        400 ("This model's maximum context length is N tokens ..."). None where the list does not say (vLLM
        releases before the field) or says something other than a positive integer."""
        data = self.eng.model_list.get("data") if isinstance(self.eng.model_list, dict) else None
        cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
        card = next((c for c in cards if c.get("id") == self.eng.model), cards[0] if cards else {})
        n = card.get("max_model_len")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        url = self.eng.root + "/tokenize"
        body = {"model": self.eng.model, "prompt": text, "add_special_tokens": add_special}
        return int_list(url, self.eng.http.call(url, body), "tokens")

    def detokenize(self, ids: list[int]) -> str:
        url = self.eng.root + "/detokenize"
        return text_field(url, self.eng.http.call(url, {"model": self.eng.model, "tokens": ids}), "prompt")

    def chat_ids(self, messages: Sequence[dict[str, str]], kwargs: dict) -> tuple[list[int], str | None]:
        """``/tokenize`` with ``messages`` (documented, not run here)."""
        url = self.eng.root + "/tokenize"
        ans = self.eng.http.call(url, {"model": self.eng.model, "messages": list(messages),
                                       "add_generation_prompt": True, **kwargs})
        return int_list(url, ans, "tokens"), None

    def generate(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                 gaps: bool) -> ServerGenerated:
        url = self.eng.base + "/completions"
        body = {"model": self.eng.model, "prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": top_n,
                "ignore_eos": ignore_eos, "return_tokens_as_token_ids": True, "stream": stream, **extra}
        g = ServerGenerated()
        for part in self.parts(url, body, stream):
            choice = first_choice(url, part)
            g.text += choice.get("text") or ""
            g.finish_reason = choice.get("finish_reason") or g.finish_reason
            lp = choice.get("logprobs")
            if not lp and (stream or not choice.get("text")):
                continue  # a stream's closing event; an empty completion
            try:
                for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
                    g.tokens.append(_token_id(tok))
                    g.logprobs.append(float(tlp))
                    pairs = sorted(((_token_id(k), float(v)) for k, v in top.items()), key=lambda kv: (-kv[1], kv[0]))
                    g.top.append(pairs[:top_n])
            except (KeyError, TypeError, ValueError, AttributeError):
                raise bad_shape(url, 'logprobs {"tokens": ["token_id:N"], "token_logprobs", "top_logprobs": '
                                     '[{"token_id:N": logprob}]}', lp) from None
        return g

    def prompt_logprobs(self, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        url = self.eng.base + "/completions"
        ans = self.eng.http.call(url, {"model": self.eng.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                       "prompt_logprobs": top_n})
        plp = first_choice(url, ans).get("prompt_logprobs")
        if not isinstance(plp, list) or len(plp) != len(ids):
            raise bad_shape(url, f"choices[0].prompt_logprobs, a list of {len(ids)} entries", plp)
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None]
        for tid, d in zip(ids[1:], plp[1:]):
            try:
                top = sorted((int(k), float(v["logprob"]), int(v["rank"])) for k, v in d.items())
                best = [(k, lp) for k, lp, r in sorted(top, key=lambda x: x[2]) if r <= top_n]
                out.append((float(d[str(tid)]["logprob"]), best))
            except (KeyError, TypeError, ValueError, AttributeError):
                raise bad_shape(url, '{"<id>": {"logprob", "rank", "decoded_token"}}', d) from None
        return out


def _token_id(tok: str) -> int:
    """vLLM's ``token_id:123`` (``return_tokens_as_token_ids``) -> 123."""
    if not isinstance(tok, str) or not tok.startswith("token_id:"):
        raise ValueError(tok)
    return int(tok[len("token_id:"):])

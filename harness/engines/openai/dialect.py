"""What every server dialect of the ``openai`` engine shares: the answer (:class:`ServerGenerated`), the dialect's
outline (:class:`Dialect`) and the readers of the JSON shapes more than one dialect answers with.

Each dialect is one class in its own module (:mod:`.llama_server`, :mod:`.llama_cpp_python`, :mod:`.vllm`,
:mod:`.generic`): what it sends, how it reads tokens and log-probs back, what it offers besides generation. The
engine (:class:`~harness.engines.openai.OpenAIEngine`) holds one of them, made for the dialect it found, and hands it
every request; what is the same on every server (the greedy and length checks, the end of a generation) stays there.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..base import Generated
from .http import ServerError, bad_shape


class ServerGenerated(Generated):
    """One greedy continuation from a server.

    Attributes (besides :class:`harness.engines.Generated`'s ``tokens`` and ``top``; ``top[i]`` holds the
    top-``top_n`` ``(id, logprob)`` pairs of step ``i``, best first, or ``[]`` where the server reported none):
        logprobs: per step, the log-probability of the generated token (NaN where the server reported none).
        missing: the steps the server reported no log-probs for (llama-server: text not yet complete UTF-8).
        text: the generated text as the server returned it.
        pieces: llama-cpp-python: each step's own text as its log-probs name it (the token decoded alone, bytes
            that are no whole UTF-8 character dropped); empty for the other dialects.
        finish_reason: ``"length"`` (``max_new_tokens`` reached) or ``"stop"`` (EOS or a stop string).
        stream_error: the message of an error event that ended a stream read for the stream check (``gaps``; the
            generic dialect), the text and steps before it kept; None otherwise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[float] = []
        self.missing: list[int] = []
        self.text = ""
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.stream_error: str | None = None


class Dialect:
    """One server dialect: the requests it takes and how its answers read back, for one engine.

    A subclass names itself (``name``, one of :data:`harness.engines.openai.DIALECTS`), states what it offers in
    the class attributes below, and fills in :meth:`generate`, :meth:`tokenize`, :meth:`detokenize` and
    :meth:`prompt_logprobs` (each raising :class:`ServerError` where the server offers no such thing). State it
    learns from the server (token texts, BOS) is kept on it for the engine's life.

    Args:
        eng: the engine it serves (:class:`~harness.engines.openai.OpenAIEngine`): its ``http``, ``root``, ``base``,
            ``model``, ``path``, ``hints``, ``model_list``, ``eog_ids`` and ``local_tok()`` are read at each request.

    Attributes:
        text_only: takes no token-id prompt (:data:`harness.engines.openai.TEXT_ONLY_DIALECTS`).
        offers_prompt_logprobs, probes_prompt_logprobs: as :class:`~harness.engines.openai.OpenAIEngine`'s.
        names_its_stop: lists the token it stopped on as the last one (llama-server, vLLM); where that is a control
            token, no end-of-generation token is put after it (:meth:`OpenAIEngine._end_with_eog`).
        model_list_optional: a failing or empty ``/v1/models`` is no error (the requests then name no model).
        no_logprobs: why no log-probabilities are read (None: they are).
    """

    name = ""
    text_only = False
    offers_prompt_logprobs = False
    probes_prompt_logprobs = False
    names_its_stop = False
    model_list_optional = False
    no_logprobs: str | None = None

    def __init__(self, eng: Any) -> None:
        self.eng = eng

    def generate(self, ids: list[int], n: int, top_n: int, stream: bool, extra: dict, ignore_eos: bool,
                 gaps: bool) -> ServerGenerated:
        """One greedy request for prompt ``ids`` (``n`` new tokens, ``top_n`` log-probs a step, ``extra`` fields such
        as ``stop``), as :meth:`OpenAIEngine.complete` describes its arguments; the answer unchecked."""
        raise NotImplementedError

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        """The server's token ids of ``text`` (:meth:`OpenAIEngine.tokenize`)."""
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        """The server's text of ``ids`` (:meth:`OpenAIEngine.detokenize`)."""
        raise NotImplementedError

    context_said = ""
    """Where :meth:`context` reads the server's context (named in a refusal: ``/props n_ctx``)."""

    def context(self) -> int | None:
        """The context a request may fill (prompt and new tokens) where the server says it, asked once while the
        server is being found out; None (the default) where it does not say (llama-cpp-python, generic)."""
        return None

    def apply_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The templated text of ``messages`` (:meth:`OpenAIEngine.apply_template`); only llama-server offers it."""
        raise ServerError(f"{self.eng.root}: {self.name} offers no endpoint that returns the templated text")

    def chat_ids(self, messages: Sequence[dict[str, str]], kwargs: dict) -> tuple[list[int], str | None]:
        """The ids of a chat request (:meth:`OpenAIEngine.chat_ids`; ``kwargs``: its ``chat_template_kwargs``)."""
        raise ServerError(f"{self.eng.root}: {self.name} offers no endpoint that renders or tokenizes a chat template")

    def prompt_logprobs(self, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """:meth:`OpenAIEngine.prompt_logprobs`, asked of the server."""
        raise NotImplementedError

    def parts(self, url: str, body: dict, stream: bool) -> Iterable[Any]:
        """The answer to ``body`` posted to ``url``: every server-sent event of a stream, else the one JSON answer."""
        return self.eng.http.stream(url, body) if stream else [self.eng.http.call(url, body)]


def text_field(url: str, ans: Any, key: str) -> str:
    if not isinstance(ans, dict) or not isinstance(ans.get(key), str):
        raise bad_shape(url, f'{{"{key}": str}}', ans)
    return ans[key]


def int_list(url: str, ans: Any, key: str) -> list[int]:
    vals = ans.get(key) if isinstance(ans, dict) else None
    if not isinstance(vals, list) or not all(isinstance(v, int) for v in vals):
        raise bad_shape(url, f'{{"{key}": [int, ...]}}', ans)
    return vals


def first_choice(url: str, ans: Any) -> dict:
    choices = ans.get("choices") if isinstance(ans, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad_shape(url, '{"choices": [{...}]}', ans)
    return choices[0]

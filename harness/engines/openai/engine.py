"""The ``openai`` engine itself: :class:`OpenAIEngine`, which finds out which server answers (:func:`detect_dialect`),
makes that dialect's object (:data:`DIALECT_CLASSES`) and hands it every request, keeping what is the same on every
server: the model name, the batch of prompts in flight, the greedy and length checks, the end of a generation, the
prompt log-probs kept per prompt.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time
from typing import Any, Callable, Mapping, Sequence

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import CONTROL, tokenizer_from_gguf

from ...core.progress import counter
from ...core.workers import EngineFailure
from ..base import TOP_N, EngineUnavailable
from ..numerics import DIALECT_NUMERICS, parse_declare
from ..numerics import declare as declare_numerics
from .dialect import Dialect, ServerGenerated
from .generic import Generic
from .http import Http, ServerContextExceeded, ServerCrashed, ServerError, ServerFailure, bad_shape
from .llama_cpp_python import LlamaCppPython
from .llama_server import LlamaServer
from .model_file import end_of_generation_ids, vocab_size
from .vllm import Vllm

DIALECT_CLASSES: dict[str, type[Dialect]] = {d.name: d for d in (LlamaServer, LlamaCppPython, Vllm, Generic)}
"""Dialect name -> its class (one module each: :mod:`.llama_server`, :mod:`.llama_cpp_python`, :mod:`.vllm`,
:mod:`.generic`)."""

DIALECTS = tuple(DIALECT_CLASSES)
"""Known dialects; ``openai`` is the generic one: any server with OpenAI's ``/v1/completions`` (transformers serve,
and every server none of the others names), judged on what that API promises (:meth:`Generic.generate`)."""

TEXT_ONLY_DIALECTS = tuple(name for name, d in DIALECT_CLASSES.items() if d.text_only)
"""Dialects that take no token-id prompt: a prompt goes as text, which must encode back to its ids
(llama-cpp-python: :meth:`LlamaCppPython.prompt_text`, through the server's own tokenizer; the generic dialect:
:meth:`Generic.prompt_text`, through ours). ``g4h parity`` without ``--prompts`` gives them its default prompt
set as text of the model's vocabulary (:func:`harness.parity.checks.server.default_text_prompts`)."""

LLAMACPP_APPROXIMATIONS = ("gelu_fp16_table", "quantized_activations")
"""What every server built on llama.cpp makes (as the ``llamacpp`` engine kind): its fp16 GELU table, and
activations rounded to the dot-product type of quantized weights; its attention numerics depend on the dialect's
defaults (:data:`harness.engines.numerics.DIALECT_NUMERICS`)."""


DOWN_HINT = ("nothing listens there: a server that is not running, or one that exited while loading its model "
             "(llama-server aborts at load on a model it cannot run, GGML_ASSERT in its log); its own log says which. "
             "g4h inspect MODEL checks the file, and g4h parity --against llamacpp runs the same llama.cpp in-process "
             "and names the assertion")
"""Said after "connection refused" before the server answered: this client did not start the server, so it cannot
read its last words; where they are and how to get them."""


def parse_url(spec: str) -> tuple[str, str]:
    """``openai:http://h:p/v1`` (or ``http://h:p/v1``, ``http://h:p``) -> (``http://h:p/v1``, ``http://h:p``).

    Raises:
        ServerError: not an http(s) URL.
    """
    url = (spec[len("openai:"):] if spec.startswith("openai:") else spec).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"{spec}: expected openai:http://HOST:PORT/v1")
    root = url[:-3] if url.endswith("/v1") else url
    return root + "/v1", root



def detect_dialect(http: Http, base: str, root: str) -> str:
    """Which server answers at ``root``: ``llama-server``, ``llama-cpp-python``, ``vllm``, else ``openai`` (the
    generic dialect) for any server whose ``/v1/models`` lists a model.

    llama-server answers ``GET /props`` with ``default_generation_settings``; llama-cpp-python and vLLM are
    FastAPI apps whose ``GET /openapi.json`` lists ``/extras/tokenize`` (llama-cpp-python) or ``/tokenize``
    and ``/version`` (vLLM); ``/v1/models``' ``owned_by`` (``llamacpp``, ``me``, ``vllm``) is the last resort.

    Raises:
        ServerError: the server is down or slow, or none of these answers says which server it is and it lists
            no model.
    """
    for path in ("/props", "/openapi.json"):
        try:
            ans = http.call(root + path)
        except ServerError as e:
            if "HTTP " not in str(e):
                raise  # down, timeout, not JSON: no point in asking further
            continue
        if not isinstance(ans, dict):
            continue
        if "default_generation_settings" in ans:
            return "llama-server"
        paths = set(ans.get("paths") or {})
        if "/extras/tokenize" in paths:
            return "llama-cpp-python"
        if {"/tokenize", "/version"} <= paths:
            return "vllm"
        if "/v1/completions" in paths:  # another FastAPI server of OpenAI's API (transformers serve)
            return "openai"
    models = http.call(base + "/models")
    data = models.get("data") if isinstance(models, dict) else None
    owners = {m.get("owned_by") for m in data or [] if isinstance(m, dict)}
    for owner, dialect in (("llamacpp", "llama-server"), ("vllm", "vllm"), ("me", "llama-cpp-python")):
        if owner in owners:
            return dialect
    if data:  # a model list in OpenAI's shape: a server of OpenAI's API, judged on what that API promises
        return "openai"
    raise ServerError(f"{root}: cannot tell which server this is (no llama-server /props, no FastAPI /openapi.json "
                      f"with llama-cpp-python or vLLM routes, /v1/models owned_by {sorted(map(str, owners))})")


class OpenAIEngine:
    """A model served over HTTP, driven greedily, token ids in and out.

    Built by :func:`harness.engines.make_engine` for the name ``openai:URL`` as ``OpenAIEngine(URL, model_path,
    server_model=..., server_timeout=...)``.

    Args:
        url: ``http://HOST:PORT/v1`` (``openai:`` and ``/v1`` optional).
        path: the model file the harness compares with; the server holds its own copy, so it is not read here.
        model: the model name to send (default: the first entry of ``GET /v1/models``); ``server_model`` is the
            same (``--server-model``).
        timeout: seconds allowed for connecting and for each read of one request; ``server_timeout`` is the same
            (``--server-timeout``, default 120).
        concurrency: requests in flight at once in :meth:`generate_full` (default 1: each prompt alone).
        dialect: skip detection and assume this one (one of :data:`DIALECTS`).
        check_greedy: :meth:`generate_full` raises on a step whose token is not the top-1 of the server's own
            log-probs (False where gates judge that instead: ``g4h parity``).
        declare: ``--declare KEY=VALUE`` items (or their parsed form, :func:`harness.engines.numerics.parse_declare`)
            that replace the dialect's default numerics: ``dtype=``, ``kv_cache=``, ``approximations=``.
        local_tokenizer: ``path -> tokenizer`` of the model, with which the generic dialect makes and checks its text
            prompts (:meth:`local_tok`; None: a GGUF's own vocabulary, and an HF folder cannot be used there). An
            argument, not a registration: :func:`harness.tokenizer.prompt_ids.model_tokenizer` lives in a sibling
            layer, and the callers above pass it (parity's pairs, the ``g4h`` commands).

    Attributes:
        path: ``path`` as given.
        dialect: the dialect's name (one of :data:`DIALECTS`).
        server: the dialect's object (:data:`DIALECT_CLASSES`), which every request goes through.
        model_list: the answer of ``GET /v1/models``.
        name: ``openai:URL (dialect, model 'NAME')``, as reports show it.
        ops: ``("generate",)``: no logits, no trace points.
        numerics: what the server computes (:class:`harness.engines.numerics.Numerics`): its dialect's defaults
            (:data:`harness.engines.numerics.DIALECT_NUMERICS`: llama-server with an f16 KV cache and flash
            attention, llama-cpp-python with an f16 KV cache, vLLM in bfloat16), or as declared.
        approximations, dtype: ``numerics.approximations``, ``numerics.dtype``.
        hints: prompt ids -> the oracle's greedy tokens and per step its top-N ``{id: log-prob}``, set by the parity
            job: llama-cpp-python names byte tokens by an empty text, and such a step is named by the oracle's token
            of that text there (:meth:`LlamaCppPython.ids`), and the generic dialect names every token so
            (:meth:`Generic.ids`); nothing else reads them.
        answers: ``(ids, max_new_tokens, top_n) -> (ServerGenerated, seconds)`` of every prompt
            :meth:`generate_full` sent (the server checks reuse them as the answers "sent alone").
        offers_prompt_logprobs: whether :meth:`prompt_logprobs` can answer (vLLM, llama-cpp-python); its answers are
            kept, so the pair check and ``server.prompt_logprobs`` send one request per prompt.
        probes_prompt_logprobs: whether :meth:`prefix_logprobs` stands in for it (llama-server: ids in, top-N of
            each generated step out, nothing for the prompt).
        context: the context a request may fill (prompt and new tokens), in tokens, where the server says it
            (:meth:`Dialect.context`: llama-server's ``/props``, per slot; vLLM's ``/v1/models``), else None;
            ``g4h parity`` judges the prompts against it before any reference work. A request past it that the
            server refuses with HTTP 400 is :class:`ServerContextExceeded` (exit 2).

    Raises:
        ServerError: the server is down, slow, answers an error or an unexpected shape, or is no known dialect
            (before it served anything: the URL cannot be used). Later requests raise :class:`ServerFailure`.
    """

    ops = ("generate",)

    def __init__(self, url: str, path: Any = None, model: str | None = None, timeout: float = 120.0,
                 concurrency: int = 1, dialect: str | None = None, check_greedy: bool = True,
                 server_model: str | None = None, server_timeout: float | None = None,
                 declare: Sequence[str] | Mapping[str, Any] | None = None,
                 local_tokenizer: Callable[[Any], Any] | None = None) -> None:
        self.base, self.root = parse_url(url)
        self.local_tokenizer = local_tokenizer
        said = declare if isinstance(declare, Mapping) else parse_declare(declare or ())  # bad input before any request
        self.http = Http(float(server_timeout) if server_timeout is not None else timeout)
        self.concurrency = max(1, int(concurrency))
        self.check_greedy = check_greedy
        self.path = path
        if dialect is not None and dialect not in DIALECTS:
            raise ServerError(f"{self.root}: unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
        try:
            self.dialect = dialect or detect_dialect(self.http, self.base, self.root)
            self.server = DIALECT_CLASSES[self.dialect](self)
            try:
                self.model_list = self.http.call(self.base + "/models")
            except ServerError as e:
                if not self.server.model_list_optional or "HTTP " not in str(e):
                    raise
                self.model_list = {"error": str(e)}  # transformers serve lists only its hub cache (a 500 without one)
            self.model = server_model or model or self._model_name()
            self.context = self.server.context()
        except EngineFailure as e:  # an answer of another shape before it served: not a server this client can use
            raise ServerError(str(e)) from None
        except ServerError as e:
            if "connection refused" not in str(e):
                raise
            raise ServerError(f"{e}: {DOWN_HINT}") from None
        self.http.serving = True  # from here on, a failing request is the server's fault
        self._check_vocabulary()
        self.name = f"openai:{self.base} ({self.dialect}, model {self.model!r})"
        self.no_logprobs = self.server.no_logprobs
        self.numerics = declare_numerics(DIALECT_NUMERICS[self.dialect], said)
        self.approximations = self.numerics.approximations
        self.dtype = self.numerics.dtype
        self.answers: dict[tuple[tuple[int, ...], int, int], tuple[ServerGenerated, float]] = {}
        self.offers_prompt_logprobs = self.server.offers_prompt_logprobs
        self.probes_prompt_logprobs = self.server.probes_prompt_logprobs
        self._prompt_lp: dict[tuple[tuple[int, ...], int], list[tuple[float, list[tuple[int, float]]] | None]] = {}
        self.hints: dict[tuple[int, ...], tuple[list[int], list[dict[int, float]]]] = {}  # naming only (see above)

    def _model_name(self) -> str | None:
        """The first model ``/v1/models`` lists; on the generic dialect, None where it lists none (the requests then
        name no model, which a server of one model takes: transformers serve with a model given on its command line
        lists only its hub cache)."""
        data = self.model_list.get("data") if isinstance(self.model_list, dict) else None
        if not data and self.server.model_list_optional:
            return None
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise bad_shape(self.base + "/models", '{"data": [{"id": str, ...}, ...]}', self.model_list)
        return data[0]["id"]

    def _check_vocabulary(self) -> None:
        """The server's vocabulary against the model file's, where the server states it (llama-server's
        ``/v1/models`` ``data[0].meta.n_vocab``): another size means it serves another model.

        Raises:
            ServerFailure: the sizes differ (both named): exit 1, the engine under test does not run this model.
        """
        try:
            theirs = int(self.model_list["data"][0]["meta"]["n_vocab"])
        except (KeyError, IndexError, TypeError, ValueError):
            return
        ours = vocab_size(self.path)
        if ours is not None and ours != theirs:
            raise ServerFailure(f"{self.base}/models: the server's model has a vocabulary of {theirs} tokens "
                                f"(meta.n_vocab), {self.path} one of {ours}: it serves another model")

    def logits(self, ids: Sequence[int], trace: Any = None) -> Any:
        """Impossible: a completion server returns the top-N log-probabilities of the tokens it generates, never
        the logits of every position, and exposes no trace points.

        Raises:
            EngineUnavailable: always (one line; exit 2 on the command line).
        """
        what = "trace points" if trace is not None else "the logits of every position"
        raise EngineUnavailable(f"openai:{self.base}: a completion server returns no {what} (only the top-N "
                                "log-probabilities of generated tokens); use g4h generate, or g4h parity --against")

    # ------------------------------------------------------------------ tokens and templates

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The server's token ids of ``text`` (special-token text parsed); ``add_special`` adds BOS as the model does.

        llama-cpp-python's ``/extras/tokenize`` always adds BOS: without ``add_special`` that BOS is dropped.
        """
        return self.server.tokenize(text, add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The server's text of ``ids``."""
        ids = [int(t) for t in ids]
        return self.server.detokenize(ids)

    def apply_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The server's chat template applied to ``messages`` (``[{"role", "content"}, ...]``), generation prompt added.

        Raises:
            ServerError: the dialect offers no such endpoint (only llama-server's ``/apply-template`` does).
        """
        return self.server.apply_template(messages)

    def chat_ids(self, messages: Sequence[dict[str, str]],
                 enable_thinking: bool = False) -> tuple[list[int], str | None]:
        """The token ids the server evaluates for a chat request of ``messages`` (generation prompt added), and the
        templated text where the server shows it.

        ``enable_thinking`` goes as ``chat_template_kwargs`` (llama-server turns thinking on by default for a template
        that supports it). llama-server: ``/apply-template`` (which drops a leading BOS text when its tokenizer adds
        BOS), then ``/tokenize`` of that text with BOS added, as its chat endpoint does. vLLM: ``/tokenize`` with
        ``messages`` (documented, not run here).

        Raises:
            ServerError: the dialect offers no such endpoint (llama-cpp-python). ServerFailure: an answer of another
                shape.
        """
        kwargs = {"chat_template_kwargs": {"enable_thinking": bool(enable_thinking)}}
        return self.server.chat_ids(messages, kwargs)

    # ------------------------------------------------------------------ generation

    def generate_full(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_n: int = TOP_N,
                      stream: bool = False) -> list[ServerGenerated]:
        """Greedy continuations (temperature 0) with the top-``top_n`` ``(id, logprob)`` of every step.

        Up to ``concurrency`` requests are in flight at once; results come back in the prompts' order, and are
        kept in :attr:`answers` (not streamed ones).
        Every dialect stops at an end-of-generation token (``finish_reason == "stop"``, fewer tokens, the last one
        that token's id: :meth:`_end_with_eog`), as the model would: asking a server to ignore EOS gives no greedy
        stream (llama-server bans the token but reports the raw log-probs). ``stream``: read the answer as
        server-sent events.

        Raises:
            ServerFailure: a request failed or answered an unexpected shape; a step's token is not the top-1 of
                the server's own log-probs (a greedy server never does that); fewer tokens than ``max_new_tokens``
                without a stop (or more). The prompt's place is its ``index``, the step its ``step`` where known.
            ServerError: a prompt cannot be sent as the dialect needs (llama-cpp-python: ids that do not survive
                its text round trip); llama-server streamed without steps whose token ids it does not send.
        """
        if max_new_tokens <= 0 or not prompts:
            return [ServerGenerated() for _ in prompts]
        args = [[int(t) for t in p] for p in prompts]

        def one(k: int) -> ServerGenerated:
            t0 = time.monotonic()
            try:
                g = self.complete(args[k], max_new_tokens, top_n, stream=stream)
            except EngineFailure as e:
                raise e.at(index=k, step=0 if isinstance(e, ServerCrashed) else None)
            if not stream:
                self.answers[(tuple(args[k]), int(max_new_tokens), int(top_n))] = (g, time.monotonic() - t0)
            sent.step()
            return g

        with counter(f"{self.dialect} requests", len(args)) as sent, \
                cf.ThreadPoolExecutor(min(self.concurrency, len(args))) as ex:
            out = list(ex.map(one, range(len(args))))
        for k, g in enumerate(out):
            if len(g.tokens) > max_new_tokens or (len(g.tokens) < max_new_tokens and g.finish_reason != "stop"):
                raise ServerFailure(f"{self.base}: prompt {k}: {len(g.tokens)} tokens where {max_new_tokens} were "
                                    f"asked (finish_reason {g.finish_reason!r}, not a stop)").at(
                    index=k, step=min(len(g.tokens), max_new_tokens), partial=list(g.tokens))
        if self.check_greedy:
            for k, g in enumerate(out):
                try:
                    _check_greedy(self.base, k, g, self.eog_ids)
                except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
                    raise ServerFailure(f"{self.base}: prompt {k}: log-probs the {self.dialect} dialect cannot read "
                                        f"({type(e).__name__}: {str(e)[:200]})").at(index=k) from None
        return out

    def complete(self, ids: Sequence[int], max_new_tokens: int, top_n: int = TOP_N, *, stream: bool = False,
                 stop: Sequence[str] | None = None, ignore_eos: bool = False, gaps: bool = False) -> ServerGenerated:
        """One greedy request (temperature 0), as the dialect takes it; no check of the answer against itself.

        Args:
            ids: the prompt's token ids (BOS included where the model wants one).
            max_new_tokens: ``max_tokens`` / ``n_predict``.
            top_n: log-probabilities per step (0: none asked; llama-server then reports no steps).
            stream: read the answer as server-sent events.
            stop: stop strings (the text is cut before the first one; ``finish_reason`` ``stop``).
            ignore_eos: generate past EOS (llama-server, vLLM; llama-server bans the end-of-generation ids with a
                -inf bias but reports the log-probs of the raw logits, where they may stay the top-1). False (the
                default, as users run servers): stop there (``finish_reason`` ``stop``), the stream ending with the
                end-of-generation id (:meth:`_end_with_eog`). llama-cpp-python always stops at EOS.
            gaps: a stream as the stream check reads it: llama-server's steps it left out (text not yet complete
                UTF-8) get the token id -1 and are listed in ``missing``, instead of raising; on the generic dialect an
                error event ends the stream, its message in ``stream_error``, the text before it kept.

        Raises:
            ServerFailure, ServerError: as :meth:`generate_full`, except the greedy and length checks.
        """
        extra = {"stop": [str(x) for x in stop]} if stop else {}
        ids = [int(t) for t in ids]
        try:
            g = self.server.generate(ids, int(max_new_tokens), int(top_n), bool(stream), extra, bool(ignore_eos),
                                     bool(gaps))
            if not ignore_eos and not stop:
                self._end_with_eog(g, ids, int(max_new_tokens))
        except ServerContextExceeded as e:  # the prompt is longer than the server's context: named by its caller
            e.prompt_ids = ids
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
            # A reply of the right outline whose values are not what they should be (a token id "12x", a step that
            # is a string): the server broke its protocol, as with any other malformed reply (exit 1, one line).
            raise ServerFailure(f"{self.base}: a completion reply the {self.dialect} dialect cannot read "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
        return g

    @property
    def eog_ids(self) -> set[int]:
        """The ids that end a generation for the model the harness compares with (:func:`end_of_generation_ids` of
        :attr:`path`)."""
        if getattr(self, "_eog", None) is None:
            self._eog = end_of_generation_ids(self.path)
        return self._eog

    def _end_with_eog(self, g: ServerGenerated, ids: list[int], n: int) -> None:
        """A generation that stopped at an end-of-generation token ends with that token's id, as llama-server and
        vLLM return it: the dialects that leave it out (llama-cpp-python's ``_create_completion`` breaks on
        ``llama_token_is_eog`` before listing the token; a text-only server) get it appended, without log-probs
        (listed in ``missing``). Which id it was is not said: the oracle's token at that step where that is one
        (:attr:`hints`), else the end-of-generation id the oracle ranks highest there, else the smallest known one;
        the greedy comparison then judges the stop like any other token (a stop where the oracle goes on parts from
        it there). Only a ``stop`` with fewer tokens than asked is such an end (a stop string is not sent here).
        llama-server and vLLM list the token they stopped on; where that is no end-of-generation id of ours nor a
        control token (llama.cpp marks every end-of-generation token control), the stop is put after it too."""
        if g.finish_reason != "stop" or len(g.tokens) >= n:
            return
        eog = self.eog_ids
        if g.tokens and g.tokens[-1] in eog:
            return
        if self.server.names_its_stop and g.tokens and self._is_control(g.tokens[-1]):
            return  # it listed the token it stopped on: an end-of-generation id of its own list (a control token)
        k = len(g.tokens)
        hint, hint_top = self.hints.get(tuple(ids), (None, None))
        if hint is not None and k < len(hint) and int(hint[k]) in eog:
            tid = int(hint[k])
        else:
            top = hint_top[k] if hint_top and k < len(hint_top) else {}
            ranked = sorted((t for t in top if int(t) in eog), key=lambda t: -top[t])
            tid = int(ranked[0]) if ranked else (min(eog) if eog else -1)
        g.tokens.append(tid)
        g.logprobs.append(math.nan)
        g.top.append([])
        g.missing.append(k)
        if g.pieces:
            g.pieces.append("")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy token ids only (the engine protocol of :mod:`harness.engines`)."""
        return [g.tokens for g in self.generate_full(prompts, max_new_tokens)]

    def _is_control(self, tid: int) -> bool:
        """Whether ``tid`` is a control token of the model's vocabulary (False where the vocabulary cannot be read)."""
        try:
            tok = self.local_tok()
        except InputError:
            return False
        return 0 <= tid < len(tok.types) and tok.types[tid] == CONTROL

    def local_tok(self) -> Any:
        """The tokenizer of the model the harness compares with, made once: ``local_tokenizer(path)`` where the
        engine was given one (the ``local_tokenizer`` option: ``path -> tokenizer`` with ``encode(text, add_bos,
        parse_special)``, ``tokens``, ``types``, ``bos_id``; :func:`harness.tokenizer.prompt_ids.model_tokenizer`,
        passed by the layers above, which reads an HF folder's ``tokenizer.json`` too), else a GGUF's own
        (:func:`reference.tokenizer.tokenizer_from_gguf`). The generic dialect sends text, made and checked with it.

        Raises:
            ServerError: the model has no tokenizer this client can read.
        """
        if getattr(self, "_tok", None) is None:
            make = getattr(self, "local_tokenizer", None)
            if make is not None:
                self._tok = make(self.path)
            elif self.path is not None and str(self.path).endswith(".gguf"):
                self._tok = tokenizer_from_gguf(self.path)
            else:
                raise ServerError(f"{self.root}: the generic OpenAI dialect sends text prompts, and {self.path} "
                                  "has no tokenizer this client can read")
        return self._tok

    # ------------------------------------------------------------------ prompt log-probs

    def prefix_logprobs(self, ids: Sequence[int], top_n: int = TOP_N) -> list[tuple[None, list[tuple[int, float]]] | None]:
        """Per prompt position, the top-N log-probabilities a server that reports none for the prompt (llama-server:
        ``/v1/completions`` ignores ``echo``) gives for it, asked as one greedy token after each prefix: position
        ``i`` is step 0 of ``ids[:i]``. Costs ``len(ids) - 1`` one-token requests (the server's prompt cache makes
        each a decode step). Same form as :meth:`prompt_logprobs`, with None for the given token's own log-prob
        (the server names only its top-N).

        Raises:
            ServerFailure: as :meth:`generate_full`; the prefix's place is its ``index``.
        """
        gens = self.generate_full([list(ids[:i]) for i in range(1, len(ids))], 1, top_n)
        return [None] + [(None, list(g.top[0])) if g.top and g.top[0] else None for g in gens]

    def prompt_logprobs(self, ids: Sequence[int],
                        top_n: int = TOP_N) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per prompt position, the log-probability of the given token after the ones before it, and the top-N.

        Returns:
            One entry per token of ``ids``: None for position 0 (nothing precedes it) and, on llama-cpp-python,
            for the first token after BOS (its echo nulls the first listed token); else
            ``(logprob of ids[i], [(id, logprob), ...] best first)``.
            Kept per ``(ids, top_n)``: asked again, the same answer without a request.

        Raises:
            ServerError: the dialect has no prompt log-probs (llama-server). ServerFailure: the answer has another
                shape.
        """
        key = (tuple(int(t) for t in ids), int(top_n))
        if key not in self._prompt_lp:
            try:
                self._prompt_lp[key] = self.server.prompt_logprobs(list(key[0]), int(top_n))
            except ServerContextExceeded as e:
                e.prompt_ids = list(key[0])
                raise
        return self._prompt_lp[key]


def _check_greedy(url: str, k: int, g: ServerGenerated, eog: set[int] | frozenset[int] = frozenset()) -> None:
    """Each generated token is the top-1 of its step's log-probs, or ties with it: what greedy means. Where that
    top-1 is an end-of-generation id (``eog``) the server should have stopped: said so."""
    for i, (tok, top) in enumerate(zip(g.tokens, g.top)):
        if not top or tok == top[0][0]:
            continue
        mine = next((lp for tid, lp in top if tid == tok), None)
        if (mine is None or mine != top[0][1]) and top[0][0] in eog:
            raise ServerFailure(f"{url}: prompt {k}, step {i}: the server's own top-1 is the end-of-generation token "
                                f"{top[0][0]} (at {top[0][1]:.6g}), where it should stop; it generated {tok} "
                                f"(EOS ignored or banned, though the request let it stop)").at(index=k, step=i)
        if mine is None or mine != top[0][1]:
            raise ServerFailure(f"{url}: prompt {k}, step {i}: generated token {tok} is not the top-1 of the server's "
                                f"own log-probs ({top[0][0]} at {top[0][1]:.6g}); greedy (temperature 0) was asked"
                                ).at(index=k, step=i)

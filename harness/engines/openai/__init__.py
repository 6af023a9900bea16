"""The ``openai`` engine: a model behind an HTTP completion server (llama-server, llama-cpp-python, vLLM, any other).

Given ``openai:http://HOST:PORT/v1``, :class:`OpenAIEngine` finds out which server answers (its
*dialect*, :func:`detect_dialect`), takes the model name from ``/v1/models`` (or an override), and runs
greedy continuations with the top-N log-probabilities of every step, returning token ids. What each
dialect accepts and answers is in ``docs/server-dialects.md`` (observed on llama-server and
llama-cpp-python 0.3.36; vLLM written to its documented API, not run here). Each dialect is one class in its own
module, which the engine holds and hands every request (:class:`~.dialect.Dialect`). In short:

* ``llama-server`` (:class:`~.llama_server.LlamaServer`): ``POST /completion`` with the prompt as token ids,
  ``n_probs``, ``return_tokens``. It reports a step's log-probs only once the generated text ends in complete UTF-8
  (its ``validate_utf8``): the other steps get an empty ``top`` entry, placed by replaying that rule over the token
  pieces (:meth:`~.llama_server.LlamaServer.place`). ``/tokenize``, ``/detokenize``, ``/apply-template``; no prompt
  log-probs.
* ``llama-cpp-python`` (:class:`~.llama_cpp_python.LlamaCppPython`): ``POST /v1/completions`` takes text prompts
  only (a token id list is a 500), and names tokens by their text. Prompts go as the server's own detokenization of
  the ids, checked to tokenize back to the same ids; generated texts are mapped back to ids through its tokenizer and
  checked. Stops at EOS. Prompt log-probs through ``echo``.
* ``vllm`` (:class:`~.vllm.Vllm`): ``POST /v1/completions`` with token ids, ``return_tokens_as_token_ids`` (tokens
  named ``token_id:N``), ``ignore_eos``; prompt log-probs through ``prompt_logprobs``; ``/tokenize``, ``/detokenize``.
* ``openai`` (:class:`~.generic.Generic`; transformers serve, any other server of OpenAI's API): ``POST
  /v1/completions`` with a text prompt and OpenAI's own fields only; text back, its tokens named by the oracle's
  (:meth:`~.generic.Generic.ids`); no log-probs, no tokenizer.

Every greedy request lets the server stop at an end-of-generation token, as users run it; a stream that stops ends
with that token's id (:meth:`OpenAIEngine._end_with_eog`).

Only the standard library is used. Every failure is one line naming the URL: a :class:`ServerError` (exit 2) before
the server served anything, a :class:`ServerFailure` (exit 1) once it has (:mod:`.http`, which also holds the
client, :class:`Http`).

The modules: :mod:`.http` (the client and its errors), :mod:`.dialect` (the answer and a dialect's outline), one
module per dialect, :mod:`.model_file` (what is read from the model file), :mod:`.engine` (:class:`OpenAIEngine`).
"""

from .dialect import Dialect, ServerGenerated
from .engine import (
    DIALECT_CLASSES,
    DIALECTS,
    DOWN_HINT,
    LLAMACPP_APPROXIMATIONS,
    TEXT_ONLY_DIALECTS,
    OpenAIEngine,
    detect_dialect,
    parse_url,
)
from .generic import Generic, _text_agrees  # noqa: F401 (tests/test_server_eos.py reads it here)
from .http import Http, ServerContextExceeded, ServerCrashed, ServerError, ServerFailure
from .llama_cpp_python import LlamaCppPython
from .llama_server import LlamaServer, utf8_cut
from .model_file import END_OF_TURN_TEXTS, end_of_generation_ids
from .vllm import Vllm

__all__ = [
    "DIALECTS", "DIALECT_CLASSES", "DOWN_HINT", "END_OF_TURN_TEXTS", "LLAMACPP_APPROXIMATIONS", "TEXT_ONLY_DIALECTS",
    "Dialect", "Generic", "Http", "LlamaCppPython", "LlamaServer", "OpenAIEngine", "ServerContextExceeded",
    "ServerCrashed", "ServerError", "ServerFailure", "ServerGenerated", "Vllm", "detect_dialect",
    "end_of_generation_ids", "parse_url", "utf8_cut",
]

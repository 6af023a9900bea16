"""The llama.cpp tokenizer worker: llama.cpp's vocabulary in its own, long-lived process.

llama.cpp aborts the whole process on some vocabularies (a ``GGML_ASSERT``, an
uncaught C++ exception), so :class:`harness.tokenizer.engines.LlamaCppEngine` never
loads it in the harness process. It starts ``python -m
gemma4_harness.harness.engines.llamacpp.tokworker MODEL.gguf`` once per engine; the worker loads the
vocabulary only (``vocab_only``, no weights, no context) and then answers
requests until its stdin closes. Unlike :mod:`harness.engines.llamacpp.worker` (one
process per batch of model jobs) it stays up, because a corpus check asks for
thousands of texts.

Protocol: one JSON object per line, UTF-8, on stdin (requests) and on the
worker's original stdout (answers; llama.cpp's own fd 1 is pointed at stderr so
nothing it prints can corrupt the stream).

* Hello (written once the vocabulary is loaded)::

    {"ok": true, "n_vocab": V, "bos": id | -1, "llama_cpp_python": "0.3.36"}

* ``{"op": "encode", "texts": [str, ...], "parse_special": bool}`` ->
  ``{"ok": true, "ids": [[int, ...], ...]}``: ``llama_tokenize`` with
  ``add_special`` false (no BOS/EOS added) and ``parse_special`` as given.
* ``{"op": "decode", "seqs": [[int, ...], ...], "special": bool}`` ->
  ``{"ok": true, "texts": [str, ...]}``: each sequence's pieces
  (``llama_token_to_piece``, no ``lstrip``, special tokens rendered only when
  ``special``) joined as bytes, one leading space dropped when the sequence
  starts with BOS (llama-cpp-python's ``detokenize`` rule), then UTF-8 with
  invalid bytes replaced.
* A request the worker refuses (a token id outside ``[0, V)``, an unknown op)
  -> ``{"ok": false, "error": "<one line>"}``; the worker keeps serving.

Failures that end the worker: it exits with status 3 and one stderr line
``G4H-WORKER-ERROR[<kind>]: <message>``, kind ``missing`` (llama_cpp does not
import) or ``load`` (llama.cpp could not load the vocabulary; its last
WARN/ERROR log line says why). An abort or a signal ends it with no such line;
the parent names it from the last stderr line (:func:`harness.core.workers.crash_error`).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any, BinaryIO

from gemma4_harness.harness.engines.llamacpp.worker import LoadError, _Log


class BadRequest(Exception):
    """A request this worker refuses (the worker keeps running)."""


class VocabRunner:
    """llama.cpp's vocabulary of one GGUF (``vocab_only``), with encode and decode over batches.

    Args:
        llama_cpp: the imported ``llama_cpp`` module.
        path: the ``.gguf`` file.

    Raises:
        LoadError: llama.cpp returned no model (its last WARN/ERROR log line is in the message).
    """

    def __init__(self, llama_cpp: Any, path: str) -> None:
        self.L = llama_cpp
        self.log = _Log(llama_cpp)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise LoadError(f"llama.cpp could not load the vocabulary of {os.path.basename(path)}: "
                            f"{load_reason(self.log.errors)}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self._piece = ctypes.create_string_buffer(64)

    def encode(self, text: str, parse_special: bool) -> list[int]:
        """``llama_tokenize`` of ``text`` (UTF-8), nothing added, ``parse_special`` as given -> ids."""
        L = self.L
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        for _ in range(2):
            buf = (L.llama_token * cap)()
            n = int(L.llama_tokenize(self.vocab, raw, len(raw), buf, cap, False, bool(parse_special)))
            if n >= 0:
                return [int(buf[i]) for i in range(n)]
            cap = -n  # the buffer was too small: -n is the size it needs
        raise BadRequest(f"llama_tokenize kept asking for a larger buffer ({cap} tokens)")

    def piece(self, tok: int, special: bool) -> bytes:
        """The bytes of one token (``llama_token_to_piece``, no lstrip); the buffer grows when asked to."""
        n = int(self.L.llama_token_to_piece(self.vocab, tok, self._piece, len(self._piece), 0, bool(special)))
        if n < 0:
            self._piece = ctypes.create_string_buffer(-n)
            n = int(self.L.llama_token_to_piece(self.vocab, tok, self._piece, len(self._piece), 0, bool(special)))
        return self._piece.raw[:max(n, 0)]

    def decode(self, ids: list[int], special: bool) -> str:
        """The text of ``ids``: pieces joined, a leading space dropped after BOS, UTF-8 (invalid -> U+FFFD)."""
        bad = [t for t in ids if not 0 <= t < self.n_vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.n_vocab})")
        out = b"".join(self.piece(t, special) for t in ids)
        if ids and ids[0] == self.bos and out[:1] == b" ":
            out = out[1:]
        return out.decode("utf-8", errors="replace")

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        """The answer to one request (see the module docstring).

        Raises:
            BadRequest: unknown op, malformed fields, a token id out of range.
        """
        op = req.get("op")
        try:
            if op == "encode":
                ps = bool(req.get("parse_special", True))
                return {"ok": True, "ids": [self.encode(str(t), ps) for t in req["texts"]]}
            if op == "decode":
                sp = bool(req.get("special", False))
                return {"ok": True, "texts": [self.decode([int(t) for t in s], sp) for s in req["seqs"]]}
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"malformed {op} request ({type(e).__name__}: {e})") from None
        raise BadRequest(f"unknown op {op!r}")


def load_reason(errors: list[str]) -> str:
    """The one line that says why llama.cpp could not load a file, from its ERROR log lines in order.

    llama.cpp logs the root cause first (``gguf_init_from_reader: ...``, or ``llama_model_load: error
    loading model: <cause>``) and generic lines after it (``... failed to load model``), so the first line
    is returned, without the ``... error loading model: `` prefixes; a fixed text when there is none.
    """
    if not errors:
        return "llama_model_load_from_file returned NULL"
    first = errors[0]
    marker = "error loading model: "
    return first.rsplit(marker, 1)[-1].strip() if marker in first else first


def _send(out: BinaryIO, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg, ensure_ascii=False).encode("utf-8") + b"\n")
    out.flush()


def _fail(kind: str, msg: str) -> int:
    sys.stderr.write(f"\nG4H-WORKER-ERROR[{kind}]: {msg}\n")
    sys.stderr.flush()
    return 3


def main(argv: list[str] | None = None) -> int:
    """Serve one GGUF's vocabulary: hello line, then one answer per request line until stdin closes.

    Returns (as exit status): 0 on a closed stdin, 2 without a model path, 3 when llama_cpp is missing or the
    vocabulary does not load (one ``G4H-WORKER-ERROR`` line on stderr).
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m gemma4_harness.harness.engines.llamacpp.tokworker MODEL.gguf\n")
        return 2
    # The answers go to a private copy of stdout; fd 1 itself now writes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        import llama_cpp  # optional heavy dependency, loaded only in this worker process
    except Exception as e:  # ImportError, or OSError from a broken shared library
        return _fail("missing", f"llama_cpp does not import ({type(e).__name__}: {e})")
    try:
        runner = VocabRunner(llama_cpp, args[0])
    except LoadError as e:
        return _fail("load", str(e))
    _send(out, {"ok": True, "n_vocab": runner.n_vocab, "bos": runner.bos,
                "llama_cpp_python": getattr(llama_cpp, "__version__", "?")})
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise BadRequest("a request is a JSON object")
            msg = runner.answer(req)
        except (BadRequest, ValueError) as e:
            msg = {"ok": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
        _send(out, msg)
    out.flush()
    sys.stderr.flush()
    # Skip llama.cpp's teardown: every answer is written, and a destructor that asserts must not end in a crash.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

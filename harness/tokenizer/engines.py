"""Tokenizer engines behind one small interface, for parity runs.

Every engine has ``encode(text) -> ids``, ``decode(ids) -> text`` and
``pieces(ids) -> [str]`` (the stored token strings, for reports):

| name | reads | what runs |
|---|---|---|
| ``ours`` | .gguf, tokenizer.json, tokenizer.model | :class:`reference.tokenizer.GGUFTokenizer` on the file's metadata (:func:`harness.tokenizer.files.load_tokenizer_metadata`) |
| ``hf`` | tokenizer.json | HF ``tokenizers`` |
| ``spm`` | tokenizer.model | ``sentencepiece`` |
| ``transformers-gguf`` | .gguf | transformers' own GGUF -> tokenizer conversion (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) |
| ``llamacpp`` | .gguf | llama.cpp's tokenizer through ``llama-cpp-python``, vocabulary only, in a worker subprocess (``python -m gemma4_harness.harness.engines.llamacpp.tokworker``) |

``encode_many(texts)`` encodes a batch (the ``llamacpp`` engine sends it to its
worker in a few requests instead of one per text).

llama.cpp can abort the whole process on a bad vocabulary, so the ``llamacpp``
engine never loads it in this one: it starts one worker per engine, which loads
the GGUF's vocabulary once and answers encode/decode requests. A worker that
dies raises :class:`harness.core.workers.EngineCrashed` (``engine crashed: <its
last stderr line>``, one line); :func:`harness.tokenizer.corpus.compare_engines` lets that through (the
engine failed, not a text), ``harness.tokenizer.checks`` reports the check as an
``error`` and goes on, ``g4h tokcheck`` prints the line and exits 2.

The same policies apply to every engine so that a difference is a difference
in *tokenization*:

* BOS: the engine encodes without its own special-token post-processing and
  puts BOS in front when ``add_bos``, also when the text starts with ``<bos>``
  (two then), as HF's template post-processor and llama.cpp's
  ``llama_tokenize(add_special=true)`` do (``harness.tokenizer.checks``
  ``bos_as_reference`` checks ours against HF).
* ``parse_special``: ``True`` matches special tokens written in the text
  (``hf``/``transformers-gguf`` always do unless told otherwise; ``llamacpp``
  ``special=True``), ``False`` matches only user-defined / non-special added
  tokens (``hf``: ``encode_special_tokens``; ``transformers-gguf``:
  ``split_special_tokens``), ``None`` each engine's native default. ``spm``
  has one fixed rule.

An engine that cannot run raises :class:`EngineUnavailable` (an
:class:`~reference.errors.InputError`, so the CLI prints one line and exits 2).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Sequence

from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import GGUFTokenizer

from ..core.workers import EngineCrashed, crash_error, start_worker, stop_child
from .files import load_tokenizer_metadata, tokenizer_kind

ENGINE_NAMES = ("ours", "hf", "spm", "transformers-gguf", "llamacpp")
#: Default engine for a file kind.
DEFAULT_ENGINE = {"gguf": "ours", "json": "hf", "spm": "spm"}
_READS = {"ours": ("gguf", "json", "spm"), "hf": ("json",), "spm": ("spm",),
          "transformers-gguf": ("gguf",), "llamacpp": ("gguf",)}


class TokEngineUnavailable(InputError):
    """A tokenizer engine cannot run here (not installed, cannot read the file offline, ...); one line."""


class TokEngine:
    """The interface: ``encode``, ``encode_many``, ``decode``, ``pieces``; ``name``, ``path``, ``bos_id``.

    Args:
        path: the tokenizer file.
        add_bos: :meth:`encode` puts ``bos_id`` in front (also before a ``<bos>`` of the text).
        parse_special: see the module docstring.
    """

    name = "?"

    def __init__(self, path: Path, add_bos: bool = True, parse_special: bool | None = None):
        self.path = Path(path)
        self.add_bos = add_bos
        self.parse_special = parse_special
        self.bos_id: int | None = None

    def _raw_encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def encode(self, text: str) -> list[int]:
        """Text -> ids, BOS in front when ``add_bos`` (also before a ``<bos>`` the text starts with, as llama.cpp's
        ``llama_tokenize(add_special=true)`` and transformers' post-processor put it)."""
        return self._with_bos(list(self._raw_encode(text)))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (an engine with a worker process sends them in batches).

        Raises:
            whatever :meth:`encode` raises, on the first text that fails.
        """
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, control tokens dropped."""
        raise NotImplementedError

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The stored token strings of ``ids``."""
        raise NotImplementedError

    def describe(self) -> str:
        """``name(path)`` for reports."""
        return f"{self.name}({self.path.name})"


def _file_key(path: Path) -> tuple[str, int, int]:
    st = Path(path).stat()
    return str(Path(path).resolve()), st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _ours_tokenizer(key: tuple[str, int, int]):
    return GGUFTokenizer(load_tokenizer_metadata(key[0]), key[0])


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(key: tuple[str, int, int]):
    from tokenizers import Tokenizer  # HF tokenizers: imported only for the hf engine (lazy: heavy)

    return Tokenizer.from_file(key[0])


class OursEngine(TokEngine):
    """:class:`reference.tokenizer.GGUFTokenizer` on any of the three file kinds (one per file, shared)."""

    name = "ours"

    def __init__(self, path: Path, add_bos: bool = True, parse_special: bool | None = None):
        super().__init__(path, add_bos, parse_special)
        self.tok = _ours_tokenizer(_file_key(path))
        self.bos_id = self.tok.bos_id

    def _raw_encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=False, parse_special=self.parse_special)

    def decode(self, ids: Sequence[int]) -> str:
        """GGUFTokenizer.decode: control tokens dropped."""
        return self.tok.decode(ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The stored GGUF pieces."""
        return self.tok.pieces(ids)


class HFEngine(TokEngine):
    """HF ``tokenizers`` from a ``tokenizer.json``."""

    name = "hf"

    def __init__(self, path: Path, add_bos: bool = True, parse_special: bool | None = None):
        try:
            import tokenizers  # noqa: F401 - only whether it is installed (lazy)
        except ImportError:
            raise TokEngineUnavailable("hf: not installed: pip install tokenizers") from None
        super().__init__(path, add_bos, parse_special)
        try:
            self.tok = _hf_tokenizer(_file_key(path))  # shared per file; the mode is set at each encode
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise InputError(f"{path}: HF tokenizers cannot load it ({str(e).splitlines()[0][:160]})") from None
        self.bos_id = self._find_bos(path)

    def _find_bos(self, path: Path) -> int | None:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = {}
        pp = doc.get("post_processor") or {}
        for p in pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]:
            if p.get("type") == "TemplateProcessing":
                single = p.get("single") or []
                if single and "SpecialToken" in single[0]:
                    name = single[0]["SpecialToken"]["id"]
                    ids = (p.get("special_tokens") or {}).get(name, {}).get("ids")
                    if ids:
                        return int(ids[0])
        for name in ("<bos>", "<s>"):
            tid = self.tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def _raw_encode(self, text: str) -> list[int]:
        self.tok.encode_special_tokens = self.parse_special is False
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """``Tokenizer.decode(skip_special_tokens=True)``."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """``Tokenizer.id_to_token`` of each id."""
        return [self.tok.id_to_token(int(i)) or f"<id {i}>" for i in ids]


class SpmEngine(TokEngine):
    """``sentencepiece`` from a ``tokenizer.model``."""

    name = "spm"

    def __init__(self, path: Path, add_bos: bool = True, parse_special: bool | None = None):
        try:
            import sentencepiece as spm  # imported only for the spm engine (lazy)
        except ImportError:
            raise TokEngineUnavailable("spm: not installed: pip install sentencepiece") from None
        super().__init__(path, add_bos, parse_special)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise InputError(f"{path}: sentencepiece cannot load it ({str(e).splitlines()[0][:160]})") from None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def _raw_encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """``SentencePieceProcessor.decode``."""
        return self.sp.decode([int(i) for i in ids])

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """``SentencePieceProcessor.id_to_piece`` of each id."""
        return [self.sp.id_to_piece(int(i)) for i in ids]


class TransformersGGUFEngine(TokEngine):
    """transformers' GGUF -> fast-tokenizer conversion (``AutoTokenizer``, ``gguf_file=``)."""

    name = "transformers-gguf"

    def __init__(self, path: Path, add_bos: bool = True, parse_special: bool | None = None):
        super().__init__(path, add_bos, parse_special)
        try:
            import transformers  # optional heavy dependency, only for the transformers-gguf engine
            from transformers import AutoTokenizer
        except ImportError:
            raise TokEngineUnavailable("transformers-gguf: not installed: pip install transformers") from None
        transformers.logging.set_verbosity_error()
        p = Path(path).resolve()
        # Alone in a folder: from_pretrained(dir) would otherwise prefer a tokenizer.json lying beside it.
        with tempfile.TemporaryDirectory(prefix="g4h-tfgguf-") as tmp:
            link = Path(tmp) / p.name
            try:
                link.symlink_to(p)
            except OSError:
                shutil.copyfile(p, link)
            try:
                self.tok = AutoTokenizer.from_pretrained(tmp, gguf_file=p.name, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - any failure of the conversion is the result we report
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise TokEngineUnavailable(f"transformers-gguf: cannot build a tokenizer from {p.name} offline "
                                        f"({type(e).__name__}: {msg})") from None
        self.bos_id = self.tok.bos_token_id

    def _raw_encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=self.parse_special is False)

    def decode(self, ids: Sequence[int]) -> str:
        """``decode(skip_special_tokens=True)``."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """``convert_ids_to_tokens``."""
        return self.tok.convert_ids_to_tokens([int(i) for i in ids])


class LlamaCppEngine(TokEngine):
    """llama.cpp's tokenizer (``llama-cpp-python``, vocabulary only) in one long-lived worker subprocess.

    The worker is ``python -m gemma4_harness.harness.engines.llamacpp.tokworker FILE.gguf`` (protocol: that module's docstring),
    started here and kept for the engine's life: llama.cpp can abort the whole process on a bad
    vocabulary, so it never runs in this one. Texts go to it in batches of :attr:`BATCH`. The calls and
    flags are those of ``Llama.tokenize(text, add_bos=False, special=parse_special is not False)`` and
    ``Llama.detokenize``: same ids for the same text.

    A worker that dies (abort, signal, cannot load the file) raises
    :class:`harness.core.workers.EngineCrashed` (``engine crashed: <its last stderr line>``); the next call
    starts a fresh worker.

    Args:
        path: a ``.gguf`` file.
        add_bos, parse_special: see the module docstring.
        timeout: seconds one request (or the start) may take before the worker is killed.

    Raises:
        EngineUnavailable: llama-cpp-python is not installed (one line saying how to install it).
        EngineCrashed: the worker died before it had loaded the vocabulary.
    """

    name = "llamacpp"
    #: Texts (or id sequences) per request to the worker.
    BATCH = 512
    INSTALL_LINE = "llamacpp: not installed: pip install llama-cpp-python"

    def __init__(self, path: Path, add_bos: bool = True, parse_special: bool | None = None,
                 timeout: float = 600.0):
        super().__init__(path, add_bos, parse_special)
        if not _llama_cpp_present():
            raise TokEngineUnavailable(self.INSTALL_LINE)
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        with self._lock:
            hello = self._start()
        self.n_vocab = int(hello["n_vocab"])
        self.bos_id = int(hello["bos"]) if int(hello["bos"]) >= 0 else None
        _LIVE_WORKERS.add(self)

    # ------------------------------------------------------------------ worker

    @property
    def worker_pid(self) -> int | None:
        """Process id of the running worker (None when there is none)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> dict:
        self._stderr = tempfile.TemporaryFile()
        self._proc = start_worker("gemma4_harness.harness.engines.llamacpp.tokworker", [str(self.path.resolve())],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        return self._exchange(None)

    def _exchange(self, req: dict | None) -> dict:
        """Send ``req`` (None: just read the hello line) and read one answer; a dead worker -> EngineCrashed."""
        proc = self._proc
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            proc.kill()

        timer = threading.Timer(self.timeout, kill)
        timer.daemon = True
        timer.start()
        try:
            if req is not None:
                proc.stdin.write(json.dumps(req, ensure_ascii=False).encode("utf-8") + b"\n")
                proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = b""
        finally:
            timer.cancel()
        if line:
            return json.loads(line)
        raise self._died(fired.is_set())

    def _died(self, timed_out: bool) -> Exception:
        """Reap the dead worker and return the error to raise."""
        proc, self._proc = self._proc, None
        rc = stop_child(proc, 30.0)  # its process group killed, whatever it left
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._stderr.seek(0)
        err = self._stderr.read().decode("utf-8", "replace")
        self._stderr.close()
        if "G4H-WORKER-ERROR[missing]" in err:
            return TokEngineUnavailable(self.INSTALL_LINE)
        if timed_out:
            return EngineCrashed(f"engine crashed: llama.cpp tokenizer worker ran past {self.timeout:.0f} s "
                                 f"on {self.path.name}")
        return crash_error(err, rc, self.path.name)

    def _request(self, req: dict) -> dict:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:  # died between requests
                    raise self._died(False)
                self._start()
            ans = self._exchange(req)
        if not ans.get("ok"):
            raise InputError(f"llamacpp: {ans.get('error', 'the worker refused the request')}")
        return ans

    def close(self) -> None:
        """Stop the worker (it exits when its stdin closes; killed after 5 s). Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        stop_child(proc, 5.0)  # exits when its stdin closes; its process group is killed after 5 s (or at once)
        proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort, also at interpreter exit
            pass

    # ------------------------------------------------------------------ the interface

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, :attr:`BATCH` texts per request.

        Raises:
            UnicodeEncodeError: a text that is not valid Unicode (a lone surrogate); nothing is sent.
            EngineCrashed: the worker died.
        """
        texts = list(texts)
        for t in texts:
            t.encode("utf-8")
        special = self.parse_special is not False
        out: list[list[int]] = []
        for k in range(0, len(texts), self.BATCH):
            ans = self._request({"op": "encode", "texts": texts[k:k + self.BATCH], "parse_special": special})
            out.extend(self._with_bos([int(i) for i in ids]) for ids in ans["ids"])
        return out

    def _raw_encode(self, text: str) -> list[int]:
        text.encode("utf-8")
        return self._request({"op": "encode", "texts": [text], "parse_special": self.parse_special is not False}
                             )["ids"][0]

    def _decode_many(self, seqs: list[list[int]], special: bool) -> list[str]:
        out: list[str] = []
        for k in range(0, len(seqs), self.BATCH):
            out.extend(self._request({"op": "decode", "seqs": seqs[k:k + self.BATCH], "special": special})["texts"])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """``Llama.detokenize`` (control tokens not rendered; UTF-8, invalid bytes replaced).

        Raises:
            InputError: an id outside the vocabulary. EngineCrashed: the worker died.
        """
        return self._decode_many([[int(i) for i in ids]], False)[0]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id detokenized alone with special tokens rendered (UTF-8, invalid bytes replaced).

        Raises:
            InputError: an id outside the vocabulary. EngineCrashed: the worker died.
        """
        return self._decode_many([[int(i)] for i in ids], True)


def _llama_cpp_present() -> bool:
    """True when ``llama_cpp`` can be found, without importing it here (the worker imports it)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return True  # there, but odd: the worker says whether it imports


#: Engines with a worker process, closed at exit.
_LIVE_WORKERS: "weakref.WeakSet[LlamaCppEngine]" = weakref.WeakSet()


@atexit.register
def _close_workers() -> None:
    for eng in list(_LIVE_WORKERS):
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def is_engine_crash(err: BaseException) -> bool:
    """True when ``err`` is :class:`harness.core.workers.EngineCrashed` (an engine's worker process died)."""
    return isinstance(err, EngineCrashed)


_CLASSES = {"ours": OursEngine, "hf": HFEngine, "spm": SpmEngine,
            "transformers-gguf": TransformersGGUFEngine, "llamacpp": LlamaCppEngine}


def make_tok_engine(name: str, path: str | os.PathLike, *, add_bos: bool = True,
                    parse_special: bool | None = None) -> TokEngine:
    """The engine ``name`` on the tokenizer file ``path``.

    Args:
        name: one of :data:`ENGINE_NAMES`.
        path: a .gguf, tokenizer.json or tokenizer.model (which ones an engine
            reads: module docstring).
        add_bos: BOS in front (also before a ``<bos>`` of the text).
        parse_special: see the module docstring.

    Raises:
        InputError: unknown engine name, missing or wrong kind of file, a file
            the engine cannot load. EngineUnavailable: the engine's package is
            missing or it cannot run on this file offline.
    """
    if name not in _CLASSES:
        raise InputError(f"unknown tokenizer engine {name!r} (expected one of {', '.join(ENGINE_NAMES)})")
    p = Path(path)
    kind = tokenizer_kind(p)
    if kind not in _READS[name]:
        want = " or ".join({"gguf": "a .gguf", "json": "a tokenizer.json", "spm": "a tokenizer.model"}[k]
                           for k in _READS[name])
        raise InputError(f"{p}: engine {name} needs {want}, this is a {kind} file")
    return _CLASSES[name](p, add_bos=add_bos, parse_special=parse_special)


def special_mode(value: str, *engines: str) -> bool | None:
    """The ``parse_special`` of a CLI ``--special`` value.

    ``parse`` -> True, ``text`` -> False, ``auto`` -> None (each engine's own
    rule) when ``spm`` takes part, since sentencepiece has one fixed rule, else
    True (HF tokenizers' behaviour).

    Raises:
        InputError: another value.
    """
    if value == "parse":
        return True
    if value == "text":
        return False
    if value == "auto":
        return None if "spm" in engines else True
    raise InputError(f"--special {value!r}: expected auto, parse or text")


@functools.lru_cache(maxsize=12)
def cached_tok_engine(name: str, path: str, add_bos: bool = True, parse_special: bool | None = None) -> TokEngine:
    """:func:`make_tok_engine`, remembered per (name, resolved path, options): building the 262k-token
    engines costs seconds, and reports and tests ask for the same ones repeatedly."""
    return make_tok_engine(name, path, add_bos=add_bos, parse_special=parse_special)

"""The engine registry: one row per engine kind, data only.

Every fact the harness keeps about an engine kind is in its :class:`EngineKind` row here, and every place that
needs one reads the row: :mod:`harness.engines` (which class to build, the options it takes, the names the CLI
offers), :mod:`harness.engines.numerics` (:data:`~harness.engines.numerics.KIND_NUMERICS`), :mod:`harness.engines.mm`
(the engines that take images and audio), :mod:`harness.core.memory` (which plan rule estimates the engine),
:func:`harness.parity.cases.default_against`, ``g4h sweep``'s default engines and its judge, the ``--oracle`` choices
(:data:`ORACLES`), ``--draft-model`` (``drafts``), the ``--skip`` name that opts a kind out (``skip``), the file of a
built case an engine runs (:meth:`EngineKind.built_file`), the memory plan's advice and the settings ``g4h inspect``
and ``g4h sweep`` plan (``options``, ``dtypes``, ``weights``), the kinds with ``_q8`` gates (``rounds``:
:func:`rounding_kinds`), the server kinds and their own checks (``server``), a built-in case's pairs (``builtin``).
Two kinds have a role the rest of the harness names them by: :data:`ORACLE` (the float64 reference, the default
oracle) and :data:`TWIN` (the fast engine). ``g4h bench``'s ``--engines`` rows are :data:`BENCH_ENGINES`.
``tests/test_kind_strings.py`` holds the modules that still write a kind's name as a string.

The rows live in ``harness.core`` (the lowest layer of the harness: ``pyproject.toml`` ``[tool.importlinter]``) so
that the memory planner, which may not import :mod:`harness.engines`, reads the same rows. This module imports
nothing of the harness and builds nothing: a row names its classes by module path, imported by
:func:`harness.engines.make_engine` only when that engine is asked for.

A plain kind (``reference``, ``fast`` ...) is also the engine's name; a *scheme* kind (``cmd``, ``openai``) is
named ``<scheme>:<argument>`` (``cmd:'./eng --threads 4'``, ``openai:http://127.0.0.1:8080/v1``).
"""

from __future__ import annotations

from dataclasses import dataclass

FORMS = ("gguf", "hf")
"""File forms a ``--model`` may take: a ``.gguf`` file, an HF model folder (``config.json`` and safetensors)."""

ROUNDS = ("always", "by default", "when it declares", "when asked")
"""When an engine kind rounds the activations of quantized matrix products (``quantized_activations``:
:attr:`EngineKind.rounds`), most certain first: ``always`` (its fixed numerics say so: llama.cpp), ``by default``
(its server dialects' defaults, or ``--declare``), ``when it declares`` (its ``hello``), ``when asked`` (an option:
the fast engine's ``--compute q8``). The order of the ``_q8`` gates (:mod:`harness.core.gates`)."""

GIVES = ("traces", "logits", "logprobs")
"""What an engine may return: trace points (per-layer activations), full logits, top-N log-probabilities of a
greedy continuation."""


@dataclass(frozen=True)
class EngineKind:
    """One engine kind.

    Attributes:
        name: the kind (``llamacpp``); for a plain kind the engine name too, for a scheme kind the scheme (``cmd``).
        module: the module of its engine class (imported only when the engine is built).
        cls: its engine class, built as ``cls(path, **options)`` (plain) or ``cls(argument, path, **options)``
            (scheme).
        summary: one line for ``--help`` and error messages; a scheme kind's ends in ``: <how it is written>``.
        usage: how ``--engine`` help writes it.
        scheme: True when the kind is named ``<scheme>:<argument>``.
        forms: the file forms (:data:`FORMS`) it reads; a scheme kind reads what its program or server reads (the
            harness hands the path over, or keeps it for the reference).
        options: the keyword options it takes from the command line (others are not passed to it).
        numerics: its fixed declared numerics as :class:`harness.engines.numerics.Numerics` fields ``(dtype,
            kv_cache, approximations, source, vec_dot_types)``, for a built-in kind that makes approximations; None:
            it computes in its own ``dtype`` exactly, or (``declares``) says at run time what it computes.
        declares: where an engine of this kind declares its numerics at run time (None: it does not).
        multimodal: ``module:Class`` of its multimodal engine (a ``for_model(mm, device, dtype)`` class method),
            None when it does not take images and audio.
        memory_rule: the rule of :data:`harness.core.memory_rules.PLAN_RULES` that estimates its memory (None: the
            engine is another program, whose memory the harness does not plan).
        default_for: the file forms for which it is compared by default when ``--against`` is not given
            (:func:`default_against`).
        gives: what it returns (:data:`GIVES`); a ``cmd:`` engine answers, of these, what its ``hello`` lists.
        label: its name in a sentence (``llama.cpp``; default: ``name``).
        dtypes: the compute dtypes it runs a model in, the default first (more than one: ``--dtype`` picks);
            ``stored``: the file's own types (empty for a scheme kind: its program or server says).
        weights: the modes it may keep a GGUF's weights in (``--weights``; empty: one way only).
        gguf_archs: with ``gguf`` in ``forms``, the architectures whose GGUF it reads (None: every one).
        gguf_types: the GGUF tensor types it decodes (None: every type its loader reads, or ``file_check`` says).
        file_check: ``module:function`` of the checks of a file beyond these facts (``g4h inspect``:
            ``function(info, cfg) -> (can_run, reason, notes)``), None when there are none.
        oracle: True when ``g4h parity --oracle`` may name it (:data:`ORACLES`: the float64 reference, the default,
            and the fast engine in fp32).
        drafts: True when it takes a drafter (``--draft-model``: speculative decoding).
        skip: the ``g4h parity --skip`` name that opts every check of this kind out (:mod:`harness.parity.skips`),
            None when it has none.
        skip_help: what ``skip`` leaves out, for ``--skip``'s help.
        rounds: when it rounds the activations of quantized products (:data:`ROUNDS`; empty: never): the kinds
            whose pairs have ``_q8`` gates (:func:`rounding_kinds`).
        server: True for a model behind a server: asked before any reference work whether it answers, and checked
            by the server checks after its pair (:mod:`harness.parity.checks.server`).
        builtin: the dtypes it is measured in on a built-in case's F32 GGUF (``""``: its own), one pair each
            (``reference~fast``, ``reference~fast_bf16``; :data:`harness.parity.cases.BUILTIN_PAIRS`).
    """

    name: str
    module: str
    cls: str
    summary: str
    usage: str
    scheme: bool = False
    forms: tuple[str, ...] = FORMS
    options: tuple[str, ...] = ()
    numerics: tuple | None = None
    declares: str | None = None
    multimodal: str | None = None
    memory_rule: str | None = None
    default_for: tuple[str, ...] = ()
    gives: tuple[str, ...] = GIVES
    label: str = ""
    dtypes: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    gguf_archs: tuple[str, ...] | None = None
    gguf_types: frozenset[str] | None = None
    file_check: str | None = None
    oracle: bool = False
    drafts: bool = False
    skip: str | None = None
    skip_help: str = ""
    rounds: str = ""
    server: bool = False
    builtin: tuple[str, ...] = ()

    @property
    def said(self) -> str:
        """Its name in a sentence (:attr:`label`, else :attr:`name`)."""
        return self.label or self.name

    @property
    def quantizes_activations(self) -> bool | None:
        """Whether it rounds the activations of quantized matrix products (``quantized_activations`` in its fixed
        numerics): True, False, or None when it declares its numerics at run time (then it may)."""
        if self.numerics is not None:
            return "quantized_activations" in self.numerics[2]
        return None if self.declares else False

    def reads(self, form: str, arch: str = "gemma4") -> bool:
        """Whether it reads a model of file form ``form`` (:data:`FORMS`) and architecture ``arch`` (a GGUF's
        ``general.architecture``): ``form`` in :attr:`forms`, and for a GGUF ``arch`` in :attr:`gguf_archs`."""
        return form in self.forms and (form != "gguf" or self.gguf_archs is None or arch in self.gguf_archs)

    def built_file(self, gguf: object, hf_dir: object, arch: str = "gemma4") -> object:
        """Which of a built case's files it runs: the GGUF when it reads one of ``arch``, else the HF folder."""
        return gguf if self.reads("gguf", arch) else hf_dir


FAST_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                             "Q5_K", "Q6_K", "IQ4_NL"})
"""GGUF tensor types the fast engine decodes: :data:`fast.quant_blocks.SUPPORTED`, copied here so that reading the
registry (``g4h inspect``) does not import torch (3-5 s, longer than the header of a 33 GB file takes);
tests/test_inspect.py checks that the copy equals the original."""

KINDS: tuple[EngineKind, ...] = (
    EngineKind("reference", "gemma4_harness.harness.engines.reference", "ReferenceEngine", "float64 NumPy reference", "reference",
               options=("cache_gb", "layers"), multimodal="gemma4_harness.harness.engines.mm:ReferenceMM",
               memory_rule="float64",
               dtypes=("float64",), oracle=True),
    EngineKind("transformers", "gemma4_harness.harness.engines.transformers", "TransformersEngine",
               "HF transformers fp32 eager (HF folders; Gemma 3 GGUFs)", "transformers",
               forms=("hf", "gguf"), gguf_archs=("gemma3",),  # transformers' GGUF loader has no gemma4 architecture
               options=("layers",), multimodal="gemma4_harness.harness.engines.mm_transformers:TransformersMM",
               memory_rule="hf-torch", default_for=("hf",), dtypes=("float32",)),
    EngineKind("fast", "gemma4_harness.harness.engines.fast", "FastEngine",
               "torch fast path (--device, --dtype, --weights, --compute)", "fast",
               options=("device", "dtype", "batched", "weights", "layers", "compute"),
               multimodal="gemma4_harness.harness.engines.mm_fast:FastMM", memory_rule="torch",
               default_for=("gguf", "hf"),
               dtypes=("float32", "bfloat16", "float16"), weights=("packed", "dequantized"),
               gguf_types=FAST_GGUF_TYPES, oracle=True, drafts=True, rounds="when asked",
               builtin=("float32", "bfloat16")),
    EngineKind("llamacpp", "gemma4_harness.harness.engines.llamacpp", "LlamaCppEngine",
               "llama.cpp via llama-cpp-python, in a worker subprocess (GGUF only)", "llamacpp",
               forms=("gguf",),
               numerics=("float32", "float32", ("gelu_fp16_table", "quantized_activations"),
                         "the llamacpp engine: F32 KV cache, flash attention off", "llama.cpp"),
               options=("timeout",), memory_rule="worker", default_for=("gguf",), label="llama.cpp",
               dtypes=("stored",),
               file_check="gemma4_harness.harness.engines.llamacpp.support:file_check", skip="llamacpp",
               skip_help="llama.cpp everywhere: its pairs, its drafter, its multimodal (mtmd) checks and its tokenizer "
                         "check", rounds="always", builtin=("",)),
    EngineKind("cmd", "gemma4_harness.harness.engines.cmd", "CmdEngine",
               "any program speaking the subprocess protocol (docs/engine-protocol.md): cmd:'COMMAND ...'",
               "cmd:'COMMAND ...' (docs/engine-protocol.md)", scheme=True, declares="hello",
               options=("check_greedy", "timeout"), rounds="when it declares"),
    EngineKind("openai", "gemma4_harness.harness.engines.openai.engine", "OpenAIEngine",
               "a model behind an OpenAI-compatible server (generate only): openai:http://HOST:PORT/v1",
               "openai:URL (a server)", scheme=True,
               options=("server_model", "server_timeout", "check_greedy", "declare", "dialect", "local_tokenizer"),
               declares="dialect defaults or --declare", gives=("logprobs",), rounds="by default", server=True),
)
"""Every engine kind: the plain ones first, in the order ``--help`` and error messages list them, then the schemes."""

KIND: dict[str, EngineKind] = {k.name: k for k in KINDS}
"""Kind name -> its row."""

ORACLES: tuple[str, ...] = tuple(k.name for k in KINDS if k.oracle)
"""What ``g4h parity --oracle`` (and the pytest plugin's ``--g4h-oracle``) may name, the default first: the float64
reference, or the fast engine in fp32 (much faster on a big model; itself held to the reference by the
``reference~fast`` gates)."""

ORACLE: str = ORACLES[0]
"""The default oracle: the float64 reference, the specification every engine is judged against (``--oracle``'s
default, the oracle side of the pairs' names ``reference~<kind>``, the engine whose failures are bad input)."""

TWIN: str = ORACLES[1]
"""The torch twin of the reference (the fast engine): the other ``--oracle``, the engine a drafter runs in
(``drafts``), ``g4h generate``'s and ``g4h explain``'s default engine, the sweep's sensitivity run."""


def plain_kinds() -> tuple[EngineKind, ...]:
    """The kinds named by their name alone."""
    return tuple(k for k in KINDS if not k.scheme)


def scheme_kinds() -> tuple[EngineKind, ...]:
    """The kinds named ``<scheme>:<argument>``."""
    return tuple(k for k in KINDS if k.scheme)


def multimodal_kinds() -> tuple[str, ...]:
    """The kinds that take images and audio."""
    return tuple(k.name for k in KINDS if k.multimodal)


def planned_kinds() -> tuple[str, ...]:
    """The kinds whose memory the harness plans (:mod:`harness.core.memory`)."""
    return tuple(k.name for k in KINDS if k.memory_rule)


def rounding_kinds() -> tuple[str, ...]:
    """The kinds that may round the activations of quantized products (``rounds``), in :data:`ROUNDS`' order (then
    the rows'): the kinds whose pairs have ``_q8`` gates."""
    rows = [k for k in KINDS if k.rounds]
    return tuple(k.name for k in sorted(rows, key=lambda k: ROUNDS.index(k.rounds)))


def server_kinds() -> tuple[str, ...]:
    """The kinds that are a model behind a server (``server``)."""
    return tuple(k.name for k in KINDS if k.server)


def default_against(form: str) -> tuple[str, ...]:
    """The kinds a model of file form ``form`` is compared with when ``--against`` is not given: those whose
    ``default_for`` holds it, the ones that read every form first (the torch twin), then the form's own engine
    (``gguf``: ``fast``, ``llamacpp``; ``hf``: ``fast``, ``transformers``)."""
    rows = [k for k in KINDS if form in k.default_for]
    return tuple(k.name for k in sorted(rows, key=lambda k: -len(k.default_for)))


@dataclass(frozen=True)
class BenchEngine:
    """One ``g4h bench --engines`` name: an engine kind timed one way.

    Attributes:
        name: the ``--engines`` name (a plain one is the kind's name; a variant is ``<kind>-<variant>``).
        kind: the engine kind it times (:data:`KIND`).
        variant: how it differs from the kind's plain engine (empty: it is that engine): ``graph`` (tg through
            :class:`fast.static_decode.StaticDecoder`), ``unchecked`` (tg without its output check), ``q8``
            (``--compute q8``), ``native`` (llama.cpp compiled for this CPU).
        maker: ``module:function`` building its timed engines, ``function(row, src, dtypes, device, threads,
            weights, built)`` (:func:`harness.bench.models.make_bench_engines`).
        shapes: True when it runs a shape-only model (``--shape``: random weights, no file).
        same_dtype: True when its speed is set beside the fast engine's of the same dtype only (it is cast to each
            dtype of ``--dtype``; the others run in one dtype of their own).
        default: True when ``--engines`` times it when not given.
    """

    name: str
    kind: str
    maker: str
    variant: str = ""
    shapes: bool = False
    same_dtype: bool = False
    default: bool = False


_BENCH_MAKERS = "gemma4_harness.harness.bench.models"

BENCH_ENGINES: tuple[BenchEngine, ...] = (
    BenchEngine("fast", "fast", f"{_BENCH_MAKERS}:fast_benches", shapes=True, default=True),
    BenchEngine("fast-graph", "fast", f"{_BENCH_MAKERS}:fast_benches", "graph", shapes=True),
    BenchEngine("fast-unchecked", "fast", f"{_BENCH_MAKERS}:fast_benches", "unchecked", shapes=True),
    BenchEngine("fast-q8", "fast", f"{_BENCH_MAKERS}:fast_benches", "q8", shapes=True),
    BenchEngine("transformers", "transformers", f"{_BENCH_MAKERS}:transformers_benches", same_dtype=True,
                default=True),
    BenchEngine("llamacpp", "llamacpp", f"{_BENCH_MAKERS}:llamacpp_benches", default=True),
    BenchEngine("llamacpp-native", "llamacpp", f"{_BENCH_MAKERS}:llamacpp_benches", "native"),
    BenchEngine("reference", "reference", f"{_BENCH_MAKERS}:reference_benches", default=True),
)
"""Every ``g4h bench --engines`` name, in the order ``--help`` and error messages list them (``fast-q8``: the fast
engine under ``--compute q8``, llama.cpp's arithmetic, :mod:`fast.q8_compute`; ``fast-unchecked``: the check's cost
on decode speed; ``llamacpp``: the harness's portable build, ``GGML_NATIVE=OFF``, the one the correctness checks use;
``llamacpp-native``: ``GGML_NATIVE=ON``, built on first use,
:func:`harness.engines.llamacpp.native.ensure_native_built`)."""

BENCH: dict[str, BenchEngine] = {b.name: b for b in BENCH_ENGINES}
"""``--engines`` name -> its row."""

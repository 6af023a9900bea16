"""What a spec variant is, and how the reference (and the fast twin) run under one.

A :class:`Variant` is one named rule where published Gemma 4 implementations disagree with the reference (a
*disagreement*), a deliberate numerical shortcut one of them takes (an *approximation*), or a mistake engines are
known to make (a *fault*, such as the self-test's mutants). It carries its sources (file and function in
transformers, llama.cpp or Google's JAX ``gemma``, or our own ``docs/`` and self-test), which implementations
follow it, the trace point where it first shows on a given model, and its override: ONE small function that
replaces one function of :mod:`reference.model` (or :mod:`reference.drafter`) while the variant is active, in the
style of :func:`harness.engines.llamacpp.numerics.llamacpp_numerics` and the self-test's mutants.

An override is a :class:`Patch`: ``wrap(original) -> replacement``, applied to the module attribute the reference
looks up at call time (every block of :mod:`reference.model` calls the others through the module's globals, so a
swapped name reaches every caller). A variant that changes a fact of the config rather than a formula (the sliding
window, the KV donors, the head) is a ``cfg -> cfg`` function, realised as a wrapper of
:func:`reference.model.forward` that hands the forward the changed config (:func:`config_patch`), and, for the fast
twin, of ``FastModel.__init__``. Patches nest: a second variant wraps what the first installed, so two variants of
different functions combine; two variants of the same rule (one :attr:`Variant.group`) never do.

The reference's default formulas are never changed: :func:`under` swaps names for the duration of a ``with`` block
and restores them after (not thread-safe, like the numerics emulation: the harness runs its checks one at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from gemma4_harness.reference.config import ModelConfig
from gemma4_harness.reference.errors import InputError

FAST = "gemma4_harness.fast.model"
FAST_MODEL = "gemma4_harness.fast.model:FastModel"
"""The fast twin's module and class, as :class:`Patch` targets (imported when applied)."""

COMMAND_SPEC: list[str] = []
"""The names of the variants this process runs the reference under for a whole command (``--spec``), in the
order given: filled by :func:`under` with ``spec`` while inside (the CLI's ``--spec``, a parity worker's
:func:`harness.engines.variants.activate_spec`), read by :func:`harness.engines.variants.active` (the parity job
hands them to its case workers as an argument and names them in ``results["spec"]``). The trials of an
explanation apply variants without ``spec``: they are not the command's."""

KINDS = ("disagreement", "approximation", "fault")
""":attr:`Variant.kind`: published implementations differ; one takes a documented numerical shortcut; a known
mistake that no published implementation makes."""


@dataclass(frozen=True)
class Source:
    """Where a rule is written: ``project`` (``transformers 5.23``, ``llama.cpp``, ``gemma 4.0.1``, ``harness``),
    ``where`` (a file and a function or class, readable offline), ``says`` (what it does there, one phrase)."""

    project: str
    where: str
    says: str

    def short(self) -> str:
        """``project where``, for one-line reports."""
        return f"{self.project} {self.where}"


@dataclass(frozen=True)
class Patch:
    """One module attribute replaced while a variant is active: ``setattr(target, name, wrap(getattr(target,
    name)))`` on entry, the original put back on exit. ``target`` is a module or a class, or its import path as a
    string (``"fast.model:FastModel"``), resolved when the patch is applied: the fast twin's patches import torch
    only when the fast twin runs under a variant (a ``cmd:`` engine or the reference alone never pays for it)."""

    target: Any
    name: str
    wrap: Callable[[Any], Any]

    def resolve(self) -> Any:
        """The target object (a string imported: ``module`` or ``module:attribute``)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        obj = importlib.import_module(module)
        return getattr(obj, attr) if attr else obj


@dataclass(frozen=True)
class Variant:
    """One spec variant (see the module docstring).

    Attributes:
        name: short id (``router_expert_input``); what ``--spec`` takes.
        family: ``text`` (the decoder), ``multimodal`` (the merge of soft tokens, the image mask) or ``drafter``.
        kind: one of :data:`KINDS`.
        description: what an engine following it computes, one line.
        reference: what the reference does instead, one phrase.
        sources: where each side is written (:class:`Source`).
        followed_by: the known implementations that follow the variant (empty for a fault).
        group: variants of one group are alternative forms of one rule; two of them are never combined.
        first_point: ``cfg -> (trace point, layer)`` where the variant first changes anything on this model, or a
            string saying why it cannot change anything here (the model lacks what it is about).
        reference_patches: the override of the reference (one small function each; :class:`Patch`).
        fast_patches: the same variant in the fast twin, where it has one (empty: reference only).
        override: the one small function the patches are built from (its docstring and name are listed in
            ``docs/spec-variants.md``).
    """

    name: str
    family: str
    kind: str
    description: str
    reference: str
    sources: tuple[Source, ...]
    followed_by: tuple[str, ...]
    group: str
    first_point: Callable[[Any], tuple[str, int] | str]
    reference_patches: tuple[Patch, ...]
    fast_patches: tuple[Patch, ...] = ()
    override: Callable[..., Any] | None = None

    def where(self, cfg: Any) -> tuple[str, int] | None:
        """``(point, layer)`` where the variant first shows on ``cfg``, or None when it cannot change anything."""
        got = self.first_point(cfg)
        return None if isinstance(got, str) else got

    def why_not(self, cfg: Any) -> str | None:
        """Why the variant cannot change anything on ``cfg`` (None: it applies)."""
        got = self.first_point(cfg)
        return got if isinstance(got, str) else None

    @property
    def has_fast(self) -> bool:
        """Whether the fast twin can run under this variant too."""
        return bool(self.fast_patches)

    def sources_line(self) -> str:
        """The sources, ``; ``-separated, for a one-line report."""
        return "; ".join(s.short() for s in self.sources)


def config_patch(transform: Callable[[ModelConfig], ModelConfig]) -> tuple[Patch, ...]:
    """The patch that runs the reference under ``cfg -> transform(cfg)``: a wrapper of
    :func:`reference.model.forward` (every forward of the reference engine, the multimodal reference and
    :func:`reference.model.greedy_generate` goes through it)."""
    def forward(orig):
        def run(cfg, *a, **kw):
            return orig(transform(cfg), *a, **kw)
        return run

    return (Patch("gemma4_harness.reference.model", "forward", forward),)


def fast_config_patch(transform: Callable[[ModelConfig], ModelConfig]) -> tuple[Patch, ...]:
    """The fast twin built from ``transform(cfg)`` (``FastModel.__init__`` wrapped)."""
    def init(orig):
        def build(self, cfg, *a, **kw):
            return orig(self, transform(cfg), *a, **kw)
        return build

    return (Patch(FAST_MODEL, "__init__", init),)


def config_variant(transform: Callable[[ModelConfig], ModelConfig], **fields: Any) -> Variant:
    """A :class:`Variant` whose override is the config change ``transform`` (reference and fast)."""
    return Variant(reference_patches=config_patch(transform), fast_patches=fast_config_patch(transform),
                   override=transform, **fields)


def replace_layers(cfg: ModelConfig, change: Callable[[Any], dict[str, Any]]) -> ModelConfig:
    """``cfg`` with each layer ``L`` replaced by ``dataclasses.replace(L, **change(L))`` (an empty dict keeps it)."""
    return dataclasses.replace(cfg, layers=tuple(dataclasses.replace(L, **change(L)) for L in cfg.layers))


@contextlib.contextmanager
def applied(patches: Sequence[Patch]) -> Iterator[None]:
    """While inside, every patch is in place (in order, so a later one wraps an earlier one of the same name);
    restored in reverse order on exit, whatever happens."""
    missing = object()  # a class attribute inherited, not its own: deleted again on exit
    saved: list[tuple[Any, str, Any]] = []
    try:
        for p in patches:
            target = p.resolve()
            own = vars(target) if isinstance(target, type) else None
            original = own.get(p.name, missing) if own is not None else getattr(target, p.name)
            saved.append((target, p.name, original))
            setattr(target, p.name, p.wrap(getattr(target, p.name)))
        yield
    finally:
        for target, name, original in reversed(saved):
            if original is missing:
                delattr(target, name)
            else:
                setattr(target, name, original)


@contextlib.contextmanager
def under(variants: Sequence[Variant], fast: bool = True, spec: bool = False) -> Iterator[None]:
    """While inside, the reference (and with ``fast``, the fast twin) computes under ``variants``. With ``fast``, a
    variant without a fast form makes the fast twin refuse to build (one line, :class:`InputError`) rather than run
    the unmodified rule. ``spec``: they are the command's ``--spec``: named in :data:`COMMAND_SPEC` while inside."""
    patches = [p for v in variants for p in v.reference_patches]
    if fast:
        patches += [p for v in variants for p in v.fast_patches]
        missing = [v.name for v in variants if not v.fast_patches]
        if missing:
            patches.append(Patch(FAST_MODEL, "__init__", _refuse(missing)))
    names = [v.name for v in variants] if spec else []
    with applied(patches):
        COMMAND_SPEC.extend(names)
        try:
            yield
        finally:
            del COMMAND_SPEC[len(COMMAND_SPEC) - len(names):]


def _refuse(names: Sequence[str]) -> Callable[[Any], Any]:
    """``FastModel.__init__`` refusing to build: the fast twin has no form of these variants, and running it
    unmodified beside a reference under them would compare two different rules without saying so."""
    def wrap(orig):
        def init(self, *a, **kw):
            raise InputError(f"--spec {','.join(names)}: the fast engine has no form of "
                             f"{'this variant' if len(names) == 1 else 'these variants'} (docs/spec-variants.md: "
                             "reference only); use the reference")
        return init
    return wrap


def conflict(a: Variant, b: Variant) -> bool:
    """Whether two variants cannot be combined: the same rule (one group), or the same variant."""
    return a.name == b.name or a.group == b.group

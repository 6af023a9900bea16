"""The engine registry (harness/core/engine_kinds.py): every row complete, and every former list read from it.

Before the registry an engine's facts were kept in eight places (``harness.engines.ENGINES``/``ENGINE_SCHEMES``/
``ENGINE_OPTIONS``, ``harness.engines.mm.MM_ENGINES`` and its if-chain, ``harness.core.memory.ENGINES`` and its
if-chains, ``harness.engines.numerics.KIND_NUMERICS``, ``harness.parity.cases.default_against``, the sweep's default
engines, the ``--engine`` help); each is checked here to be the rows' reading, and the user-visible texts to be what
they were.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from gemma4_harness.harness import engines
from gemma4_harness.harness.core import engine_kinds as ek
from gemma4_harness.harness.core import gates, memory
from gemma4_harness.harness.engines import mm, numerics
from gemma4_harness.harness.engines.base import EngineUnavailable
from gemma4_harness.harness.parity.cases import default_against
from gemma4_harness.reference.errors import InputError


def _defines(module: str, cls: str) -> bool:
    """Whether ``module``'s source defines class ``cls`` (read, not imported: the torch engines stay unimported)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(n, ast.ClassDef) and n.name == cls for n in tree.body)


@pytest.mark.parametrize("row", ek.KINDS, ids=lambda r: r.name)
def test_every_row_is_complete(row):
    assert row.name and row.summary and row.usage
    assert _defines(row.module, row.cls), f"{row.module} defines no class {row.cls}"
    assert row.forms and set(row.forms) <= set(ek.FORMS)
    assert set(row.default_for) <= set(row.forms)
    assert row.gives and set(row.gives) <= set(ek.GIVES)
    assert all(isinstance(o, str) and o for o in row.options)
    if row.scheme:  # its summary ends in how it is written, which the "nothing after cmd:" error quotes
        assert row.summary.rsplit(": ", 1)[-1].startswith(f"{row.name}:")
        assert row.usage.startswith(f"{row.name}:")
    else:
        assert row.usage == row.name
    if row.numerics is not None:
        n = numerics.Numerics(*row.numerics)
        assert n.dtype in numerics.DTYPES and n.kv in numerics.KV_CACHE_TYPES and n.source
        assert set(n.approximations) <= set(numerics.APPROXIMATIONS)
        assert n.vec_dot_types in (None, *numerics.VEC_DOT_TABLES)
    assert not (row.numerics is not None and row.declares), "fixed numerics or declared ones, not both"
    if row.multimodal is not None:
        module, cls = row.multimodal.split(":")
        assert _defines(module, cls)
        source = Path(importlib.util.find_spec(module).origin).read_text()
        assert "def for_model(" in source  # the one constructor make_mm_engine calls
    if row.memory_rule is not None:
        assert row.memory_rule in memory.PLAN_RULES


def test_names_are_unique_and_plain_before_schemes():
    names = [k.name for k in ek.KINDS]
    assert len(names) == len(set(names)) and set(ek.KIND) == set(names)
    assert [k.scheme for k in ek.KINDS] == sorted(k.scheme for k in ek.KINDS)


def test_engine_registry_lists_are_the_rows():
    assert list(engines.ENGINES) == [k.name for k in ek.KINDS if not k.scheme]
    assert list(engines.ENGINE_SCHEMES) == [k.name for k in ek.KINDS if k.scheme]
    for k in ek.KINDS:
        entry = engines.ENGINES.get(k.name) or engines.ENGINE_SCHEMES[k.name]
        assert (entry.module, entry.cls, entry.summary) == (k.module, k.cls, k.summary)
        assert engines.ENGINE_OPTIONS.get(k.name, ()) == k.options
    assert set(engines.ENGINES) == {"reference", "transformers", "fast", "llamacpp"}
    assert set(engines.ENGINE_SCHEMES) == {"cmd", "openai"}


def test_engine_help_and_unknown_engine_message_unchanged():
    import argparse

    from gemma4_harness.harness.cli._args import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    help_text = next(a.help for a in p._actions if a.dest == "engine")
    assert help_text == ("reference | transformers | fast | llamacpp | cmd:'COMMAND ...' (docs/engine-protocol.md) | "
                         "openai:URL (a server)")
    with pytest.raises(EngineUnavailable) as e:
        engines.check_engine_name("nope")
    assert str(e.value) == ("unknown engine 'nope' (available: reference, transformers, fast, llamacpp, cmd:..., "
                            "openai:...)")
    with pytest.raises(EngineUnavailable) as e:
        engines.check_engine_name("cmd: ")
    assert str(e.value) == "engine 'cmd: ': nothing after cmd: (expected cmd:'COMMAND ...')"


def test_multimodal_engines_are_the_rows():
    assert mm.MM_ENGINES == ek.multimodal_kinds() == tuple(k.name for k in ek.KINDS if k.multimodal)
    assert set(mm.MM_ENGINES) == {"reference", "fast", "transformers"}
    for name in ("llamacpp", "cmd", "openai", "nope"):
        with pytest.raises(EngineUnavailable, match=rf"engine '{name}' does not take images or audio \(multimodal "
                                                    r"engines: reference, transformers, fast\)"):
            mm.make_mm_engine(name, None)


def test_memory_plan_engines_are_the_rows():
    assert memory.ENGINES == ek.planned_kinds() == tuple(k.name for k in ek.KINDS if k.memory_rule)
    assert set(memory.ENGINES) == {"reference", "fast", "transformers", "llamacpp"}
    assert {k.memory_rule for k in ek.KINDS if k.memory_rule} == set(memory.PLAN_RULES)  # no rule unused
    # the rules' flags, as the if-chains had them: torch engines plan on their device; llama.cpp runs apart
    assert {n for n, r in memory.PLAN_RULES.items() if r.torch} == {"torch", "hf-torch"}
    assert {n for n, r in memory.PLAN_RULES.items() if not r.in_process} == {"worker"}
    with pytest.raises(InputError, match=r"memory plan: unknown engine 'cmd' \(expected one of reference, "
                                         r"transformers, fast, llamacpp\)"):
        memory._terms("cmd", None, {})


def test_numerics_are_the_rows():
    assert numerics.KIND_NUMERICS == {k.name: numerics.Numerics(*k.numerics) for k in ek.KINDS if k.numerics}
    n = numerics.KIND_NUMERICS["llamacpp"]
    assert (n.dtype, n.kv_cache, n.approximations, n.vec_dot_types) == (
        "float32", "float32", ("gelu_fp16_table", "quantized_activations"), "llama.cpp")
    assert {k.name for k in ek.KINDS if k.quantizes_activations} == {"llamacpp"}
    assert {k.name for k in ek.KINDS if k.quantizes_activations is None} == {"cmd", "openai"}  # declared at run time
    # core/gates.py keeps its own order of the q8 pairs (the order of docs/gates.md): the same kinds as the rows'
    q8 = {g.split("~", 1)[1].split("_q8", 1)[0] for g in gates.DEFAULT_GATES
          if g.startswith("reference~") and "_q8" in g}
    # a kind that may round its activations: by its fixed numerics, declared at run time, or by an option
    # (the fast engine's --compute q8, docs/quantized-activations.md)
    assert q8 == {k.name for k in ek.KINDS if k.quantizes_activations is not False or "compute" in k.options}


def test_sweep_judge_reads_the_rows():
    pytest.importorskip("ray")
    from gemma4_harness.harness.sweep import judge, run

    assert judge.QUANTIZED_ACTIVATION_KINDS == frozenset({"llamacpp"})
    assert run.DEFAULT_ENGINES == ek.default_against("gguf") == ("fast", "llamacpp")


def test_default_against_is_the_rows(tmp_path):
    assert ek.default_against("gguf") == ("fast", "llamacpp")
    assert ek.default_against("hf") == ("fast", "transformers")
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert default_against(f) == ["fast", "llamacpp"]
    assert default_against(tmp_path) == ["fast", "transformers"]
    assert default_against(f, oracle="fast") == ["llamacpp"]
    assert default_against(tmp_path, oracle="fast") == ["transformers"]


def test_transformers_multimodal_refuses_a_gguf_as_before(tmp_path):
    """The check the if-chain made before it built transformers' engine, now :meth:`TransformersMM.for_model`."""
    from types import SimpleNamespace

    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    for mm_model in (SimpleNamespace(source=str(f), mmproj=None), SimpleNamespace(source=str(tmp_path), mmproj="p")):
        with pytest.raises(EngineUnavailable) as e:
            mm.make_mm_engine("transformers", mm_model)
        assert str(e.value) == (f"{mm_model.source}: the transformers engine needs the HF folder (it cannot read a "
                                "Gemma 4 GGUF or an mmproj)")


def test_help_texts_read_the_rows_unchanged():
    import argparse

    from gemma4_harness.harness.cli import parity as cli_parity

    p = argparse.ArgumentParser()
    cli_parity.add_arguments(p)
    against = next(a.help for a in p._actions if a.dest == "against")
    assert against.endswith("Default: every engine that can read the model (a GGUF: fast, llamacpp; an HF folder: "
                            "fast, transformers)")
    pytest.importorskip("ray")
    from gemma4_harness.harness.cli import sweep as cli_sweep

    p = argparse.ArgumentParser()
    cli_sweep.add_arguments(p)
    assert next(a.help for a in p._actions if a.dest == "against").endswith("Default: fast,llamacpp")


def test_engine_facts_outside_the_registry_are_read_from_the_rows():
    """What the modules outside the registry used to decide by the kind's name (issue 33): the oracles, the kind
    that takes a drafter, the ``--skip`` name that opts a kind out, the file of a built case each kind runs."""
    from gemma4_harness.harness.parity import skips
    from gemma4_harness.harness.parity.checks import pair

    assert ek.ORACLES == ("reference", "fast") and (ek.ORACLE, ek.TWIN) == ("reference", "fast")
    assert not hasattr(pair, "ORACLES")  # read from the registry, not re-exported (parity.job, cli.parity)
    assert [k.name for k in ek.KINDS if k.drafts] == ["fast"]
    assert {k.name: k.skip for k in ek.KINDS if k.skip} == {"llamacpp": "llamacpp"}
    assert all(k.skip in skips.SKIPS for k in ek.KINDS if k.skip)
    assert pair.opted_out("llamacpp", ("llamacpp",)) == "llamacpp" and pair.opted_out("fast", ("llamacpp",)) is None
    assert pair.expected_sets(["fast", "llamacpp"], ("llamacpp",)) == [()]
    built = {k.name: k.built_file("gguf", "hf") for k in ek.KINDS}
    assert built == {"reference": "gguf", "transformers": "hf", "fast": "gguf", "llamacpp": "gguf", "cmd": "gguf",
                     "openai": "gguf"}
    assert ek.KIND["transformers"].reads("gguf", "gemma3") and not ek.KIND["llamacpp"].reads("hf")
    assert "local_tokenizer" in ek.KIND["openai"].options  # our tokenizer of the model: an argument (not a hook)



def test_facts_moved_into_the_rows_read_as_before():
    """What modules outside the registry used to write out by kind name (issue 33, second pass), read from the rows
    and equal to what they wrote: the q8 gates' kinds in their order, the built-in pairs, the server kinds' own
    checks, the --skip names, the bench --engines names, default and drafter rows."""
    from gemma4_harness.harness.bench import DRAFTED
    from gemma4_harness.harness.bench.run import ENGINE_NAMES
    from gemma4_harness.harness.cli.device_bench import DECODE_ENGINES
    from gemma4_harness.harness.parity import cases, skips

    assert ek.rounding_kinds() == ("llamacpp", "openai", "cmd", "fast")  # the order of docs/gates.md's _q8 rows
    q8 = [g.split("~", 1)[1].split("_q8", 1)[0] for g in gates.DEFAULT_GATES if g.startswith("reference~")
          and g.endswith("_q8.greedy")]
    assert q8 == list(ek.rounding_kinds())
    assert {k.name: k.rounds for k in ek.KINDS if k.rounds} == {
        "llamacpp": "always", "openai": "by default", "cmd": "when it declares", "fast": "when asked"}
    for k in ek.KINDS:  # rounds agrees with the numerics it declares or may declare
        assert (k.rounds == "always") == bool(k.quantizes_activations)
        assert (k.rounds in ("by default", "when it declares")) == (k.declares is not None)
        assert (k.rounds == "when asked") == ("compute" in k.options)
    assert cases.BUILTIN_PAIRS == (("fast", {"dtype": "float32"}), ("fast", {"dtype": "bfloat16"}), ("llamacpp", {}))
    assert list(cases.OWN_CHECKS) == ["openai"] and ek.server_kinds() == ("openai",)
    assert list(skips.SKIPS)[0] == "llamacpp" and skips.KIND_SKIPS == {
        "llamacpp": "llama.cpp everywhere: its pairs, its drafter, its multimodal (mtmd) checks and its tokenizer check"}
    assert ENGINE_NAMES == ("fast", "fast-graph", "fast-unchecked", "fast-q8", "transformers", "llamacpp",
                            "llamacpp-native", "reference")
    assert all(b.kind in ek.KIND and b.name.startswith(b.kind) for b in ek.BENCH_ENGINES)
    assert [b.name for b in ek.BENCH_ENGINES if b.default] == ["fast", "transformers", "llamacpp", "reference"]
    assert [b.name for b in ek.BENCH_ENGINES if b.shapes] == ["fast", "fast-graph", "fast-unchecked", "fast-q8"]
    assert DRAFTED == ("fast",) and DECODE_ENGINES == ["fast", "fast-graph"]
    for b in ek.BENCH_ENGINES:  # every maker is a function of harness.bench.models (read, not imported: torch)
        module, function = b.maker.split(":")
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body), b.maker

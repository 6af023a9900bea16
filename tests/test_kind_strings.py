"""Engine kinds named outside the registry (issue 33): every fact about a kind is read from its registry row
(harness/core/engine_kinds.py); a module that writes a kind's name as a string (``"llamacpp"``, ``"fast"``) outside
the registry and the kind's own package is listed, with its reason, in ``tests/kind_strings.py`` (``MUST_NAME``), and
held there. How a kind literal is told from prose, pair names and other meanings: that module's docstring."""

from __future__ import annotations

from pathlib import Path

import kind_strings as ks

from gemma4_harness.harness.core import engine_kinds

ROOT = Path(__file__).resolve().parents[1]


def test_the_kinds_are_the_registrys():
    assert ks.KINDS == tuple(k.name for k in engine_kinds.KINDS)
    assert set(ks.OWN) == set(ks.KINDS)


def test_no_module_names_a_kind_beyond_the_list():
    named = ks.naming(ROOT)
    found = {(m, k): n for k in ks.KINDS for m, n in named[k].items()}
    beyond = {key: n for key, n in found.items() if n > ks.MUST_NAME.get(key, (0, ""))[0]}
    assert not beyond, (
        f"modules naming an engine kind as a string outside harness/core/engine_kinds.py and the kind's own package "
        f"(module, kind): literals: {beyond}; read the fact from the kind's registry row (ORACLE, TWIN, "
        f"rounding_kinds, BENCH_ENGINES ...), or list the module with its reason in tests/kind_strings.py MUST_NAME")
    assert len({m for m, _ in found}) <= 1  # the modules left (parity/cases.py: the built-in cases' extras)


def test_other_meanings_are_still_there():
    """Each literal of another meaning is still in its module (a stale entry would hide a kind literal added
    there)."""
    found = ks.scan(ROOT)
    stale = {key: n for key, (n, _) in ks.OTHER_MEANINGS.items() if len(found[key[1]].get(key[0], [])) < n}
    assert not stale, f"tests/kind_strings.py OTHER_MEANINGS counts more than the module holds: {stale}"


def test_the_count_sees_a_new_kind_string(tmp_path):
    """A module that writes ``"llamacpp"`` as an engine kind is counted; a pair name, a bench row, a docstring and
    an f-string are not."""
    pkg = tmp_path / "harness" / "parity"
    pkg.mkdir(parents=True)
    (pkg / "new.py").write_text('"""Runs llamacpp, "fast"."""\n'
                                'PAIR = "reference~llamacpp"\nROW = "fast-graph"\nX = f"{1}fast"\n'
                                'def f(kind):\n    """"llamacpp" prose."""\n    return kind == "llamacpp"\n')
    for top in ("fast", "reference"):
        (tmp_path / top).mkdir()
    new = (pkg / "new.py").relative_to(tmp_path).as_posix()
    assert ks.naming(tmp_path) == {**{k: {} for k in ks.KINDS}, "llamacpp": {new: 1}}

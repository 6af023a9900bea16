"""Hostile GGUF files: every damage class must end in one clean line or in the clean file's logits.

Each example takes a valid base file, damages it in one way (``tests/gguf_mutate.py``:
truncation in every region, header, structural and name bit flips, huge and off-by-few
counts and lengths, wrong value and element types, required keys renamed or
removed, nonsensical numbers, misaligned / overlapping / out-of-file offsets,
type swaps, changed dims and n_dims, NaN/Inf/huge weights, bad rope_freqs),
then runs ``load_model`` + a 5-token forward in a forked child bounded to 5 s
and its address space + 4 GiB (``tests/gguf_campaign.py``). The only accepted
outcomes: logits bit-identical to the clean file's, or an ``InputError`` whose
message is one line naming the file, with nothing printed or warned before it.
Hangs, tracebacks (MemoryError included), warnings, and exit 0 with other or
non-finite logits all fail.

Bases: the tiny F32 model (tests/conftest.py) and the synthetic E2B case in
Q8_0 (quantized blocks, PLE, KV sharing, a 512-token vocabulary); the slow
variants add 26B-A4B in Q4_0 (MoE) and 31B in BF16, and the fast engine.
"""

from __future__ import annotations

import random

import pytest
from gguf_campaign import OK, campaign, load_base, run_isolated, write_bases
from gguf_mutate import KINDS, mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CI_BASES = ("tiny-F32", "e2b-Q8_0")
ALL_BASES = ("tiny-F32", "e2b-Q8_0", "26b-a4b-Q4_0", "31b-BF16")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Clean base files with their fields located and their reference and fast logits."""
    work = tmp_path_factory.mktemp("fuzz")
    paths = write_bases(work / "bases", ALL_BASES)
    return {"work": work, "loaded": {}, "paths": paths}


def _base(bases, name: str, engine: str):
    key = (name, engine)
    if key not in bases["loaded"]:
        bases["loaded"][key] = load_base(name, bases["paths"][name], (engine,))
    return bases["loaded"][key]


def _check(bases, base_name: str, kind: str, rnd: random.Random, engine: str = "reference") -> None:
    base = _base(bases, base_name, engine)
    data, detail = mutate(base.data, base.layout, kind, rnd)
    path = bases["work"] / f"{base_name}-{kind}.gguf"
    path.write_bytes(data)
    out = run_isolated(path, engine, base.clean[engine])
    assert out.kind in OK, f"{base_name} {kind}: {detail} -> {out.kind}: {out.detail}"


_SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=4, **_SETTINGS)
@given(base=st.sampled_from(CI_BASES), rnd=st.randoms(use_true_random=False))
def test_damaged_gguf_refused_or_same_logits(bases, kind, base, rnd):
    _check(bases, base, kind, rnd)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=150, **_SETTINGS)
@given(base=st.sampled_from(ALL_BASES), rnd=st.randoms(use_true_random=False))
def test_damaged_gguf_refused_or_same_logits_many(bases, kind, base, rnd):
    _check(bases, base, kind, rnd)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=20, **_SETTINGS)
@given(base=st.sampled_from(ALL_BASES), rnd=st.randoms(use_true_random=False))
def test_damaged_gguf_fast_engine(bases, kind, base, rnd):
    _check(bases, base, kind, rnd, engine="fast")


#: The target for the messages of a refused file: this share names the key or tensor at fault itself
#: (as the file spells it; "after key X" of an unreadable entry does not count). Only the 24-byte header
#: (magic, version, counts) has neither.
NAMED_SHARE = 0.90


@pytest.mark.slow
def test_errors_name_the_key_or_tensor(bases):
    """A fixed campaign (every kind on every base in turn, seed 0): every outcome acceptable, and at least
    :data:`NAMED_SHARE` of the errors name a key or tensor."""
    loaded = [_base(bases, name, "reference") for name in ALL_BASES]
    r = campaign(loaded, "reference", 20 * len(KINDS), seed=0, work=bases["work"])
    assert set(r["outcomes"]) <= set(OK), r["examples"]
    named, errors = map(int, r["errors_naming_key_or_tensor"].split("/"))
    assert named >= NAMED_SHARE * errors, f"{named}/{errors} errors name a key or tensor"

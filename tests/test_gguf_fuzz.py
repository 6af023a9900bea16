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


# --------------------------------------------------------------------------- extreme but finite weights (issue 26)

ENGINE_SPECS = ("reference", "fast:float32", "fast:bfloat16", "fast:float16")


@pytest.fixture(scope="module")
def extreme_bases(tmp_path_factory):
    """The e2b case in F32 (norms, projections, PLE, layer scales at full precision) and 26B-A4B in F32 (experts,
    router)."""
    work = tmp_path_factory.mktemp("extreme")
    paths = write_bases(work / "bases", ("e2b-F32", "26b-a4b-F32"))
    return {"work": work, "bases": {n: load_base(n, p, ()) for n, p in paths.items()}}


def _extreme(extreme_bases, base: str, spec: str, role: str, magnitude: float, seed: int = 0):
    from gguf_campaign import EXTREME_OK, run_engine_isolated
    from gguf_mutate import weight_extreme

    b = extreme_bases["bases"][base]
    data, detail = weight_extreme(b.data, b.layout, random.Random(seed), role, magnitude)
    path = extreme_bases["work"] / f"{base}-{role}.gguf"
    path.write_bytes(data)
    out, _ = run_engine_isolated(path, spec, timeout=120)
    assert out.kind in EXTREME_OK, f"{spec} {detail} -> {out.kind}: {out.detail}"
    return out


@pytest.mark.parametrize("spec", ENGINE_SPECS)
def test_extreme_but_finite_weights_never_give_exit_0_nonfinite(extreme_bases, spec):
    """One weight of each role at the top of what the engine's dtype accepts (9.9e29; 65000 for float16): the
    engine computes finite logits, or fails naming its first non-finite layer and point, or refuses in one line;
    never NaN or Inf handed back. Every role at every magnitude: the slow variant, and
    ``python tests/gguf_campaign.py --extreme N``."""
    from gguf_mutate import LADDER, roles_of

    top = LADDER["float16" if spec.endswith("float16") else "float32"][-1]
    for base in ("e2b-F32", "26b-a4b-F32"):
        for role in roles_of(extreme_bases["bases"][base].layout):
            if base == "26b-a4b-F32" and role not in ("experts", "router"):
                continue
            _extreme(extreme_bases, base, spec, role, top)


@pytest.mark.parametrize("tensor,index,value,spec,point", [
    ("blk.0.ffn_norm.weight", 3, 1e25, "fast:float32", "layer 0, point ffn_out"),  # gelu(gate) * up: its square
    ("blk.0.ffn_norm.weight", 3, 1e25, "fast:bfloat16", "layer 0, point ffn_out"),
    ("blk.0.ffn_norm.weight", 3, 60000.0, "fast:float16", "layer 0, point ffn_out"),  # accepted by the 65504 check
    ("blk.0.layer_output_scale.weight", 0, 3000.0, "fast:float16", "layer 1, point per_layer_embd_out"),
])
def test_known_overflows_fail_the_engine_with_the_point_and_were_warned(extreme_bases, tensor, index, value, spec,
                                                                         point):
    """The issue's findings (exit 0 with all-NaN logits), on the e2b case: now the engine fails naming the first
    non-finite layer and point, and the load-time carry check (fast/carry.py) warned about that tensor; the
    reference computes the same file finitely (no false alarm on the specification)."""
    import struct

    from gguf_campaign import run_engine_isolated

    b = extreme_bases["bases"]["e2b-F32"]
    t = {t.name: t for t in b.layout.tensors}[tensor]
    buf = bytearray(b.data)
    struct.pack_into("<f", buf, t.data_start + 4 * index, value)
    path = extreme_bases["work"] / "known.gguf"
    path.write_bytes(bytes(buf))
    out, carry = run_engine_isolated(path, spec, timeout=120)
    assert out.kind == "engine_failed" and f"first at {point}" in out.detail, out
    assert any(f"tensor {tensor}: {spec.split(':')[1]} cannot carry it" in c for c in carry), carry
    assert run_engine_isolated(path, "reference", timeout=120)[0].kind == "finite"


@pytest.mark.slow
@pytest.mark.parametrize("spec", ENGINE_SPECS)
def test_extreme_weights_every_role_and_magnitude(extreme_bases, spec):
    from gguf_mutate import LADDER, roles_of

    for base in ("e2b-F32", "26b-a4b-F32"):
        for role in roles_of(extreme_bases["bases"][base].layout):
            for m in LADDER["float16" if spec.endswith("float16") else "float32"]:
                _extreme(extreme_bases, base, spec, role, m)

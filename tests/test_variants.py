"""The spec-variant catalogue (harness/engines/variants): data and sources, docs/spec-variants.md up to date, the
overrides (each changes the reference exactly where it says, and nothing after the ``with`` block), the fast twin's
forms, and ``--spec`` on the command line and in the parity job's workers."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from clitools import REPO_ROOT, assert_one_line_error, run_cli
from variant_lab import build

import gemma4_harness.reference.drafter as rd
import gemma4_harness.reference.model as rm
from gemma4_harness.harness.core.gates import DEFAULT_GATES as G
from gemma4_harness.harness.core.gates import effect_limit
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.engines.variants import (
    FAMILIES,
    KINDS,
    VARIANTS,
    active,
    family,
    markdown,
    parse_spec,
    spec_context,
    under,
)
from gemma4_harness.harness.traces.compare import DivergenceRule, compare
from gemma4_harness.harness.traces.format import TraceWriter
from gemma4_harness.reference.errors import InputError

PROJECTS = ("transformers 5.23", "llama.cpp", "gemma 4.0.1")
IDS = [2, 100, 200, 300, 17, 45, 99, 301, 302, 5, 6]  # longer than the lab's window of 4


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("lab"))


def test_docs_spec_variants_is_generated_from_the_catalogue():
    text = (REPO_ROOT / "docs" / "spec-variants.md").read_text(encoding="utf-8")
    assert text == markdown(), "stale: python -m gemma4_harness.harness.engines.variants > docs/spec-variants.md"


def test_every_variant_is_complete_data():
    assert set(v.family for v in VARIANTS.values()) == set(FAMILIES)
    for v in VARIANTS.values():
        assert v.kind in KINDS and v.description and v.reference and v.group, v.name
        assert v.override is not None and (v.override.__doc__ or "").strip(), v.name
        assert v.reference_patches, v.name
        projects = {s.project for s in v.sources}
        assert all(s.where and s.says for s in v.sources), v.name
        if v.kind == "disagreement":  # published implementations differ: both sides cited, the followers named
            assert v.followed_by and len(projects & set(PROJECTS)) >= 2, v.name
        if v.kind == "fault":
            assert not v.followed_by, v.name


def test_the_moe_router_disagreement_is_stated_with_its_sources():
    v = VARIANTS["router_expert_input"]
    where = " ".join(s.short() for s in v.sources)
    for name in ("_modules.py Block._forward_moe", "_moe.py MoERagged.__call__", "Gemma4TextDecoderLayer.forward",
                 "src/models/gemma4.cpp"):
        assert name in where
    design = (REPO_ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert "router_expert_input" in design and "moe_in = self.pre_ffw_norm(attn_output)" in design


def test_parse_spec_refuses_unknown_duplicate_and_rival_names():
    assert [v.name for v in parse_spec("head_tied, window_inclusive")] == ["head_tied", "window_inclusive"]
    for text, what in (("no_such_rule", "not a known variant"), ("head_tied,head_tied", "given twice"),
                       ("kv_donor_position,kv_donor_first", "another form of the rule")):
        with pytest.raises(InputError) as e:
            parse_spec(text)
        assert what in str(e.value) and "\n" not in str(e.value)


def test_under_restores_every_name_even_on_an_error():
    before = {n: getattr(rm, n) for n in ("forward", "moe_block", "rms_norm", "decoder_layer", "layer_scale",
                                          "vision_blocks", "pad_id")}
    before_d = (rd.drafter_forward, rd.drafter_head)
    with pytest.raises(RuntimeError):
        with under(list(VARIANTS.values())[:8] + [VARIANTS["layer_scalar_branch"], VARIANTS["drafter_softcap"]],
                   fast=False):
            assert rm.forward is not before["forward"]
            raise RuntimeError("boom")
    assert {n: getattr(rm, n) for n in before} == before and (rd.drafter_forward, rd.drafter_head) == before_d


def _trace(ref, ids):
    w = TraceWriter("x", ids, dtype="float64", keep_tensors=True)
    ref.logits(ids, trace=w)
    return w.trace()


@pytest.mark.parametrize("model", ["lab-dense", "lab-moe"])
def test_each_text_variant_first_changes_the_reference_where_it_says(lab, model):
    """The scope the search relies on: the first trace point the override moves is :meth:`Variant.where`."""
    ref = ReferenceEngine(lab[model])
    forward = rm.forward
    base = _trace(ref, IDS)
    for v in family("text"):
        if v.why_not(ref.cfg) is not None:
            continue
        with under([v], fast=False):
            got = _trace(ref, IDS)
        first = compare(got, base, DivergenceRule(tol=1e-12)).first
        assert first is not None, f"{v.name} changes nothing on {model}"
        assert (first.point, first.layer) == v.where(ref.cfg), (v.name, first.where)
    assert rm.forward is forward  # restored


@pytest.mark.parametrize("model", ["lab-dense", "lab-moe"])
def test_the_fast_twin_follows_each_variant_it_has_a_form_of(lab, model):
    """Within ``reference~fast``'s bound; the fp16 GELU table within the bound of an engine that declares it
    (:func:`harness.core.gates.effect_limit`: twice the table's own effect on the model), the bound the fast twin is
    held to when it stands in for the reference with the same emulation (``--oracle fast``): rounding to fp16 after
    an fp32 GELU flips the odd value by one fp16 step against the float64 one."""
    from gemma4_harness.harness.engines.fast import FastEngine

    ref = ReferenceEngine(lab[model])
    for v in family("text"):
        if not v.has_fast or v.why_not(ref.cfg) is not None:
            continue
        with under([v]):
            z_ref = ref.logits(IDS)
            z_fast = np.asarray(FastEngine(lab[model], device="cpu", dtype="float32").logits(IDS), dtype=np.float64)
        changed = np.max(np.abs(z_ref - ref.logits(IDS)))
        assert changed > G["reference~fast.max_abs_logit"].limit, v.name  # and the variant changed something
        if v.kind == "approximation":  # held as an engine declaring it is: max(fp32 bound, 2 x its effect)
            limit = effect_limit(G["reference~llamacpp.max_abs_logit"], changed)
        else:
            limit = G["reference~fast.max_abs_logit"].limit
        assert np.max(np.abs(z_fast - z_ref)) <= limit, v.name


def test_spec_on_the_command_line(lab, tmp_path):
    ids = tmp_path / "p.json"
    ids.write_text(str(IDS))
    out = tmp_path / "z.npy"
    proc = run_cli("logits", "--model", str(lab["lab-dense"]), "--engine", "reference", "--spec", "rope_freqs_ignored",
                   "--prompt-ids", str(ids), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    ref = ReferenceEngine(lab["lab-dense"])
    with under([VARIANTS["rope_freqs_ignored"]], fast=False):
        want = ref.logits(IDS)
    assert np.array_equal(np.load(out), want)
    assert_one_line_error(run_cli("logits", "--model", str(lab["lab-dense"]), "--spec", "rope_plain", "--prompt-ids",
                                  str(ids), "--out", str(out)), "--spec 'rope_plain'")


def test_parity_under_spec_says_so_and_an_engine_following_the_rule_passes(lab, tmp_path):
    """``g4h parity --spec V`` on a user's model: an engine that follows V passes against the reference under V, and
    the report's first section says which rule the reference ran under."""
    stub = f"cmd:'{sys.executable} {REPO_ROOT / 'tests' / 'cmd_stub.py'} --spec softcap_default_30'"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": %s}\n' % IDS)
    proc = run_cli("parity", "--model", str(lab["lab-moe"]), "--against", stub, "--spec", "softcap_default_30",
                   "--prompts", str(prompts), "--max-new-tokens", "2", "--out", str(tmp_path / "r"), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = next((tmp_path / "r").glob("*/report.md")).read_text()
    assert "the reference ran under spec variants softcap_default_30" in report.split("| case", 1)[0]


def test_the_command_spec_is_named_while_applied_and_not_by_a_trial():
    """``--spec`` (:func:`spec_context`) is what :func:`active` names, the parity job hands to its workers and writes
    in ``results["spec"]``; an explanation's trial (:func:`under` without ``spec``) is not the command's."""
    assert active() == ()
    with spec_context("head_tied,window_inclusive"):
        assert active() == ("head_tied", "window_inclusive")
        with under([VARIANTS["softcap_default_30"]], fast=False):
            assert active() == ("head_tied", "window_inclusive")
    assert active() == ()


def test_a_worker_process_takes_the_parents_spec_as_an_argument(lab):
    """The parity job's case workers are spawned: their initializer is handed the parent's ``--spec``
    (:func:`harness.parity.job._init_worker`) and applies it for the worker's life; no environment variable is read
    (none is set here)."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import gemma4_harness.reference.model as rm\n"
            "f = rm.forward\n"
            "from gemma4_harness.harness.engines.variants import active\n"
            "from gemma4_harness.harness.parity.job import _init_worker\n"
            "_init_worker(1, ('head_tied', 'window_inclusive'))\n"
            "print(active(), rm.forward is not f)\n") % str(REPO_ROOT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("G4H_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "('head_tied', 'window_inclusive') True", out.stderr


def test_multimodal_and_drafter_variants_apply_only_where_they_can(lab):
    cfg = ReferenceEngine(lab["lab-dense"]).cfg
    assert VARIANTS["mm_ple_row_zero"].why_not(cfg) == "pad_token_id is 0: every rule reads row 0"
    assert VARIANTS["mm_image_block_causal"].why_not(cfg) == "the model attends causally already"
    vision = dataclasses.replace(cfg, pad_token_id=1, use_bidirectional_attention="vision")
    assert VARIANTS["mm_ple_row_zero"].where(vision) == ("inp_per_layer", -1)
    assert VARIANTS["mm_bidirectional_full_layers"].where(vision) == ("attn_out", 1)
    assert VARIANTS["kv_donor_position"].why_not(ReferenceEngine(lab["lab-moe"]).cfg) == "no KV-shared layer"


def test_the_fast_engine_refuses_a_variant_it_has_no_form_of(lab, tmp_path):
    ids = tmp_path / "p.json"
    ids.write_text(str(IDS))
    proc = run_cli("logits", "--model", str(lab["lab-moe"]), "--engine", "fast", "--spec", "experts_swiglu",
                   "--prompt-ids", str(ids), "--out", str(tmp_path / "z.npy"))
    assert_one_line_error(proc, "--spec experts_swiglu: the fast engine has no form")


def test_explain_and_spec_bad_input_is_one_line(lab, tmp_path):
    m = ["--model", str(lab["lab-moe"])]
    for name in ("a.jsonl", "b.jsonl"):  # files that exist, so that --spec is the one thing wrong
        (tmp_path / name).write_text("")
    for args, names in ((["explain", *m, "--explain-budget", "-1"], ("--explain-budget",)),
                        (["explain", *m, "--variants", "router"], ("--variants 'router'",)),
                        (["explain", *m, "--tol", "0"], ("--tol",)),
                        (["parity", *m, "--spec", "head_tied,head_tied"], ("given twice",)),
                        (["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--spec", "x"],
                         ("--spec 'x'",))):
        assert_one_line_error(run_cli(*args), *names)

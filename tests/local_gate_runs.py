"""``local_median`` on tests/test_local_gate.py's small quantized files (its VARIANTS and MOE shapes): the correct file
and its faulty copies (the rows fault, on Q4_1/Q5_1 the block and swap faults too, on MoE one expert's rows), the
``llamacpp`` engine against the reference, judged as the pair judges (``tests/quant_pairs.py`` ``judge``). One line
per (shape, file): passed, the figure, its limit, the null, the first diverging point. Run from a source tree's root
(``git archive <commit> | tar -x`` for another commit, to compare)::

    python tests/local_gate_runs.py
"""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_faults import make_fault
from quant_pairs import judge, prompts_for
import test_local_gate as T
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns

gate = "reference~llamacpp_q8.local_median"
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    for variant in list(T.VARIANTS) + list(T.MOE):
        _, path = T._built(variant, tmp)
        runs = ReferenceRuns(ReferenceEngine(path))
        moe = variant in T.MOE
        prompts = prompts_for(path, runs.ref.cfg) if moe else prompts_for(path, runs.ref.cfg)[:4]
        files = [("correct", path)]
        if moe:
            files.append(("expert", make_fault("expert", path, tmp / "expert.gguf", "blk.2.ffn_down_exps.weight")[0]))
        else:
            files.append(("rows", make_fault("rows", path, tmp / "rows.gguf", "blk.1.ffn_down.weight")[0]))
        if variant in ("h96-q4_1", "h128-ple-q5_1"):
            for kind in ("block", "swap"):
                files.append((kind, make_fault(kind, path, tmp / f"{kind}.gguf", "blk.1.ffn_down.weight")[0]))
        for label, f in files:
            r = judge(runs, f, prompts, n_tokens=2)
            g = r["gates"][gate]
            d = g["detail"]
            print(f"{variant:14s} {label:8s} passed={r['passed']!s:5s} local_median={g['worst']:.6g} limit={g['limit']:.3g} "
                  f"null={d.get('null', float('nan')):.6g} first={d.get('first_divergence')} fail={g['fail']}", flush=True)

"""The MoE expert faults of docs/quantized-activations.md: the MoE shape of tests/test_local_gate.py (``MOE``: 5
experts top-2) through the ``llamacpp`` engine, the correct file and one copy per expert of ``blk.1`` and ``blk.2``
with the first half of that expert's ``ffn_down_exps`` rows x1.02 (:func:`quant_faults.scale_expert_rows`), judged
as ``g4h parity`` judges the pair (:func:`quant_pairs.judge`) on the synthetic prompts. Per copy: the verdict, the
``local_median`` figure and first diverging point, and at the faulty layer's ``ffn_moe`` the positions beyond the
limit (the engine's, the null's, the most that flips explain) of all positions: a fault moving fewer than half of
them is one a median over positions cannot see.

    python tests/quant_experts.py [h64-moe-q8_0 h64-moe-q4_0 ...]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_faults import scale_expert_rows  # noqa: E402
from quant_pairs import judge, prompts_for  # noqa: E402
from test_local_gate import MOE, _built  # noqa: E402

from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns  # noqa: E402

GATE = "reference~llamacpp_q8.local_median"


def main(argv: list[str]) -> int:
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for variant in argv or list(MOE):
            _, path = _built(variant, Path(tmp))
            runs = ReferenceRuns(ReferenceEngine(path))
            prompts = prompts_for(path, runs.ref.cfg)
            positions = sum(len(p["prompt_ids"]) for p in prompts)
            copies = [("correct", None, path)]
            for il in (1, 2):
                for e in range(runs.ref.cfg.n_expert):
                    f, what = scale_expert_rows(path, Path(tmp) / f"{variant}-{il}-{e}.gguf",
                                                f"blk.{il}.ffn_down_exps.weight", e)
                    copies.append((f"blk.{il}.ffn_down_exps {what} x1.02", il, f))
            for label, il, f in copies:
                r = judge(runs, f, prompts, n_tokens=2)
                g = r["gates"][GATE]
                d = g["detail"]
                at = [row for row in d.get("moved_per_point") or () if il is not None and row[:2] == ["ffn_moe", il]]
                b, nb, m = at[0][2:] if at else (0, 0, None)
                ok = r["passed"] == (il is None)
                status |= not ok
                print(f"{variant} | {label} | {'PASS' if r['passed'] else 'FAIL'} | {g['worst']:.3g} | "
                      f"{d.get('first_divergence') or '-'} | "
                      + ("-" if il is None else f"{b} / {nb} / {m} of {positions}")
                      + f" | {'ok' if ok else ('false alarm' if il is None else 'miss')}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Issue 38's figure for the ``local_median`` forwards: the reference re-seeded from the ``llamacpp`` engine's
stream, one prompt at a time (``ReferenceRuns.reseeded`` per prompt, as the pair did before) against every prompt in
one pass over the weights (``ReferenceRuns.reseeded_many``, what the pair does now), on one GGUF.

Not part of the test suite (minutes, gigabytes on a real shape); run it by hand::

    python tests/reseed_runs.py FILE.gguf                # both, one after the other in one process
    python tests/reseed_runs.py FILE.gguf after          # one of them

The prompts are the synthetic set within the model's vocabulary (``tests/quant_pairs.py`` ``prompts_for``), the
emulations the ``llamacpp`` engine's. Per path: the wall time and the CPU time of the process (every BLAS thread),
the load average after it (other jobs on the machine inflate both) and the peak resident memory so far. With both:
whether the 2 x prompts traces (re-seeded and the ``jitter_sums`` null) are bit-identical, and each path's
``local_median`` figure (``harness/parity/checks/quantized.py`` ``local_figure``).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from quant_pairs import prompts_for  # noqa: E402

from gemma4_harness.harness.engines import make_engine  # noqa: E402
from gemma4_harness.harness.engines.reference import ReferenceEngine  # noqa: E402
from gemma4_harness.harness.parity.checks.pair import engine_numerics  # noqa: E402
from gemma4_harness.harness.parity.checks.pair_figures import _logits_many  # noqa: E402
from gemma4_harness.harness.parity.checks.quantized import local_figure  # noqa: E402
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns, local_errors  # noqa: E402
from gemma4_harness.harness.parity.result import fig  # noqa: E402


def main(argv: list[str]) -> int:
    path, order = argv[0], argv[1:] or ["before", "after"]
    ref = ReferenceEngine(path)
    runs = ReferenceRuns(ref)
    prompts = prompts_for(path, ref.cfg)
    eng = make_engine("llamacpp", path)
    approx = runs.effective(engine_numerics(eng, "llamacpp").emulation())
    t = time.perf_counter()
    got = _logits_many(eng, "llamacpp", prompts)
    traces = [got[str(p["id"])][1] for p in prompts]
    print(f"{len(prompts)} prompts, {sum(len(p['prompt_ids']) for p in prompts)} tokens, emulations {approx}; "
          f"the engine's traces {time.perf_counter() - t:.1f} s", flush=True)
    res = {}
    for what in order:
        w0, c0 = time.perf_counter(), time.process_time()
        if what == "before":
            res[what] = [runs.reseeded(approx, p, tr) for p, tr in zip(prompts, traces)]
        else:
            res[what] = runs.reseeded_many(approx, prompts, traces)
        w, c = time.perf_counter() - w0, time.process_time() - c0
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{what}: wall {w:.1f} s, CPU {c:.1f} s, load {load}, peak RSS so far {peak:.2f} GiB", flush=True)
    if len(res) == 2:
        pairs = [(x, y) for pa, pb in zip(res["before"], res["after"]) for x, y in zip(pa, pb)]
        same = all(x.tensors.keys() == y.tensors.keys() and all(np.array_equal(x.tensors[k], y.tensors[k])
                                                                 for k in x.tensors) for x, y in pairs)
        print(f"bit-identical traces (re-seeded and null): {same}")
    for what, out in res.items():
        figs = [fig("reference~llamacpp_q8.local_median", float("nan"), p["id"],
                    _errors=local_errors(tr, *o, ref.cfg.n_layer)) for p, tr, o in zip(prompts, traces, out)]
        f = local_figure("reference~llamacpp", figs)
        print(f"{what}: local_median {f.measured:.6g} (null {f.detail['null']:.6g}, worst point "
              f"{f.detail['worst_point']}, first divergence {f.detail['first_divergence']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

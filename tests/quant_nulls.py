"""The null of ``agreeing_positions`` on logits (harness/parity/checks/quantized.py ``quantized_gates``): the input
jitter it used until issue 34 against the sums jitter of the streams' and local_median's nulls (``quantized.NULL``,
its null since), with the ``llamacpp`` engine's logits
(its traces left out: an engine with logits only) on a file of tests/test_local_gate.py and its faulty copies
(quant_faults.make_fault), counted as quantized_gates counts them (leading positions within the max_abs_logit fp32
bound). Prints one JSON line; the table of docs/quantized-activations.md ("Open").

    python tests/quant_nulls.py VARIANT reference|fast [rows,block,swap]
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_local_gate import _built
from quant_faults import make_fault
from quant_matrix import TENSORS
from quant_pairs import prompts_for
from gemma4_harness.harness.core.gates import DEFAULT_GATES
from gemma4_harness.harness.parity.checks.quantized import _agreeing_run
from gemma4_harness.harness.engines import make_engine
from gemma4_harness.harness.engines.fast import FastEngine
from gemma4_harness.harness.engines.reference import ReferenceEngine
from gemma4_harness.harness.engines.numerics import KIND_NUMERICS
from gemma4_harness.harness.parity.checks.reference_runs import ReferenceRuns
from gemma4_harness.reference.weights import load_model

BOUND = DEFAULT_GATES["reference~llamacpp_q8.max_abs_logit"].limit  # the fp32 bound quantized_gates counts within


def lead(a, b):
    """The leading run of positions within BOUND, as quantized_gates counts it."""
    return _agreeing_run(np.max(np.abs(a - b), axis=1).tolist(), BOUND)[0]


variant, oracle = sys.argv[1], sys.argv[2]
faults = sys.argv[3].split(",") if len(sys.argv) > 3 else ["rows", "block", "swap"]
tensors = dict(zip(("rows", "block", "swap"), TENSORS))  # the fault matrix's matrices (tests/quant_matrix.py)
tmp = Path(tempfile.mkdtemp(prefix="quant-nulls-")) / variant
tmp.mkdir(parents=True, exist_ok=True)
_, path = _built(variant, tmp)
cfg, W = load_model(path, cache_bytes=0)
ref = ReferenceEngine.from_model(cfg, W)
runs = ReferenceRuns(ref) if oracle == "reference" else ReferenceRuns(ref, FastEngine.from_model(cfg, W, device="cpu"))
prompts = prompts_for(path, cfg)
approx = runs.effective(KIND_NUMERICS["llamacpp"].emulation())
t0 = time.time()
base = {str(p["id"]): runs.logits(approx, p)[0] for p in prompts}
nin = {str(p["id"]): lead(runs.raw_logits((*approx, "jitter"), p["prompt_ids"]), base[str(p["id"])])
       for p in prompts}
nsum = {str(p["id"]): lead(runs.raw_logits((*approx, "jitter_sums"), p["prompt_ids"]), base[str(p["id"])])
        for p in prompts}
rows = {"variant": variant, "oracle": oracle, "prompts": len(prompts),
        "positions": sum(len(p["prompt_ids"]) for p in prompts), "null_input": sum(nin.values()),
        "null_sums": sum(nsum.values()), "per_prompt_null": {k: [nin[k], nsum[k]] for k in nin}}
copies = [("correct", path)]
for f in faults:
    try:
        copies.append((f, make_fault(f, path, tmp / f"{f}.gguf", tensors[f])[0]))
    except Exception as e:
        print("fault", f, e)
for label, f in copies:
    eng = make_engine("llamacpp", f)
    try:
        got = eng.logits_many([p["prompt_ids"] for p in prompts], trace=False)
    finally:
        getattr(eng, "close", lambda: None)()
    agree = {str(p["id"]): lead(np.asarray(z, dtype=np.float64), base[str(p["id"])]) for p, (z, _) in zip(prompts, got)}
    a = sum(agree.values())
    rows[label] = {"agreeing": a, "ratio_input": a / rows["null_input"] if rows["null_input"] else float("nan"),
                   "ratio_sums": a / rows["null_sums"] if rows["null_sums"] else float("nan"),
                   "per_prompt": agree}
rows["seconds"] = round(time.time() - t0, 1)
print(json.dumps(rows))

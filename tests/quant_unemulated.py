"""A server whose activation rounding cannot be emulated, judged by the streams' yardstick
(docs/quantized-activations.md, "Not emulated, on a server"): llama-server with its defaults on a file and on
faulty copies of it (quant_faults: ``rows<factor>`` the first half of a matrix's rows scaled, ``block`` one block
x1.5, ``swap`` two rows swapped), each judged by ``g4h parity --declare vec_dot_types=none`` against the correct
file. Prints one line per run: the exit status, ``<pair>_q8x.mean_kld`` against its limit, the yardstick and their
ratio.

    python tests/quant_unemulated.py FILE|VARIANT PROMPTS|small|texts reference|fast FAULTS [NEW_TOKENS]

``VARIANT``: a shape of tests/test_local_gate.py (``h96-q8_0``, ``h128-ple-q4_0``); ``small``: the four prompts of
tests/test_unemulated_server.py; ``texts``: tests/field_servers.py's; ``FAULTS``: a comma list of ``correct``,
``rows1.02``, ``block``, ``swap``. Tensors: ``blk.1.ffn_down`` (rows), ``blk.3.attn_output`` (block),
``blk.2.ffn_gate`` (swap).
"""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from field_servers import field_prompts, server  # noqa: E402
from quant_faults import make_fault, scale_rows  # noqa: E402
from test_local_gate import VARIANTS, _built  # noqa: E402
from test_unemulated_server import NEW_TOKENS, OPTIONS, PROMPTS  # noqa: E402

from gemma4_harness.harness.cli import main  # noqa: E402

TENSORS = {"rows": "blk.1.ffn_down.weight", "block": "blk.3.attn_output.weight", "swap": "blk.2.ffn_gate.weight"}


def run(model: Path, prompts: Path, oracle: str, fault: str, tmp: Path, new_tokens: int) -> str:
    """One server on ``model``'s copy with ``fault``, judged against ``model``: the line printed."""
    if fault == "correct":
        path = model
    elif fault.startswith("rows"):
        path = scale_rows(model, tmp / "fault.gguf", TENSORS["rows"], float(fault[4:]))
    else:
        path = make_fault(fault, model, tmp / "fault.gguf", TENSORS[fault])[0]
    s = server("llama-server", path, tmp / f"{fault}.log").start()
    try:
        out, t0 = tmp / f"out-{fault}", time.time()
        rc = main(["parity", "--model", str(model), "--against", f"openai:{s.url}/v1", "--prompts", str(prompts),
                   "--out", str(out), "--max-new-tokens", str(new_tokens), *OPTIONS,
                   *(["--oracle", "fast"] if oracle == "fast" else [])])
    finally:
        s.stop()
    (results,) = out.glob("*/results.json")
    checks = [c for c in json.loads(results.read_text())["cases"][0]["checks"] if c["gate"].endswith("_q8x.mean_kld")]
    if not checks:
        return f"{fault}: exit {rc}, no _q8x.mean_kld figure"
    c = checks[0]
    return (f"{fault}: exit {rc}, {c['gate']} {c['measured']:.3g} (limit {c['limit']:.3g}), yardstick "
            f"{c['yardstick']:.3g}, ratio {c['measured'] / c['yardstick']:.2f}, {c['positions']} positions, "
            f"{time.time() - t0:.0f} s")


def main_(argv: list[str]) -> None:
    target, prompts_arg, oracle, faults = argv[:4]
    new_tokens = int(argv[4]) if len(argv) > 4 else NEW_TOKENS
    with tempfile.TemporaryDirectory(prefix="g4h-unemulated-") as t:
        tmp = Path(t)
        model = _built(target, tmp)[1] if target in VARIANTS else Path(target)
        prompts = tmp / "prompts.jsonl"
        lines = (field_prompts() if prompts_arg == "texts" else
                 [{"id": f"p{k}", "prompt_ids": p} for k, p in enumerate(PROMPTS)] if prompts_arg == "small" else None)
        if lines is None:
            prompts = Path(prompts_arg)
        else:
            prompts.write_text("".join(json.dumps(p) + "\n" for p in lines))
        for fault in faults.split(","):
            print(f"{target} {oracle} {run(model, prompts, oracle, fault, tmp, new_tokens)}", flush=True)


if __name__ == "__main__":
    main_(sys.argv[1:])

"""llama.cpp against the float64 reference on the real Gemma 3 270M GGUF (:func:`check_gemma3_real`, the
``tests/test_llamacpp.py`` measurement and ``g4h``'s Gemma 3 figures) and the F32 copy it is controlled with.

A built synthetic case measures llama.cpp through the pair pipeline of ``--model`` (``reference~llamacpp``,
:mod:`.pair`: the reference emulates llama.cpp's declared fp16 GELU table, the figures against the exact reference
beside as ``vs_exact_reference``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from gemma4_harness.reference.tokenizer import tokenizer_from_gguf

from ...core.kld import kld_stats
from ...core.realdata import gemma3_270m_gguf
from ...core.workers import EngineCrashed
from ...engines.llamacpp import LlamaCppEngine
from ...engines.reference import ReferenceEngine
from .gemma3_real import PROMPTS


def check_gemma3_real(path: str | os.PathLike | None = None, *, threads: int | None = None,
                      texts: Sequence[str] | None = None, f32_control: bool = False) -> dict[str, Any]:
    """llama.cpp vs the float64 reference on the real Gemma 3 270M GGUF (Q8_0/Q5_0/Q4_K/Q6_K tensors).

    Tokenizes each text with :func:`reference.tokenizer.tokenizer_from_gguf` (and, as a side check,
    with llama.cpp's own tokenizer), runs both engines over every position, and pools all
    positions into one ``llama-perplexity --kl-divergence`` statistic set (next-token ids given,
    so PPL and Δp figures are filled). Also greedy-generates each :data:`harness.parity.checks.gemma3_real.PROMPTS`
    prompt with llama.cpp and checks the expected continuation.

    On a quantized file llama.cpp's CPU matmuls quantize the *activations* too (to Q8_K / Q8_0 for the
    integer dot products), which the reference (exactly dequantized weights, float64 activations) does
    not; that, not a formula fault, is most of the difference. ``f32_control=True`` separates the two:
    it writes an F32 copy of the file (every tensor dequantized with ``gguf.quants``, the same values the
    reference uses; ~1.1 GB, cached beside the original) and repeats the comparison on it as
    ``f32_control``, where only fp32 rounding and the fp16 GELU table remain.

    Returns:
        ``model``, ``n_positions``, ``kld`` (:class:`harness.core.kld.KLDStats` as a dict), ``max_abs_logit``,
        ``per_text`` (n_tokens, max_abs_logit, mean_kld, same_top1, tokenizer_match), ``continuations``
        (per prompt: expected, llama.cpp text, pass), ``seconds``; or ``error`` when llama.cpp crashes;
        with ``f32_control``, also ``f32_control`` (the same keys, on the F32 copy).

    Raises:
        EngineUnavailable: llama-cpp-python is not installed.
        InputError: the GGUF package is missing or the file is bad.
    """
    t0 = time.perf_counter()
    gguf_path = Path(path) if path is not None else gemma3_270m_gguf()
    tok = tokenizer_from_gguf(gguf_path)
    if texts is None:
        texts = [text + expected for _, text, expected in PROMPTS] + list(GEMMA3_EXTRA_TEXTS)
    seqs = [tok.encode(t) for t in texts]
    eng = LlamaCppEngine(gguf_path, n_ctx=max(len(s) for s in seqs) + 32, threads=threads)
    res: dict[str, Any] = {"model": str(gguf_path), "texts": list(texts)}
    try:
        runs = eng.logits_many(seqs)
        prompt_ids = [tok.encode(text) for _, text, _ in PROMPTS]
        n_new = [len(tok.encode(exp, add_bos=False)) + 2 for _, _, exp in PROMPTS]
        gens = eng.generate_full(prompt_ids, max(n_new))
        llama_tok = eng.tokenize_many(texts)
    except EngineCrashed as e:
        res.update(error=str(e), error_kind="engine", seconds=round(time.perf_counter() - t0, 3))
        return res
    t_ref = time.perf_counter()
    ref = ReferenceEngine(gguf_path)
    per_text, ours_all, ref_all, next_all = [], [], [], []
    for text, ids, (ours, _), lt in zip(texts, seqs, runs, llama_tok):
        base = ref.logits(ids)
        st = kld_stats(ours, base)
        per_text.append({"text": text, "n_tokens": len(ids), "max_abs_logit": float(np.max(np.abs(ours - base))),
                         "mean_kld": float(st.mean_kld), "same_top1": float(st.same_top_p_pct) / 100.0,
                         "tokenizer_match": lt == list(ids)})
        # Rows 0..T-2 are scored against the next token (llama-perplexity's convention).
        ours_all.append(ours[:-1])
        ref_all.append(base[:-1])
        next_all.append(np.asarray(ids[1:], dtype=np.int64))
    ref_s = time.perf_counter() - t_ref
    ours_cat, ref_cat = np.concatenate(ours_all), np.concatenate(ref_all)
    stats = kld_stats(ours_cat, ref_cat, tokens=np.concatenate(next_all))
    conts = []
    for (name, text, expected), g in zip(PROMPTS, gens):
        k = len(tok.encode(expected, add_bos=False)) + 2
        cont = tok.decode(g.tokens[:k])
        conts.append({"name": name, "expected": expected, "llamacpp": cont, "pass": cont.startswith(expected)})
    res.update({
        "n_positions": int(ours_cat.shape[0]),
        "kld": stats.as_dict(),
        "max_abs_logit": float(np.max(np.abs(ours_cat - ref_cat))),
        "per_text": per_text,
        "continuations": conts,
        "reference_s": round(ref_s, 3),
        "seconds": round(time.perf_counter() - t0, 3),
    })
    if f32_control:
        del ref
        f32 = gguf_path.with_name(gguf_path.stem + ".F32-control.gguf")
        f32_copy(gguf_path, f32)
        res["f32_control"] = check_gemma3_real(f32, threads=threads, texts=texts)
    return res


def f32_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write ``dst``: ``src`` with every tensor dequantized to F32 (``gguf.quants.dequantize``), same metadata.

    Reused when ``dst`` exists and is newer than ``src``; written under a temporary name and moved into
    place, so an interrupted write never leaves a partial file under ``dst``.
    """
    src, dst = Path(src), Path(dst)
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    r = GGUFReader(src)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), str(r.fields["general.architecture"].contents()))
    try:
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            vt = GGUFValueType(f.types[0])
            w.add_key_value(name, f.contents(), vt, sub_type=GGUFValueType(f.types[-1])
                            if vt == GGUFValueType.ARRAY else None)
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w.add_tensor(t.name, a.reshape(tuple(int(x) for x in reversed(t.shape))))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


#: Extra real-text passages for the Gemma 3 KLD statistics (more positions than the three short prompts).
GEMMA3_EXTRA_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. Meanwhile, in the kitchen, the kettle began to whistle, "
    "and the cat, startled, knocked a cup of tea off the table.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature, which is why cooking pasta in the mountains takes longer.",
)

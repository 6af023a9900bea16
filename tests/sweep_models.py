"""Models for the ``g4h sweep`` tests: two tiny synthetic Gemma 4 models of different shapes, and eight
quantizations of the first made by llama.cpp's own ``llama-quantize`` (built into the user cache on first use).

* ``sweep-a``: hidden 256 (rows K-quants can take whole), 4 layers (3 sliding, 1 full), no PLE, untied head.
* ``sweep-b``: hidden 128, 3 layers, PLE, tied head, another vocabulary size: a second group in one sweep.
"""

from __future__ import annotations

from pathlib import Path

from gemma4_harness.harness import synth
from gemma4_harness.harness.core.paths import cache_root
from gemma4_harness.harness.engines.llamacpp import tools

#: The eight types of the issue's table, every family of llama-quantize: legacy, K-quants (S/M mixes), i-quant.
TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K", "IQ4_XS")

_COMMON = """
max_position_embeddings = 4096
rms_norm_eps = 1e-6
hidden_activation = "gelu_pytorch_tanh"
attention_k_eq_v = false
enable_moe_block = false
final_logit_softcapping = 30.0
sliding_window = 16

[config.rope_parameters.sliding_attention]
rope_type = "default"
rope_theta = 10000.0

[config.rope_parameters.full_attention]
rope_type = "proportional"
partial_rotary_factor = 0.25
rope_theta = 1000000.0
"""

SPEC_A = """description = "g4h sweep tests: hidden 256 (whole K-quant blocks), 4 layers, no PLE"
seed = 20260428

[config]
vocab_size = 512
hidden_size = 256
intermediate_size = 512
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 64
global_head_dim = 128
layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
num_kv_shared_layers = 0
hidden_size_per_layer_input = 0
vocab_size_per_layer_input = 512
use_double_wide_mlp = false
tie_word_embeddings = false
""" + _COMMON + """
[init]
# The built-in cases' scales (cases/models/e2b.toml), with an untied head: median top-1 margin 1.06 on
# cases/prompts/synthetic.jsonl, logits up to 24 (tied at this width the input token dominates: margin 11, a saturated
# softmax that no quantization moves).
embed_std = 0.2
linear_gain = 1.0
norm_low = 0.6
norm_high = 1.4
qk_norm_low = 0.25
qk_norm_high = 0.5
post_norm_low = 1.0
post_norm_high = 2.0
output_norm_low = 1.5
output_norm_high = 3.0
layer_scalar_low = 0.5
layer_scalar_high = 1.5
"""

SPEC_B = """description = "g4h sweep tests: a second group (hidden 128, 3 layers, PLE, tied head, vocabulary 384)"
seed = 20260429

[config]
vocab_size = 384
hidden_size = 128
intermediate_size = 256
num_hidden_layers = 3
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 64
global_head_dim = 64
layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
num_kv_shared_layers = 0
hidden_size_per_layer_input = 16
vocab_size_per_layer_input = 384
use_double_wide_mlp = false
tie_word_embeddings = true
""" + _COMMON + """
[init]
embed_std = 0.2
"""


def build(name: str, text: str) -> synth.BuiltCase:
    """The synthetic case of spec ``text`` (written to and cached under ``$G4H_CACHE``)."""
    spec_dir = cache_root() / "sweep-test-specs"
    spec_dir.mkdir(parents=True, exist_ok=True)
    path = spec_dir / f"{name}.toml"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return synth.ensure_built(path)


def quantized(case: synth.BuiltCase, types=TYPES) -> dict[str, Path]:
    """``case``'s F32 GGUF quantized to each type by ``llama-quantize`` (made once, kept beside the case)."""
    src = case.gguf["F32"]
    out = {}
    t = None
    for qt in types:
        dst = src.parent / "llama-quantize" / f"{case.spec.name}-{qt}.gguf"
        if not dst.is_file():
            dst.parent.mkdir(exist_ok=True)
            t = t or tools.ensure_tools()
            tools.quantize(src, dst, qt, tools=t)
        out[qt] = dst
    return out

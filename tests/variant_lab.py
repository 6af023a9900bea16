"""Two tiny Gemma 4 models on which every text spec variant changes something (tests/test_explain.py,
tests/test_variants.py), written straight to F32 GGUF from a spec (no transformers, milliseconds).

* ``lab-dense``: 5 layers ``[S, F, S | S, F]`` with the last two KV-shared, one head_dim for both layer types (so
  llama.cpp's and JAX's position rule, which crosses types here, gives another valid layout), PLE, an untied head,
  a final softcap, window 4 (the prompts are longer), proportional RoPE on the full layers;
* ``lab-moe``: 2 layers ``[S, F]``, MoE (4 experts, top 2) beside the dense MLP, no softcap key, a tied head.

Norms, router and layer scalars are drawn away from 1 (the built-in cases' ``[init]``), so no variant is invisible.
"""

from __future__ import annotations

from pathlib import Path

from gemma4_harness.harness.synth import load_spec, make_weights, write_gguf

#: The built-in cases' weight scales (cases/models/e2b.toml): norms, router and scalars away from 1.
COMMON_INIT = """
[init]
embed_std = 0.2
ple_embed_std = 1.0
linear_gain = 1.0
router_std = 1.5
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
router_scale_low = 0.5
router_scale_high = 1.5
per_expert_scale_low = 0.5
per_expert_scale_high = 1.5
"""
#: Gemma 4's RoPE: default on sliding layers, proportional (0.25) on full layers.
ROPE = """
[config.rope_parameters.sliding_attention]
rope_type = "default"
rope_theta = 10000.0

[config.rope_parameters.full_attention]
rope_type = "proportional"
partial_rotary_factor = 0.25
rope_theta = 1000000.0
"""
#: The dense model's spec.
DENSE = '''description = "variant lab, dense"
seed = 27001

[config]
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 5
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
global_head_dim = 16
attention_k_eq_v = false
layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
sliding_window = 4
max_position_embeddings = 256
rms_norm_eps = 1e-6
hidden_activation = "gelu_pytorch_tanh"
num_kv_shared_layers = 2
hidden_size_per_layer_input = 8
vocab_size_per_layer_input = 512
use_double_wide_mlp = false
enable_moe_block = false
final_logit_softcapping = 30.0
tie_word_embeddings = false
''' + ROPE + COMMON_INIT
#: The MoE model's spec.
MOE = '''description = "variant lab, MoE"
seed = 27002

[config]
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
global_head_dim = 16
attention_k_eq_v = false
layer_types = ["sliding_attention", "full_attention"]
sliding_window = 4
max_position_embeddings = 256
rms_norm_eps = 1e-6
hidden_activation = "gelu_pytorch_tanh"
num_kv_shared_layers = 0
hidden_size_per_layer_input = 0
vocab_size_per_layer_input = 512
use_double_wide_mlp = false
enable_moe_block = true
num_experts = 4
top_k_experts = 2
moe_intermediate_size = 16
tie_word_embeddings = true
''' + ROPE + COMMON_INIT


def build(out: Path) -> dict[str, Path]:
    """Write ``lab-dense.gguf`` and ``lab-moe.gguf`` (and their specs) into ``out``; name -> GGUF path."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in (("lab-dense", DENSE), ("lab-moe", MOE)):
        toml = out / f"{name}.toml"
        toml.write_text(text)
        spec = load_spec(toml)
        paths[name] = write_gguf(spec, make_weights(spec), out / f"{name}.gguf")
    return paths

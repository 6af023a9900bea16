"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence


def _share_cpus() -> None:
    """Under pytest-xdist, give each worker its share of the CPUs: ``OMP_NUM_THREADS`` (and OpenBLAS's and MKL's)
    = CPUs // workers, unless the user set it. Set here, before numpy or torch is imported, so their thread pools
    start at that size, and llama.cpp's workers and servers take it (:func:`harness.engines.llamacpp.worker.
    default_threads`). Without it, 2 workers on 2 cores ran 4 spinning threads: measured, the whole suite took
    16.5 minutes against 8.7 with one thread per worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        share = str(max(1, len(os.sched_getaffinity(0)) // workers))
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, share)


_share_cpus()

# Ray's loopback switch (harness/core/cluster.py, LOOPBACK_SWITCH), set before any test module imports Ray: the
# clusters the tests start are bound to 127.0.0.1, and a driver whose Ray was imported without it would connect to
# this machine's network address instead (ray._private.services.resolve_ip_for_localhost)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402  (after _share_cpus: its BLAS threads start at import)
import pytest  # noqa: E402

#: The real llama.cpp servers (llama-server, llama-cpp-python) and the GGUFs they serve, as fixtures.
pytest_plugins = ("servers",)


def _cuda_present() -> bool:
    import torch  # lazy: only when a collected test needs CUDA

    return torch.cuda.is_available()


# Triton's interpreter (tests/test_cuda_kernels.py runs the fused kernels' source on the CPU) must be on before
# triton is first imported in the process: triton defines its own library functions (tl.max's combine, ...) as
# interpreted or compiled at import, and torch/transformers import it early. On a machine with a GPU the compiled
# kernels are what the `cuda` tests check, and the variable stays as the user set it.
if "TRITON_INTERPRET" not in os.environ and not _cuda_present():
    os.environ["TRITON_INTERPRET"] = "1"

# --------------------------------------------------------------------------- tiny gemma4 GGUF

# A 2-layer gemma4 text decoder: layer 0 sliding (head_dim 8), layer 1 full
# (head_dim 8, proportional RoPE through rope_freqs), GQA 2:1, tied head, no
# PLE, no MoE. Small enough that the float64 reference runs in milliseconds.
TINY = {
    "n_layer": 2,
    "hidden": 16,
    "n_head": 2,
    "n_kv_head": 1,
    "head_dim": 8,
    "head_dim_swa": 8,
    "n_ff": 32,
    "vocab": 32,
    "window": 4,
    "context": 64,
    "pattern": [True, False],  # true = sliding layer
}


def tiny_tensor_shapes(c: Mapping[str, Any] = TINY) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes of every tensor of the tiny model (matches reference.config.expected_tensors)."""
    h, v = c["hidden"], c["vocab"]
    t: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (v, h),
        "output_norm.weight": (h,),
        "rope_freqs.weight": (c["head_dim"] // 2,),
    }
    for i, sliding in enumerate(c["pattern"]):
        d = c["head_dim_swa"] if sliding else c["head_dim"]
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = (h,)
        t[b + "attn_q.weight"] = (c["n_head"] * d, h)
        t[b + "attn_k.weight"] = (c["n_kv_head"] * d, h)
        t[b + "attn_v.weight"] = (c["n_kv_head"] * d, h)
        t[b + "attn_q_norm.weight"] = (d,)
        t[b + "attn_k_norm.weight"] = (d,)
        t[b + "attn_output.weight"] = (h, c["n_head"] * d)
        t[b + "post_attention_norm.weight"] = (h,)
        t[b + "ffn_norm.weight"] = (h,)
        t[b + "ffn_gate.weight"] = (c["n_ff"], h)
        t[b + "ffn_up.weight"] = (c["n_ff"], h)
        t[b + "ffn_down.weight"] = (h, c["n_ff"])
        t[b + "post_ffw_norm.weight"] = (h,)
        t[b + "layer_output_scale.weight"] = (1,)
    return t


def write_tiny_gguf(
    path: str | Path,
    *,
    arch: str = "gemma4",
    drop: tuple[str, ...] = (),
    reshape: Mapping[str, tuple[int, ...]] | None = None,
    seed: int = 0,
    extra_kv: Sequence[tuple[str, Any, Any, Any]] = (),
    skip_kv: tuple[str, ...] = (),
) -> Path:
    """Write the tiny gemma4 model as an F32 GGUF with llama.cpp's keys and tensor names.

    Args:
        path: destination file.
        arch: ``general.architecture`` (another value makes a wrong-architecture
            file; the keys stay under ``gemma4.``).
        drop: tensor names to leave out (a missing-tensor file).
        reshape: tensor name -> numpy-order shape to write instead of the right
            one (a mis-shaped-tensor file).
        seed: weight seed.
        extra_kv: more keys, ``(key, value, gguf.GGUFValueType, array element type or None)``.
        skip_kv: keys to leave out.

    Returns:
        ``path`` as a :class:`Path`.
    """
    import gguf

    c = TINY
    VT = gguf.GGUFValueType
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    a = "gemma4"
    kv: list[tuple[str, Any, Any, Any]] = [
        ("general.name", "tiny-test", VT.STRING, None),
        ("general.file_type", 0, VT.UINT32, None),
        (f"{a}.context_length", c["context"], VT.UINT32, None),
        (f"{a}.block_count", c["n_layer"], VT.UINT32, None),
        (f"{a}.embedding_length", c["hidden"], VT.UINT32, None),
        (f"{a}.feed_forward_length", c["n_ff"], VT.UINT32, None),
        (f"{a}.attention.head_count", c["n_head"], VT.UINT32, None),
        (f"{a}.attention.head_count_kv", c["n_kv_head"], VT.UINT32, None),
        (f"{a}.attention.key_length", c["head_dim"], VT.UINT32, None),
        (f"{a}.attention.value_length", c["head_dim"], VT.UINT32, None),
        (f"{a}.attention.key_length_swa", c["head_dim_swa"], VT.UINT32, None),
        (f"{a}.attention.value_length_swa", c["head_dim_swa"], VT.UINT32, None),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, VT.FLOAT32, None),
        (f"{a}.attention.sliding_window", c["window"], VT.UINT32, None),
        (f"{a}.attention.sliding_window_pattern", list(c["pattern"]), VT.ARRAY, VT.BOOL),
        (f"{a}.rope.freq_base", 1_000_000.0, VT.FLOAT32, None),
        (f"{a}.rope.freq_base_swa", 10_000.0, VT.FLOAT32, None),
        (f"{a}.rope.dimension_count", c["head_dim"], VT.UINT32, None),
        (f"{a}.rope.dimension_count_swa", c["head_dim_swa"], VT.UINT32, None),
        (f"{a}.final_logit_softcapping", 30.0, VT.FLOAT32, None),
    ]
    for key, val, vtype, sub in [*kv, *extra_kv]:
        if key not in skip_kv:
            w.add_key_value(key, val, vtype, sub_type=sub)

    shapes = tiny_tensor_shapes(c)
    reshape = dict(reshape or {})
    for name in list(reshape) + list(drop):
        if name not in shapes:
            raise KeyError(f"tiny model has no tensor {name}")
    for name, shape in shapes.items():
        if name in drop:
            continue
        shape = tuple(reshape.get(name, shape))
        if name == "rope_freqs.weight":
            # proportional RoPE, partial_rotary_factor 0.25: 1 rotated pair, 1e30 for the rest
            n = shape[0]
            arr = np.array([1.0] + [1e30] * (n - 1), dtype=np.float32)
        elif len(shape) == 1:  # norms and the layer scalar: around 1, randomised
            arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            arr = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def make_tiny_gguf(tmp_path) -> Callable[..., Path]:
    """Factory ``make(name="tiny.gguf", **kw) -> Path`` writing :func:`write_tiny_gguf` variants into tmp_path."""

    def make(name: str = "tiny.gguf", **kw: Any) -> Path:
        return write_tiny_gguf(tmp_path / name, **kw)

    return make


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    """A valid tiny 2-layer F32 gemma4 GGUF (vocab 32, context 64) in tmp_path."""
    return write_tiny_gguf(tmp_path / "tiny.gguf")


# --------------------------------------------------------------------------- the gemma4-type test tokenizer


@pytest.fixture(scope="session")
def built():
    """The gemma4-type test tokenizer (GGUF + tokenizer.json), built once into the cache."""
    from gemma4_harness.harness.tokenizer.build import build_gemma4_test_tokenizer

    return build_gemma4_test_tokenizer()


@pytest.fixture(scope="session")
def g4(built):
    """Ours on the gemma4-type GGUF."""
    from gemma4_harness.harness.tokenizer.engines import cached_tok_engine

    return cached_tok_engine("ours", str(built.gguf), True, None).tok


# --------------------------------------------------------------------------- the wheel (test_wheel, test_namespace)


BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "gemma4_harness", "reference", "fast",
                "harness", "cases")
"""What a build of the distribution reads, relative to the repository root."""


@pytest.fixture(scope="session")
def wheel_source(tmp_path_factory) -> Path:
    """A copy of :data:`BUILD_INPUTS` (Python caches, a built case library and egg-info left out), so that a build or
    an editable install writes nothing into the clone."""
    src = tmp_path_factory.mktemp("src")
    root = Path(__file__).resolve().parent.parent
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_cases", "*.egg-info")
    for name in BUILD_INPUTS:
        p = root / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    return src


@pytest.fixture(scope="session")
def wheel(wheel_source, tmp_path_factory) -> Path:
    """The wheel, built from :func:`wheel_source` without build isolation (this environment's setuptools) and
    without an index."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(wheel_source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("gemma4_harness-*.whl")
    return whl


# --------------------------------------------------------------------------- pytest --bench


def pytest_addoption(parser):
    parser.addoption("--bench", action="store_true", default=False,
                     help="run the throughput benchmarks (tests marked 'bench'); they write reports/<ts>-bench/")


def pytest_collection_modifyitems(config, items):
    """Deselect (not skip) what was not asked for or cannot apply here, and say so in the summary.

    * benchmarks (marker ``bench``) without ``--bench``;
    * tests of a CUDA device (marker ``cuda``) on a machine without one: the CPU-side tests of the same
      code still run; the device figures come from ``g4h device-check`` on a GPU machine.
    """
    drop = []
    if not config.getoption("--bench"):
        drop += [item for item in items if "bench" in item.keywords]
    cuda = [item for item in items if "cuda" in item.keywords and item not in drop]
    if cuda and not _cuda_present():
        drop += cuda
        config._g4h_no_cuda = len(cuda)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item not in drop]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_g4h_no_cuda", 0)
    if n:
        terminalreporter.write_line(f"{n} CUDA test(s) deselected: no CUDA device here (they run on a GPU machine)")

"""The harness's foundation: paths, run directories and atomic writes, cases and prompts, metrics, gates.

Nothing in ``harness.core`` imports another ``harness`` subpackage; everything above it may use it
(the layers are declared in ``pyproject.toml`` and checked by ``tests/test_layers.py``).
"""

"""``g4h sweep``: every quantization of every model against one float64 base, on every engine, on Ray.

Who it is for: quantizers who publish a GGUF per type of each model, and engine authors whose CI runs every
architecture x quantization x backend. The question it answers: which file, on which engine, is wrong, and how
wrong. The design (``docs/sweep.md``):

* :mod:`.files`: the files named (a folder, a list, a glob), read from their headers (``g4h inspect``), grouped by
  base model (architecture and tensor shapes); each group's base is its highest-precision file (or ``--base``).
* :mod:`.prompts`: the prompt set (token ids or text), per group.
* :mod:`.tasks`: what a task computes: the float64 reference on the base once per group (:func:`.tasks.base_run`),
  one engine on one file against it (:func:`.tasks.engine_run`: llama-perplexity's KLD statistics, greedy
  agreement, the first-divergence layer), the group's 8-bit yardstick (:func:`.tasks.sensitivity_run`).
* :mod:`.run`: the sweep on Ray: the base through the object store, one task per (file, engine) declaring the CPUs
  and memory of its engine's memory plan, dead tasks as rows, resumable (:mod:`.store`), cluster started locally or
  reached with ``--address`` (:mod:`harness.core.cluster`, :mod:`harness.core.keeper`, shared with ``g4h parity --address``), progress shown (:mod:`.progress`).
* :mod:`.judge`: statuses, the cross-engine gates, the exit status. :mod:`.report`: ``results.json``, ``sweep.csv``,
  ``report.md``, the plots.

Ray is imported only by :mod:`.run` and :mod:`harness.core.cluster` (``pip install 'gemma4-harness[sweep]'``).
"""

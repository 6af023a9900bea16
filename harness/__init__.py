"""gemma4-harness: engines side by side: traces, metrics, gates, oracles, reports, CLI."""

if __name__ != "gemma4_harness.harness":  # imported by its folder name, a checkout on sys.path: no second copy
    from gemma4_harness import _refuse_folder_name

    _refuse_folder_name(__name__)

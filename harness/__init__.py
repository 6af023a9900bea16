"""gemma4-harness: engines side by side: traces, metrics, gates, oracles, reports, CLI."""

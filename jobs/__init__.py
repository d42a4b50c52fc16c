"""Job entry points: `python -m jobs.generate` and the `kivi-ray` console script."""

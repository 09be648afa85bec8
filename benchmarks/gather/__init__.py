"""The gather benchmark: ``python -m benchmarks.gather`` (see ``__main__``)."""

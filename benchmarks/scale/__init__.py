"""At scale, many ranks and many units: ``python -m benchmarks.scale`` (see ``__main__``)."""

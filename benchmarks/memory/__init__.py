"""Peak memory and time of the offline tools against their peers and floors: ``python -m benchmarks.memory
OPERATION|all`` (the operations: ``__main__.OPERATIONS``; each a module here, see docs/benchmarks.md)."""

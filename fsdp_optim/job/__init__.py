"""Inside a running job: the one module that talks to ``torch.distributed`` (``transport``), the typed FSDP
root and fairscale's private attributes (``root``, ``host``), the live optimizer (``local``), and the
entry points that orchestrate them (``api``, ``sharded``, ``async_save``, ``fsdp``)."""

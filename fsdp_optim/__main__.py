"""``python -m fsdp_optim``: the ``fsdp-optim`` command line (see :mod:`fsdp_optim.cli`)."""

import sys

from .cli import main

sys.exit(main())

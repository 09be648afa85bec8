"""``python -m fsdp_optim``: the ``fsdp-optim`` command line (see :mod:`fsdp_optim.cli`)."""

import sys

from fsdp_optim.cli import main

sys.exit(main())

"""Bounds on what a caller or a file may declare (world sizes, nesting, records), checked before anything is
allocated."""

from __future__ import annotations

# Bounds. Real checkpoints stay far below them; each one caps what a crafted input can make us spend.
MAX_DEPTH = 32  # containers nested in a loaded object (a full dict is 5 deep, a manifest 9)
MAX_JSON_DEPTH = 64  # containers nested in a JSON file we read (a manifest is 9 deep, tagged values included)



MAX_NODES = 1 << 22  # references a walk may visit, a shared object counted once per reference (~800k params)



MAX_WORLD_SIZE = 1 << 16  # declared or requested world sizes (rank file names hold 5 digits: 99999 at most)



MAX_RECORDS = 1 << 20  # zip records in one file (a rank file holds one per tensor)

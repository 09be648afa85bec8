import os
import sys

# Tests import their helpers (_dist, _models, _checks) as top-level modules, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))

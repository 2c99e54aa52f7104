"""`python -m openk2 ...` (also what `torchrun -m openk2 ...` runs)."""

import sys

from openk2.cli import main

sys.exit(main())

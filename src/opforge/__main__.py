"""``python -m opforge``: the ``opforge`` command."""

import sys

from opforge.cli import main

sys.exit(main())

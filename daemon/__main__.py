"""``python -m daemon``: the same as the ``gossipd`` command."""

import sys

from .cli import main

sys.exit(main())

"""``python -m blazecore_app``: the ``blazecore`` command."""

import sys

from .cli import main

sys.exit(main())

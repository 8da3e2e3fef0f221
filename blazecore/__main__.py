"""``python -m blazecore <command>``: runs the ``blazecore`` command of the application (``blazecore_app.cli``).

The library never imports its application: the command's module is looked up by name only when this file
runs as ``__main__``.
"""

from __future__ import annotations

import importlib
import sys


def main(argv=None) -> int:
    try:
        cli = importlib.import_module("blazecore_app.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("blazecore_app", "blazecore_app.cli"):
            raise
        print("blazecore: the command-line application (blazecore_app) is not installed; install the project "
              "with pip install blazecore (or pip install . in a checkout)", file=sys.stderr)
        return 1
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())

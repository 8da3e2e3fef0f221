"""The PyTorch baselines of the benchmarks: ``blazecore_torch.baseline`` (installed with the package).

Kept under this name so the benchmarks (``from bench import baselines``) and the tests that load
``bench/baselines.py`` by path find them; the code lives in ``adapters/blazecore_torch/baseline.py``,
where ``python -m blazecore train --baseline`` uses it as well.
"""

from __future__ import annotations

import pathlib
import sys

try:
    from blazecore_torch import baseline as _baseline
except ImportError:  # a source checkout that is not installed: use its adapters/ directory
    _root = pathlib.Path(__file__).resolve().parents[1]
    for _p in (_root, _root / "adapters"):
        if str(_p) not in sys.path:
            sys.path.insert(0, str(_p))
    from blazecore_torch import baseline as _baseline

ACTIVATIONS = _baseline.ACTIVATIONS
BaselineUnavailable = _baseline.BaselineUnavailable
IMPLEMENTATIONS = _baseline.IMPLEMENTATIONS
conventional_moe = _baseline.conventional_moe
grouped_mm_moe = _baseline.grouped_mm_moe
grouped_mm_unsupported = _baseline.grouped_mm_unsupported

__all__ = [
    "ACTIVATIONS",
    "BaselineUnavailable",
    "IMPLEMENTATIONS",
    "conventional_moe",
    "grouped_mm_moe",
    "grouped_mm_unsupported",
]

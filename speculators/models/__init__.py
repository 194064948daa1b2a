"""Speculator families (EAGLE-3, Medusa, MTP, DFlash) behind one interface (`base.Speculator`).

`SPECULATORS` is the one dict family name -> class; it is filled lazily so `import speculators` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from speculators.core.errors import SpeculatorsError

_FAMILY_MODULES = {"eagle3": "speculators.models.eagle3", "medusa": "speculators.models.medusa",
                   "mtp": "speculators.models.mtp", "dflash": "speculators.models.dflash"}
FAMILIES: tuple[str, ...] = tuple(_FAMILY_MODULES)  # the family names, without importing any family


class _Registry(dict):
    def __missing__(self, family: str) -> Any:
        if family not in _FAMILY_MODULES:
            raise SpeculatorsError(f"unknown speculator family {family!r}; known: {', '.join(_FAMILY_MODULES)}")
        module = importlib.import_module(_FAMILY_MODULES[family])
        cls = module.SPECULATOR_CLASS
        self[family] = cls
        return cls

    def __contains__(self, family: object) -> bool:
        return family in _FAMILY_MODULES

    def names(self) -> list[str]:
        return list(_FAMILY_MODULES)


SPECULATORS: _Registry = _Registry()

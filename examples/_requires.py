"""What the examples need beyond nitrobrew and torch: a missing package ends the example with the pip command."""

from __future__ import annotations

import importlib
import sys

# package -> nitrobrew's extra that installs it
EXTRAS = {"transformers": "hf", "safetensors": "hf", "trl": "trl", "datasets": "trl", "accelerate": "trl"}


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return True
    return False


def require(*packages: str) -> None:
    missing = [name for name in packages if _missing(name)]
    if missing:
        extras = ",".join(sorted({EXTRAS[name] for name in missing}))
        sys.exit(f"{sys.argv[0]} needs {', '.join(missing)}: pip install {' '.join(missing)}  (or, from nitrobrew's "
                 f"checkout: pip install --no-build-isolation '.[{extras}]')")

"""The integrations' optional dependencies: a missing one names the extra that installs it.

`unisched-client` itself depends on protobuf only, so an app container pulls in nothing else; each integration
module imports its library and, when that fails, raises `missing_extra(...)`, which names the pip command.
"""

from __future__ import annotations

__all__ = ["DISTRIBUTION", "LIBRARIES", "missing_extra"]

DISTRIBUTION = "unisched-client"
LIBRARIES = {"torch": "torch", "cuda": "pycuda", "gl": "OpenGL", "av": "av"}
"""Each extra (named like its integration module, `unisched_client.<extra>`) and the package it installs."""


def missing_extra(error: ModuleNotFoundError, extra: str) -> ModuleNotFoundError:
    """The error for an integration whose import failed with `error`: the extra's install line when its library
    is missing, the original error when the library is there but something it needs is not (not an extra's job)."""
    library = LIBRARIES[extra]
    if (error.name or "").split(".")[0] != library:
        return error
    return ModuleNotFoundError(
        f"unisched_client.{extra} needs {library}, which is not installed: pip install '{DISTRIBUTION}[{extra}]'",
        name=error.name,
    )

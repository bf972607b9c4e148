"""Where an orchestrator runs a tenant: the pod's namespace, name and container, which metrics carry as labels.

An integration (the Kubernetes device plugin) passes them when it adopts a pod's cgroup; the daemon keeps them
with the tenant and in its state file. They come from a client and from a file on disk, so they are checked as
hostile input: only the keys below, each value a Kubernetes name (lowercase letters, digits, '-' and '.'), of
bounded length. The keys are dcgm-exporter's, so one PromQL join matches our series with its.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["LABEL_KEYS", "MAX_LABEL_CHARS", "LabelError", "validate_labels"]

LABEL_KEYS = ("namespace", "pod", "container")
"""The only keys a tenant may carry, in the order metrics list them (dcgm-exporter's names for the same)."""
MAX_LABEL_CHARS = 253
"""A pod name is a DNS subdomain (at most 253 characters); namespaces and containers are DNS labels (63)."""
_VALUE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class LabelError(ValueError):
    """A label the daemon will not keep; the message names the key and what is allowed."""


def validate_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels, checked: keys from LABEL_KEYS, values Kubernetes names of at most MAX_LABEL_CHARS."""
    if not isinstance(labels, Mapping):
        raise LabelError(f"labels must be a mapping of {', '.join(LABEL_KEYS)} to names")
    out: dict[str, str] = {}
    for key, value in labels.items():
        if key not in LABEL_KEYS:
            shown = key[:40] + "..." if isinstance(key, str) and len(key) > 40 else key
            raise LabelError(f"label {shown!r} is not one of {', '.join(LABEL_KEYS)}")
        if not isinstance(value, str) or not 0 < len(value) <= MAX_LABEL_CHARS or not _VALUE.fullmatch(value):
            raise LabelError(f"label {key}: must be 1..{MAX_LABEL_CHARS} lowercase letters, digits, '-' or '.', "
                             "starting and ending with a letter or digit")
        out[key] = value
    return {k: out[k] for k in LABEL_KEYS if k in out}

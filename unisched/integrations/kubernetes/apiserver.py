"""The Kubernetes API server as the node agent reaches it: JSON over HTTPS with the pod's service account token.

One small client for the device plugin's pod lookups and the DRA driver's ResourceClaim reads and ResourceSlice
writes; what each may do is in the RBAC of deploy/kubernetes/. No client library: a few GET/POST/PUT calls.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

__all__ = ["ApiServer", "ApiServerError"]


class ApiServerError(OSError):
    """The API server answered with an error status (`code`), other than 404."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ApiServer:
    SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

    def __init__(self, base_url: str, token_file: Path, ca_file: Path | None, timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_file = token_file
        self.timeout = timeout
        self._context = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else None

    @classmethod
    def in_cluster(cls) -> Self | None:
        """From the environment every pod gets; None outside a cluster."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (cls.SA_DIR / "token").exists():
            return None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", cls.SA_DIR / "token", cls.SA_DIR / "ca.crt")

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The JSON reply; None for 404. ApiServerError for another error status, OSError when unreachable."""
        token = self.token_file.read_text().strip()  # re-read: projected tokens rotate
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._context) as resp:
                reply = json.load(resp)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise ApiServerError(e.code, f"API server answered {e.code} for {method} {path}: {e.reason}") from None
        return reply if isinstance(reply, dict) else {}

"""unisched client library: register a tenant on the daemon's lease stream and gate your own GPU work on leases.

Core: `Client`, `Gate`. Integrations (imported on use): `unisched_client.cuda` (pycuda),
`unisched_client.torch` (PyTorch, also `Client.step()`), `unisched_client.gl` (PyOpenGL frames),
`unisched_client.av` (PyAV hardware codec sessions).
"""

from unisched_client.client import DEFAULT_SOCKET, Client, CodecRefused, Gate, UnischedError, UnischedUnavailable

__all__ = ["DEFAULT_SOCKET", "Client", "CodecRefused", "Gate", "UnischedError", "UnischedUnavailable"]

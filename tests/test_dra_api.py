"""The DRA driver's ResourceClaims and ResourceSlice against a fake Kubernetes API server over HTTP, and the
`unisched dra-driver` command registering with a stub kubelet, serving and cleaning up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import drarig
from conftest import ROOT, QuietHandler, child_env, fake_api_server, wait_until
from drarig import DRIVER, NODE, claim, make_config, ref
from inproc import InProcessServer
from kubelet_stub import StubPluginWatcher

from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra
from unisched.integrations.kubernetes.dra_claims import ApiServerClaims, resource_slice

daemon_fixture = drarig.daemon_fixture  # the fixture `daemon`


def test_api_server_claims_reads_claims_and_creates_then_updates_the_slice(tmp_path: Path, short_dir: Path) -> None:
    c = claim("c", "gpu0", ns="ml")
    seen: list[tuple[str, str, Any]] = []
    slices: dict[str, dict[str, Any]] = {}

    class Handler(QuietHandler):
        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")

        def do_GET(self) -> None:
            seen.append(("GET", self.path, self.headers.get("Authorization")))
            if self.path == "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c":
                self._reply(200, c)
            elif self.path.startswith("/apis/resource.k8s.io/v1/resourceslices/") and self.path.rsplit("/", 1)[1] in slices:
                self._reply(200, slices[self.path.rsplit("/", 1)[1]])
            else:
                self._reply(404, {"kind": "Status", "code": 404})

        def do_POST(self) -> None:
            body = self._body()
            seen.append(("POST", self.path, body))
            slices[body["metadata"]["name"]] = {**body, "metadata": {**body["metadata"], "resourceVersion": "7"}}
            self._reply(201, body)

        def do_PUT(self) -> None:
            body = self._body()
            seen.append(("PUT", self.path, body))
            self._reply(200, body)

    token = tmp_path / "token"
    token.write_text("t0ken\n")
    with fake_api_server(Handler) as url:
        api = ApiServerClaims(url, token, None)
        assert api.claim("ml", "c") == c
        assert api.claim("ml", "gone") is None
        body = resource_slice(make_config(short_dir), [], {})
        api.publish_slice(body)  # none yet: created
        api.publish_slice(body)  # there: replaced, with its resourceVersion and the next pool generation
    assert seen[0] == ("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c", "Bearer t0ken")
    writes = [(m, p) for m, p, _ in seen if m != "GET"]
    assert writes == [("POST", "/apis/resource.k8s.io/v1/resourceslices"),
                      ("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{NODE}-{DRIVER}")]
    put = seen[-1][2]
    assert put["metadata"]["resourceVersion"] == "7" and put["spec"]["pool"]["generation"] == 2


# --- the command ------------------------------------------------------------------------------------------------


def test_dra_driver_help_explains_it() -> None:
    out = subprocess.run([sys.executable, "-m", "unisched", "dra-driver", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=child_env())
    assert out.returncode == 0
    for words in (DRIVER, "--node-name", "--cdi-dir", "--plugins-dir", "--registry-dir", "NodePrepareResources",
                  "ResourceSlice", "v1beta1.DRAPlugin", "unisched.io/gpu", "GpuConfig"):
        assert words in out.stdout, words


def test_dra_driver_needs_a_node_name() -> None:
    out = subprocess.run([sys.executable, "-m", "unisched", "dra-driver"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**child_env(), "NODE_NAME": ""})
    assert out.returncode == 2 and "pass --node-name or set NODE_NAME" in out.stderr


def test_dra_driver_command_registers_serves_and_cleans_up(daemon: InProcessServer, short_dir: Path) -> None:
    config = make_config(short_dir)
    config.registry_dir.mkdir()
    watcher = StubPluginWatcher(config.registry_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "unisched", "dra-driver", "--socket", daemon.socket, "--node-name", NODE,
         "--plugins-dir", str(config.plugins_dir), "--registry-dir", str(config.registry_dir), "--cdi-dir",
         str(config.cdi_dir), "--interval", "0.2", "--log-format", "json"],
        cwd=ROOT, env={**child_env(), "KUBERNETES_SERVICE_HOST": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: config.registration_socket.exists() and config.endpoint.exists(), 30, "the driver's sockets")
        assert watcher.scan() == [DRIVER]
        c = claim("c", "gpu0")
        reply = watcher.plugin(DRIVER).NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[ref(c)]), timeout=10)
        assert "no API server" in reply.claims[c["metadata"]["uid"]].error
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=20)[0].decode()
        assert proc.returncode == 0, log[-2000:]
    finally:
        watcher.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not config.endpoint.exists() and not config.registration_socket.exists()
    # GPUs from the daemon's Status (the in-process daemon's fake telemetry has GPUs 0 and 1)
    assert '"gpus": [0, 1]' in log and "DRA driver started" in log, log[-2000:]
    assert "no API server: the ResourceSlice is not published" in log and "registered with the kubelet" in log

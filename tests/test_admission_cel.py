"""deploy/kubernetes/dra/admission-policy.yaml's CEL, compiled and evaluated by the CEL project's own runtime (cel-cpp,
through cel-expr-python, with the optional and strings extensions an API server enables) against the admission
requests each policy must allow and deny. An API server also type-checks the expressions against the resources'
schemas; this checks their syntax and what they decide."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import pytest
import yaml
from conftest import ROOT

cel = pytest.importorskip("cel_expr_python.cel", reason="cel-expr-python is not installed (pip install -e '.[test]')")
ext_optional = pytest.importorskip("cel_expr_python.ext.ext_optional")
ext_strings = pytest.importorskip("cel_expr_python.ext.ext_strings")

POLICIES = ROOT / "deploy" / "kubernetes" / "dra" / "admission-policy.yaml"
ACCOUNT = "system:serviceaccount:unisched-system:unisched"
NODE_KEY = "authentication.kubernetes.io/node-name"


def _policies() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(POLICIES.read_text()) if d]
    return {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}


class EvalError(Exception):
    """The expression's evaluation failed (the runtime returns errors as values)."""


def _eval(expression: str, data: Mapping[str, Any]) -> Any:
    names = ("request", "object", "oldObject", "variables")
    env = cel.NewEnv(variables={n: cel.Type.DYN for n in names},
                     extensions=[ext_optional.ExtOptional(), ext_strings.ExtStrings()])
    value = env.compile(expression).eval(data={n: data.get(n) for n in names})
    if value.type() == cel.Type.ERROR:
        raise EvalError(str(value.plain_value()))
    return value.plain_value()


def admit(policy: str, request: Mapping[str, Any], obj: Mapping[str, Any] | None,
          old: Mapping[str, Any] | None = None) -> tuple[bool, str]:
    """What the API server makes of one request under `policy`: (allowed, the first failed validation's message);
    a request its matchConditions leave out is allowed with message "not matched". With `failurePolicy: Fail` (both
    policies) an expression that fails to evaluate denies: in a match condition, in a validation, or in a variable a
    validation reads (variables are evaluated when read: one that failed is left out, so reading it fails)."""
    spec = _policies()[policy]
    assert spec["failurePolicy"] == "Fail"
    data: dict[str, Any] = {"request": request, "object": obj, "oldObject": old}
    try:
        for cond in spec.get("matchConditions", []):
            if _eval(cond["expression"], data) is not True:
                return True, "not matched"
    except EvalError as e:
        return False, f"match condition failed: {e}"
    data["variables"] = variables = {}
    for var in spec.get("variables", []):
        with contextlib.suppress(EvalError):  # left out: a validation that reads it fails
            variables[var["name"]] = _eval(var["expression"], data)
    for check in spec["validations"]:
        try:
            if _eval(check["expression"], data) is True:
                continue
            message = _eval(check["messageExpression"], data) if "messageExpression" in check else check["message"]
        except EvalError as e:
            return False, f"validation failed: {e}"
        return False, str(message)
    return True, ""


def slice_request(operation: str = "CREATE", user: str = ACCOUNT, node: str | None = "node-a",
                  extra: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """An admission request's fields the policies read. `extra` None: the node-name extra alone (none without a
    node); an empty map is left out, as the API server leaves out an empty `extra`."""
    extra = ({} if node is None else {NODE_KEY: [node]}) if extra is None else extra
    return {"operation": operation, "userInfo": {"username": user, **({"extra": extra} if extra else {})}}


def resource_slice(node: str | None = "node-a", driver: str = "gpu.unisched.io") -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "spec": spec}


@pytest.mark.parametrize(("operation", "token_node", "slice_node", "driver", "allowed", "says"), [
    ("CREATE", "node-a", "node-a", "gpu.unisched.io", True, ""),
    ("UPDATE", "node-a", "node-a", "gpu.unisched.io", True, ""),
    ("DELETE", "node-a", "node-a", "gpu.unisched.io", True, ""),
    ("CREATE", "node-a", "node-b", "gpu.unisched.io", False, "unisched on node node-a may write only that node's"),
    ("DELETE", "node-a", "node-b", "gpu.unisched.io", False, "unisched on node node-a may write only that node's"),
    ("CREATE", "node-a", None, "gpu.unisched.io", False, "may write only that node's"),  # allNodes: every node's
    ("DELETE", "node-a", None, "gpu.unisched.io", False, "may write only that node's"),
    ("CREATE", "node-a", "node-a", "gpu.nvidia.com", False, "only ResourceSlices of its driver"),
    ("CREATE", None, "node-a", "gpu.unisched.io", False, "names no node"),
])
def test_the_dra_driver_writes_only_its_own_node_s_slices_of_its_driver(
        operation: str, token_node: str | None, slice_node: str | None, driver: str, allowed: bool, says: str) -> None:
    written = resource_slice(slice_node, driver)
    obj, old = (None, written) if operation == "DELETE" else (written, resource_slice() if operation == "UPDATE" else None)
    got, message = admit("unisched-dra-resourceslices", slice_request(operation, node=token_node), obj, old)
    assert got is allowed, message
    assert says in message


@pytest.mark.parametrize("extra", [
    {},  # a token with no extras: `extra` left out of the request
    {NODE_KEY: []},
    {"authentication.kubernetes.io/pod-name": ["unisched-abc"]},  # bound to a pod, from before 1.32
])
def test_a_token_without_a_node_is_refused_with_the_reason(extra: dict[str, list[str]]) -> None:
    got, message = admit("unisched-dra-resourceslices", slice_request(extra=extra), resource_slice())
    assert not got
    assert "names no node" in message


def test_an_expression_that_fails_denies_as_failure_policy_fail_does() -> None:
    """The harness denies where the API server would: a claim result without its driver field makes `exists` fail."""
    broken = claim(["gpu.unisched.io"], 2)
    del broken["status"]["allocation"]["devices"]["results"][0]["driver"]
    got, message = admit("unisched-dra-claim-one-pod", {"operation": "UPDATE", "userInfo": {"username": "x"}}, broken)
    assert not got and "failed" in message


def test_the_resourceslice_policy_leaves_other_accounts_alone() -> None:
    """Other writers (NVIDIA's driver, the scheduler) are not this policy's to judge."""
    got, message = admit("unisched-dra-resourceslices",
                         slice_request(user="system:serviceaccount:nvidia:driver", node=None),
                         resource_slice("node-b", "gpu.nvidia.com"))
    assert (got, message) == (True, "not matched")


def claim(drivers: list[str], reserved: int, allocated: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if allocated:
        status["allocation"] = {"devices": {"results": [
            {"request": "gpu", "driver": d, "pool": "node-a", "device": f"gpu-{i}"} for i, d in enumerate(drivers)]}}
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": f"pod-{i}", "uid": f"uid-{i}"} for i in range(reserved)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
            "spec": {"devices": {"requests": []}}, **({"status": status} if status else {})}


@pytest.mark.parametrize(("obj", "allowed"), [
    (claim(["gpu.unisched.io"], 0, allocated=False), True),  # created, not yet allocated
    (claim(["gpu.unisched.io"], 0), True),
    (claim(["gpu.unisched.io"], 1), True),
    (claim(["gpu.unisched.io"], 2), False),  # the second pod's reservation
    (claim(["gpu.nvidia.com", "gpu.unisched.io"], 2), False),
    (claim(["gpu.nvidia.com"], 2), True),  # another driver's claim may be shared
    (claim([], 3, allocated=False), True),
])
def test_a_unisched_claim_is_reserved_for_one_pod_at_most(obj: dict[str, Any], allowed: bool) -> None:
    got, message = admit("unisched-dra-claim-one-pod", {"operation": "UPDATE", "userInfo": {"username": "x"}}, obj)
    assert got is allowed, message
    if not allowed:
        assert "serves one pod" in message


def test_a_broken_expression_fails_here() -> None:
    """The check has teeth: CEL the runtime cannot parse raises, as the API server refuses the policy."""
    with pytest.raises(RuntimeError, match="Syntax error"):
        _eval("object.?spec.orValue(", {})

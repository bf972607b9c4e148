"""deploy/kubernetes: the manifests against the Kubernetes schemas, and what they must agree on with the code: the
daemon's and the device plugin's pods, privileges, seccomp profiles, RBAC, the sample pods, the second scheduler, DRA
and metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from unisched.cli.parser import build_parser
from unisched.policy import Engine, Priority
from unisched.scheduler.config import (
    DEFAULT_AGENT_SOCKET,
    DEFAULT_RUNTIME_AGENT_SOCKET,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    METRICS_PORT,
    load_config,
)

KUBE = ROOT / "deploy" / "kubernetes"
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # the oldest release we claim, and the newest schemas kubernetes-validate bundles
DRA = KUBE / "dra"
DRA_VERSIONS = ("1.34.0", "1.37.0")  # dra/ needs resource.k8s.io/v1, GA (and in the schemas) from 1.34
EXAMPLES_IN_PODS = {"01", "02", "03", "04", "05", "mixed_train_render", "ad_sim", "cloud_gaming", "online_offline"}


def _docs(path: Path) -> list[dict]:  # type: ignore[type-arg]
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[Path]:
    return sorted(KUBE.rglob("*.yaml"))


def _schema_errors(doc: dict, versions: tuple[str, ...] = KUBE_VERSIONS) -> list[str]:  # type: ignore[type-arg]
    """What the Kubernetes JSON schemas (strict: no unknown fields) say about one object, offline."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) bundles the schemas")
    errors = []
    for version in versions:
        try:
            kv.validate(doc, version, strict=True)
        except (kv.ValidationError, kv.SchemaNotFoundError) as e:
            errors.append(f"{doc.get('kind')} {doc.get('metadata', {}).get('name')} ({version}): {str(e).splitlines()[0]}")
    return errors


def _is_crd_object(doc: dict) -> bool:  # type: ignore[type-arg]
    """An object of a CRD (the Prometheus Operator's ServiceMonitor): no bundled schema; its own test checks it."""
    return str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/")


def _by_kind(kind: str) -> dict[str, dict]:  # type: ignore[type-arg]
    return {d["metadata"]["name"]: d for p in _manifests() for d in _docs(p) if d["kind"] == kind}


def _pod_specs() -> list[tuple[dict, dict]]:  # type: ignore[type-arg]
    """(metadata, pod spec) of every pod and pod template under examples/ and schedulers/ (dra/'s pods ask
    through claims: test_dra_manifests_agree_with_the_driver)."""
    out = []
    for p in _manifests():
        if p.parent in (KUBE, DRA):
            continue
        for d in _docs(p):
            if d["kind"] == "Pod":
                out.append((d["metadata"], d["spec"]))
            elif d["kind"] == "Deployment" and "unisched-examples" in str(d["metadata"].get("labels")):
                out.append(({**d["metadata"], **d["spec"]["template"]["metadata"]}, d["spec"]["template"]["spec"]))
    return out


def test_kubernetes_manifests_match_the_schemas() -> None:
    files = _manifests()
    assert {p.name for p in files} >= {"namespace.yaml", "rbac.yaml", "configmap.yaml", "daemonset.yaml"}
    errors = [e for p in files for d in _docs(p) if not _is_crd_object(d)
              for e in _schema_errors(d, DRA_VERSIONS if p.parent == DRA else KUBE_VERSIONS)]
    assert errors == []
    assert {p.name for p in files if p.parent == DRA} == {"daemonset.yaml", "deviceclass.yaml", "rbac.yaml",
                                                          "claim-templates.yaml", "side-by-side.yaml",
                                                          "admission-policy.yaml"}
    assert sum(len(_docs(p)) for p in files) >= 20


def test_schema_check_fails_on_broken_manifests(tmp_path: Path) -> None:
    import copy

    (ds,) = _docs(KUBE / "daemonset.yaml")
    typo = copy.deepcopy(ds)
    typo["spec"]["template"]["spec"]["hostPIDs"] = True
    missing = copy.deepcopy(ds)
    del missing["spec"]["selector"]
    wrong_type = copy.deepcopy(ds)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = "yes"
    bad_pod = tmp_path / "bad.yaml"
    bad_pod.write_text((KUBE / "examples" / "01-pycuda-kernel-loop.yaml").read_text().replace("limits:", "limitz:"))
    for doc, words in [(typo, "'hostPIDs' was unexpected"), (missing, "'selector' is a required property"),
                       (wrong_type, "'yes' is not of type 'boolean'"), (_docs(bad_pod)[0], "'limitz' was unexpected")]:
        errors = _schema_errors(doc)
        assert len(errors) == len(KUBE_VERSIONS) and words in errors[0], errors


def test_daemonset_runs_the_daemon_and_the_device_plugin_with_the_host_paths_they_need() -> None:
    from unisched.integrations.kubernetes.adopt import DEFAULT_POD_RESOURCES_SOCKET
    from unisched.integrations.kubernetes.plugin import DEFAULT_KUBELET_DIR

    ds = _by_kind("DaemonSet")["unisched"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["serviceAccountName"] == "unisched"
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    runtime_dir = str(Path(DEFAULT_RUNTIME_AGENT_SOCKET).parent)
    assert set(host.values()) == {"/run/unisched", runtime_dir, "/var/lib/unisched", "/sys/fs/cgroup", "/sys/fs/bpf",
                                  DEFAULT_KUBELET_DIR, str(Path(DEFAULT_POD_RESOURCES_SOCKET).parent),
                                  "/var/lib/kubelet/seccomp"}
    containers = {c["name"]: c for c in spec["containers"]}
    mounts = {name: {m["mountPath"]: host.get(m["name"], m["name"]) for m in c["volumeMounts"]}
              for name, c in containers.items()}
    assert containers["daemon"]["securityContext"]["privileged"] is True  # cgroups, BPF, /dev/nvidia*, host PIDs
    # the daemon: `unisched serve` with the ConfigMap's config, in the host cgroup namespace
    daemon = containers["daemon"]
    argv = daemon["command"] + daemon["args"]
    assert argv[:5] == ["nsenter", "--target", "1", "--cgroup", "--"]
    args = build_parser().parse_args(argv[6:])
    assert args.command == "serve" and args.config == "/etc/unisched/unisched.toml"
    assert {"/sys/fs/cgroup": "/sys/fs/cgroup", "/sys/fs/bpf": "/sys/fs/bpf", "/run/unisched": "/run/unisched",
            runtime_dir: runtime_dir, DEFAULT_STATE_DIR: DEFAULT_STATE_DIR}.items() <= mounts["daemon"].items()
    # the device plugin: the kubelet's directories and the daemon's socket, at the paths it is told
    plugin = containers["device-plugin"]
    args = build_parser().parse_args(plugin["command"][1:] + plugin["args"])
    assert args.command == "device-plugin" and args.units_per_gpu == 100 and args.require_gpu_profile
    assert args.socket == DEFAULT_SOCKET and str(Path(args.socket).parent) in mounts["device-plugin"]
    assert mounts["device-plugin"][args.kubelet_dir] == DEFAULT_KUBELET_DIR
    assert mounts["device-plugin"][str(Path(args.pod_resources_socket).parent)] == str(Path(DEFAULT_POD_RESOURCES_SOCKET).parent)
    assert mounts["device-plugin"]["/sys/fs/cgroup"] == "/sys/fs/cgroup"  # where it finds pod cgroups
    # session resources the samples ask for are advertised
    asked = {k for _, s in _pod_specs() for c in s["containers"] for k in c["resources"]["limits"]}
    assert ("unisched.io/decode-sessions" in asked) <= (args.decode_sessions is not None)
    assert ("unisched.io/render-sessions" in asked) <= (args.render_sessions is not None)
    # the init container installs the profile where the kubelet resolves Localhost profiles
    (init,) = spec["initContainers"]
    words = init["args"][0].split()
    kube_seccomp = next(m["mountPath"] for m in init["volumeMounts"] if host.get(m["name"]) == "/var/lib/kubelet/seccomp")
    assert {f"{kube_seccomp}/profiles/unisched-gpu.json", f"{kube_seccomp}/profiles/unisched-gpu-containerd.json"} \
        <= set(words)


def _all_pod_specs() -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    """(file: name, pod spec) of every pod and pod template under deploy/kubernetes."""
    out = []
    for p in _manifests():
        for d in _docs(p):
            spec = d.get("spec", {})
            spec = spec.get("template", {}).get("spec", spec) if d["kind"] != "Pod" else spec
            if "containers" in spec:
                out.append((f"{p.relative_to(KUBE)}: {d['metadata']['name']}", spec))
    return out


def test_only_the_daemon_container_is_privileged() -> None:
    """The device plugin and the DRA driver only talk to sockets (the kubelet's, the daemon's): they run
    without privilege, capabilities or a writable image, and every other container is unprivileged too."""
    specs = _all_pod_specs()
    assert len(specs) >= 10
    privileged = {(where, c["name"]) for where, s in specs for c in s.get("initContainers", []) + s["containers"]
                  if c.get("securityContext", {}).get("privileged")}
    assert privileged == {("daemonset.yaml: unisched", "daemon"), ("dra/daemonset.yaml: unisched-dra", "daemon")}
    for ds, name in (("unisched", "device-plugin"), ("unisched-dra", "dra-driver")):
        spec = _by_kind("DaemonSet")[ds]["spec"]["template"]["spec"]
        sc = next(c for c in spec["containers"] if c["name"] == name)["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and "add" not in sc["capabilities"]
        # it keeps the sockets it talks to
        mounts = {m["mountPath"] for c in spec["containers"] if c["name"] == name for m in c["volumeMounts"]}
        assert "/run/unisched" in mounts


def test_only_the_daemon_container_mounts_the_runtime_agent_socket_s_directory() -> None:
    """The runtime agent socket is believed as the host's container runtime because only root on the host reaches
    it: its directory goes into the daemon's container, and into no other container (root in a pod with it mounted
    could name any tenant)."""
    runtime_dir = str(Path(DEFAULT_RUNTIME_AGENT_SOCKET).parent)
    mounting = set()
    for where, spec in _all_pod_specs():
        host = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
        above_or_in = [h for h in host.values() if Path(h) in Path(runtime_dir).parents or Path(runtime_dir) in Path(h).parents]
        assert not above_or_in, (where, above_or_in)  # nor a directory above it, nor one in it
        for c in spec.get("initContainers", []) + spec["containers"]:
            if any(host.get(m["name"]) == runtime_dir for m in c.get("volumeMounts", [])):
                mounting.add((where, c["name"]))
                assert {m["mountPath"] for m in c["volumeMounts"] if host.get(m["name"]) == runtime_dir} == {runtime_dir}
    assert mounting == {("daemonset.yaml: unisched", "daemon"), ("dra/daemonset.yaml: unisched-dra", "daemon")}


def test_only_the_node_agent_container_gets_the_api_token() -> None:
    """The daemon runs privileged and needs no API access: the pod mounts no token by default, and the container
    that reads pods and claims (device plugin, DRA driver) gets a projected one at the path in-cluster clients read."""
    from unisched.integrations.kubernetes.apiserver import ApiServer

    for name, agent in (("unisched", "device-plugin"), ("unisched-dra", "dra-driver")):
        spec = _by_kind("DaemonSet")[name]["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        (volume,) = [v for v in spec["volumes"] if "projected" in v]
        sources = {k for src in volume["projected"]["sources"] for k in src}
        assert sources == {"serviceAccountToken", "configMap", "downwardAPI"}
        mounting = {c["name"]: m for c in spec["initContainers"] + spec["containers"] for m in c.get("volumeMounts", [])
                    if m["name"] == volume["name"]}
        assert list(mounting) == [agent], name
        assert mounting[agent]["mountPath"] == str(ApiServer.SA_DIR) and mounting[agent]["readOnly"] is True


def test_the_resourceslice_policy_names_the_dra_driver_s_account_and_driver() -> None:
    """dra/admission-policy.yaml narrows the driver's ResourceSlice writes to its node's slices of its driver:
    it must name the account the DRA DaemonSet runs as and the driver name the driver publishes."""
    from unisched.integrations.kubernetes.defaults import DRIVER_NAME

    ds = _by_kind("DaemonSet")["unisched-dra"]
    account = f"system:serviceaccount:{ds['metadata']['namespace']}:{ds['spec']['template']['spec']['serviceAccountName']}"
    policy = _by_kind("ValidatingAdmissionPolicy")["unisched-dra-resourceslices"]["spec"]
    (condition,) = policy["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{account}"'
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceslices"]
    expressions = " ".join(v["expression"] for v in policy["validations"] + policy["variables"])
    assert f'spec.driver == "{DRIVER_NAME}"' in expressions and "authentication.kubernetes.io/node-name" in expressions
    bindings = {b["spec"]["policyName"]: b["spec"]["validationActions"]
                for b in _by_kind("ValidatingAdmissionPolicyBinding").values()}
    assert bindings == {"unisched-dra-resourceslices": ["Deny"], "unisched-dra-claim-one-pod": ["Deny"]}
    one_pod = _by_kind("ValidatingAdmissionPolicy")["unisched-dra-claim-one-pod"]["spec"]
    assert one_pod["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceclaims", "resourceclaims/status"]
    assert f'r.driver == "{DRIVER_NAME}"' in one_pod["variables"][0]["expression"]
    assert "reservedFor.orValue([]).size() <= 1" in one_pod["validations"][0]["expression"]


def test_the_metrics_port_is_open_to_the_scraper_namespaces_only() -> None:
    (policy,) = _by_kind("NetworkPolicy").values()
    port = _by_kind("Service")["unisched-metrics"]["spec"]["ports"][0]["port"]
    assert policy["spec"]["podSelector"]["matchLabels"] == _by_kind("Service")["unisched-metrics"]["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [port]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"unisched.io/metrics-scraper": "true"}}}]


def test_admin_rights_follow_the_host_namespaces() -> None:
    """uid 0 is an admin of the daemon only in the daemon's own PID and user namespaces: the node agent's pods
    (which adopt pods) share the host's; no other pod does, so root in a workload pod is not an admin."""
    agents = {"daemonset.yaml: unisched", "dra/daemonset.yaml: unisched-dra"}
    for where, spec in _all_pod_specs():
        assert (spec.get("hostPID") is True) == (where in agents), where
        if where in agents:
            assert spec["hostUsers"] is True, where  # said explicitly: a user-namespaced agent would lose admin


def test_configmap_holds_a_loadable_config_and_the_seccomp_profile(tmp_path: Path) -> None:
    import json

    data = _by_kind("ConfigMap")["unisched-config"]["data"]
    toml = tmp_path / "unisched.toml"
    toml.write_text(data["unisched.toml"])
    cfg = load_config(toml)
    assert (cfg.socket, cfg.agent_socket, cfg.state_dir) == (DEFAULT_SOCKET, DEFAULT_AGENT_SOCKET, DEFAULT_STATE_DIR)
    assert cfg.runtime_agent_socket == DEFAULT_RUNTIME_AGENT_SOCKET
    assert cfg.user_tenants is False  # a pod process may not make itself a tenant outside its pod's
    assert cfg.user_leases is False  # nor report its own GPU time in place of the freezer's measure
    assert (cfg.metrics_port, cfg.metrics_listen) == (METRICS_PORT, "0.0.0.0")  # on, on the pod's address
    profile = json.loads(data["unisched-gpu.json"])
    assert profile == json.loads((ROOT / "deploy" / "seccomp" / "unisched-gpu.json").read_text())
    assert profile["listenerPath"] == cfg.runtime_agent_socket  # the runtime hands over on root's own socket
    # containerd nodes: the resolved form, which containerd reads without dropping the capability-dependent rules
    resolved = json.loads(data["unisched-gpu-containerd.json"])
    assert resolved == json.loads((ROOT / "deploy" / "seccomp" / "unisched-gpu.containerd-amd64.json").read_text())
    assert resolved["listenerPath"] == cfg.runtime_agent_socket and "archMap" not in resolved


def test_both_daemonsets_install_both_seccomp_profiles() -> None:
    import yaml

    for path in ("daemonset.yaml", "dra/daemonset.yaml"):
        ds = next(d for d in yaml.safe_load_all((KUBE / path).read_text()) if d and d["kind"] == "DaemonSet")
        init = ds["spec"]["template"]["spec"]["initContainers"][0]
        script = " ".join(init["args"])
        for name in ("unisched-gpu.json", "unisched-gpu-containerd.json"):
            assert f"/etc/unisched/{name}" in script and f"/host/seccomp/profiles/{name}" in script, (path, script)


def test_seccomp_profile_is_the_runtime_default_plus_our_notify_rules() -> None:
    """Generated, not hand-edited: the committed profile (and its ConfigMap copy) is what generate.py makes of
    the vendored runtime default, so governed pods keep the default's refusals (defaultAction an errno)."""
    import json

    seccomp = ROOT / "deploy" / "seccomp"
    check = subprocess.run([sys.executable, str(seccomp / "generate.py"), "--check"], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stderr
    profile = json.loads((seccomp / "unisched-gpu.json").read_text())
    default = json.loads((seccomp / "runtime-default.json").read_text())
    assert profile["defaultAction"] == default["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == 38
    notify = [r for r in profile["syscalls"] if r["action"] == "SCMP_ACT_NOTIFY"]
    from unisched.enforce.seccomp.filter import NOTIFIED

    assert {r["args"][0]["valueTwo"] for r in notify} == {(ord("F") << 8) | e for e in NOTIFIED}
    # every rule of the default is kept, except ioctl leaving the argument-free ALLOW list for conditional rules
    kept = [r for r in profile["syscalls"] if r["names"] != ["ioctl"]]
    plain = [r for r in default["syscalls"]]
    plain[1] = {**plain[1], "names": [n for n in plain[1]["names"] if n != "ioctl"]}
    assert kept == plain
    assert all(r.get("args") for r in profile["syscalls"] if "ioctl" in r["names"])


def test_rbac_grants_the_device_plugin_pod_reads_only() -> None:
    role = _by_kind("ClusterRole")["unisched-device-plugin"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    binding = _by_kind("ClusterRoleBinding")["unisched-device-plugin"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "unisched", "namespace": "unisched-system"}]


def test_sample_pods_cover_every_example_and_ask_for_gpu_weight() -> None:
    from unisched.integrations.kubernetes.adopt import unhooked_containers
    from unisched.integrations.kubernetes.devices import DECODE, RENDER, WEIGHT

    specs = _pod_specs()
    assert {m["labels"]["unisched.io/example"] for m, _ in specs if "unisched.io/example" in m["labels"]} == EXAMPLES_IN_PODS
    for meta, spec in specs:
        engines = meta.get("annotations", {}).get("unisched.io/engines", "compute").split(",")
        assert set(engines) <= {e.value for e in Engine}, meta["name"]
        assert meta.get("annotations", {}).get("unisched.io/priority", "offline") in {p.value for p in Priority}
        assert spec["securityContext"]["runAsNonRoot"] is True  # uid 0 would be an admin of the daemon
        for c in spec["containers"]:
            limits = c["resources"]["limits"]
            assert set(limits) <= {WEIGHT, RENDER, DECODE}
            assert 1 <= int(limits[WEIGHT]) <= 100, meta["name"]  # one GPU's units (--units-per-gpu=100)
            assert c["securityContext"]["seccompProfile"] == {"type": "Localhost",
                                                              "localhostProfile": "profiles/unisched-gpu.json"}
            script = next(a for a in c["command"] if a.startswith("/opt/unisched/"))
            assert (ROOT / script.removeprefix("/opt/unisched/")).is_file(), script
        assert unhooked_containers(spec) == (), meta["name"]  # what the shipped --require-gpu-profile asks


def test_second_scheduler_owns_the_render_pool_and_pods_pick_pools() -> None:
    import yaml

    (ds,) = _docs(KUBE / "daemonset.yaml")
    pool_key = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]["key"]
    config = yaml.safe_load(_by_kind("ConfigMap")["unisched-render-scheduler"]["data"]["config.yaml"])
    assert (config["apiVersion"], config["kind"]) == ("kubescheduler.config.k8s.io/v1", "KubeSchedulerConfiguration")
    (profile,) = config["profiles"]
    args = {p["name"]: p["args"] for p in profile["pluginConfig"]}
    (term,) = args["NodeAffinity"]["addedAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": pool_key, "operator": "In", "values": ["render"]}]
    assert args["NodeResourcesFit"]["scoringStrategy"]["resources"] == [{"name": "unisched.io/gpu-weight", "weight": 1}]
    deploy = _by_kind("Deployment")["unisched-render-scheduler"]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    mount = c["volumeMounts"][0]["mountPath"]
    assert c["command"] == ["kube-scheduler", f"--config={mount}/config.yaml"]
    pods = {d["metadata"]["name"]: d["spec"] for d in _docs(KUBE / "schedulers" / "pool-pods.yaml")}
    assert pods["render-player"]["schedulerName"] == profile["schedulerName"]
    (train_term,) = pods["trainer"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert train_term["matchExpressions"] == [{"key": pool_key, "operator": "In", "values": ["train"]}]
    assert "schedulerName" not in pods["trainer"]


def test_dra_manifests_agree_with_the_driver() -> None:
    from unisched.integrations.kubernetes import dra_v1beta1_pb2 as dra_pb
    from unisched.integrations.kubernetes.defaults import (
        CONFIG_KIND,
        DEFAULT_CDI_DIR,
        DEFAULT_PLUGINS_DIR,
        DEFAULT_REGISTRY_DIR,
        DRIVER_NAME,
    )
    from unisched.integrations.kubernetes.dra_claims import CONFIG_API_VERSION, DraConfig, prepared_claim

    (cls,) = _docs(DRA / "deviceclass.yaml")
    assert cls["metadata"]["name"] == DRIVER_NAME
    assert cls["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}}]
    # the node agent: the daemon as in ../daemonset.yaml, and the driver at the kubelet's paths
    ds = _by_kind("DaemonSet")["unisched-dra"]
    spec = ds["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"daemon", "dra-driver"}
    assert containers["daemon"] == _by_kind("DaemonSet")["unisched"]["spec"]["template"]["spec"]["containers"][0]
    driver = containers["dra-driver"]
    args = build_parser().parse_args(driver["command"][1:] + driver["args"])
    assert args.command == "dra-driver" and args.driver_name == DRIVER_NAME and args.socket == DEFAULT_SOCKET
    mounts = {m["mountPath"]: host.get(m["name"], m["name"]) for m in driver["volumeMounts"]}
    assert mounts[args.plugins_dir] == DEFAULT_PLUGINS_DIR and mounts[args.registry_dir] == DEFAULT_REGISTRY_DIR
    assert mounts[args.cdi_dir] == DEFAULT_CDI_DIR and mounts[str(Path(args.socket).parent)] == "/run/unisched"
    node_name = next(e for e in driver["env"] if e["name"] == "NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # DRA nodes run this agent and not the device plugin's: the two node selections exclude each other
    def terms(name: str) -> list[dict]:  # type: ignore[type-arg]
        aff = _by_kind("DaemonSet")[name]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        (term,) = aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        return term["matchExpressions"]  # type: ignore[no-any-return]

    assert {"key": "unisched.io/dra", "operator": "In", "values": ["true"]} in terms("unisched-dra")
    assert {"key": "unisched.io/dra", "operator": "NotIn", "values": ["true"]} in terms("unisched")
    # RBAC: read claims and pods, keep slices; nothing more
    role = _by_kind("ClusterRole")["unisched-dra-driver"]
    assert {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]} == {("", "pods", "get"), ("resource.k8s.io", "resourceclaims", "get"),
                                        ("resource.k8s.io", "resourceslices", "get"),
                                        ("resource.k8s.io", "resourceslices", "create"),
                                        ("resource.k8s.io", "resourceslices", "update")}
    binding = _by_kind("ClusterRoleBinding")["unisched-dra-driver"]
    assert binding["roleRef"]["name"] == "unisched-dra-driver" and binding["subjects"][0]["name"] == spec["serviceAccountName"]
    # each template asks for one device of the class, and the driver accepts the claim the scheduler makes of it
    templates = _by_kind("ResourceClaimTemplate")
    config = DraConfig(node_name="n", gpus=(0,), weight_per_gpu=args.weight_per_gpu)
    for name, t in templates.items():
        (request,) = t["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == DRIVER_NAME
        weight = request["exactly"]["capacity"]["requests"]["weight"]
        (cfg,) = t["spec"]["spec"]["devices"]["config"]
        params = cfg["opaque"]["parameters"]
        assert (cfg["opaque"]["driver"], params["apiVersion"], params["kind"]) == (DRIVER_NAME, CONFIG_API_VERSION, CONFIG_KIND)
        assert int(weight) == params["weight"] <= args.weight_per_gpu, name
        claim = {"metadata": {"uid": "u-1"}, "status": {
            "allocation": {"devices": {
                "results": [{"request": request["name"], "driver": DRIVER_NAME, "pool": "n", "device": "gpu0",
                             "consumedCapacity": {"weight": weight}}],
                "config": [{"source": "FromClaim", **cfg}]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "u-2"}]}}
        prepared = prepared_claim(config, dra_pb.Claim(namespace="default", name=name, uid="u-1"), claim)
        assert prepared.weight == params["weight"]
    # the sample pods name a template and use its claim, and run as non-root with the seccomp profile
    pods = [d for d in _docs(DRA / "side-by-side.yaml") if d["kind"] == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        ((claim_ref,), (c,)) = pod["spec"]["resourceClaims"], pod["spec"]["containers"]
        assert claim_ref["resourceClaimTemplateName"] in templates
        assert c["resources"]["claims"] == [{"name": claim_ref["name"]}]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["seccompProfile"] == {"type": "Localhost", "localhostProfile": "profiles/unisched-gpu.json"}
        script = next(a for a in c["command"] if a.startswith("/opt/unisched/"))
        assert (ROOT / script.removeprefix("/opt/unisched/")).is_file(), script


def test_both_node_agents_serve_metrics_and_are_probed_over_http() -> None:
    """The daemon container of each DaemonSet names the metrics port and probes /healthz (live) and /readyz
    (ready) on it: no exec of a Python CLI every 10 s."""
    for name in ("unisched", "unisched-dra"):
        template = _by_kind("DaemonSet")[name]["spec"]["template"]
        daemon = next(c for c in template["spec"]["containers"] if c["name"] == "daemon")
        assert daemon["ports"] == [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}], name
        assert daemon["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}, name
        assert daemon["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}, name
        # a restart for a stall must leave the daemon its 5 s of slices and more: 3 probes 10 s apart
        live = daemon["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 30, name
        assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent", name


def test_service_and_servicemonitor_reach_every_node_agent() -> None:
    (svc,) = _docs(KUBE / "service.yaml")
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"  # each pod scraped, no load balancing
    for name in ("unisched", "unisched-dra"):
        labels = _by_kind("DaemonSet")[name]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
    (port,) = svc["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("metrics", METRICS_PORT, "metrics")
    (mon,) = _docs(KUBE / "monitoring" / "servicemonitor.yaml")
    assert (mon["apiVersion"], mon["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    (endpoint,) = mon["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # our pod/namespace labels name the tenant's pod, not the agent's


def test_our_metrics_port_is_not_dcgm_exporters() -> None:
    """9400 is dcgm-exporter's port; unisched's docs and manifests say METRICS_PORT, and mention 9400 only as
    dcgm-exporter's."""
    assert METRICS_PORT != 9400 and not 9100 <= METRICS_PORT <= 9999  # Prometheus' allocated exporter range
    deploy = [p for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file()]
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *deploy]
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "9400" in line.replace(str(METRICS_PORT), ""):
                assert "dcgm-exporter" in line, f"{path.relative_to(ROOT)}:{n}: {line.strip()}"

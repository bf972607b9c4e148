"""Generate deploy/seccomp/unisched-gpu.json: the container runtime's default seccomp profile plus our notify
rules for the NVIDIA allocation ioctls, so a governed pod keeps the runtime's default hardening.

    python3 deploy/seccomp/generate.py          # rewrite the profiles and their copies in kubernetes/configmap.yaml
    python3 deploy/seccomp/generate.py --check  # exit 1 if any differs (tests/test_deploy.py)

It also writes unisched-gpu.containerd-amd64.json and unisched-gpu.containerd-arm64.json: the same profile
resolved into the OCI runtime-spec form, for containerd. containerd (ctr --seccomp-profile and the CRI plugin's
Localhost profiles alike, contrib/seccomp.WithProfile) unmarshals the file straight into the runtime spec's
LinuxSeccomp: the engine format's archMap, includes and excludes are dropped unread, so every rule the default
gates on a capability would apply to every container and the default's refusals of those calls (kcmp, bpf,
perf_event_open, setns, ...) would be lost (tests/test_containerd.py shows it). The resolved form is what a
container with containerd's default capabilities gets under CRI-O from unisched-gpu.json.

runtime-default.json is vendored unchanged: /usr/share/containers/seccomp.json of Debian 12's package
golang-github-containers-common 0.50.1+ds1-4 (containers/common v0.50.1, Apache-2.0), the default profile of
CRI-O and Podman; moby's and containerd's defaults have the same rules. Its format is the engine format that
Localhost profiles use (archMap, includes/excludes by capability and architecture); the runtime resolves it into
an OCI seccomp section per container, as `to_oci` here does for tests that run runc.

How the rules combine (libseccomp, which runc and crun use): an argument-free rule for a syscall swallows
every conditional rule for it, so the default's plain ALLOW for ioctl would leave our NOTIFY rules dead. ioctl
therefore leaves the default's plain ALLOW list and gets conditional rules only: NOTIFY where (request & 0xFFFF)
is one of ours, and ALLOW for every request through a comparison that always holds (request >= 0). libseccomp
tests the masked-equal comparisons before that one, so NOTIFY wins for our requests and every other ioctl is
allowed as before. A catch-all written as (request & 0) == 0 does not work: libseccomp tries it first and
allows everything. tests/test_oci_agent.py checks both outcomes with runc.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "runtime-default.json"
OUTPUT = HERE / "unisched-gpu.json"
CONTAINERD_ARCHES = ("amd64", "arm64")
"""GPU nodes' architectures (x86 servers; Grace): one resolved file each, since the OCI form has no archMap."""
CONTAINERD_DEFAULT_CAPS = frozenset({
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
    "CAP_AUDIT_WRITE",
})
"""containerd's default capabilities (oci/spec.go defaultUnixCaps, v1.6 to 2.x), which its CRI plugin gives every
container that adds none: the set the containerd files are resolved for. A container that adds capabilities
keeps these rules (stricter than its engine-format resolution, never looser)."""


def containerd_output(arch: str) -> Path:
    return HERE / f"unisched-gpu.containerd-{arch}.json"
LISTENER_PATH = "/run/unisched-runtime/seccomp-agent.sock"
"""The daemon's runtime agent socket (runtime_agent_socket): root's alone, where the container runtime on the host
hands over each container's listener; never mounted into pods."""

NOTIFIED_IOCTLS = (
    (0x462B, "NVIDIA RM_ALLOC: (request & 0xFFFF) == 0x462B ('F', nr 0x2B)"),
    (0x4628, "NVIDIA RM_ALLOC_OBJECT: (request & 0xFFFF) == 0x4628 ('F', nr 0x28), RM_ALLOC's older form without "
             "parameters, so session caps count it"),
    (0x4627, "NVIDIA RM_ALLOC_MEMORY: (request & 0xFFFF) == 0x4627 ('F', nr 0x27), the older memory allocation, so "
             "GPU memory caps count it"),
    (0x464A, "NVIDIA RM_VID_HEAP_CONTROL: (request & 0xFFFF) == 0x464A ('F', nr 0x4A), the heap allocations "
             "EGL/OpenGL make, so GPU memory caps count them"),
    (0x4634, "NVIDIA RM_DUP_OBJECT: (request & 0xFFFF) == 0x4634 ('F', nr 0x34), which may take a handle the driver "
             "picks, so the memory caps' handle replay follows it"),
    (0x46D3, "NVIDIA IOCTL_XFER_CMD: (request & 0xFFFF) == 0x46D3 ('F', nr 0xD3), wraps another escape"),
    (0x4629, "NVIDIA RM_FREE: (request & 0xFFFF) == 0x4629 ('F', nr 0x29), so session counts follow frees"),
)
"""The requests the daemon's seccomp agent decides on (unisched.enforce.seccomp notifies the same ones)."""

Profile = dict[str, Any]


def _notify_rule(request: int, comment: str) -> dict[str, Any]:
    return {
        "names": ["ioctl"],
        "action": "SCMP_ACT_NOTIFY",
        "args": [{"index": 1, "value": 0xFFFF, "valueTwo": request, "op": "SCMP_CMP_MASKED_EQ"}],
        "comment": comment,
    }


ALLOW_OTHER_IOCTLS = {
    "names": ["ioctl"],
    "action": "SCMP_ACT_ALLOW",
    "args": [{"index": 1, "value": 0, "op": "SCMP_CMP_GE"}],
    "comment": "every other ioctl, as the runtime default allows it: request >= 0 always holds; a conditional rule, "
               "so that it does not swallow the notify rules above, which libseccomp tests first",
}


def generate(default: Profile) -> Profile:
    """The default profile with ioctl moved out of its argument-free ALLOW rule into our conditional rules."""
    out = copy.deepcopy(default)
    plain = [r for r in out["syscalls"] if "ioctl" in r["names"]]
    if len(plain) != 1 or plain[0]["action"] != "SCMP_ACT_ALLOW" or plain[0].get("args") or plain[0].get("includes") \
            or plain[0].get("excludes"):
        raise ValueError("the runtime default no longer allows ioctl in one argument-free rule: review the merge")
    plain[0]["names"] = [n for n in plain[0]["names"] if n != "ioctl"]
    out["listenerPath"] = LISTENER_PATH
    out["listenerMetadata"] = ""
    out["syscalls"] += [_notify_rule(req, comment) for req, comment in NOTIFIED_IOCTLS] + [ALLOW_OTHER_IOCTLS]
    return out


def render(profile: Profile) -> str:
    """Top-level keys one per line, each syscall rule on one line: short enough to embed in the ConfigMap."""
    head = json.dumps({k: v for k, v in profile.items() if k != "syscalls"}, indent=1)[:-2]
    rules = ",\n".join("  " + json.dumps(rule) for rule in profile["syscalls"])
    return f'{head},\n "syscalls": [\n{rules}\n ]\n}}\n'


CONFIGMAP = HERE.parent / "kubernetes" / "configmap.yaml"
_CONFIGMAP_KEY = "  unisched-gpu.json: |\n"
CONTAINERD_KEY = "unisched-gpu-containerd.json"
"""The ConfigMap's copy of the containerd-amd64 file: nodes whose runtime is containerd name this profile."""


def configmap_with(profile_text: str, containerd_text: str, configmap: str) -> str:
    """The ConfigMap with its embedded profiles (its last two keys: the engine-format one for CRI-O, the resolved
    one for containerd) replaced."""
    head = configmap[: configmap.index(_CONFIGMAP_KEY) + len(_CONFIGMAP_KEY)]
    body = "".join("    " + line + "\n" for line in profile_text.splitlines())
    tail = "".join("    " + line + "\n" for line in containerd_text.splitlines())
    return f"{head}{body}  {CONTAINERD_KEY}: |\n{tail}"


_ARCH_NAMES = {"amd64": "SCMP_ARCH_X86_64", "x86": "SCMP_ARCH_X86", "x32": "SCMP_ARCH_X32",
               "arm64": "SCMP_ARCH_AARCH64", "arm": "SCMP_ARCH_ARM"}


def _applies(conditions: dict[str, Any], caps: set[str], arch: str, negate: bool) -> bool:
    """Whether an includes (negate=False) or excludes (negate=True) block holds for this container."""
    if not conditions:
        return not negate
    hits = []
    if "caps" in conditions:
        hits.append(any(c in caps for c in conditions["caps"]))
    if "arches" in conditions:
        hits.append(arch in conditions["arches"])
    if "minKernel" in conditions:
        hits.append(True)  # kernels here are newer than any minKernel in the default
    return any(hits) if negate else all(hits)


def to_oci(profile: Profile, caps: set[str], arch: str = "amd64") -> dict[str, Any]:
    """The OCI runtime-spec seccomp section a runtime derives from an engine-format profile for one container
    (its capabilities and architecture), as CRI-O and containerd do before they start runc."""
    native = _ARCH_NAMES[arch]
    arches = [native]
    for entry in profile.get("archMap", []):
        if entry["architecture"] == native:
            arches += entry["subArchitectures"]
    syscalls = []
    for rule in profile["syscalls"]:
        if not _applies(rule.get("includes", {}), caps, arch, negate=False):
            continue
        if rule.get("excludes") and _applies(rule["excludes"], caps, arch, negate=True):
            continue
        out = {k: v for k, v in rule.items() if k in ("names", "action", "errnoRet", "args")}
        if not out.get("args"):
            out.pop("args", None)
        syscalls.append(out)
    oci = {"defaultAction": profile["defaultAction"], "architectures": arches, "syscalls": syscalls}
    for key in ("defaultErrnoRet", "listenerPath", "listenerMetadata"):
        if key in profile:
            oci[key] = profile[key]
    return oci


def main(argv: list[str]) -> int:
    profile = generate(json.loads(DEFAULT.read_text()))
    text = render(profile)
    outputs = {OUTPUT: text}
    for arch in CONTAINERD_ARCHES:
        outputs[containerd_output(arch)] = render(to_oci(profile, set(CONTAINERD_DEFAULT_CAPS), arch))
    outputs[CONFIGMAP] = configmap_with(text, outputs[containerd_output("amd64")], CONFIGMAP.read_text())
    if argv[1:] == ["--check"]:
        stale = [p.name for p, want in outputs.items() if not p.exists() or p.read_text() != want]
        if stale:
            print(f"{', '.join(stale)}: not what {Path(__file__).name} generates: run it", file=sys.stderr)
            return 1
        return 0
    for path, want in outputs.items():
        path.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

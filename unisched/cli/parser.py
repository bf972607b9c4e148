"""The `unisched` argument parser: one sub-command per verb, the `serve` flags generated from the knob table."""

from __future__ import annotations

import argparse
import os
from typing import Any

from unisched import __version__
from unisched.cli.args import (
    add_knob_flag,
    add_memory_opts,
    add_remote,
    add_socket,
    add_tenant_opts,
    count_arg,
    gpus_arg,
    int_in,
    interval_arg,
    namespace_list,
    positive_seconds,
    size_arg,
    weight_arg,
)
from unisched.cli.service import DEFAULT_CONFIG_PATH, DEFAULT_UNIT_PATH
from unisched.integrations.kubernetes.defaults import (
    CDI_KIND,
    CONFIG_KIND,
    DEFAULT_CDI_DIR,
    DEFAULT_KUBELET_DIR,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_REGISTRY_DIR,
    DEVICE_LISTS,
    DRIVER_NAME,
)
from unisched.scheduler.config import (
    KNOBS,
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="unisched",
        description="Share NVIDIA GPUs between tenants by one weight each, over compute, rendering and video.",
    )
    ap.add_argument("--version", action="version", version=f"unisched {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve", help="run the daemon (as root)", description="Run the unisched daemon. Flags override the config file.",
        epilog="example: sudo unisched serve --config /etc/unisched/unisched.toml --check-config",
    )
    s.add_argument("--config", help="TOML config file ([daemon], [policy], [[tenants]], [[tidal]])")
    s.add_argument("--check-config", action="store_true",
                   help="check the config and flags against this host (GPUs, groups, declared cgroups), print a "
                        "summary and exit: 0 when good, 2 with the key at fault; starts and changes nothing")
    for spec in KNOBS:
        add_knob_flag(s, spec)
    s.add_argument("--delegated", action="store_true",
                   help="run in a cgroup subtree systemd delegated (Delegate=yes): move the daemon into the leaf "
                        "<own cgroup>/daemon before it starts; tenants belong under <own cgroup>/tenants")

    i = sub.add_parser(
        "install-service", help="write the systemd unit for this installation (as root)",
        description="Write the systemd unit with ExecStart running this Python interpreter (`python -m unisched "
                    "serve`), so it works for a venv or a `pip install --user` as for a system install; and the "
                    "config it names, with every setting's default, where there is none.",
        epilog="example: sudo python3 -m unisched install-service && sudo systemctl daemon-reload && "
               "sudo systemctl enable --now unisched",
    )
    i.add_argument("--unit-path", default=DEFAULT_UNIT_PATH, help=f"where to write the unit (default {DEFAULT_UNIT_PATH})")
    i.add_argument("--config", default=DEFAULT_CONFIG_PATH,
                   help=f"config the unit's daemon reads (default {DEFAULT_CONFIG_PATH})")

    r = sub.add_parser(
        "run",
        help="run a command as (part of) a tenant",
        description="Start CMD inside the tenant's cgroup, registered with the daemon; wait for it and exit with its exit "
                    "code. CMD starts with the environment the daemon gives the tenant (`unisched tenants --json` shows "
                    "it): __GL_YIELD=USLEEP, so that NVIDIA's GL driver sleeps instead of spinning while it waits for "
                    "the GPU (the tenant's CPU time splits the GPU's busy time), and MPS client settings under "
                    "`serve --mps`.",
        epilog="example: unisched run --tenant training --weight 300 -- python3 train.py",
    )
    add_socket(r)
    add_tenant_opts(r)
    add_memory_opts(r, "the run fails before CMD starts")
    r.add_argument("--no-session-hooks", action="store_true",
                   help="do not install the seccomp hook that lets the daemon admit and count GPU sessions")
    r.add_argument("--keep", action="store_true",
                   help="keep the tenant (weight, caps) after its last process exits; without it a tenant this run "
                        "creates is removed then, unless the config declares it")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    a = sub.add_parser("adopt", help="govern an existing cgroup (a container's) as a tenant (admin)",
                       description="Make an existing cgroup (a container's, a systemd service's) a tenant: its processes "
                                   "are weighed and capped as the tenant's, where they are; nothing is moved.",
                       epilog="example: unisched adopt --tenant sim --weight 300 --cgroup /system.slice/sim.service")
    add_socket(a)
    add_tenant_opts(a)
    add_memory_opts(a, "the adoption is refused")
    a.add_argument("--cgroup", required=True, help="cgroup path, absolute or relative to the cgroup root")

    t = sub.add_parser("tenants", help="list tenants and their shares",
                       description="Each tenant: weight, target and measured share, frozen or running, sessions, caps "
                                   "and refusals.", epilog="example: unisched tenants --json")
    add_socket(t)
    add_remote(t)
    t.add_argument("--json", action="store_true", help="print a JSON list, one object per tenant")

    w = sub.add_parser("set-weight", help="change a tenant's weight (admin)",
                       description="Change a tenant's weight: its share of every GPU engine it uses is weight / the sum "
                                   "of the weights of those contending there. Kept across restarts.",
                       epilog="example: unisched set-weight --tenant training --weight 300")
    add_socket(w)
    w.add_argument("--tenant", required=True, help="the tenant's name")
    w.add_argument("--weight", type=weight_arg, required=True, help="the new weight, 1..10000")

    lim = sub.add_parser("set-limit", help="cap a tenant's render/decode/encode sessions and GPU memory (admin)",
                         description="Caps on live sessions and GPU memory. -1 clears a cap back to the default "
                                     "(decode/encode: the weight share of the GPU's video engines; render, memory: none).",
                         epilog="example: unisched set-limit --tenant player-3 --render 1 --memory 4GiB")
    add_socket(lim)
    lim.add_argument("--tenant", required=True, help="the tenant's name")
    lim.add_argument("--render", type=count_arg, metavar="N", help="live render (3D/graphics) contexts (-1 clears)")
    lim.add_argument("--decode", type=count_arg, metavar="N", help="live NVDEC sessions (-1 clears)")
    lim.add_argument("--encode", type=count_arg, metavar="N", help="live NVENC sessions (-1 clears)")
    lim.add_argument("--memory", type=size_arg, metavar="SIZE",
                     help="GPU memory per GPU, e.g. 8GiB (-1 clears); the allocation that would cross it fails as out of "
                          "memory (hooked tenants: `unisched run`, OCI agent)")
    lim.add_argument("--memory-reserve", type=size_arg, metavar="SIZE",
                     help="GPU memory kept for the tenant on each GPU it may use, e.g. 4GiB (-1 clears); refused when the "
                          "reserves on a GPU would exceed its memory")

    rm = sub.add_parser("remove", help="forget a tenant and thaw its cgroup (admin, or the tenant's owner)",
                        description="Forget a tenant: its cgroup is thawed and no longer governed; processes still in "
                                    "it keep running (a cgroup the daemon made is removed once they end).",
                        epilog="example: unisched remove --tenant old-job")
    add_socket(rm)
    rm.add_argument("--tenant", required=True, help="the tenant's name")

    st = sub.add_parser("status", help="daemon and GPU status; exit 0 when the daemon answers",
                        description="The daemon's version, mode, sockets, session hooks and GPUs; exit 0 when it "
                                    "answers, 1 when it cannot be reached (a health check).",
                        epilog="example: unisched status --json")
    add_socket(st)
    add_remote(st)
    st.add_argument("--json", action="store_true", help="print one JSON object")

    top = sub.add_parser("top", help="live view of tenants, shares per engine domain, sessions and refusals",
                         description="Refreshes every --interval seconds; q quits (Ctrl-C when stdin is not a terminal).",
                         epilog="example: unisched top --interval 0.5")
    add_socket(top)
    add_remote(top)
    top.add_argument("--interval", type=interval_arg, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    _add_device_plugin(sub)
    _add_dra_driver(sub)
    _add_calibrate(sub)
    return ap


def _add_calibrate(sub: Any) -> None:
    from unisched.calibrate import QUICK, STANDARD, estimate_s

    c = sub.add_parser(
        "calibrate", help="measure how much CUDA and rendering slow each other on this GPU, for the daemon",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Measure on GPU 0 how much a CUDA load and a render load slow each other, and write it where the daemon reads it
(STATE_DIR/contention.json, merged under the GPU's name: one file serves several GPU models). The daemon reads the
file at start and picks how to schedule compute against graphics on that GPU model (docs/calibration.md):
  separate-graphics  both keep most of their solo rate together: not sliced against each other
  partial-overlap    together they do about as much as either alone: mixed slices
  shared-sm          they contend: sliced against each other as one domain (also without a calibration)

Run it once per GPU model, and again after a driver update, on an otherwise idle GPU, then restart the daemon.
Needs an NVIDIA GPU, PyTorch with CUDA and PyOpenGL.""",
        epilog=f"time: about {estimate_s(STANDARD):.0f} s ({STANDARD.seconds:g} s windows); --quick about "
               f"{estimate_s(QUICK):.0f} s. Progress goes to stderr.\n"
               "exit status: 0 written; 1 a measurement failed (nothing written); 2 refused before measuring "
               "(no GPU, missing workloads, a target it cannot write)\n"
               "example: sudo unisched calibrate --dry-run && sudo unisched calibrate && sudo systemctl restart unisched",
    )
    c.add_argument("--config", help="the TOML config `unisched serve` reads, for its state_dir")
    state_dir = next(k for k in KNOBS if k.name == "state_dir")
    add_knob_flag(c, state_dir)
    c.add_argument("--out", metavar="FILE", help="write (merge into) FILE instead of STATE_DIR/contention.json")
    c.add_argument("--quick", action="store_true",
                   help=f"{QUICK.seconds:g} s windows instead of {STANDARD.seconds:g} s: checks the set-up; the "
                        "fractions are noisier")
    c.add_argument("--seconds", type=positive_seconds, help="measured window per run (overrides --quick's)")
    c.add_argument("--warmup", type=positive_seconds, help="seconds from a workload's launch to its window")
    c.add_argument("--gpu-name", metavar="NAME", help="file the result under NAME instead of GPU 0's NVML name")
    c.add_argument("--render-iterations", type=int_in("render iterations", 1, 1_000_000), metavar="N",
                   help="fixed shader iterations per frame; skips finding those that give ~36 frames/s")
    c.add_argument("--workload-cmd-cuda", metavar="CMD",
                   help="command replacing the CUDA load (shell words; the window arguments are appended)")
    c.add_argument("--workload-cmd-render", metavar="CMD", help="command replacing the render load (as above)")
    c.add_argument("--work-dir", metavar="DIR", help="workload logs and reports (default: a new folder in /tmp)")
    c.add_argument("--dry-run", action="store_true", help="print the plan and the time it takes; run nothing")


def _add_device_plugin(sub: Any) -> None:
    d = sub.add_parser(
        "device-plugin",
        help="Kubernetes device plugin: advertise GPU weight to the kubelet and adopt pods as tenants (as root)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run beside `unisched serve` on a Kubernetes node (deploy/kubernetes/ has the DaemonSet; docs/kubernetes.md).

Advertises to the kubelet (device plugin API v1beta1, one socket and Register call per resource):
  unisched.io/gpu-weight       --units-per-gpu device IDs per GPU; a pod asks for its weight as a count and
                               gets that many units, all on one GPU (GetPreferredAllocation keeps them there;
                               Allocate refuses units that span GPUs)
  unisched.io/render-sessions  --render-sessions per GPU, only when given: a pod's count is its cap on live
  unisched.io/decode-sessions  render contexts / NVDEC sessions (a pod that asks for none gets cap 0)

Allocate gives the container UNISCHED_TENANT (derived from its units), UNISCHED_WEIGHT, UNISCHED_GPU,
UNISCHED_SOCKET, NVIDIA_VISIBLE_DEVICES, the daemon's socket directory (read-only) and the GPU's device nodes.
The kubelet's PodResources API then says which pod holds which units; the plugin adopts each such pod's cgroup
as a daemon tenant (weight = its units, pinned to its GPU; pod UID looked up in the API server with the pod's
service account), before its containers start (PreStartContainer), and removes the tenant when the pod is gone.
GPU health (NVML) reaches the kubelet through ListAndWatch; a kubelet restart is followed by a new registration.
""",
        epilog="example: unisched device-plugin --units-per-gpu 100 --render-sessions 8",
    )
    add_socket(d)
    d.add_argument("--kubelet-dir", default=DEFAULT_KUBELET_DIR,
                   help=f"the kubelet's device-plugins directory, holding kubelet.sock (default {DEFAULT_KUBELET_DIR})")
    d.add_argument("--pod-resources-socket", default=DEFAULT_POD_RESOURCES_SOCKET,
                   help=f"the kubelet's PodResources socket (default {DEFAULT_POD_RESOURCES_SOCKET})")
    d.add_argument("--units-per-gpu", type=int_in("units per GPU", 1, 1000), default=100,
                   help="unisched.io/gpu-weight device IDs per GPU (default 100: a pod's count is its weight)")
    d.add_argument("--beside-nvidia-plugin", action="store_true",
                   help="start even where NVIDIA's device plugin (nvidia-*.sock in --kubelet-dir) advertises some of "
                        "these GPUs; without it the plugin refuses to start there (exit 3) and says what to do")
    _add_node_agent_args(d, ("advertise", "advertised"), ("unisched.io/render-sessions", "unisched.io/decode-sessions"),
                         "kubelet, health and adoption checks")


def _add_node_agent_args(d: Any, verb: tuple[str, str], sessions: tuple[str, str], checks: str) -> None:
    """The flags `device-plugin` and `dra-driver` share."""
    d.add_argument("--require-gpu-profile", action="store_true",
                   help="refuse a pod whose containers holding unisched.io resources or using this driver's claims "
                        "run without the GPU seccomp profile (Localhost profiles/unisched-gpu*.json) or privileged: "
                        "the device plugin holds its containers back at PreStartContainer, the DRA driver fails the "
                        "claim's preparation, each with the reason; without it such a pod is weighted but its session "
                        "caps are not enforced")
    d.add_argument("--online-namespaces", type=namespace_list, default=None, metavar="NS,NS",
                   help="the namespaces whose pods may ask for the online priority (annotation unisched.io/priority: "
                        "online, which holds the other tenants back while it has work); a pod elsewhere that asks for "
                        "it is not adopted and its containers are held back with the reason (default: any namespace)")
    d.add_argument("--device-list", choices=DEVICE_LISTS, default=DEVICE_LISTS[0],
                   help="how a container's GPUs are named to the NVIDIA container toolkit: the NVIDIA_VISIBLE_DEVICES "
                        "variable (envvar, the default), or /dev/null mounted per GPU under "
                        "/var/run/nvidia-container-devices (volume-mounts); with volume-mounts, and the toolkit set to "
                        "accept-nvidia-visible-devices-as-volume-mounts = true and "
                        "accept-nvidia-visible-devices-envvar-when-unprivileged = false, a pod that sets the variable "
                        "itself gets no GPU")
    d.add_argument("--render-sessions", type=int_in("render sessions per GPU", 1, 1000),
                   help=f"{verb[0]} {sessions[0]}, this many per GPU (default: not {verb[1]})")
    d.add_argument("--decode-sessions", type=int_in("decode sessions per GPU", 1, 1000),
                   help=f"{verb[0]} {sessions[1]}, this many per GPU (default: not {verb[1]})")
    d.add_argument("--gpus", type=gpus_arg, default=[], help=f"GPU indices to {verb[0]} (default: the GPUs the daemon serves)")
    d.add_argument("--cgroup-root", help="where pod cgroups are searched (default: the daemon's cgroup root)")
    d.add_argument("--interval", type=interval_arg, default=2.0, help=f"seconds between {checks} (default 2)")
    d.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                   help="json lines, or console text (default auto: console on a terminal, else json)")


def _add_dra_driver(sub: Any) -> None:
    d = sub.add_parser(
        "dra-driver",
        help=f"Kubernetes DRA driver {DRIVER_NAME} (1.34+): publish GPUs, prepare claims as CDI devices (as root)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"""\
Run beside `unisched serve` on a Kubernetes 1.34+ node, instead of `unisched device-plugin`
(deploy/kubernetes/dra/ has the DaemonSet, DeviceClass and a sample claim; docs/kubernetes.md).

Registers with the kubelet through its plugins_registry directory (plugin registration API v1: GetInfo says
DRAPlugin {DRIVER_NAME}, v1beta1.DRAPlugin) and serves the DRA plugin API v1beta1 under --plugins-dir.
Publishes the node's ResourceSlice: one device per GPU (gpu0, gpu1, ...; attributes index, uuid, product,
renderSessions, decodeSessions) with capacity `weight` = --weight-per-gpu, shareable by consumable capacity.

NodePrepareResources reads each ResourceClaim from the API server, takes its {DRIVER_NAME} devices on this node
and its weight ({CONFIG_KIND} opaque config `weight`, else the weight capacity consumed, else the whole GPU's),
writes a CDI spec ({CDI_KIND}) into --cdi-dir that gives the containers UNISCHED_TENANT, UNISCHED_WEIGHT,
UNISCHED_GPU, UNISCHED_SOCKET, NVIDIA_VISIBLE_DEVICES, the daemon's socket directory and the GPUs' device nodes,
and adopts the pod's cgroup as that daemon tenant. NodeUnprepareResources removes both. A claim that cannot be
prepared fails alone, with the reason in the pod's events.
""",
        epilog="example: unisched dra-driver --weight-per-gpu 100",
    )
    add_socket(d)
    d.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="this node's name: the ResourceSlice's pool and node (default: $NODE_NAME)")
    d.add_argument("--driver-name", default=DRIVER_NAME, help=f"the DRA driver name (default {DRIVER_NAME})")
    d.add_argument("--plugins-dir", default=DEFAULT_PLUGINS_DIR,
                   help=f"the kubelet's plugins directory; the driver serves <dir>/<driver-name>/dra.sock "
                        f"(default {DEFAULT_PLUGINS_DIR})")
    d.add_argument("--registry-dir", default=DEFAULT_REGISTRY_DIR,
                   help=f"the kubelet's plugins_registry directory (default {DEFAULT_REGISTRY_DIR})")
    d.add_argument("--cdi-dir", default=DEFAULT_CDI_DIR,
                   help=f"where CDI specs are written, read by the container runtime (default {DEFAULT_CDI_DIR})")
    d.add_argument("--weight-per-gpu", type=int_in("weight per GPU", 1, 1000), default=100,
                   help="the weight capacity of each GPU, and a whole GPU's weight (default 100)")
    _add_node_agent_args(d, ("publish", "published"), ("attribute renderSessions", "attribute decodeSessions"),
                         "socket, health, ResourceSlice and adoption checks")

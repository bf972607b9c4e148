"""Kubernetes: the kubelet's device plugin and pod resources APIs (generated code beside their .proto files),
the unisched device plugin that advertises GPU weight and session counts, and the adopter that turns pods
holding them into daemon tenants. See docs/kubernetes.md."""

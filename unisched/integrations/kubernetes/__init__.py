"""Kubernetes: the unisched device plugin (advertises GPU weight and session counts to the kubelet) and DRA
driver (publishes GPUs, prepares claims as CDI devices), and the adopter that turns the pods holding them into
daemon tenants. Each is a client of the daemon, through its socket; the kubelet's APIs are generated code beside
their .proto files. See docs/kubernetes.md."""

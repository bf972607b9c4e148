"""unisched's wire protocol, in one place for the daemon and the client library.

`unisched.proto` and its generated code (`unisched_pb2`, and `unisched_pb2_grpc`, which only the daemon and its
CLI import: it needs grpcio, which the client library does not depend on), the lease stream's frames
(`leasewire`) and the environment a tenant process starts with (`tenantenv`). It imports only the standard
library and protobuf, so the `unisched-client` distribution that ships it pulls in nothing else.
Regenerate the code with `python -m unisched.transport.codegen` (a checkout with grpcio-tools).
"""

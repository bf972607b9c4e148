"""Session admission: seccomp user notification on NVIDIA's allocation ioctls.

A classic-BPF seccomp filter, installed in a tenant's first process just before exec (no_new_privs +
SECCOMP_FILTER_FLAG_NEW_LISTENER), sends only NVIDIA's allocation escapes to a supervisor; every other syscall
runs at kernel speed. The listener fd reaches the daemon over a Unix socket (SCM_RIGHTS): from `unisched run`'s
child, or from an OCI runtime (runc >= 1.1, crun >= 0.19) whose seccomp profile has SCMP_ACT_NOTIFY and
`listenerPath` (deploy/seccomp/unisched-gpu.json). The daemon serves each listener with a supervisor that counts
sessions per tenant and admits or refuses new ones.

- abi.py: the kernel's seccomp numbers and structs, the syscall, `probe`.
- filter.py: the BPF program and installing it (tenant side).
- handover.py: giving the listener to the daemon (tenant side).
- agent.py: reading the hand-over message and replying (daemon side).
- calls.py: decoding one notified call from the caller's memory (pure, the reader passed in).
- accounting.py: which calls open and close which sessions (pure).
- memory.py, handles.py: video memory per allocation and the driver-picked handles replayed (pure).
- ledger.py: the bytes every tenant holds per GPU, shared by all the books; each allocation admitted or refused.
- supervisor.py: the thread that answers one listener's notifications.
- examine.py: reading a notified call from its caller; a call the daemon's filter never sends (not its listener).
- proc.py: a tenant's memory (process_vm_readv, /proc/PID/mem) and who a pid names over time (its start time).
- decisions.py: the new sessions' calls a supervisor asks the event loop to decide.
- budget.py: one owner's listeners take turns, at a bounded rate (the interpreter lock they share with the loop).
- listener.py: the listener fd's ioctls (receive, check, answer, write a refused call's status).
- memory_calls.py: charging video memory allocations, booking devices and frees (the supervisor's memory side).
- stats.py: what a supervisor reports (`SupervisorStats`).
- hooks.py: what the daemon needs from all of that (`SessionHooks`), the real one and a fake.

abi, filter and handover import the standard library only, and this file imports nothing: `unisched run`'s
trampoline runs them in every new tenant process.

CAVEAT (seccomp_unotify(2)): "continue" makes the kernel re-read the argument from user memory, so a hostile
multithreaded tenant can swap the class after the supervisor looked at it, and the driver dispatches on an
escape's nr and size whatever the type byte says. This is admission control and QoS for cooperative or
unaware applications, NOT a security boundary against hostile code.
"""

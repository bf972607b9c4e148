"""Integrations: programs that run beside the daemon and talk to it as its clients (over the wire protocol), to
fit unisched into an orchestrator. They sit on top of the layers; nothing below imports them."""

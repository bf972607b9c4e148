"""The scheduler: the asyncio loop that measures, charges the policy, decides and enforces each slice."""

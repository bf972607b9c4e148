"""The engine: the asyncio loop that measures, charges the policy, decides and enforces each slice."""

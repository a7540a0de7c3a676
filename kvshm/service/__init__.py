"""The coordinator process, its wire protocol and the asyncio client."""

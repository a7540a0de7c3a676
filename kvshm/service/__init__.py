"""The transport: the coordinator process (asyncio on uvloop), frame reading,
the handshake and both clients.  What an op does is `kvshm.ops`."""

"""The sans-IO ops layer: protocol messages -> core calls, for one owner.

It holds the wire types (`protocol`) and the wire error table (`errors`),
whom an op runs for (`owner`), tenants (`tenants`), the session records in
the segment (`sessions`), the op executor (`executor`: dispatch) and the
session and restart lifecycle (`lifecycle`).  Nothing here touches a
socket or an event loop: the coordinator (`kvshm.service.server`), the
embedded replay, the compute-free scheduler and the benchmarks drive it.
"""

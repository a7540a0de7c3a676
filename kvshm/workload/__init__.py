"""Workloads: every workload's requests in one family of generators
(items.py: synthetic chat, the RAG shape, JSONL files, conversations in
waves, shared prefixes with duplicates, system prompts; one `Item` type),
the one spec that names a run's requests (spec.py, `WorkloadSpec`), the
scheduling policy, sans-IO (policy.py: `Planner` and its `Seq`), and the
compute-free scheduler that drives it through the op executor (scheduler.py:
`kvshm demo`, scripts/bench_service.py).  The CPU workers' engine
(kvshm/workers/engine.py) drives the same planner.

It sits on the ops layer (the scheduler's embedded backend runs the
coordinator's executor) and under the command line, the workers, the vLLM
driver and the benchmarks, which take their requests from here."""

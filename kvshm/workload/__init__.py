"""Workloads: every workload's requests in one family of generators
(items.py: synthetic chat, the RAG shape, JSONL files, conversations in
waves, shared prefixes with duplicates; one `Item` type), and the
compute-free scheduler that drives them through the op executor
(scheduler.py: `kvshm demo`, scripts/bench_service.py).

It sits on the ops layer (the scheduler's embedded backend runs the
coordinator's executor) and under the command line, the workers, the vLLM
driver and the benchmarks, which take their requests from here."""

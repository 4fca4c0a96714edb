"""Developer tools, run as `python -m eaglepipe.tools.<tool>`: benchmarks (bench_train, bench_engines,
bench_generation, bench_extraction, with the machine's limits in limits), the data-scaling run (scaling), the
parse-time plan (estimate, also read by the workflow and preflight) and the node plan of a dry run (plan). No stage
imports them, except estimate for the plan and the target's facts."""

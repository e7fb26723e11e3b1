"""The command-line tools besides training, each run from the repository root as a module: python -m tools.NAME.
The modules named after a tool (bench_*.py, gpu_check_*.py) are its parts, which no one runs: what a reader looks
for in the tool (a measurement, a stage, the report), and what two tools share."""

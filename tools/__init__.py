"""The command-line tools besides training, each run from the repository root as a module: python -m tools.NAME."""

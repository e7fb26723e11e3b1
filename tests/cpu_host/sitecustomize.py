import cpu_host  # noqa: F401  (Python imports sitecustomize at start-up: see cpu_host.py)

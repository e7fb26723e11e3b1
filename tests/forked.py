"""Many short commands of ours (`python train_gpt2.py ...`, `python -m tools.sample ...`) run as real processes, each
with its own exit status, output, environment and working directory, without each paying Python's and torch's start
(seconds apiece on 2 cores): one server process imports what they use once, then forks a child per command, a few at
a time. A child adds its environment before its command runs; what would only act at a fresh Python's start (a
sitecustomize on PYTHONPATH) is given as `prelude`, a Python file the child runs first.

    runs = run_forked({"case": Command(["train_gpt2.py", "--max_steps", "-1"])}, preload=["train_gpt2"])
    runs["case"].returncode, runs["case"].stderr
"""

import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Command:
    argv: list[str]  # what follows `python`: a script and its arguments, or -m, a module and its arguments
    env: dict[str, str] = field(default_factory=dict)  # added to the server's (the test's train_env())
    cwd: str = str(ROOT)
    prelude: str | None = None  # a Python file the child runs before its command


def run_forked(commands: dict[str, Command], preload: list[str], env: dict[str, str], parallel: int = 3,
               timeout: int = 180) -> dict[str, subprocess.CompletedProcess]:
    """Each command run to its end (SIGALRM ends one running past `timeout` s: returncode -14), by name. The server
    imports the modules in `preload` and runs in `env`."""
    with tempfile.TemporaryDirectory() as out:
        jobs = {name: asdict(command) | {"stdout": f"{out}/{i}.out", "stderr": f"{out}/{i}.err"}
                for i, (name, command) in enumerate(commands.items())}
        request = {"preload": preload, "parallel": parallel, "timeout": timeout, "jobs": jobs}
        server = subprocess.run([sys.executable, __file__], input=json.dumps(request), capture_output=True, text=True,
                                cwd=ROOT, env=env, timeout=timeout * len(commands))
        assert server.returncode == 0, server.stderr[-4000:]
        codes = json.loads(server.stdout)
        return {name: subprocess.CompletedProcess(commands[name].argv, codes[name], Path(job["stdout"]).read_text(),
                                                  Path(job["stderr"]).read_text()) for name, job in jobs.items()}


def serve(request: dict) -> dict[str, int]:
    sys.path[0] = str(ROOT)  # as for `python train_gpt2.py` in ROOT (this file's directory would come first)
    for module in request["preload"]:
        importlib.import_module(module)
    waiting, running, codes = list(request["jobs"].items()), {}, {}
    while waiting or running:
        while waiting and len(running) < request["parallel"]:
            name, job = waiting.pop(0)
            sys.stdout.flush(), sys.stderr.flush()  # (nothing buffered here may be written twice)
            pid = os.fork()
            if pid == 0:
                run_child(job, request["timeout"])
            running[pid] = name
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    return codes


def run_child(job: dict, timeout: int) -> None:
    """In the forked child: the job's command, as `python ARGV` would run it; never returns."""
    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        signal.alarm(timeout)
        if job["prelude"]:
            runpy.run_path(job["prelude"])
        argv = job["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:  # as the interpreter ends on it: a message is printed and means status 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    print(json.dumps(serve(json.loads(sys.stdin.read()))))

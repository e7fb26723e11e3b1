"""The CPU the tests run as, in every process of the suite: pytest's own (tests/conftest.py imports this first) and
every Python it starts (torchrun, its ranks, the tools), which import it through sitecustomize.py beside it
(conftest.py puts this directory on their PYTHONPATH; it stands in for any other sitecustomize there).

TESTS_CPU_BF16=1 or 0: what precision.cpu_has_bf16_arithmetic answers, the one question the code asks of the CPU
(bf16 or fp32 for --dtype auto and for Muon's Newton–Schulz). Tests set it through conftest.py's cpu_bf16 fixture,
which runs them both ways; a test that asks without it fails, saying so, so that no machine's own answer can hide
the other branch of any test.

TESTS_CPU=avx2: run as on an x86 CPU with AVX2 but no AVX-512 and no AMX (as many users' and CI machines are),
whatever this one has: ATen's AVX2 kernels, oneDNN and MKL kept to AVX2 (so bf16 matmuls are emulated, and slow, as
there), torch.cpu's checks of the CPU's features answering as there, and a torch.compile cache of its own. The
whole suite so:

    TESTS_CPU=avx2 .venv/bin/python -m pytest tests      # or: TESTS_CPU=avx2 bash run_tests.sh
"""

import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
from getpass import getuser

FORCED = "TESTS_CPU_BF16"
AVX2_CACHE = "_tests_cpu_avx2"

# What torch.cpu's checks of the CPU's features answer on an AVX2-only x86 CPU.
AVX2_ONLY = {"_is_avx2_supported": True, "_is_avx512_supported": False, "_is_avx512_bf16_supported": False,
             "_is_vnni_supported": False, "_is_amx_tile_supported": False, "_is_amx_fp16_supported": False}


def forced_bf16_arithmetic() -> bool:
    """precision.cpu_has_bf16_arithmetic in the suite: the answer the test forced."""
    answer = os.environ.get(FORCED)
    if answer not in ("0", "1"):
        raise AssertionError(
            "this test's path depends on whether the CPU has bf16 arithmetic (precision.cpu_has_bf16_arithmetic: "
            "--dtype auto, Muon's Newton–Schulz), and the test did not force the answer: give it tests/conftest.py's "
            "cpu_bf16 fixture, which runs it both ways, or take the question out of its path (--dtype fp32, say)")
    return answer == "1"


def detected_bf16_arithmetic() -> bool:
    """precision.cpu_has_bf16_arithmetic's own answer, unforced: this CPU's (or, under TESTS_CPU=avx2, that one's)."""
    from training import precision
    return precision.cpu_has_bf16_arithmetic.__wrapped__()


def answer_as_avx2_only(torch_cpu) -> None:
    for check, answer in AVX2_ONLY.items():
        setattr(torch_cpu, check, lambda answer=answer: answer)


def force_the_question(precision) -> None:
    forced_bf16_arithmetic.__wrapped__ = precision.cpu_has_bf16_arithmetic  # the real detection, for its own test
    precision.cpu_has_bf16_arithmetic = forced_bf16_arithmetic


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Changes a module right after it first runs (importing torch here would slow down every Python started)."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute, patch = spec.loader.exec_module, self.patches[name]

        def execute_and_patch(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = execute_and_patch
        return spec


def run_as_avx2_only() -> None:
    # Read when torch dispatches its first kernel and when oneDNN and MKL start: before torch is imported, so here.
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"  # (fp32 matmuls)
    # torch.compile's cache of its own: code compiled for this CPU must not be found by a run as the other (a graph
    # compiled here made a later run on an AMX CPU abort), and the other way round.
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getuser()}"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache if cache.endswith(AVX2_CACHE) else cache + AVX2_CACHE


patches = {"training.precision": force_the_question}
if os.environ.get("TESTS_CPU") == "avx2":
    run_as_avx2_only()
    patches["torch.cpu"] = answer_as_avx2_only
elif os.environ.get("TESTS_CPU"):
    raise ValueError(f"TESTS_CPU={os.environ['TESTS_CPU']}: the one other CPU the suite can run as is avx2")
sys.meta_path.insert(0, PatchOnImport(patches))

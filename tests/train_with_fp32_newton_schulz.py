"""train_gpt2.py with Muon's Newton–Schulz iteration in fp32 on every device, for tests that compare a distributed
Muon run with one process more tightly than bf16's rounding allows: torch's bf16 iteration turns gradients that differ
by the order of additions alone (fsdp's reduce-scatter against one process's accumulation, ~1e-7) into losses
1e-5 apart within a few steps, where the fp32 one keeps them ~1e-7 apart.

    python tests/train_with_fp32_newton_schulz.py ARGS...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root, as conftest.py does

import train_gpt2  # noqa: E402
from training import optim  # noqa: E402
from training.errors import run_entry_point  # noqa: E402

optim.bf16_matmul_is_slow = lambda device: True  # what optim.newton_schulz asks before it picks its precision

if __name__ == "__main__":
    run_entry_point(lambda: train_gpt2.main(sys.argv[1:]))

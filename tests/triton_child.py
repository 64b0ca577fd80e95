"""Running Triton kernel tests without a GPU.

Without CUDA the kernels run in Triton's interpreter on CPU tensors. Triton 3.9
needs TRITON_INTERPRET=1 before `triton` itself is first imported (its own
`tl.max`/`tl.sum` helpers are decorated then) and for as long as kernels
launch; other test files may already have imported triton (transformers'
modeling code does). So on CPU a kernel test file re-runs itself in a child
pytest with the variable set, and the parent only reports the child's result:

    from triton_child import RUN_HERE, interpreter_child, kernel_test
    test_cpu_interpreter_child = interpreter_child(__file__)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

RUN_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="on CPU these run in the TRITON_INTERPRET=1 child of test_cpu_interpreter_child")


def interpreter_child(test_file: str) -> Callable[[], None]:
    """The parent's one test on CPU: run `test_file` again under TRITON_INTERPRET=1; it must pass."""

    @pytest.mark.skipif(RUN_HERE, reason="kernels run in this process")
    def test_cpu_interpreter_child() -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env["TRITON_INTERPRET"] = "1"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"],
            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        assert " passed" in proc.stdout, proc.stdout[-2000:]

    return test_cpu_interpreter_child

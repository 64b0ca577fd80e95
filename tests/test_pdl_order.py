"""The rule the PDL kernels rely on (`nanoinfer.kernels.pdl_enabled`): a kernel lets its dependents launch only
after its own `gdc_wait`, so a kernel that starts finds everything before its immediate predecessor finished, and
rotate_and_cache and SiLU-and-mul read the residual row (written two kernels back) before their wait. A kernel
that released its dependents first would let them read that row while it is still being written. Checked on the
kernels' source (CPU: no GPU needed to break the rule)."""

from __future__ import annotations

import ast
import pathlib

import nanoinfer.kernels

KERNELS = pathlib.Path(nanoinfer.kernels.__file__).parent


def _calls(node: ast.AST, name: str) -> list[int]:
    """Line numbers of calls to `...name()` inside node."""
    return [n.lineno for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name]


def test_every_kernel_releases_its_dependents_after_its_wait() -> None:
    """Textual order in each kernel that takes USE_PDL (launched with PDL): it waits, and releases no dependents
    before its first wait. (A kernel launched with PDL that never waited could end before its own predecessor;
    the kernel after it would then find that one unfinished.) Early returns before the wait are the kernels'
    own concern: paged attention's programs without work leave before it, and every launch has a program
    that waits."""
    checked = []
    for path in sorted(KERNELS.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef) or "USE_PDL" not in [a.arg for a in fn.args.args]:
                continue
            waits, releases = _calls(fn, "gdc_wait"), _calls(fn, "gdc_launch_dependents")
            assert waits, f"{path.name}:{fn.name} launches with PDL and never waits for its predecessor"
            assert not releases or min(waits) < min(releases), \
                f"{path.name}:{fn.name} releases its dependents before its wait"
            checked.append(fn.name)
    # the kernels that launch with PDL (a new one joins this list when it does)
    assert {"_rotate_and_cache_kernel", "_silu_and_mul_kernel", "_paged_attention_kernel", "_rms_norm_kernel",
            "_skinny_gemm_kernel", "_all_reduce_add_kernel"} <= set(checked)

"""What the GPU would run, read without a GPU: compiles our paged-attention kernel for an H100 / H200 (sm_90) with
the ptxas and cuobjdump that ship in Triton's wheel, and prints its registers, shared memory and the instruction
mix of its loops. The kernel's arguments come from a real call of its launcher on small CPU tensors, so the compiled
variant is the one the engine would launch (PDL on, as on a GPU).

To see what the device machines' Triton (3.6) makes of a kernel, put that wheel's unpacked `triton/` first on
PYTHONPATH (`pip download --no-deps triton==3.6.0`, unzip): its registers and loop counts match the ncu / device
figures in bench/RESULTS.md (fp8 decode under the 128-register cap: 874 instructions per step; bf16: 225 registers).

This is how the fp8 decode kernel's byte-wise V loads were found (bench/NOTES.md): 128 `LDS.U8` per thread per
64-token step. Instruction counts are not times; measure on the GPU before believing a change.

`--moe T` compiles the fused MoE's two grouped GEMMs instead, as Qwen3-30B-A3B launches them at T tokens
(`--fp8-experts`; `--bf16-activations`: the fp8 GEMM on bfloat16 activations, as before 2026-11-29 18:30): how the
conversion of fp8 experts to bfloat16 (64 F2F and 32 PRMT per thread per K step) was found.

    python bench/sass.py [--kv-cache-dtype fp8] [--token-major-v] [--prefill] [--batch 16] [--heads 32,4]
                         [--num-splits 4] [--balance-programs 1056] [--block-n 128] [--num-warps 4]
                         [--num-stages 5] [--maxnreg 128] [--top 30]
    python bench/sass.py --moe 1 [--fp8-experts [--bf16-activations]]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import heads_arg  # bench/kernels.py
from nanoinfer.kernels import paged_attention as pa
from nanoinfer.kernels.attention_config import choose_config
from nanoinfer.layers.attention import v_cache_view

_POINTER_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32", torch.int64: "i64"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclasses.dataclass
class Report:
    registers: int
    spill_bytes: int
    shared_bytes: int
    loops: list[list[str]]  # each loop's instructions (opcode with modifiers), innermost-first order of the SASS


def capture_launches(kernels: list, launch) -> list[tuple[object, tuple, dict]]:
    """(kernel, args, kwargs) of each `kernel[grid](...)` that `launch()` makes of these kernels, in order,
    without running any of them."""
    calls = []
    with contextlib.ExitStack() as stack:
        for kernel in kernels:
            stack.enter_context(mock.patch.object(
                kernel, "run", lambda *args, _kernel=kernel, **kwargs: calls.append((_kernel, args, kwargs))))
        launch()
    return calls


def capture_launch(kernel, launch) -> tuple[tuple, dict]:
    """The arguments `launch()` gives `kernel[grid](...)` (its last launch), without running the kernel."""
    _, args, kwargs = capture_launches([kernel], launch)[-1]
    return args, kwargs


def compile_for_sm90(kernel, args: tuple, kwargs: dict, **option_overrides):
    """Compile `kernel` for sm_90 as a launch with these arguments would: pointers 16-byte aligned, ints
    of 1 and multiples of 16 specialised (unless the kernel opts out), constexprs as given."""
    params = {p.name: p for p in kernel.params}
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        param, value = params[name], values.get(name, params[name].default)
        if isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = "*" + _POINTER_TYPES[value.dtype], [["tt.divisibility", 16]]
        elif param.is_constexpr or (type(value) is int and value == 1 and not param.do_not_specialize):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs} | {k: v for k, v in option_overrides.items() if v}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def report(compiled) -> Report:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([_BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    code = [(int(addr, 16), text.strip()) for addr, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in code:  # a branch to an earlier address closes a loop
        target = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            loops.append([_opcode(t) for a, t in code if int(target.group(1), 16) <= a <= addr])
    return Report(int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"LOCAL:(\d+)", usage).group(1)),
                  compiled.metadata.shared, loops)


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def attention_launch(cache_dtype: torch.dtype, *, prefill: bool, token_major_v: bool, batch: int = 256,
                     heads: tuple[int, int] = (16, 8), **config_overrides):
    """A Qwen3-0.6B-shaped paged_attention call on CPU tensors (`heads`: 16 query / 8 KV heads; head_dim 128,
    block 16): four sequences of 100 tokens, decoding one token each or prefilling 50, with the tiles
    `choose_config` gives a batch of `batch` sequences, and for decode the engine's longest-first `seq_order`."""
    num_seqs, seq_len, q_len = 4, 100, 50 if prefill else 1
    num_heads, num_kv_heads = heads
    kv = torch.zeros(2, 64, 16, num_kv_heads, 128, dtype=cache_dtype)
    k_cache, v_cache = kv[0], kv[1] if token_major_v else v_cache_view(kv[1])
    query = torch.zeros(num_seqs * q_len, num_heads, 128, dtype=torch.bfloat16)
    query_start_loc = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    block_tables = torch.arange(num_seqs * 8, dtype=torch.int32).view(num_seqs, 8)
    config = choose_config(num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16, max_query_len=q_len,
                           num_seqs=batch, max_seq_len=1000, num_sms=132, cache_dtype=cache_dtype)
    config = dataclasses.replace(config, **config_overrides)
    seq_order = None if prefill else torch.arange(num_seqs, dtype=torch.int32)
    return lambda: pa.paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, 0.1,
                                      max_query_len=q_len, config=config, seq_order=seq_order)


def attention_report(cache_dtype: torch.dtype, *, prefill: bool = False, token_major_v: bool = False,
                     maxnreg: int | None = None, batch: int = 256, heads: tuple[int, int] = (16, 8),
                     **config_overrides) -> Report:
    kernel = pa._paged_attention_kernel
    args, kwargs = capture_launch(kernel, attention_launch(cache_dtype, prefill=prefill, token_major_v=token_major_v,
                                                           batch=batch, heads=heads, **config_overrides))
    kwargs.update(USE_PDL=True, launch_pdl=True)  # as on the GPU
    return report(compile_for_sm90(kernel, args, kwargs, maxnreg=maxnreg))


def moe_reports(fp8: bool, tokens: int, fp16_activations: bool = True) -> dict[str, Report]:
    """The fused MoE's two grouped GEMMs (kernels/moe.py) as a Qwen3-30B-A3B layer launches them at `tokens`
    tokens (H = 2048, I = 768, k = 8; 8 experts stand for its 128: the tiles depend on T, k and E through the
    block size, which is computed for 128), bf16 activations, fp8 or bf16 experts; the small kernels around them
    are not run. fp16_activations=False compiles the fp8 gated GEMM alone on the bf16 x: the K loop's conversion
    to bfloat16 that 25035fd ran (its epilogue still writes the scaled, saturated float16 intermediate)."""
    from nanoinfer.kernels import moe as km

    H, I, E, k = 2048, 768, 8, 8
    x = torch.zeros(tokens, H, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
    scales = (None, None)
    if fp8:
        w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
        scales = (torch.ones(E, 2 * I), torch.ones(E, H))
    ids = torch.arange(tokens * k, dtype=torch.int32).view(tokens, k) % E
    kernels = [getattr(km, name) for name in dir(km) if name.endswith("_kernel")]
    block_m = km.choose_block_m(tokens * k, 128)
    with mock.patch.object(km, "choose_block_m", lambda entries, experts: block_m):
        calls = capture_launches(kernels, lambda: km.fused_moe(x, w13, w2, torch.ones(tokens, k), ids, None, *scales))
    gemms = [(args, kwargs) for kernel, args, kwargs in calls if kernel is km._moe_gemm_kernel]
    assert len(gemms) == 2, f"fused_moe launched {len(gemms)} grouped GEMMs, not 2"
    if not fp16_activations:
        gemms = [(tuple(x if i == 0 else a for i, a in enumerate(args)), kwargs) for args, kwargs in gemms[:1]]
    return {name: report(compile_for_sm90(km._moe_gemm_kernel, args, kwargs))
            for name, (args, kwargs) in zip(("gated", "plain"), gemms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--token-major-v", action="store_true", help="V laid out as K (an fp8 cache's V is dim-major)")
    p.add_argument("--prefill", action="store_true", help="the prefill variant (50-token chunks) instead of decode")
    p.add_argument("--batch", type=int, default=256, help="the launch config choose_config gives this many sequences")
    p.add_argument("--heads", type=heads_arg, default=(16, 8), metavar="Q,KV",
                   help="query and KV heads (Qwen3-30B-A3B: 32,4, whose split merge takes 8 heads at once)")
    p.add_argument("--num-splits", type=int)
    p.add_argument("--balance-programs", type=int)
    p.add_argument("--block-n", type=int)
    p.add_argument("--num-warps", type=int)
    p.add_argument("--num-stages", type=int)
    p.add_argument("--maxnreg", type=int)
    p.add_argument("--top", type=int, default=25, help="opcodes shown per loop")
    p.add_argument("--moe", type=int, metavar="T",
                   help="the fused MoE's two GEMMs at T tokens instead (Qwen3-30B-A3B's shape, bf16 activations)")
    p.add_argument("--fp8-experts", action="store_true", help="with --moe: fp8 experts")
    p.add_argument("--bf16-activations", action="store_true",
                   help="with --moe --fp8-experts: the gated GEMM on bfloat16 activations (the old conversion)")
    args = p.parse_args()
    attention_options = [name for name in ("kv_cache_dtype", "token_major_v", "prefill", "batch", "heads", "num_splits",
                                           "balance_programs", "block_n", "num_warps", "num_stages", "maxnreg")
                         if getattr(args, name) != p.get_default(name)]
    if args.moe is not None:
        if args.moe < 1:
            p.error("--moe takes a number of tokens >= 1")
        if attention_options:
            p.error("--moe compiles the tiles choose_config gives; these do not apply to it: "
                    + ", ".join(attention_options))
        if args.bf16_activations and not args.fp8_experts:
            p.error("--bf16-activations needs --fp8-experts")
        reports = moe_reports(args.fp8_experts, args.moe, not args.bf16_activations)
    else:
        if args.fp8_experts or args.bf16_activations:
            p.error("--fp8-experts and --bf16-activations need --moe")
        overrides = {k: v for k, v in (("block_n", args.block_n), ("num_warps", args.num_warps),
                                       ("num_stages", args.num_stages), ("num_splits", args.num_splits),
                                       ("balance_programs", args.balance_programs)) if v is not None}
        dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
        reports = {"attention": attention_report(dtype, prefill=args.prefill, token_major_v=args.token_major_v,
                                                 maxnreg=args.maxnreg, batch=args.batch, heads=args.heads, **overrides)}
    for name, r in reports.items():
        print(f"{name}: triton {triton.__version__}, sm_90: {r.registers} registers, {r.spill_bytes} B spilled, "
              f"{r.shared_bytes} B shared memory")
        for i, loop in enumerate(r.loops):
            top = collections.Counter(loop).most_common(args.top)
            print(f"  loop {i}: {len(loop)} instructions: " + ", ".join(f"{n} {op}" for op, n in top))


if __name__ == "__main__":
    main()

"""Shared bits of the benchmarks: engine flags, device description, result records."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time



def _engine_tree() -> str:
    """Where `import nanoinfer` comes from: the first PYTHONPATH entry holding a `nanoinfer/` (bench/ab.sh runs
    each build's copy so), else this checkout. Inserting the checkout first unconditionally made every such A/B
    run the checkout's engine for both builds (fixed 2026-11-22, bench/NOTES.md)."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(os.path.join(entry, "nanoinfer")):
            return os.path.abspath(entry)
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, _engine_tree())

from nanoinfer.cli import add_engine_args, engine_kwargs  # noqa: E402

QWEN3_06B = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanoinfer", "configs", "qwen3-0.6b.json")


def parser(description: str, model_default: str | None = QWEN3_06B, load_format_default: str = "dummy") -> argparse.ArgumentParser:
    # The engine's own log (KV cache size, GEMM tuning, graph capture) belongs with the figures.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=description)
    add_engine_args(p)
    p.set_defaults(model=model_default, load_format=load_format_default)
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    return p


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads)"


def commit() -> str:
    """NANOINFER_COMMIT when set (the device machine gets a copy of the tree, maybe a stale .git), else git's."""
    if os.environ.get("NANOINFER_COMMIT", "unknown") != "unknown":
        return os.environ["NANOINFER_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL).decode().strip()
    except Exception:
        return "unknown"


class GcPauses:
    """The garbage collector's pauses between start() and stop(): (generation, seconds) each."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._began = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._began))

    def start(self) -> "GcPauses":
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)


def time_calls(totals: dict[str, float], owner, name: str, phase: str):
    """Wrap `owner.name` (an instance's method or a class's) so that each call's wall time adds to
    totals[phase]; returns what it replaced, to put back."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    return inner


def report(name: str, figures: dict, args: argparse.Namespace) -> None:
    record = {"bench": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device_name(),
              "commit": commit(), "command": " ".join(sys.argv), **figures}
    print("RESULT " + json.dumps(record))
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(record) + "\n")


__all__ = ["parser", "engine_kwargs", "report", "device_name", "GcPauses", "time_calls", "QWEN3_06B"]

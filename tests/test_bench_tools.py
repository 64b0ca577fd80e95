"""The benchmark harness runs the engine it is told to: bench/ab.sh compares builds by putting each one's
copy first on PYTHONPATH, and every benchmark must then import that copy, not the checkout around it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = "import sys; sys.path.insert(0, 'bench'); import common, nanoinfer; print(nanoinfer.__file__)"


def _imported_from(pythonpath: str | None) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).resolve()


def test_a_pythonpath_build_wins_over_the_checkout(tmp_path) -> None:
    build = tmp_path / "build"
    shutil.copytree(ROOT / "nanoinfer", build / "nanoinfer", ignore=shutil.ignore_patterns("__pycache__"))
    assert _imported_from(os.pathsep.join([str(build), str(ROOT)])) == build / "nanoinfer" / "__init__.py"


def test_without_a_build_the_checkout_is_used(tmp_path) -> None:
    assert _imported_from(None) == ROOT / "nanoinfer" / "__init__.py"
    assert _imported_from(str(tmp_path)) == ROOT / "nanoinfer" / "__init__.py"  # an entry without nanoinfer/


def test_host_step_reports_every_phase_of_a_decode_step(tmp_path) -> None:
    """bench/host_step.py runs on the CPU and accounts for a step's host work phase by phase (each phase timed, and
    the phases within the step's host time), with the device work (here the CPU's) apart."""
    import json

    out = tmp_path / "host.jsonl"
    subprocess.run([sys.executable, "bench/host_step.py", "--num-seqs", "8", "--steps", "5", "--json-out", str(out)],
                   cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["bench"] == "host_step" and record["num_seqs"] == 8 and record["steps"] == 5
    assert set(record["host_phases_ms"]) == {"schedule", "prepare inputs", "sampling metadata", "read back tokens",
                                             "update", "output processing"}
    assert all(v > 0 for v in record["host_phases_ms"].values()) and record["device_work_on_cpu_ms"] > 0
    assert record["host_ms_per_step"] >= sum(record["host_phases_ms"].values()) - 0.01  # each rounded to 1 us


def test_throughput_serves_random_lora_adapters_with_loras(tmp_path, tiny_models) -> None:
    """bench/throughput.py --loras N runs the workload (cut to 3 requests, on a tiny model with a vocabulary that
    holds its token ids and the warm-up's) with request i under adapter i % N: every output token comes back."""
    import json

    sys.path.insert(0, str(ROOT / "bench"))
    from throughput import workload

    config = json.loads((Path(tiny_models["qwen3"]) / "config.json").read_text())
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**config, "vocab_size": 20480, "max_position_embeddings": 2048}))
    out = tmp_path / "thr.jsonl"
    subprocess.run([sys.executable, "bench/throughput.py", "--model", str(config_path), "--num-seqs", "3", "--loras",
                    "2", "--max-lora-rank", "8", "--no-tqdm", "--json-out", str(out)],
                   cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    expected = sum(p.max_tokens for p in workload(3)[1])
    assert json.loads(out.read_text())["nanoinfer"]["output_tokens"] == expected

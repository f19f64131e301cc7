"""scripts/load_bench.py --replicas 1 2 on a tiny model: nothing failed, every answer equals the
single process's, and two replicas both served."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving import save_tiny

SCRIPT = Path(__file__).parent.parent / "scripts" / "load_bench.py"


def test_load_bench_across_replicas(tmp_path):
    pytest.importorskip("ray.serve")
    out = tmp_path / "load.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(save_tiny(tmp_path / "tiny", positions=4096)), "--clients", "2",
         "--requests", "2", "--max-tokens", "8", "--on", "early-exit", "--replicas", "1", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [label.split(" (")[0] for label in results] == ["1 process, on", "1 replica", "2 replicas"]
    for figures in results.values():
        assert figures["requests"] == 4 and figures["failed"] == 0 and figures.get("differing", 0) == 0
    assert [len(r["requests_per_replica"]) for r in list(results.values())[1:]] == [1, 2]
    assert "| 2 replicas" in run.stdout

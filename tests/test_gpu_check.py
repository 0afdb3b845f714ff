"""The prepared GPU call, dry-run on the CPU (CI never has a GPU): scripts/gpu_check.sh --dry-run prints its stages
and limits (under the 8 minutes that leave room for a second try in a session's 15) and writes the benchmark's plan,
whose shapes are BERT-base's and ModernBERT-base's; scripts/gpu_wheels.sh and the check script parse; the wheel
folder is git-ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    for stage in ("1. install", "2. env", "3. tests", "4. bench"):
        assert stage in text, text
    assert "-m pytest -m cuda tests/test_cuda.py" in text and "scripts/bench_gpu.py --budget 260" in text
    limits = int(text.split("limits adding up to ")[1].split(" s")[0])
    assert limits < 480
    plan = json.loads((tmp_path / "bench-plan.json").read_text())
    shapes = {s["name"]: s for s in plan["plan"]["shapes"]}
    assert shapes["bert-base"]["hidden"] == 768 and shapes["bert-base"]["layers"] == 12
    assert shapes["modernbert-base"]["layers"] == 22 and shapes["modernbert-base"]["local_window"] == 128
    assert 0 < shapes["bert-base"]["non_embedding_parameters"] < shapes["bert-base"]["parameters"]
    assert plan["plan"]["max_length"] == 512 and plan["train_lengths"]["max"] <= 512
    assert plan["plan"]["serve_clients"] == 64 and set(plan["would_run"]) == {"finetune", "inference", "serve",
                                                                              "adapters", "profile"}
    assert not list(tmp_path.glob("*.xml")), "a dry run runs no test"


def test_bad_argument_and_syntax():
    assert subprocess.run(["bash", "-n", "scripts/gpu_wheels.sh"], cwd=REPO).returncode == 0
    wrong = subprocess.run(["bash", "scripts/gpu_check.sh", "--wet"], cwd=REPO, capture_output=True, text=True)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


def test_the_wheels_folder_is_ignored():
    ignored = subprocess.run(["git", "check-ignore", "-q", "gpu-wheels/fastapi-0.165.0-py3-none-any.whl"], cwd=REPO)
    assert ignored.returncode == 0


def test_the_wheels_cover_every_core_dependency():
    """What `hfport serve` imports on the GPU machine: each core dependency is in the image (gpu_wheels.sh's
    in_image, from KINDS.md's list) or carried as a wheel. The first GPU call lacked swagger-ui-bundle-v2."""
    import re
    import tomllib

    def names(array: str) -> set[str]:
        body = re.search(rf"^{array}=\((.*?)\)", script, re.S | re.M).group(1)
        return {w.split("==")[0].lower() for w in body.split() if not w.startswith("#")}

    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    assert needed - names("in_image") - names("wheels") == set()


def test_an_ab_call_is_prepared_and_fits(tmp_path):
    """--prepare-ab REV puts REV's hfport/, scripts/ and tests/ in a folder the call carries; the dry run then plans
    REV's benchmark before this tree's, within the same 8 minutes."""
    ab = tmp_path / "ab"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "GPU_AB": str(ab)}
    made = subprocess.run(["bash", "scripts/gpu_check.sh", "--prepare-ab", "HEAD"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert (ab / "hfport" / "__init__.py").is_file() and (ab / "scripts" / "bench_gpu.py").is_file()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert (ab / "REVISION").read_text().strip() == head.stdout.strip()
    plan = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    text = plan.stdout
    assert f"A/B against {head.stdout.strip()}" in text, text
    assert "files back: env.txt tests.log cuda-tests.xml bench-base.json bench-head.json bench.log" in text, text
    assert text.index(f"{ab}/scripts/bench_gpu.py") < text.index("then ")
    assert int(text.split("limits adding up to ")[1].split(" s")[0]) < 480

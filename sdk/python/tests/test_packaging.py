"""`pip install ./sdk/python` gives a pure-Python package with no dependencies."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SDK = Path(__file__).resolve().parents[1]


def test_wheel_is_pure_python_without_dependencies(tmp_path):
    # Build from a copy: an in-tree build would leave build/ and src/starling.egg-info behind.
    src = tmp_path / "sdk"
    shutil.copytree(SDK, src, ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__", ".*"))
    out = tmp_path / "dist"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("starling-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), f"{wheel.name} is not a pure-Python wheel"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(meta).decode()
    modules = {"__init__", "client", "errors", "safetensors", "types"}
    assert {f"starling/{m}.py" for m in modules} <= names, sorted(names)
    assert "starling/py.typed" in names
    required = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert required == [], f"the SDK must not require anything: {required}"

    # Installed on its own, it imports, without torch on the path.
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.modules['torch'] = None\n"  # no torch
        "import starling\n"
        "assert starling.__file__.startswith(sys.argv[1]), starling.__file__\n"
        "try:\n"
        "    starling.save_bf16({'w': 1}, sys.argv[1] + '/x')\n"
        "except starling.StarlingError as e:\n"
        "    assert e.code == 'invalid_state_dict' and 'PyTorch' in e.message, e\n"
        "print(starling.__version__)\n"
    )
    r = subprocess.run([sys.executable, "-I", "-c", probe, str(site)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

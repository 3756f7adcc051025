import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from vllm_harness import Server, make_checkpoints  # noqa: E402

VERSIONS = 20
RESULTS: dict = {}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("starling-vllm")


@pytest.fixture(scope="session")
def ckpts(workdir):
    t0 = time.time()
    dirs, how = make_checkpoints(workdir / "ckpt", VERSIONS)
    RESULTS["checkpoints"] = {"generator": how, "versions": len(dirs), "seconds": round(time.time() - t0, 2)}
    return dirs


@pytest.fixture(scope="session")
def server(ckpts, workdir):
    s = Server(ckpts[0], workdir / "vllm-server.log")
    RESULTS["server_start_seconds"] = round(s.start_seconds, 1)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def results():
    return RESULTS


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("STARLING_VLLM_RESULTS")
    if out and RESULTS:
        Path(out).write_text(json.dumps(RESULTS, indent=2, sort_keys=True) + "\n")

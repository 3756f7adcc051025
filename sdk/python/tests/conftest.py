"""A real Starling cluster for the SDK's tests: the hub and one actor with the built-in engine,
from the binaries in ``$STARLING_BIN_DIR`` (default ``/var/tmp/starling-ci-target/release``).

Every process's stdout and stderr are read by a thread for the process's whole life (a
process whose pipe fills blocks; one whose pipe closes dies), kept as lines, and searched by
:meth:`Proc.wait_for`. Every process is killed at teardown, with its process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

# The SDK under test is this checkout's, whatever else is installed.
SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

BIN_DIR = Path(os.environ.get("STARLING_BIN_DIR", "/var/tmp/starling-ci-target/release"))
START_TIMEOUT = 60.0

# STARLING_SDK_REQUIRE_TORCH=1 (CI): a test that needs torch fails without it instead of skipping.
REQUIRE_TORCH = os.environ.get("STARLING_SDK_REQUIRE_TORCH") == "1"

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TORCH = False

needs_torch = pytest.mark.skipif(
    not HAVE_TORCH and not REQUIRE_TORCH, reason="PyTorch is not installed (pip install torch)"
)


def binary(name: str) -> str:
    p = BIN_DIR / name
    if not (p.is_file() and os.access(p, os.X_OK)):
        pytest.fail(
            f"{p} is missing: build the Rust binaries (cargo build --release --workspace) "
            "and point STARLING_BIN_DIR at their directory",
            pytrace=False,
        )
    return str(p)


def run(*args: str, cwd: Optional[Path] = None) -> str:
    r = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


class Proc:
    """A child process whose merged output is read line by line in a thread."""

    def __init__(self, name: str, args: List[str], log: Path):
        self.name = name
        self.args = args
        self.lines: List[str] = []
        self._cond = threading.Condition()
        self._log = open(log, "w", buffering=1)
        self.p = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            line = line.rstrip("\n")
            self._log.write(line + "\n")
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT, start: int = 0) -> re.Match:
        """The first line (from index ``start``) matching ``pattern``; fails after ``timeout``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                if self.p.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(
                        f"{self.name} exited ({self.p.returncode}) before printing {pattern!r}:\n" + self.tail()
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.name} did not print {pattern!r} within {timeout} s:\n" + self.tail())
                self._cond.wait(min(left, 0.5))

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(timeout=5)
        self._reader.join(timeout=5)
        self._log.close()


@dataclass
class Material:
    """What a cluster is built from: checkpoints, the cluster's keys, actor and trainer credentials."""

    root: Path
    ckpt: Path
    init: Path
    step1: Path
    cluster: Path
    actor_creds: Path
    trainer_creds: Path
    token: str


@dataclass
class Cluster:
    material: Material
    hub: Proc
    actor: Proc
    http: str
    quic: str
    url: str
    root: Path

    @property
    def token(self) -> str:
        return self.material.token

    def client(self, **kw):
        from starling import Client

        kw.setdefault("credentials", self.material.trainer_creds)
        kw.setdefault("checkpoint_dir", self.root / "trainer-ckpt")
        return Client(self.url, **kw)

    def actor_digest(self, version: int, timeout: float = START_TIMEOUT) -> str:
        """The digest the actor printed when it made ``version`` active."""
        return self.actor.wait_for(rf"^active {version} ([0-9a-f]+)\b", timeout).group(1)


@pytest.fixture(scope="session")
def material(tmp_path_factory) -> Material:
    hub = binary("starling-hub")
    root = tmp_path_factory.mktemp("starling")
    ckpt = root / "ckpt"
    run(hub, "bench", "gen", "--model", "tiny", "--steps", "1", "-o", str(ckpt))
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["config.json", "step-0000.safetensors", "step-0001.safetensors"], files
    cluster = root / "cluster"
    run(hub, "init", "--dir", str(cluster))
    a1, t1 = root / "A1", root / "T1"
    run(hub, "issue", "--dir", str(cluster), "--role", "actor", "--name", "a1", "-o", str(a1))
    run(hub, "issue", "--dir", str(cluster), "--role", "trainer", "--name", "t1", "-o", str(t1))
    return Material(
        root=root,
        ckpt=ckpt,
        init=ckpt / "step-0000.safetensors",
        step1=ckpt / "step-0001.safetensors",
        cluster=cluster,
        actor_creds=a1,
        trainer_creds=t1,
        token=(t1 / "token").read_text().strip(),
    )


def start_cluster(material: Material, root: Path, init: Optional[Path] = None) -> Cluster:
    """A hub and a built-in-engine actor on ``init`` (default: the tiny generated checkpoint;
    a model directory such as scripts/fetch-model.sh prints works too)."""
    init = init or material.init
    root.mkdir(parents=True, exist_ok=True)
    procs: List[Proc] = []
    try:
        hub = Proc(
            "starling-hub",
            [
                binary("starling-hub"),
                "serve",
                "--cluster", str(material.cluster),
                "--store", str(root / "hub-store"),
                "--init", str(init),
                "--listen", "127.0.0.1:0",
                "--http", "127.0.0.1:0",
                "--model-id", "tiny",
                # Every pytest temporary directory (the tests publish from tmp_path): the
                # hub publishes only from the directories it is given.
                "--publish-dir", str(material.root.parent),
            ],
            root / "hub.log",
        )
        procs.append(hub)
        http = hub.wait_for(r"^http on (\S+)").group(1)
        quic = hub.wait_for(r"^listening on (\S+)").group(1)
        actor = Proc(
            "starling-actor",
            [
                binary("starling-actor"),
                "--credentials", str(material.actor_creds),
                "--hub", quic,
                "--init", str(init),
                "--store", str(root / "a1-store"),
                "--model-id", "tiny",
                "--engine", "builtin",
            ],
            root / "actor.log",
        )
        procs.append(actor)
        actor.wait_for(r"^active 0 [0-9a-f]+")
        actor.wait_for(r"worker connected")
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return Cluster(material, hub, actor, http, quic, f"http://{http}", root)


@pytest.fixture(scope="module")
def cluster(material, tmp_path_factory):
    """A hub and an actor shared by one test module (tests must not assume version numbers)."""
    c = start_cluster(material, tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.actor.stop()
        c.hub.stop()


@pytest.fixture
def fresh_cluster(material, tmp_path):
    """A hub and an actor of the test's own (version numbers start at 0)."""
    c = start_cluster(material, tmp_path / "cluster")
    try:
        yield c
    finally:
        c.actor.stop()
        c.hub.stop()


def pytest_report_header(config):
    import starling

    if HAVE_TORCH:
        t = f"torch {torch.__version__}"
    else:
        t = "NO (torch tests " + ("FAIL: STARLING_SDK_REQUIRE_TORCH=1)" if REQUIRE_TORCH else "skipped)")
    return [f"starling binaries: {BIN_DIR}", f"starling SDK: {Path(starling.__file__).parent}", t]


# Make `import grpo_torch` work for the example's test.
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
if EXAMPLES.is_dir() and str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

__all__ = ["Cluster", "Material", "Proc", "needs_torch", "HAVE_TORCH"]

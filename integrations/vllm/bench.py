"""Time to make a version live in a running vLLM: sparse in place vs full reload vs restart.

    <venv python> integrations/vllm/bench.py --model 0.5b --versions 4 --out /var/tmp/starling-vllm-bench

Run with the venv from install.sh (PYTHONPATH is set by the script for src/ and tests/).
Generates versions+1 checkpoints with `starling-hub bench gen` (STARLING_BIN_DIR), starts
`vllm.entrypoints.openai.api_server` with the extension on the first, then per version:
/pause?mode=keep, starling_apply(patch file), /resume (timed from the client, HTTP included),
(odd versions through vLLM's loader, even ones by direct scatter), and a full in-place reload of the same version (starling_load_full, digest included) and the
server's cold start for comparison. Prints one JSON object."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "src"), str(HERE / "tests")]

from safetensors.torch import load_file  # noqa: E402

from vllm_harness import MODEL_ID, Server, write_patch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--out", default="/var/tmp/starling-vllm-bench")
    a = ap.parse_args()
    out = Path(a.out) / a.model
    import os
    import subprocess

    raw = out / "raw"
    hub = Path(os.environ.get("STARLING_BIN_DIR", "/var/tmp/starling-ci-target/release")) / "starling-hub"
    t0 = time.time()
    if not (raw / f"step-{a.versions:04}.safetensors").exists():
        subprocess.run([str(hub), "bench", "gen", "--model", a.model, "--steps", str(a.versions), "-o", str(raw)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dirs = []
    for i in range(a.versions + 1):
        d = out / f"v{i:04}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text((raw / "config.json").read_text())
        if not (d / "model.safetensors").exists():
            os.link(raw / f"step-{i:04}.safetensors", d / "model.safetensors")
        dirs.append(d)
    gen_s = time.time() - t0

    s = Server(dirs[0], out / "server.log")
    res = {"model": a.model, "server_start_s": s.start_seconds, "generate_checkpoints_s": gen_s}
    try:
        t0 = time.perf_counter()
        r = s.rpc("starling_attach", MODEL_ID, "0")
        assert r["ok"], r
        res["attach_full_digest_s"] = time.perf_counter() - t0
        old = load_file(dirs[0] / "model.safetensors")
        pre = r["digest"]  # vLLM's, equal to the generator's (the tests check that)
        numel = sum(t.numel() for t in old.values())
        res["parameters"] = numel
        rows = []
        for k in range(1, a.versions + 1):
            new = load_file(dirs[k] / "model.safetensors")
            path = out / f"patch-{k:04}.safetensors"
            t0 = time.perf_counter()
            p = write_patch(path, old, new, k - 1, k, pre=pre)
            pre = p.post_digest
            make_s = time.perf_counter() - t0
            mode = "loader" if k % 2 else "scatter"
            t0 = time.perf_counter()
            s.post("/pause?mode=keep")
            r = s.rpc("starling_apply", str(path), mode)
            s.post("/resume")
            wall = time.perf_counter() - t0
            assert r["ok"], r
            rows.append({"version": k, "mode": mode, "changes": p.num_changes, "fraction": p.num_changes / numel,
                         "patch_bytes": path.stat().st_size, "make_patch_s": make_s,
                         "pause_apply_resume_s": wall, "extension": r["seconds"]})
            old = new
        res["sparse"] = rows
        ids = s.greedy([1, 17, 230, 4711, 99])
        t0 = time.perf_counter()
        r = s.rpc("starling_load_full", str(dirs[-1] / "model.safetensors"), MODEL_ID, str(a.versions))
        res["full_reload_rpc_s"] = time.perf_counter() - t0
        assert r["ok"], r
        res["full_reload_extension"] = r["seconds"]
        assert s.greedy([1, 17, 230, 4711, 99]) == ids
        for m in ("loader", "scatter"):
            res[f"median_{m}_pause_apply_resume_s"] = statistics.median(
                x["pause_apply_resume_s"] for x in rows if x["mode"] == m)
        res["median_changed_fraction"] = statistics.median(x["fraction"] for x in rows)
    finally:
        s.stop()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

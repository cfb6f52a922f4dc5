"""Two ways to host a FastAPI server on Ray 2.60.0: a plain actor running uvicorn, or Ray Serve.

Measures, for the same tiny app (GET /healthz -> {"ok": true}, POST /echo -> the JSON body back,
GET /pid -> the serving process's pid), on a fresh local Ray cluster per mode:

- ``actor``: ``@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)`` whose ``__init__``
  binds 127.0.0.1:0 itself and runs ``uvicorn.Server(config).run(sockets=[sock])`` in a thread;
  clients call the app directly.
- ``serve``: ``@serve.deployment @serve.ingress(app)``, one replica, Serve's HTTP proxy on
  127.0.0.1:<free port>; clients call through the proxy.

Figures: seconds from "create" to the first 200 on /healthz; median and p99 of 1,000 sequential
POST /echo (~1 KiB body, one ``httpx.Client``); requests/s of 2,000 POST /echo from 32
concurrent ``httpx.AsyncClient``; how many OS processes Ray started (those whose
``/proc/<pid>/environ`` carries ``MIDFLIGHT_RAY_MARKER=<uuid>``, set before Ray starts); what
SIGKILL of the serving process does (actor: stays dead with ``max_restarts=0``; serve: does the
controller start a new replica, how long until /healthz answers, what fails meanwhile); and, for
Serve, whether a single replica can be reached over HTTP (two replicas behind one route).

Ray runs on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), with token auth, no usage
stats, and a throwaway temp dir. It is not a project dependency set: run it with its own venv::

    python3 -m venv /tmp/serve-venv
    /tmp/serve-venv/bin/pip install "ray[serve]==2.60.0" httpx fastapi uvicorn
    /tmp/serve-venv/bin/python scripts/compare_ray_hosting.py [--json] [--only actor|serve]
"""

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import tempfile
import threading
import time
import uuid

MARKER = "MIDFLIGHT_RAY_MARKER"
MARK = uuid.uuid4().hex
os.environ.update(
    {
        MARKER: MARK,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(24),
    }
)
os.environ.pop("RAY_ADDRESS", None)

import httpx  # noqa: E402
import ray  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from ray import serve  # noqa: E402

BODY = {"data": "x" * 1000, "n": 1}  # ~1 KiB of JSON
SEQUENTIAL = 1000
CONCURRENT_CLIENTS = 32
CONCURRENT_REQUESTS = 2000


def make_app() -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return await request.json()

    @app.get("/pid")
    def pid() -> dict:
        return {"pid": os.getpid()}

    return app


# --- mode A: a plain actor running uvicorn --------------------------------------------------


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)
class HttpActor:
    def __init__(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self._url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True).start()

    def url(self) -> str:
        return self._url

    def pid(self) -> int:
        return os.getpid()


# --- mode B: Ray Serve ----------------------------------------------------------------------

serve_app = make_app()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(serve_app)
class Ingress:
    pass


# --- helpers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def marked_processes() -> dict[int, str]:
    """Processes (not this one) that Ray started: those whose environment carries our marker,
    and their descendants (setproctitle can overwrite a process's environ block, so the marker
    alone misses some of Ray's agents)."""
    needle = f"{MARKER}={MARK}".encode()
    marked: set[int] = set()
    parent: dict[int, int] = {}
    argv: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
            parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
            argv[pid] = _read(f"/proc/{pid}/cmdline").decode(errors="replace").split("\0")
            if needle in _read(f"/proc/{pid}/environ").split(b"\0"):
                marked.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    found = {}
    for pid, args in argv.items():
        p, seen = pid, 0
        while p not in marked and p in parent and seen < 64:
            p, seen = parent[p], seen + 1
        if p not in marked:
            continue
        name = args[0].split(" ")[0] if args[0].startswith("ray::") else os.path.basename(args[0])
        if name.startswith("python"):  # python -u .../monitor.py: name it by its script
            name = os.path.basename(next((a for a in args[1:] if a.endswith(".py")), name))
        found[pid] = name
    return found


def summary(procs: dict[int, str]) -> str:
    names: dict[str, int] = {}
    for n in procs.values():
        names[n] = names.get(n, 0) + 1
    return ", ".join(f"{n}x{c}" if c > 1 else n for n, c in sorted(names.items()))


def wait_200(url: str, deadline_s: float = 120.0) -> float:
    start = time.monotonic()
    with httpx.Client(timeout=2.0) as c:
        while time.monotonic() - start < deadline_s:
            try:
                if c.get(url + "/healthz").status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
    raise TimeoutError(f"{url}/healthz gave no 200 in {deadline_s}s")


def sequential_latency(url: str) -> dict:
    with httpx.Client(timeout=10.0) as c:
        for _ in range(20):  # warm up the connection and the app
            c.post(url + "/echo", json=BODY).raise_for_status()
        times = []
        for _ in range(SEQUENTIAL):
            s = time.perf_counter()
            r = c.post(url + "/echo", json=BODY)
            times.append(time.perf_counter() - s)
            assert r.status_code == 200, r.text
            assert r.json() == BODY, r.text
    return {
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "p99_ms": round(statistics.quantiles(times, n=100)[98] * 1e3, 3),
    }


async def _throughput(url: str) -> dict:
    remaining = CONCURRENT_REQUESTS
    errors = 0

    async def worker() -> None:
        nonlocal remaining, errors
        async with httpx.AsyncClient(timeout=30.0) as c:
            while remaining > 0:
                remaining -= 1
                try:
                    r = await c.post(url + "/echo", json=BODY)
                    errors += r.status_code != 200
                except httpx.HTTPError:
                    errors += 1

    s = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENT_CLIENTS)))
    took = time.perf_counter() - s
    return {"rps": round(CONCURRENT_REQUESTS / took, 1), "errors": errors}


def throughput(url: str) -> dict:
    return asyncio.run(_throughput(url))


def start_ray(temp_dir: str) -> None:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        log_to_driver=False,
        _temp_dir=temp_dir,
    )


def stop_ray_and_check() -> dict:
    ray.shutdown()
    leftover: dict[int, str] = {}
    for _ in range(50):
        leftover = marked_processes()
        if not leftover:
            break
        time.sleep(0.2)
    for pid in leftover:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {"leftover_after_shutdown": summary(leftover) or None}


# --- the two modes --------------------------------------------------------------------------


def run_actor() -> dict:
    out: dict = {"mode": "actor"}
    base = marked_processes()
    t0 = time.monotonic()
    actor = HttpActor.remote()
    url = ray.get(actor.url.remote(), timeout=120)
    out["first_200_s"] = round(wait_200(url) - t0, 3)
    out |= sequential_latency(url)
    out |= throughput(url)
    time.sleep(1.0)
    procs = marked_processes()
    out["ray_processes"] = len(procs)
    out["ray_processes_before_create"] = len(base)
    out["processes_before_create"] = summary(base)
    out["processes"] = summary(procs)

    pid = ray.get(actor.pid.remote())
    assert httpx.get(url + "/pid").json()["pid"] == pid
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    died = None
    try:
        ray.get(actor.url.remote(), timeout=30)
    except ray.exceptions.ActorDiedError as e:
        died = type(e).__name__
    except Exception as e:
        died = f"other: {type(e).__name__}: {e}"
    out["kill_call_raises"] = died
    out["kill_call_raised_after_s"] = round(time.monotonic() - t_kill, 3)
    time.sleep(5.0)
    try:
        ray.get(actor.url.remote(), timeout=30)
        out["kill_still_dead_after_5s"] = False
    except ray.exceptions.ActorDiedError:
        out["kill_still_dead_after_5s"] = True
    try:
        httpx.get(url + "/healthz", timeout=2.0)
        out["kill_http_after"] = "answered"
    except httpx.HTTPError as e:
        out["kill_http_after"] = type(e).__name__
    out["kill_actor_processes_after"] = sum(
        n == "ray::HttpActor" for n in marked_processes().values()
    )
    return out


def run_serve() -> dict:
    out: dict = {"mode": "serve"}
    base = marked_processes()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t_started = time.monotonic()
    serve.run(Ingress.bind(), name="app", route_prefix="/")
    t_ran = time.monotonic()
    out["first_200_s"] = round(wait_200(url) - t0, 3)
    out["serve_start_s"] = round(t_started - t0, 3)
    out["serve_run_s"] = round(t_ran - t_started, 3)
    out |= sequential_latency(url)
    out |= throughput(url)
    time.sleep(1.0)
    procs = marked_processes()
    out["ray_processes"] = len(procs)
    out["ray_processes_before_create"] = len(base)
    out["processes_before_create"] = summary(base)
    out["processes"] = summary(procs)

    # SIGKILL the replica; poll /healthz through the proxy until a new replica answers.
    pid = httpx.get(url + "/pid").json()["pid"]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    outcomes: dict[str, int] = {}
    recovered = None
    new_pid = None
    with httpx.Client(timeout=2.0) as c:
        while time.monotonic() - t_kill < 120:
            try:
                r = c.get(url + "/pid")
                key = str(r.status_code)
                if r.status_code == 200 and r.json()["pid"] != pid:
                    recovered = time.monotonic()
                    new_pid = r.json()["pid"]
                    break
            except httpx.HTTPError as e:
                key = type(e).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
            time.sleep(0.05)
    out["kill_new_replica"] = new_pid is not None
    out["kill_recovered_s"] = round(recovered - t_kill, 3) if recovered else None
    out["kill_requests_meanwhile"] = outcomes
    if new_pid is not None:
        out["kill_healthz_after"] = httpx.get(url + "/healthz").status_code

    # Serve's default max_ongoing_requests (5) queues the rest in the proxy's router, which
    # retries with backoff; the same load again with room for all 32 clients at once.
    serve.run(Ingress.options(max_ongoing_requests=32).bind(), name="app", route_prefix="/")
    wait_200(url)
    out["rps_max_ongoing_32"] = throughput(url)["rps"]

    # Two replicas behind the one route: which process answers?
    serve.run(Ingress.options(num_replicas=2).bind(), name="app", route_prefix="/")
    seen: dict[int, int] = {}
    with httpx.Client(timeout=10.0) as c:
        for _ in range(60):
            p = c.get(url + "/pid").json()["pid"]
            seen[p] = seen.get(p, 0) + 1
    out["two_replicas_pids_seen_over_http"] = len(seen)
    serve.shutdown()
    return out


ROWS = [
    ("first 200 on /healthz after create (s)", "first_200_s"),
    ("POST /echo sequential median (ms)", "median_ms"),
    ("POST /echo sequential p99 (ms)", "p99_ms"),
    ("req/s, 32 clients, 2000 req", "rps"),
    ("errors in that run", "errors"),
    ("  same, serve max_ongoing_requests=32", "rps_max_ongoing_32"),
    ("OS processes Ray started", "ray_processes"),
    ("  of which before create", "ray_processes_before_create"),
    ("leftover after shutdown", "leftover_after_shutdown"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--only", choices=["actor", "serve"], help="run one mode")
    args = ap.parse_args()
    modes = [m for m in ("actor", "serve") if args.only in (None, m)]
    results = {"load_before": os.getloadavg(), "ray": ray.__version__, "cpus": os.cpu_count()}
    for mode in modes:
        temp_dir = tempfile.mkdtemp(prefix="rhc-")
        start_ray(temp_dir)
        try:
            r = run_actor() if mode == "actor" else run_serve()
        finally:
            cleanup = stop_ray_and_check()
            shutil.rmtree(temp_dir, ignore_errors=True)
        r |= cleanup
        results[mode] = r
    results["load_after"] = os.getloadavg()
    results["home_ray_dir_exists"] = os.path.exists(os.path.expanduser("~/.ray"))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"ray {results['ray']}, {results['cpus']} CPUs, load before {results['load_before']}")
    print(f"{'':42}" + "".join(f"{m:>14}" for m in modes))
    for label, key in ROWS:
        print(f"{label:42}" + "".join(f"{results[m].get(key)!s:>14}" for m in modes))
    for m in modes:
        print(f"\n[{m}] processes before create: {results[m]['processes_before_create']}")
        print(f"[{m}] processes after create: {results[m]['processes']}")
        for k, v in results[m].items():
            if k.startswith(("kill_", "serve_", "two_")):
                print(f"[{m}] {k}: {v}")
    print(f"\nload after {results['load_after']}; ~/.ray exists: {results['home_ray_dir_exists']}")


if __name__ == "__main__":
    main()

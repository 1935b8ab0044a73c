"""Does dynamic batching pay? `loracls serve` under 1, 4 and 16 concurrent clients against `loracls predict`
on the same texts offline (the baseline, measured in the same run).

The classifier is the real Gemma 3 270M, trained briefly and exported (`inference.make_export`: the speed
of a forward pass does not depend on how long it was trained). The server runs as its own process on a
loopback port; every client sends one text per request, as a caller classifying a stream would, for a
bounded number of requests. The clients run two ways, taking turns at each level: threads of this process
(`threads`, the load generator before), and asyncio tasks in a process of their own (`asyncio-process`:
nothing of the load generator shares an interpreter with the server or holds the GIL of the benchmark).
On a machine of few cores the clients still share its CPUs with the server, so each level also reports
the CPU milliseconds per request spent by the load generator and by the server (its `process_cpu_seconds`
on /metrics). Reported per concurrency: throughput (texts/s), p50 and p99 latency, and the mean batch the
worker formed (from /metrics), beside `loracls predict` offline (its default batch of 32)
and offline in the batches such a server sees (the texts in arrival order, 8 at a time: the mean batch at
16 clients; each sorted by length, then cut into passes). Two servers run one after the other: passes of 8
texts (the CPU default before) and passes of at most 512 padded tokens (today's; `--pass-tokens`).
Ratios: throughput at 16 clients over offline throughput
(target >= 0.8: batching works), p50 latency at 1 client over one forward pass of one text (target <= 1.5).

    python benchmarks/serve.py [--texts 256] [--requests 96] [--export FOLDER]

Writes benchmarks/results/serve.json (with the CPU flags: bf16 is emulated on CPUs without AVX-512-BF16).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_result  # noqa: E402
from inference import make_export  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.inference.predict import Classifier  # noqa: E402
from loracls.inference.serve import CPU_PASS_TOKENS  # noqa: E402

PASSES = {"8 texts": (8, None), f"{CPU_PASS_TOKENS} tokens": (32, CPU_PASS_TOKENS)}
"""How the servers compared cut a batch into forward passes on a CPU (`--pass-size`, `--pass-tokens`): passes
of 8 texts (the default before), and of at most 32 texts and `CPU_PASS_TOKENS` padded tokens (today's)."""

GROUP = 8
"""The texts a server of one-text requests from 16 clients answers at once (its mean batch): with every
client waiting for its answer, about half of them have a request queued while the other half's batch runs."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(arguments: list[str], port: int) -> subprocess.Popen:
    """`loracls serve ARGUMENTS --port PORT` in a process of its own, once it answers `/ready`."""
    command = [sys.executable, "-m", "loracls", "serve", *arguments, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`loracls serve {' '.join(arguments)}` did not become ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def batches_formed(url: str) -> tuple[float, float]:
    """(forward passes, texts) so far, from the server's batch-size histogram."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    value = {
        line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("loracls_batch_texts_")
    }
    return value.get("loracls_batch_texts_count", 0.0), value.get("loracls_batch_texts_sum", 0.0)


def thread_clients(url: str, bodies: list[dict], clients: int) -> tuple[list[float], float, float]:
    """The `/classify` request `bodies`, sent by `clients` threads of this process (the load generator
    before): each request's latency, the wall time, and the CPU seconds this process spent."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(worker: int) -> None:
        with httpx.Client(timeout=300) as http:
            for body in bodies[worker::clients]:
                started = time.perf_counter()
                http.post(f"{url}/classify", json=body).raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(clients)]
    cpu, started = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - started, time.process_time() - cpu


async def async_clients(url: str, bodies: list[dict], clients: int) -> tuple[list[float], float, float]:
    """The same as `thread_clients`, as `clients` asyncio tasks on one connection pool (run in a process of
    its own by `process_clients`)."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:

        async def client(worker: int) -> None:
            for body in bodies[worker::clients]:
                started = time.perf_counter()
                (await http.post(f"{url}/classify", json=body)).raise_for_status()
                latencies.append(time.perf_counter() - started)

        await http.get(f"{url}/ready")  # the connection pool's first connection, outside the timing
        cpu, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(w) for w in range(clients)))
        return latencies, time.perf_counter() - started, time.process_time() - cpu


def process_clients(url: str, bodies: list[dict], clients: int) -> tuple[list[float], float, float]:
    """`async_clients` in a fresh process of its own (no torch, no model in it): the load generator the
    server does not share an interpreter with."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_async_clients, url, bodies, clients).result()


def run_async_clients(url: str, bodies: list[dict], clients: int) -> tuple[list[float], float, float]:
    return asyncio.run(async_clients(url, bodies, clients))


LOAD_GENERATORS = {"threads": thread_clients, "asyncio-process": process_clients}
"""How the clients are run: threads of the benchmark's process (before), or asyncio tasks in a process of
their own."""


def under_load(url: str, bodies: list[dict], clients: int, generator: str) -> dict:
    """The `/classify` request `bodies`, sent by `clients` concurrent clients run as `generator` says;
    throughput, latency percentiles, the mean batch the worker formed, and the CPU seconds per request spent
    by the load generator and by the server."""
    passes, seen = batches_formed(url)
    server_cpu = process_cpu_seconds(url)
    latencies, wall, client_cpu = LOAD_GENERATORS[generator](url, bodies, clients)
    server_cpu = process_cpu_seconds(url) - server_cpu
    passes_after, seen_after = batches_formed(url)
    latencies.sort()
    return {
        "load_generator": generator,
        "clients": clients,
        "requests": len(bodies),
        "texts_per_s": len(bodies) / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_batch": (seen_after - seen) / max(passes_after - passes, 1),
        "load_generator_cpu_ms_per_request": 1000 * client_cpu / len(bodies),
        "server_cpu_ms_per_request": 1000 * server_cpu / len(bodies),
    }


def process_cpu_seconds(url: str) -> float:
    """The server process's CPU seconds so far (user and system), from its /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return next(float(line.split()[1]) for line in lines if line.startswith("process_cpu_seconds_total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--requests", type=int, default=96, help="requests per concurrency level")
    parser.add_argument("--export", type=Path, default=None, help="an export to serve (default: train one)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's --max-wait-ms")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    export = args.export or make_export("gemma3-270m", "zh-reviews", folder)
    texts = list(load_splits(TrainConfig(data="zh-reviews")).test["text"][: args.texts])

    classifier = Classifier.load(export)
    classifier.predict_probs(texts[:8])  # warm-up
    started = time.perf_counter()
    classifier.predict_probs(texts)
    offline = len(texts) / (time.perf_counter() - started)
    # what a server of one-text requests can see at once: the texts in arrival order, a batch of GROUP at a
    # time (the mean batch at 16 clients), each batch sorted and cut into the passes each server makes
    offline_groups = {}
    for way, (pass_size, pass_tokens) in PASSES.items():
        classifier.batch_size, classifier.pass_tokens = pass_size, pass_tokens
        started = time.perf_counter()
        for start in range(0, len(texts), GROUP):
            classifier.predict_probs(texts[start : start + GROUP])
        offline_groups[way] = len(texts) / (time.perf_counter() - started)
    single = []
    for text in texts[:16]:
        started = time.perf_counter()
        classifier.predict_probs([text])
        single.append(time.perf_counter() - started)
    one_pass_ms = 1000 * statistics.median(single)
    del classifier

    bodies = [{"input": texts[n % len(texts)]} for n in range(args.requests)]
    levels = []
    for way, (pass_size, pass_tokens) in PASSES.items():
        port = free_port()
        options = ["--max-batch", "32", "--max-wait-ms", str(args.max_wait_ms)]
        options += ["--pass-size", str(pass_size), "--pass-tokens", str(pass_tokens or 0)]
        server = start_server([str(export), *options], port)
        url = f"http://127.0.0.1:{port}"
        try:
            # the two load generators take turns at each level, so that drift in the machine hits both
            levels += [
                {"passes": way} | under_load(url, bodies, c, generator)
                for c in (1, 4, 16)
                for generator in LOAD_GENERATORS
            ]
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    at = {(level["passes"], level["load_generator"], level["clients"]): level for level in levels}
    result = {
        "question": "loracls serve under 1/4/16 concurrent one-text clients vs loracls predict offline",
        "server": {"max_batch": 32, "max_wait_ms": args.max_wait_ms, "passes": PASSES},
        "baseline": {
            "offline_texts_per_s": offline,
            f"offline_texts_per_s_in_arrival_batches_of_{GROUP}": offline_groups,
            "one_forward_pass_ms": one_pass_ms,
            "texts": len(texts),
        },
        "levels": levels,
        "ratios": {
            f"{way}, {generator}": {
                "throughput_16_clients_over_offline": at[way, generator, 16]["texts_per_s"] / offline,
                f"throughput_16_clients_over_offline_in_arrival_batches_of_{GROUP}": (
                    at[way, generator, 16]["texts_per_s"] / offline_groups[way]
                ),
                "p50_1_client_over_one_pass": at[way, generator, 1]["p50_ms"] / one_pass_ms,
            }
            for way in PASSES
            for generator in LOAD_GENERATORS
        },
        "targets": {"throughput_16_clients_over_offline": ">= 0.8", "p50_1_client_over_one_pass": "<= 1.5"},
    }
    grouped = ", ".join(f"{way}: {speed:.1f}" for way, speed in offline_groups.items())
    print(
        f"offline (loracls predict, batch 32): {offline:.1f} texts/s; "
        f"in arrival batches of {GROUP}, {grouped}; "
        f"one forward pass of one text: {one_pass_ms:.0f} ms"
    )
    print(
        "| passes | load generator | clients | texts/s | p50 ms | p99 ms | mean batch "
        "| client CPU ms/request | server CPU ms/request |\n|---|---|---|---|---|---|---|---|---|"
    )
    for level in levels:
        cells = [
            level["passes"],
            level["load_generator"],
            level["clients"],
            f"{level['texts_per_s']:.1f}",
            f"{level['p50_ms']:.0f}",
            f"{level['p99_ms']:.0f}",
            f"{level['mean_batch']:.1f}",
            f"{level['load_generator_cpu_ms_per_request']:.1f}",
            f"{level['server_cpu_ms_per_request']:.0f}",
        ]
        print(f"| {' | '.join(map(str, cells))} |")
    for way, ratios in result["ratios"].items():
        print(way, {k: round(v, 3) for k, v in ratios.items()})
    write_result(args.out, result)


if __name__ == "__main__":
    main()

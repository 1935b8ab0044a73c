"""Does one server of many classifiers cost what one classifier does? `loracls serve NAME=RUN ...` with 1, 4
and 16 classifiers on one base model, against today's server of one (the baseline, measured in the same run).

The classifiers are two short real runs on Gemma 3 270M (zh-reviews, 2 labels; en-tweets, 3 labels;
`inference.make_run`), served under several names each: a server's memory and speed depend on how many
adapters and heads it holds, not on what they learned. Measured:
  memory      the server process's resident memory once ready, with 1 classifier (today's merged server),
              4 and 16 (target: 16 under 1.3x one)
  throughput  16 clients sending one-text requests, spread over 4 classifiers, against 16 clients of the
              server of one
  fan-out     one request naming 4 classifiers for a batch of texts, against 4 requests one after another
  mixed       offline, rows of 4 classifiers in shared forward passes (`ClassifierSet.probs_mixed`, peft's
              `adapter_names`) against each classifier's own passes (what the server's worker does today),
              passes of 8 texts either way; the fastest of alternating rounds

    python benchmarks/serve_shared.py [--runs RUN_A RUN_B] [--texts 64] [--requests 96]

Writes benchmarks/results/serve_shared.json (with the CPU flags).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_result  # noqa: E402
from inference import make_run  # noqa: E402
from serve import free_port, start_server, under_load  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.inference.serve import CPU_PASS_TOKENS  # noqa: E402
from loracls.inference.shared_base import ClassifierSet, read_member  # noqa: E402


def named(runs: list[Path], count: int) -> list[str]:
    """`count` classifiers, the runs taking turns under names c0, c1, ... (one: the run as it is)."""
    return [str(runs[0])] if count == 1 else [f"c{n}={runs[n % len(runs)]}" for n in range(count)]


def fan_out_against_separate(url: str, names: list[str], texts: list[str], rounds: int) -> dict:
    """Median seconds of one fan-out request over `names` and of one request per name in turn."""
    fan, separate = [], []
    with httpx.Client(timeout=300) as http:
        for _ in range(rounds):
            started = time.perf_counter()
            http.post(f"{url}/classify", json={"model": names, "input": texts}).raise_for_status()
            fan.append(time.perf_counter() - started)
            started = time.perf_counter()
            for name in names:
                http.post(f"{url}/classify", json={"model": name, "input": texts}).raise_for_status()
            separate.append(time.perf_counter() - started)
    return {"fan_out_s": statistics.median(fan), "separate_s": statistics.median(separate)}


def mixed_against_grouped(runs: list[Path], texts: list[str], rounds: int) -> dict:
    """Offline seconds for each of 4 classifiers' `texts`: shared passes of rows of all four, against each
    classifier's own passes (both cut as the server cuts them on a CPU: at most 32 texts and
    `CPU_PASS_TOKENS` padded tokens); the fastest of `rounds` alternating rounds."""
    members = [read_member(f"c{n}", runs[n % len(runs)]) for n in range(4)]
    shared = ClassifierSet.load(members)
    encoded = {}
    for name, classifier in shared.classifiers.items():
        classifier.batch_size, classifier.pass_tokens = 32, CPU_PASS_TOKENS
        encoded[name] = classifier.encode(texts)
    warm_up = {name: ids["input_ids"][:8] for name, ids in encoded.items()}
    shared.probs_mixed(warm_up, 32, max_tokens=CPU_PASS_TOKENS)
    mixed, grouped = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        every = {name: ids["input_ids"] for name, ids in encoded.items()}
        shared.probs_mixed(every, 32, max_tokens=CPU_PASS_TOKENS)
        mixed.append(time.perf_counter() - started)
        started = time.perf_counter()
        for name, classifier in shared.classifiers.items():
            classifier.probs(encoded[name])
        grouped.append(time.perf_counter() - started)
    return {"mixed_s": min(mixed), "grouped_s": min(grouped), "texts": 4 * len(texts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, nargs="*", help="finished runs on one base (default: train two)")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--requests", type=int, default=96, help="one-text requests under 16 clients")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_shared.json")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="serve-shared-"))
    runs = args.runs or [make_run("gemma3-270m", data, folder / data) for data in ("zh-reviews", "en-tweets")]
    texts = list(load_splits(TrainConfig(data="zh-reviews")).test["text"][: args.texts])

    memory, load, fan = {}, {}, {}
    for count in (1, 4, 16):
        port = free_port()
        server = start_server([*named(runs, count), "--max-batch", "32"], port)
        url = f"http://127.0.0.1:{port}"
        try:
            names = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
            memory[count] = psutil.Process(server.pid).memory_info().rss / 2**30
            if count in (1, 4):
                bodies = [
                    {"model": names[n % count], "input": texts[n % len(texts)]} for n in range(args.requests)
                ]
                load[count] = under_load(url, bodies, 16)
            if count == 4:
                fan = fan_out_against_separate(url, names, texts[:8], args.rounds)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    mixed = mixed_against_grouped(runs, texts, args.rounds)
    ratios = {
        "memory_16_over_1": memory[16] / memory[1],
        "memory_4_over_1": memory[4] / memory[1],
        "throughput_4_classifiers_over_1": load[4]["texts_per_s"] / load[1]["texts_per_s"],
        "fan_out_over_separate_calls": fan["fan_out_s"] / fan["separate_s"],
        "mixed_over_grouped_passes": mixed["mixed_s"] / mixed["grouped_s"],
    }
    result = {
        "question": "one server of 1/4/16 classifiers on one base against today's server of one",
        "runs": [str(r) for r in runs],
        "baseline": "loracls serve RUN (one classifier, merged), measured in the same run",
        "memory_gb": memory,
        "under_16_clients": load,
        "fan_out_4": fan,
        "offline_4_classifiers": mixed,
        "ratios": ratios,
        "targets": {"memory_16_over_1": "< 1.3"},
    }
    print(f"resident memory (GB): {', '.join(f'{k}: {v:.2f}' for k, v in memory.items())}")
    print(
        f"16 clients: {load[1]['texts_per_s']:.1f} texts/s (1 classifier), {load[4]['texts_per_s']:.1f} (4)"
    )
    print({k: round(v, 3) for k, v in ratios.items()})
    write_result(args.out, result)


if __name__ == "__main__":
    main()

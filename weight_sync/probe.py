"""A standalone weight receiver without an engine: joins the learner's weight sync and reports
every verified version as one JSON line on stdout. A deployment check (can this host reach
the learner's store, control plane and snapshot server, and are the bytes right?), and the
receiver process of the weight-sync tests and benchmark.

    python -m sluice.weight_sync.probe --master-port P --control tcp://host:port [--service-id ID]

Each line: {"event": "version", "version": v, "digest": d, "bytes": n, "time": t, "pulls": k}
where `digest` is xxh3-64 over every tensor's bytes in name order. Ends (exit 0) when the
learner announces shutdown; exit 1 if the receiver failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

import torch
import xxhash

from sluice.config.weight_sync import WeightSyncConfig
from sluice.weight_sync.layout import tensor_bytes
from sluice.weight_sync.receiver import ReceivedWeights, WeightReceiver


def digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """One xxh3-64 over every tensor's bytes, in name order (what tests compare)."""
    h = xxhash.xxh3_64()
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(tensor_bytes(t.detach().cpu()))
    return h.hexdigest()


def report(weights: ReceivedWeights, receiver: WeightReceiver) -> None:
    nbytes = sum(t.numel() * t.element_size() for _, t in weights.tensors)
    line = {
        "event": "version",
        "version": weights.version,
        "digest": digest(weights.tensors),
        "bytes": nbytes,
        "time": time.time(),
        "pulls": receiver.pulls,
        "refused": receiver.refused_versions,
        "failures": receiver.failures,
    }
    print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "\n").splitlines()[0])
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--control", required=True, help="control-plane endpoint tcp://host:port")
    ap.add_argument("--service-id", default="probe-0")
    ap.add_argument("--publish-timeout-s", type=float, default=60.0)
    ap.add_argument("--ready-timeout-s", type=float, default=10.0)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-digest", action="store_true", help="report versions without hashing them")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format=f"%(asctime)s {args.service_id} %(levelname)s %(message)s")
    torch.set_num_threads(1)
    cfg = WeightSyncConfig(
        master_addr=args.master_addr,
        master_port=args.master_port,
        timeout_s=args.timeout_s,
        publish_timeout_s=args.publish_timeout_s,
        ready_timeout_s=args.ready_timeout_s,
    )
    receiver = WeightReceiver(
        cfg, service_id=args.service_id, control_endpoint=args.control, device=torch.device(args.device)
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    receiver.start()
    while not stop.is_set():
        weights = receiver.wait_for_weights(timeout_s=0.5)
        if weights is not None:
            if args.no_digest:
                line = {"event": "version", "version": weights.version, "time": time.time()}
                print(json.dumps(line), flush=True)
            else:
                report(weights, receiver)
        elif receiver.finished.is_set():
            break
    receiver.stop()
    return 1 if receiver.error is not None else 0


if __name__ == "__main__":
    sys.exit(main())

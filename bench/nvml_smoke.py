"""NVML smoke test for a machine with an NVIDIA GPU: read the GPUs, publish the map, print it.

    pip install -e . nvidia-ml-py
    python bench/nvml_smoke.py [--seconds 5] [--node-name NAME --kubeconfig FILE]

Samples every GPU through the real NVML source (``zerolayer.runtime.gpu.nvml.NvmlSource``) at
200 ms, runs the real gossip publisher and prints, at the end, the readings and the GPU map
as the fleet reader sees it. With ``--node-name`` and a kubeconfig (and an InferenceNode of
that name) it merge-patches that node's status; without, it prints each status it *would*
patch (one JSON line per publication) and reads the map back from the last one. No
Kubernetes is needed in that mode. Exit status 2 when NVML cannot start (no driver or GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from zerolayer.gpumap import FleetMap
from zerolayer.map_cli import render_table
from zerolayer.runtime.gossip import GossipPublisher, GossipSettings, KubeApiError, Load, PrintSink, RecordingSource
from zerolayer.runtime.gpu import GpuSampler, GpuSourceError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--node-name", default="nvml-smoke")
    parser.add_argument("--kubeconfig", help="publish for real into InferenceNode --node-name")
    parser.add_argument("--simulated", action="store_true",
                        help="use a simulated GPU instead of NVML (checks this script on a machine with no GPU)")
    args = parser.parse_args()

    from zerolayer.runtime.gpu.nvml import NvmlSource
    from zerolayer.runtime.gpu.simulated import SimulatedGpuSource

    try:
        source = SimulatedGpuSource.constant(0.4, gpus=2) if args.simulated else NvmlSource()
    except GpuSourceError as exc:
        print(f"nvml_smoke: {exc}", file=sys.stderr)
        return 2
    if args.kubeconfig:
        from zerolayer.runtime.gossip.kube import NodeApi

        try:
            sink = NodeApi(kubeconfig=args.kubeconfig)
        except KubeApiError as exc:
            print(f"nvml_smoke: {exc}", file=sys.stderr)
            return 2
        settings = None
    else:
        sink = PrintSink()
        settings = GossipSettings(heartbeat_s=1.0)
    recording = RecordingSource(source)
    publisher = GossipPublisher(args.node_name, sink, readings=lambda: recording.latest, load=Load,
                                endpoint="http://127.0.0.1:8443", sample_seq=lambda: recording.seq,
                                settings=settings)
    recording.on_sample = publisher.notify
    sampler = GpuSampler(recording, lambda s: None)
    started = time.monotonic()
    publisher.start()
    sampler.start()
    try:
        time.sleep(args.seconds)
    finally:
        sampler.stop()
        publisher.stop(final=False)
        source.close()
    elapsed = time.monotonic() - started
    print(f"\n# {recording.seq} {source.kind} samples in {elapsed:.1f} s "
          f"({recording.seq / elapsed:.1f}/s, sampler errors {sampler.errors}); "
          f"{publisher.patches} publications, {publisher.failures} failed")
    for r in recording.latest or ():
        print(json.dumps({"uuid": r.uuid, "index": r.index, "name": r.name, "memoryUsedBytes": r.memory_used_bytes,
                          "memoryTotalBytes": r.memory_total_bytes, "utilization": r.utilization,
                          "powerWatts": r.power_watts, "temperatureC": r.temperature_c,
                          "nvlinkErrors": r.nvlink_errors,
                          "processes": [(p.pid, p.used_memory_bytes) for p in r.processes]}))
    if publisher.state.last_status is not None:
        obj = {"metadata": {"name": args.node_name}, "spec": {}, "status": publisher.state.last_status}
        print("\n" + render_table(FleetMap.from_objects([obj])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

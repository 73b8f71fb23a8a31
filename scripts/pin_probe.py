"""What pinning the host tier costs, and what it costs a GPU serving meanwhile (issue 20; bench/LOG.md section 46).

The host tier (client/engine/fast/state_table.py) registers its slots with cudaHostRegister at start; on the H100
host 817 slots of 146 MiB took 109 s (section 37), so the engine's start waited past 60 s. This probe measures, on
fresh host memory of `--slots` slots:
- pinning one slot at a time, and with 8 and 16 threads (GB/s): cudaHostRegister faulting the pages in, or each
  slot faulted in first with madvise(MADV_POPULATE_WRITE);
- a step's small copies (8 KiB) beside a state's copy in the same direction, on another stream: whether they
  queue behind it, with the state's copy whole or in chunks (one copy may not span two registrations: across
  slots pinned in 2 MiB pieces it failed with "invalid argument" on the H100, section 46);
- a CUDA graph of about `--step-ms` replayed over and over (a state's copy beside each), alone, while 8 threads
  register whole slots (the host tier before section 46), and while a state table pins its host tier its own way
  (one thread, 8 MiB pieces faulted in first): the replay's wall time p50/p99/max, the latency a step sees while the
  tier pins as the engine serves.

    python -m scripts.pin_probe --json pin_probe.json
"""
import json
import mmap
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from client import cli

PROG = "scripts/pin_probe.py"

SLOT_BYTES = 146 << 20
MADV_POPULATE_WRITE = 23


def fresh(count, stride):
    buffer = mmap.mmap(-1, count * stride)
    if hasattr(buffer, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    return buffer, base


def register_all(addresses, size, threads, populate=None):
    """Seconds to register every (address, size) with `threads` threads, each range first faulted in at once
    by populate(address) when given; the addresses stay registered."""
    cudart = torch.cuda.cudart()

    def one(address):
        if populate is not None:
            populate(address)
        error = cudart.cudaHostRegister(address, size, 1)
        if error != cudart.cudaError.success:
            raise MemoryError(f"cudaHostRegister: {cudart.cudaGetErrorString(error)}")
    began = time.perf_counter()
    if threads == 1:
        for address in addresses:
            one(address)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, addresses))
    return time.perf_counter() - began


def unregister_all(addresses):
    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


def populater(buffer, base):
    """populate(address): fault in the slot at `address` of `buffer` at once (MADV_POPULATE_WRITE)."""
    return lambda address: buffer.madvise(MADV_POPULATE_WRITE, address - base, SLOT_BYTES)


def pin_rates(slots, threads_list):
    """GB/s of pinning fresh memory per thread count: registration faulting the pages in, or each slot faulted
    in first with madvise(MADV_POPULATE_WRITE) (as the state table's host tier does)."""
    rows = []
    for threads in threads_list:
        for populated in (False, True):
            buffer, base = fresh(slots, SLOT_BYTES)
            addresses = [base + i * SLOT_BYTES for i in range(slots)]
            seconds = register_all(addresses, SLOT_BYTES, threads, populater(buffer, base) if populated else None)
            rows.append({"threads": threads, "populated_first": populated, "seconds": seconds,
                         "gb_per_s": slots * SLOT_BYTES / seconds / 1e9})
            print(f"pin {slots} slots, {threads} thread(s), {'populate + register' if populated else 'register'}: "
                  f"{seconds:.2f} s ({rows[-1]['gb_per_s']:.2f} GB/s)", flush=True)
            unregister_all(addresses)
            del buffer
    return rows


def step_graph(step_ms):
    """A CUDA graph of matmuls lasting about step_ms."""
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(a)
    torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    per = (time.perf_counter() - began) / 10 * 1000.0
    count = max(1, round(step_ms / per))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.matmul(a, b, out=out)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(count):
                torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    return graph


def replays(graph, seconds, copy=None):
    """Wall ms of each replay (launch to synchronize) for `seconds`; with copy=(dst, src), a host->device copy
    on its own stream beside each."""
    stream = torch.cuda.Stream()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        graph.replay()
        if copy is not None:
            with torch.cuda.stream(stream):
                copy[0].copy_(copy[1], non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1000.0)
    times = np.asarray(times)
    return {"replays": int(times.size), "p50_ms": float(np.median(times)), "p99_ms": float(np.percentile(times, 99)),
            "max_ms": float(times.max())}


def serving_while_pinning(slots, threads, step_ms, seconds):
    """Replays alone; while `threads` threads register `slots` fresh whole slots (the host tier before section
    46); and while a state table pins a host tier of `slots` slots its own way (one thread, PIECE_BYTES pieces,
    each faulted in first)."""
    from client.engine.fast.state_table import StateTable

    graph = step_graph(step_ms)
    pinned_host = torch.empty(SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(SLOT_BYTES, dtype=torch.uint8, device="cuda")
    rows = {"alone": replays(graph, seconds, (device_buffer, pinned_host))}
    print(f"replays alone: {rows['alone']}", flush=True)
    buffer, base = fresh(slots, SLOT_BYTES)
    addresses = [base + i * SLOT_BYTES for i in range(slots)]
    pinning = threading.Thread(target=register_all, args=(addresses, SLOT_BYTES, threads))
    began = time.perf_counter()
    pinning.start()
    label = f"while {threads} threads register whole slots"
    rows[label] = replays(graph, seconds, (device_buffer, pinned_host))
    pinning.join()
    rows[label]["pin_s"] = time.perf_counter() - began
    print(f"replays {label}: {rows[label]}", flush=True)
    unregister_all(addresses)
    del buffer
    table = StateTable(({"state": ((SLOT_BYTES,), torch.uint8, 0)}, "cuda"), 1, host_capacity=slots - 1)
    label = "while the state table pins its host tier"
    rows[label] = replays(graph, seconds, (device_buffer, pinned_host))
    table.wait_pinned()
    rows[label]["pin_s"] = table.pin_s
    rows[label]["pin_gb_per_s"] = table.host_bytes / table.pin_s / 1e9
    print(f"replays {label}: {rows[label]}", flush=True)
    return rows


def small_copy_delays(chunk_mib_list, repeats=20):
    """A step's own small copies (inputs in, predictions out) while a state's 146 MiB copy runs on another stream
    in the same direction: the small copy's latency (ms, from its enqueue to its completion, median and max), with
    the big copy whole or in chunks; and an event on the legacy default stream recorded behind nothing while the
    big copy runs (whether the default stream waits for the copy stream)."""
    host = torch.empty(SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(SLOT_BYTES, dtype=torch.uint8, device="cuda")
    small_host = torch.empty(8192, dtype=torch.uint8, pin_memory=True)
    small_device = torch.empty(8192, dtype=torch.uint8, device="cuda")
    big_stream, step_stream = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    rows = []
    for direction in ("to_gpu", "to_host"):
        for chunk_mib in (None, *chunk_mib_list):
            for stream_name in ("step stream", "default stream"):
                stream = step_stream if stream_name == "step stream" else torch.cuda.default_stream()
                delays = []
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    with torch.cuda.stream(big_stream):
                        step = SLOT_BYTES if chunk_mib is None else chunk_mib << 20
                        for begin in range(0, SLOT_BYTES, step):
                            if direction == "to_gpu":
                                device_buffer[begin:begin + step].copy_(host[begin:begin + step], non_blocking=True)
                            else:
                                host[begin:begin + step].copy_(device_buffer[begin:begin + step], non_blocking=True)
                    time.sleep(0.0005)  # the big copy under way
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(stream):
                        start.record()
                        if direction == "to_gpu":
                            small_device.copy_(small_host, non_blocking=True)
                        else:
                            small_host.copy_(small_device, non_blocking=True)
                        end.record()
                    torch.cuda.synchronize()
                    delays.append(start.elapsed_time(end))
                rows.append({"direction": direction, "big_chunk_mib": chunk_mib, "stream": stream_name,
                             "small_copy_ms_median": float(np.median(delays)), "small_copy_ms_max": float(max(delays))})
                print(f"small copy {direction} on the {stream_name} beside a 146 MiB copy "
                      f"{'whole' if chunk_mib is None else f'in {chunk_mib} MiB chunks'}: "
                      f"median {rows[-1]['small_copy_ms_median']:.3f} ms, max {rows[-1]['small_copy_ms_max']:.3f}",
                      flush=True)
    return rows


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=cli.positive_int, default=32,
                        help="slots of 146 MiB pinned in each measurement")
    parser.add_argument("--threads", type=cli.positive_ints,
                        default=[1, 8, 16], help="comma list of thread counts that pin (default 1,8,16)")
    parser.add_argument("--step-ms", type=cli.positive_float, default=3.0, help="the replayed graph's length")
    parser.add_argument("--seconds", type=cli.positive_float, default=3.0,
                        help="replays measured for this long, or while pinning")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise cli.CliError(f"needs a CUDA GPU (it measures cudaHostRegister and copies to the device), and this torch "
                           f"({torch.__version__}) sees none")
    result = {"device": torch.cuda.get_device_name(), "slot_bytes": SLOT_BYTES, "slots": args.slots,
              "pin": pin_rates(args.slots, args.threads),
              "small_copies": small_copy_delays([8]),
              "serving": serving_while_pinning(args.slots, 8, args.step_ms, args.seconds)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))

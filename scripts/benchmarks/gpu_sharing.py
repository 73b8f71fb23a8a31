"""Whether the GPU is the run's alone, looked at before the first section: the memory already held on it (this
process's CUDA context, and whatever other processes hold) and its utilisation while this process does nothing. A
GPU shared with another process gives the state table fewer slots (a share of the memory free at the engine's
start) and slower steps, and no other field of a record says so: session 17's H100 swap engine had 254 GPU slots
where the capacity runs on other H100s had 338-364 (bench/LOG.md section 63)."""
import os
import shutil
import subprocess
import time

CONTEXT_BYTES = 1 << 30  # this process's CUDA context with torch loaded, with room: more held at start is another's
SAMPLES = 5  # utilisation samples, PERIOD_S apart, while this process does nothing on the GPU
PERIOD_S = 0.1
BUSY_SAMPLES = 2  # samples over 0% that say another process computes: one alone may be this process's own start


def _smi(command, index, *query) -> list[list[str]] | None:
    """nvidia-smi's csv rows for GPU `index`, or None where it cannot answer (absent, failing, a timeout)."""
    path = shutil.which(command)
    if path is None:
        return None
    try:
        done = subprocess.run([path, f"--id={index}", *query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30)
    except (subprocess.TimeoutExpired, OSError):
        return None
    if done.returncode != 0:
        return None
    return [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def processes(index, command="nvidia-smi") -> list[dict] | None:
    """The compute processes on GPU `index` other than this one: [{pid, used_bytes}] (None: nvidia-smi cannot say).
    Inside a container nvidia-smi may list none, or this process under the host's pid."""
    rows = _smi(command, index, "--query-compute-apps=pid,used_memory")
    if rows is None:
        return None
    found = []
    for row in rows:
        if len(row) == 2 and row[0].isdigit() and int(row[0]) != os.getpid():
            used = float(row[1]) * 2**20 if row[1].replace(".", "", 1).isdigit() else None  # MiB, or [N/A]
            found.append({"pid": int(row[0]), "used_bytes": used})
    return found


def utilization(index, command="nvidia-smi", samples=SAMPLES, period_s=PERIOD_S) -> list[float] | None:
    """GPU `index`'s utilisation (%) sampled `samples` times (None: nvidia-smi cannot say)."""
    values = []
    for k in range(samples):
        rows = _smi(command, index, "--query-gpu=utilization.gpu")
        if not rows or not rows[0][0].replace(".", "", 1).isdigit():
            return None
        values.append(float(rows[0][0]))
        if k + 1 < samples:
            time.sleep(period_s)
    return values


def verdict(total_bytes, free_bytes, others, utilization_pct) -> dict:
    """{shared, why}: the GPU is shared where more than CONTEXT_BYTES was held before this process allocated
    anything, another compute process holds memory on it, or BUSY_SAMPLES of its utilisation samples were over 0%
    while this process did nothing (an H200's first sample said 3% on a host where nothing else ran)."""
    reasons = []
    held = total_bytes - free_bytes
    if held > CONTEXT_BYTES:
        reasons.append(f"{held / 2**30:.1f} GiB of {total_bytes / 2**30:.1f} GiB held before the run allocated "
                       f"anything (a CUDA context takes < {CONTEXT_BYTES / 2**30:.0f} GiB)")
    if others:
        reasons.append(f"{len(others)} other compute process(es) on it: " + ", ".join(
            f"pid {p['pid']}" + ("" if p["used_bytes"] is None else f" {p['used_bytes'] / 2**30:.1f} GiB")
            for p in others))
    busy = [u for u in utilization_pct or () if u > 0]
    if len(busy) >= BUSY_SAMPLES:
        reasons.append(f"utilisation up to {max(busy):g}% in {len(busy)} of {len(utilization_pct)} samples while "
                       f"this run was idle")
    return {"shared": bool(reasons), "why": "; ".join(reasons)}


def snapshot(index, command="nvidia-smi") -> dict:
    """The GPU at the run's start: its memory (torch's view), the other compute processes and the utilisation
    while this process is idle (each None where nvidia-smi cannot say), and the verdict."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    others, util = processes(index, command), utilization(index, command)
    return {"total_bytes": total, "free_bytes": free, "held_bytes": total - free, "other_processes": others,
            "utilization_pct": util, **verdict(total, free, others, util)}

"""Symbols sharded over GPUs: one engine process per GPU, each symbol's state on exactly one of them.

A symbol is placed on the shard holding the fewest symbols when first seen and stays there. A step's symbols
are split by shard; each part goes to its shard's process, which submits it to its own FastEngine (so the
shards step concurrently, each pipelined on its own GPU and with its own interpreter), and the part's
predictions come back as soon as that shard is done. Processes are started with torch.multiprocessing
(spawn) and talk over its pipes; each loads the model itself from the same spec, so no weights travel.

The shard interface is what a multi-host deployment needs too: `Shard.submit(step_id, symbols, features)`,
answered later by (step_id, predictions) or (step_id, error), plus release and stop. A remote shard runs the
same loop (`_serve_shard`) behind a torch.distributed RPC endpoint or any message channel on another host.
"""
import itertools
import queue
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

from client.engine.base import NUM_TOWERS, Engine, PendingStep, check_step_inputs


@dataclass(frozen=True)
class ModelSpec:
    """How a shard process loads the model: a preset with a checkpoint path or synthetic weights' seed."""
    preset: str
    weights: str | None = None
    seed: int = 0


class ShardError(RuntimeError):
    """A shard failed a step (its message says why) or its process is gone."""


def _serve_shard(spec: ModelSpec, device: str, options: dict, requests, replies):
    """A shard process: build the engine, then submit each step as it arrives and answer it when it is done
    (a second thread collects results in submission order, so submitting never waits for the GPU)."""
    from client.engine.fast import FastEngine
    from client.model import load_model

    try:
        model, fingerprint = load_model(spec.preset, weights=spec.weights, seed=spec.seed, device=device)
        engine = FastEngine(model, device, progress=False, **options)
        del model
    except Exception as exc:  # the parent reports it on one line
        replies.send(("failed", f"{device}: {type(exc).__name__}: {exc}"))
        return
    replies.send(("ready", {"fingerprint": fingerprint, **engine.describe()}))
    submitted = queue.Queue()  # (step_id, PendingStep or the exception its submit raised)

    def collect():
        while True:
            item = submitted.get()
            if item is None:
                return
            step_id, pending = item
            try:
                if isinstance(pending, Exception):
                    raise pending
                replies.send(("done", step_id, pending.result()))
            except Exception as exc:
                replies.send(("error", step_id, f"{type(exc).__name__}: {exc}"))

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    while True:
        message = requests.recv()
        if message[0] == "step":
            _, step_id, symbols, features = message
            try:
                submitted.put((step_id, engine.submit(symbols, features)))
            except Exception as exc:  # bad input or no room: this step's part alone fails
                submitted.put((step_id, exc))
        elif message[0] == "release":
            engine.release(message[1])
        else:  # "stop"
            submitted.put(None)
            collector.join()
            return


class Shard:
    """One shard process on one device, and the thread that receives its answers."""

    def __init__(self, index, spec, device, options, ctx):
        self.index, self.device = index, device
        child_requests, self.requests = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self.replies, child_replies = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve_shard, name=f"shard-{index}", daemon=True,
                                   args=(spec, str(device), options, child_requests, child_replies))
        self.process.start()
        child_requests.close()  # the child's ends: closed here, so that its exit reads as EOF
        child_replies.close()
        self.waiting: dict[int, "_Part"] = {}
        self.lock = threading.Lock()
        self.info = None

    def wait_ready(self, timeout_s):
        if not self.replies.poll(timeout_s):
            raise ShardError(f"shard {self.index} on {self.device} did not start within {timeout_s:.0f} s")
        kind, payload = self.replies.recv()
        if kind != "ready":
            raise ShardError(f"shard {self.index} failed to start: {payload}")
        self.info = payload
        threading.Thread(target=self._receive, name=f"shard-{self.index}-replies", daemon=True).start()

    def submit(self, step_id, symbols, features, part):
        with self.lock:
            self.waiting[step_id] = part
        self.requests.send(("step", step_id, symbols, features))

    def _receive(self):
        while True:
            try:
                kind, step_id, payload = self.replies.recv()
            except (EOFError, OSError):
                error = ShardError(f"shard {self.index} on {self.device} stopped "
                                   f"(exit code {self.process.exitcode})")
                with self.lock:
                    parts, self.waiting = list(self.waiting.values()), {}
                for part in parts:
                    part.finish(error=error)
                return
            with self.lock:
                part = self.waiting.pop(step_id)
            part.finish(payload if kind == "done" else None,
                        None if kind == "done" else ShardError(f"shard {self.index}: {payload}"))

    def stop(self):
        try:
            self.requests.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


class _Part:
    """One shard's part of a step: which rows of the step it answers; its outcome goes to the step's queue."""

    def __init__(self, rows, arrivals):
        self.rows, self.arrivals = rows, arrivals
        self.predictions = self.error = None

    def finish(self, predictions=None, error=None):
        self.predictions, self.error = predictions, error
        self.arrivals.put(self)


class ShardedPendingStep(PendingStep):
    """A sharded step: result() waits for every part; parts() yields (rows, predictions or the exception) as
    each part arrives, so that a caller can answer them one by one."""

    def __init__(self, parts, arrivals, batch):
        super().__init__(self._assemble)
        self._parts, self._arrivals, self._batch = parts, arrivals, batch
        self._arrived = []

    def parts(self):
        for index in range(len(self._parts)):
            if index == len(self._arrived):
                self._arrived.append(self._arrivals.get())
            part = self._arrived[index]
            yield part.rows, (part.error if part.error is not None else part.predictions)

    def _assemble(self):
        out = np.empty((self._batch, NUM_TOWERS), dtype=np.float32)
        for rows, outcome in self.parts():
            if isinstance(outcome, Exception):
                raise outcome
            out[rows] = outcome
        return out


class ShardedEngine(Engine):
    name = "sharded"

    def __init__(self, spec: ModelSpec, devices, *, progress=True, start_timeout_s=600, **engine_options):
        """devices: one per shard (e.g. ["cuda:0", "cuda:1"]; "cpu" several times for a test); engine_options
        go to each shard's FastEngine (capacity, state_memory, state_dtype, precision, max_batch, ...)."""
        devices = [torch.device(d) for d in devices]
        if len(devices) < 1:
            raise ValueError("a sharded engine needs at least one device")
        if devices[0].type == "cuda":
            present = torch.cuda.device_count()
            missing = [str(d) for d in devices if (d.index or 0) >= present]
            if missing:
                raise ValueError(f"{', '.join(missing)} asked for, but this machine has {present} GPU(s)")
        begin = time.perf_counter()
        ctx = mp.get_context("spawn")
        self.shards = [Shard(i, spec, d, engine_options, ctx) for i, d in enumerate(devices)]
        try:
            for shard in self.shards:
                shard.wait_ready(start_timeout_s)
                if progress:
                    sys.stderr.write(f"[sharded engine] shard {shard.index} ready on {shard.device}: "
                                     f"{shard.info['capacity']} symbols\n")
        except Exception:
            self.close()
            raise
        self.shard_of: dict[str, int] = {}
        self._load = [0] * len(self.shards)
        self._step_ids = itertools.count()
        self.startup_s = time.perf_counter() - begin

    @property
    def symbols(self):
        return list(self.shard_of)

    def describe(self):
        return {"shards": [shard.info for shard in self.shards], "devices": [str(s.device) for s in self.shards]}

    def _place(self, symbol) -> int:
        shard = self.shard_of.get(symbol)
        if shard is None:
            shard = min(range(len(self.shards)), key=self._load.__getitem__)
            self.shard_of[symbol] = shard
            self._load[shard] += 1
        return shard

    def release(self, symbols):
        by_shard = {}
        for symbol in symbols:
            if symbol in self.shard_of:
                shard = self.shard_of.pop(symbol)
                self._load[shard] -= 1
                by_shard.setdefault(shard, []).append(symbol)
        for shard, names in by_shard.items():
            self.shards[shard].requests.send(("release", names))

    def step(self, symbols, features):
        return self.submit(symbols, features).result()

    def submit(self, symbols, features) -> ShardedPendingStep:
        symbols = list(symbols)
        features = check_step_inputs(symbols, features)
        rows_of = {}
        for row, symbol in enumerate(symbols):
            rows_of.setdefault(self._place(symbol), []).append(row)
        step_id, arrivals = next(self._step_ids), queue.SimpleQueue()
        parts = []
        for shard, rows in rows_of.items():
            part = _Part(np.asarray(rows), arrivals)
            self.shards[shard].submit(step_id, [symbols[r] for r in rows], features[rows], part)
            parts.append(part)
        return ShardedPendingStep(parts, arrivals, len(symbols))

    def close(self):
        for shard in self.shards:
            shard.stop()

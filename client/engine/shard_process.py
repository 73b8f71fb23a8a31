"""Shards as processes on this machine (one per GPU), over torch.multiprocessing pipes.

Each process is started with spawn, loads the model from the spec, builds its engine, and then submits each step
as it arrives and answers it when it is done (a second thread collects results in submission order, so
submitting never waits for the GPU). Its exit reads as end-of-file on the replies pipe: the shard is lost.
"""
import queue
import signal
import threading
import time

import torch
import torch.multiprocessing as mp

from client.engine.base import PendingStep
from client.engine.sharded import (ModelSpec, Shard, ShardError, ShardLost, ShardStartError, build_shard_engine,
                                   import_answer, share_host_tier, submit_placeable, wait_started)

# How long a stopped shard's process has to exit before it is killed (it finishes the step under way first)
STOP_TIMEOUT_S = 30.0

def _serve_shard(spec: ModelSpec, device: str, engine_name: str, options: dict, requests, replies):
    """A shard process: build the engine, then answer ("step", seq, symbols, features) with ("done", seq,
    predictions) or ("error", seq, message), in order, as ("export", seq, symbol) with its state and ("import",
    seq, symbol, data) with import_answer's; ("release", symbols) and ("stop",) have no answer."""
    try:
        _on_own_gpu(device)
        engine, info = build_shard_engine(spec, device, engine_name, options)
    except KeyboardInterrupt:  # Ctrl-C while the client starts: it exits at once, and so does this
        return
    except Exception as exc:  # the parent reports it on one line
        replies.send(("failed", f"{device}: {type(exc).__name__}: {exc}"))
        return
    # Serving, Ctrl-C at the terminal reaches this process too; the parent decides when it stops (close() says
    # "stop"), so that a clean stop does not read as a lost shard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies.send(("ready", info))
    submitted = queue.Queue()  # (seq, PendingStep or the exception its submit raised)

    def collect():
        _on_own_gpu(device)
        while True:
            item = submitted.get()
            if item is None:
                return
            seq, pending = item
            try:
                if isinstance(pending, Exception):
                    raise pending
                reply = ("done", seq, pending.result())
            except Exception as exc:
                reply = ("error", seq, f"{type(exc).__name__}: {exc}")
            try:
                replies.send(reply)
            except BrokenPipeError:  # the parent is gone without a "stop", as below: nobody to answer, nor a traceback
                parent_gone.set()
                return

    parent_gone = threading.Event()  # an answer nobody took: the steps queued after it are not run
    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    while not parent_gone.is_set():
        try:
            message = requests.recv()
        except EOFError:  # the parent is gone without a "stop" (killed, or a second Ctrl-C): nothing to answer
            return
        if message[0] == "step":
            _, seq, symbols, features = message
            try:
                submitted.put((seq, submit_placeable(engine, symbols, features)))
            except Exception as exc:  # bad input or no room: this part alone fails
                submitted.put((seq, exc))
        elif message[0] == "export":
            _, seq, symbol = message
            try:
                submitted.put((seq, engine.export_state(symbol)))
            except Exception as exc:
                submitted.put((seq, exc))
        elif message[0] == "import":
            _, seq, symbol, data = message
            submitted.put((seq, PendingStep.completed(import_answer(engine, symbol, data))))
        elif message[0] == "release":
            engine.release(message[1])
        else:  # "stop"
            submitted.put(None)
            collector.join()
            return


def _on_own_gpu(device: str) -> None:
    """This thread's CUDA calls on the shard's GPU. A thread starts on GPU 0, and a CUDA call there makes a context on
    GPU 0: ~0.5 GiB of another shard's GPU, and ~0.1 s of the shard's first step (bench/LOG.md section 74)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:  # "cuda" is GPU 0 in every thread of a new process
        torch.cuda.set_device(device)


class ProcessShard(Shard):
    """One shard process on one device; its replies come back in submission order."""

    def __init__(self, index, spec, device, engine_name, options, ctx):
        self.index, self.device = index, str(device)
        self.where = f"process on {self.device}"
        child_requests, self.requests = ctx.Pipe(duplex=False)  # (receiving end, sending end)
        self.replies, child_replies = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve_shard, name=f"shard-{index}", daemon=True,
                                   args=(spec, self.device, engine_name, options, child_requests, child_replies))
        self.process.start()
        child_requests.close()  # the child's ends: closed here, so that its exit reads as EOF
        child_replies.close()
        self.info = None
        self._next_seq = 0
        self._reaping = threading.Lock()
        # a message written, or read, whole at a time; and the pipes closed while no thread is inside one (a
        # descriptor closed under a read or write may be reused by the time it is read or written)
        self._sending, self._receiving = threading.Lock(), threading.Lock()

    def wait_ready(self, timeout_s):
        if not self.replies.poll(timeout_s):
            raise ShardStartError(f"shard {self.index} on {self.device} did not start within {timeout_s:.0f} s")
        try:
            with self._receiving:
                kind, payload = self.replies.recv()
        except (EOFError, OSError):
            raise ShardStartError(f"shard {self.index} on {self.device} exited while starting "
                                  f"(exit code {self._exit_code()})") from None
        if kind != "ready":
            raise ShardStartError(f"shard {self.index} failed to start: {payload}")
        self.info = payload

    def _exit_code(self):
        # one thread at a time: the submitter and the collector may both see the exit, and the one whose waitpid
        # lost the race to reap it would read no exit code
        with self._reaping:
            self.process.join(timeout=5)
            return self.process.exitcode

    def _gone(self) -> ShardLost:
        return ShardLost(f"its process exited (exit code {self._exit_code()})")

    def submit(self, symbols, features):
        return self._send("step", symbols, features)

    def export_state(self, symbol):
        return self._send("export", symbol)

    def import_state(self, symbol, data):
        return self._send("import", symbol, data)

    def _send(self, kind, *args):
        """Send a message that is answered (its sequence number, the handle for result())."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            with self._sending:
                self.requests.send((kind, seq, *args))
        except (BrokenPipeError, OSError):
            raise self._gone() from None
        return seq

    def result(self, handle):
        try:
            with self._receiving:
                kind, seq, payload = self.replies.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        if seq != handle:  # replies come in submission order; anything else is a broken shard
            raise ShardLost(f"answered step {seq} where step {handle} was due")
        if kind != "done":
            raise ShardError(f"shard {self.index}: {payload}")
        return payload

    def release(self, symbols):
        try:
            with self._sending:
                self.requests.send(("release", symbols))
        except (BrokenPipeError, OSError):
            raise self._gone() from None

    def kill(self):
        self.process.kill()  # SIGKILL ends a stopped or hung process too
        self._close_pipes()

    def stop(self):
        try:
            with self._sending:
                self.requests.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        with self._reaping:  # not waiting on its sentinel while a kill() from a loss closes it (_close_pipes)
            self.process.join(timeout=STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
        self._close_pipes()

    def _close_pipes(self):
        """Give back the pipes' descriptors once the process has ended, rather than when this object is collected.
        Its end ends any read or write of ours on them (end of file, broken pipe), so the locks come free; a process
        that outlives SIGKILL (stuck in a driver) keeps them."""
        if self._exit_code() is None:
            return
        with self._sending, self._receiving:
            self.requests.close()
            self.replies.close()
        # and its start's two (Process.close() would close them too, but then exitcode and join raise)
        self.process._popen.close()


def process_shards(spec: ModelSpec, devices, *, engine="fast", options=None, progress=True,
                   start_timeout_s=600) -> list[ProcessShard]:
    """A started shard process per device (e.g. ["cuda:0", "cuda:1"]; "cpu" several times for a test), each
    running `engine` ("fast" or "reference") with `options` (make_engine's: capacity, precision, ...)."""
    devices = [torch.device(d) for d in devices]
    if len(devices) < 1:
        raise ValueError("a sharded engine needs at least one device")
    if devices[0].type == "cuda":
        present = torch.cuda.device_count()
        missing = [str(d) for d in devices if (d.index or 0) >= present]
        if missing:
            raise ValueError(f"{', '.join(missing)} asked for, but this machine has {present} GPU(s)")
    options = share_host_tier(dict(options or {}), engine, devices[0], len(devices))
    ctx = mp.get_context("spawn")
    shards = [ProcessShard(i, spec, d, engine, options, ctx) for i, d in enumerate(devices)]
    deadline = time.monotonic() + start_timeout_s
    return wait_started(shards, lambda shard: shard.wait_ready(max(0.0, deadline - time.monotonic())), progress)


"""FastEngine: the state table, the step runner and its CUDA graphs put together behind the Engine interface."""
import contextlib
import functools
import gc
import platform
import sys
import threading
import time

import numpy as np
import torch

from client.constants import DEFAULT_REQUESTS_PER_SYMBOL
from client.engine.base import (NUM_TOWERS, Engine, PendingStep, Sequences, check_step_inputs, is_count,
                                state_data, state_symbol, symbol_list)
from client.engine.cuda_streams import own_stream
from client.engine.precision import DEFAULT_PRECISION, FP32_STATE, Precision, StateStorage
from client.model.config import TOWER_NAMES

from .placement import place_towers
from .layers import StepPlan
from .runner import GraphedStep, StepInputs, StepRunner, precompile, shape_for, step_shapes
from .state_table import (CPU_CAPACITY, STATE_MEMORY, StateTable, capacity_for_memory, host_memory, host_symbols_for,
                          host_tier_budget, slot_layout)

# Pinned staging buffers for submitted steps, each with its own set of graphs: one more than the runtime keeps
# in flight (2), so that reusing one never has to wait for its previous step.
RING = 3
# Free GPU slots kept ready by moving least recently used states to the host ahead of need (at most an eighth of
# the table): a burst of up to 8 symbols arriving together, new or returning, takes slots whose evictions are
# done, so their returns start at once. Refilling a slot costs one state's copy to the host (146 MiB: ~5 ms at
# PCIe speed, on the stream that carries no returns), and no capacity: the host tier holds the states moved out.
RESERVE = 8
# A step of one request a symbol queued behind another on the GPU is launched at a shape with room for this many
# more (JoinableStep). At the event's pace (a request every 2.5 ms, steps of 2.4-2.7 ms) at most one arrives before
# it starts, and room costs: on two H100s a step of one symbol took 0.03 / 0.09 ms more at 2 rows than at 1, and
# 0.14 / 0.29 ms more at 3 (bench/LOG.md section 56).
JOIN_ROOM = 1


def _progress(label):
    live = sys.stderr.isatty()  # in a log (not a terminal): the last count only, and no carriage returns

    def report(done, total):
        if live:
            sys.stderr.write(f"\r[fast engine] {label} {done}/{total}" + ("\n" if done == total else ""))
        elif done == total:
            sys.stderr.write(f"[fast engine] {label} {done}/{total}\n")
    return report


def _on_device(device):
    """torch.cuda.device(device) for a block, or nothing where it is the current device already (or the CPU). A
    thread's CUDA calls go to its current device, GPU 0 until the thread sets another: one there from an engine on
    another GPU makes a CUDA context on GPU 0 (~0.5 GiB of its memory, and ~0.1 s: bench/LOG.md section 74)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _on_own_device(method):
    """The engine's method run on its (first) device, from whichever thread calls it."""
    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        with _on_device(self.device):
            return method(self, *args, **kwargs)
    return on_device


class Staging:
    """One submitted step's pinned host buffers (inputs shared by every GPU, an output per GPU), and the events
    recorded after each GPU's read-back was enqueued."""

    def __init__(self, max_sequences, max_rows, num_features, shards, timed=False):
        self.inputs = StepInputs(torch.zeros(StepInputs.bytes_for(max_sequences, max_rows, num_features),
                                             dtype=torch.uint8, pin_memory=True),
                                 max_sequences, max_rows, num_features)  # laid out like GraphedStep.inputs
        self.outs = [torch.empty(max_rows, len(shard.columns), dtype=torch.float32, pin_memory=True)
                     for shard in shards]
        # each GPU's copy of the sequence slots as its step read them (-1 until then): which joins made it
        self.taken = [torch.full((max_sequences,), -1, dtype=torch.int32, pin_memory=True) for _ in shards]
        self.taken_views = [taken.numpy() for taken in self.taken]  # reset through numpy before each launch
        self.done = [torch.cuda.Event(enable_timing=timed) for _ in shards]
        # timed: recorded before the step's placement (its time includes waits for its own copies). Not one more
        # before its launch: with states moving, such an event held the launch back until a copy to the host
        # ended, ~3 ms, in 1-2% of the steps (bench/LOG.md section 48)
        self.started = [torch.cuda.Event(enable_timing=True) for _ in shards] if timed else None
        self.columns = [shard.columns for shard in shards]
        self.devices = [shard.device for shard in shards]  # each GPU's event is waited for on that GPU
        self.step: PendingStep | None = None  # the last step that used these buffers

    def ended(self) -> bool:
        """Whether every GPU has ended the step and its read-back (without waiting)."""
        for done, device in zip(self.done, self.devices):
            with _on_device(device):
                if not done.query():
                    return False
        return True

    def wait(self, gpu=0):
        """Until GPU `gpu` has ended the step and its read-back (releases the GIL meanwhile)."""
        with _on_device(self.devices[gpu]):
            self.done[gpu].synchronize()

    def read_back(self, batch, step_times=None):
        out = np.empty((batch, NUM_TOWERS), dtype=np.float32)  # a copy: the buffers are reused by a later step
        for gpu, (host, columns) in enumerate(zip(self.outs, self.columns)):
            self.wait(gpu)
            out[:, columns] = host[:batch].numpy()
        if step_times is not None:
            step_times.append((batch, max(start.elapsed_time(done) for start, done in zip(self.started, self.done))))
        return out


class JoinableStep(PendingStep):
    """A step of one request a symbol queued on the GPU behind one still running, launched at a shape with room
    for more: join() adds a request of another symbol resident on the GPU until the step starts (its inputs are
    read from the pinned staging when the stream reaches it, StepInputs.join), fate() says whether it made it.

    result(): predictions [formed rows + joins, 4], the formed rows in submit's order, then the joins in
    join order; a join that did not make it has a row of NaN (and its symbol's state is untouched)."""

    def __init__(self, engine, staging, symbols, restore, capacity, ahead):
        super().__init__(self._read, poll=staging.ended)
        self.engine, self.staging, self.restore, self.capacity = engine, staging, restore, capacity
        self.formed, self.ahead = len(restore), ahead  # ahead: the staging of the step it queues behind
        self.symbols = set(symbols)
        self.slots = []  # each join's slot, in join order
        self._fates = None  # once the step is read back: each join's fate (the staging may then be reused)
        self._joins = threading.Lock()

    def join(self, symbol, features) -> bool:
        """Stage one request of `symbol` (features float32 [F]) into the step; False when it cannot be: no room
        left, the step may have started (the one ahead of it is done), its symbol already in the step or not
        resident on the GPU with its copies done. True says only that it may make it: see fate(). ValueError
        for features of the wrong shape or not finite, as submit's."""
        # a tensor reshaped as it is: check_step_inputs reads those numpy cannot (requiring grad, bf16), as submit's
        row = features.reshape(1, -1) if isinstance(features, torch.Tensor) else np.asarray(features).reshape(1, -1)
        features = check_step_inputs([symbol], row)[0]
        # on the engine's GPU: resident_slot queries the slot's last copy's event (no device guard), from the
        # runtime's thread, which may be on GPU 0 (a CUDA call there makes a context on it)
        with self._joins, _on_device(self.engine.device):
            sequence = self.formed + len(self.slots)
            if sequence >= self.capacity or symbol in self.symbols or self._fates is not None:
                return False
            slot = self.engine.table.resident_slot(symbol)  # may wait for the table's lock
            # checked last, so that little can pass between the step ahead still running and the slot's store
            if slot is None or not self.engine.queued(self.staging, self.ahead):
                return False
            self.staging.inputs.join(sequence, slot, features)
            self.slots.append(slot)
            self.symbols.add(symbol)
            return True

    def fate(self, j) -> bool | None:
        """Whether join j is in the step: None until the step has read its inputs."""
        if self._fates is not None:
            return self._fates[j]
        seen = int(self.staging.taken_views[0][self.formed + j])
        return None if seen == -1 else seen == self.slots[j]

    def _read(self):
        self.staging.wait()  # the step is over, so is the one ahead: nothing joins it any more
        with self._joins:  # the fates kept: a later step that reuses the staging resets `taken`
            self._fates = [self.fate(j) for j in range(len(self.slots))]
        out = self.staging.read_back(self.formed + len(self._fates), self.engine.step_times)
        out[:self.formed] = out[:self.formed][self.restore]
        for j, made_it in enumerate(self._fates):
            if not made_it:
                out[self.formed + j] = np.nan
        return out


class DeviceTowers:
    """The towers placed on one device: their runner, its CUDA graphs, and their columns of the predictions."""

    def __init__(self, runner, columns):
        self.runner, self.columns, self.graphed = runner, columns, None

    @property
    def device(self):
        return self.runner.device


class FastEngine(Engine):
    name = "fast"
    # submit(..., joinable=True): see JoinableStep. On x86 only: a join's store fence (runner._store_fence) orders
    # the host's stores as the device reads them there, not on a weaker memory model (aarch64).
    takes_joins = platform.machine().lower() in ("x86_64", "amd64")

    def __init__(self, model, device=None, *, max_batch=64, max_rows_per_symbol=DEFAULT_REQUESTS_PER_SYMBOL,
                 graphs=None, precision=DEFAULT_PRECISION, capacity=None, state_memory=None, host_symbols=None,
                 host_memory=None, idle_timeout_s=None, reserve=None, state_storage=FP32_STATE, devices=None,
                 time_steps=False, compile=False, progress=True, time_copies=False):
        """model: the fp32 reference model (client.model.Ensemble), or a callable without arguments that loads it
        (the engine then holds the model only while it converts its weights: the tiers are sized without it);
        max_batch: symbols a captured step holds; max_rows_per_symbol: requests of one symbol it carries
        (a step with more runs as several, in order). device, or devices (several: the towers placed over them);
        capacity (symbols on the GPU) or
        state_memory (the share of free GPU memory the state table takes, STATE_MEMORY by default);
        host_symbols: states that may wait in host memory (default on CUDA: what `host_memory` bytes hold, by
        default the available host memory less a headroom; none on the CPU), allocated at start and pinned in the
        background as the engine serves;
        reserve: free GPU slots kept ready (default RESERVE, at most an eighth of the table); time_copies: keep
        every host<->GPU transfer's time (table.transfer_seconds); state_storage: the matrix states' dtypes and
        rounding (a StateStorage, client/engine/precision.py: fp32, or fp16/bf16 storage of xLSTM's and Mamba2's,
        rounded stochastically or to nearest); time_steps: keep (batch, GPU milliseconds from before the step's
        placement to its end) of every submitted step in step_times. precision: the
        weights' dtypes (a Precision, client/engine/precision.py). compile: each block through torch.compile
        (compiled.py), compiled here, before any graph is captured;
        CompileUnavailable if it cannot run."""
        if not isinstance(precision, Precision) or not isinstance(state_storage, StateStorage):
            raise TypeError("precision and state_storage are a Precision and a StateStorage, parsed where they come "
                            "in: Precision.parse('bf16'), StateStorage.parse('fp16') (client/engine/precision.py)")
        devices = [torch.device(d) for d in (devices or [device or ("cuda" if torch.cuda.is_available() else "cpu")])]
        if capacity is not None and state_memory is not None:
            raise ValueError("give the state table's capacity or its memory share, not both")
        if capacity is not None and not is_count(capacity, 1):
            raise ValueError(f"capacity must be a positive whole number of symbols, got {capacity!r}")
        if host_symbols is not None and not is_count(host_symbols, 0):  # here, not once the weights are converted
            raise ValueError(f"host_symbols must be a whole number of symbols >= 0, got {host_symbols!r}")
        if not (is_count(max_rows_per_symbol, 1) and is_count(max_batch, 1)):
            raise ValueError(f"max_batch and max_rows_per_symbol must be positive whole numbers, got {max_batch!r}, "
                             f"{max_rows_per_symbol!r}")
        devices = _checked_devices(devices)
        start = time.perf_counter()
        self.device, self.devices, self.max_batch = devices[0], devices, max_batch
        # On one GPU submit returns while the step runs, and the step's done() queries its events: the runtime may
        # submit and poll from its event loop (client/team_api.py steps_in_background); on the CPU submit computes.
        self.steps_in_background = len(devices) == 1 and devices[0].type == "cuda"
        self.state_storage = state_storage
        self.compile_s = None  # seconds of compiling: torch.compile's probe, then every graph the step needs
        if compile:
            from .compiled import check_compile, warm_up
            for device in devices:
                check_compile(device)  # before the weights are converted: where it cannot run, fail at once
            self.compile_s = time.perf_counter() - start
        # A loader instead of a model: the fp32 model lives only while its weights are converted, so that the tiers'
        # shares of the free GPU and host memory below leave it out (7.9 GB of the full preset, ~35 slots)
        loaded = not isinstance(model, torch.nn.Module)
        if loaded:
            if not callable(model):
                raise TypeError(f"FastEngine takes the model or a loader returning it, got {type(model).__name__}")
            model = model()
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"a model loader must return the model (a torch.nn.Module), got {type(model).__name__}")
        placement = place_towers(model, precision, len(devices))
        self.shards = []
        for device, towers in zip(devices, placement):
            if progress and len(devices) > 1:
                sys.stderr.write(f"[fast engine] {device}: towers {', '.join(towers)}\n")
            runner = StepRunner(model, device, precision, towers=towers, state_storage=state_storage,
                                compile=compile)
            self.shards.append(DeviceTowers(runner, [TOWER_NAMES.index(name) for name in towers]))
        if loaded:
            del model
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        parts = [(shard.runner.layout, shard.device) for shard in self.shards]
        if capacity is None:
            capacity = self._capacity_for_memory(parts, STATE_MEMORY if state_memory is None else state_memory)
        if host_symbols is None:
            budget = host_tier_budget() if host_memory is None else host_memory
            host_symbols = (host_symbols_for(budget, [slot_layout(layout)[1] for layout, _ in parts])
                            if devices[0].type == "cuda" else 0)
        if reserve is None:
            reserve = min(RESERVE, capacity // 8)
        # The host tier pins in the background from here on, paused while the graphs are captured (a registration
        # would break a capture); the engine serves meanwhile, each slot joining the tier as it is pinned.
        self.table = StateTable(parts, capacity, host_capacity=host_symbols, idle_timeout_s=idle_timeout_s,
                                reserve=reserve, separate=compile, time_copies=time_copies)
        # Steps run on a stream of their own on each GPU, not on the default stream, which synchronises with every
        # blocking stream: with a timing event before each launch, 72 of 7,760 steps of the swap section waited for a
        # state's copy to the host against 126 on the default stream (bench/LOG.md section 48)
        self.step_streams = ([own_stream(shard.device) for shard in self.shards]
                             if self.device.type == "cuda" else [])
        self.max_batch = max_batch = min(max_batch, capacity)  # a step's symbols all hold GPU slots at once
        self.max_rows_per_symbol = max_rows_per_symbol
        self.shapes = step_shapes(max_batch, max_rows_per_symbol)
        for shard, part in zip(self.shards, self.table.parts):
            shard.runner.attach(part.tensors)
            began, tell = time.perf_counter(), progress and shard.device.type == "cuda"
            if tell:
                sys.stderr.write(f"[fast engine] compiling kernels for {len(self.shapes)} step shapes on "
                                 f"{shard.device} ...")
                sys.stderr.flush()
            precompile(shard.runner, self.shapes)
            if tell:
                sys.stderr.write(f" {time.perf_counter() - began:.1f} s\n")
            if compile:
                self.table.pause_pinning()  # torch.compile's warm-up captures graphs of its own
                self.compile_s += warm_up(shard.runner, self.shapes, progress)
        self._ring = None  # without CUDA every step is synchronous
        self.step_times = [] if time_steps else None
        self.graphed = None
        self._next = 0
        self.table.pause_pinning()  # no host registration may run while graphs are captured
        try:
            self._capture(graphs, time_steps, progress)
        finally:
            self.table.resume_pinning()
        self.startup_s = time.perf_counter() - start
        if progress:
            d = self.describe()
            compiled = "" if self.compile_s is None else f", compiled in {self.compile_s:.1f} s"
            sys.stderr.write(f"[fast engine] ready on {', '.join(map(str, devices))} in {self.startup_s:.1f} s"
                             f"{compiled}; precision {precision.describe()}; state table: "
                             f"{d['capacity']} symbols on {'the GPU' if self.device.type == 'cuda' else 'the CPU'} "
                             f"({d['state_bytes_per_symbol'] / 2**20:.1f} MiB each, matrix states "
                             f"{state_storage.describe()}), "
                             f"{d['host_symbols']} in host memory ({d['host_bytes'] / 2**30:.1f} GiB"
                             f"{', pinning in the background as the engine serves' if self.table.pinning else ''})\n")

    def _capture(self, graphs, time_steps, progress):
        """The pinned staging ring and, on a GPU (unless graphs is False), every shape's CUDA graphs."""
        if self.device.type == "cuda":
            max_rows = max(shape.rows for shape in self.shapes)
            self._ring = [Staging(self.max_batch, max_rows, self.runner.num_features, self.shards, time_steps)
                          for _ in range(RING)]
        if not (self.device.type == "cuda" if graphs is None else graphs):
            return
        for i, shard in enumerate(self.shards):
            with torch.cuda.device(shard.device):
                label = "capturing graphs" + (f" on {shard.device}" if len(self.shards) > 1 else "")
                staging = [(st.inputs.buffer, st.outs[i], st.taken[i]) for st in self._ring or ()]
                shard.graphed = GraphedStep(shard.runner, self.shapes, progress=_progress(label) if progress else None,
                                            staging=staging)
                shard.graphed.capture()
        self.graphed = self.shards[0].graphed

    def wait_pinned(self, progress=True):
        """Wait until the host tier is pinned (the engine serves meanwhile; this is for measurements that need
        the whole tier), with progress on stderr."""
        report = None
        if progress and self.table.pinning:
            report = _progress(f"pinning the host tier ({self.table.host_bytes / 2**30:.1f} GiB): slots")
        self.table.wait_pinned(report)

    @staticmethod
    def _capacity_for_memory(parts, share):
        if parts[0][1].type != "cuda":
            if not 0 < share <= 0.95:
                raise ValueError(f"--state-memory must be a share in (0, 0.95], got {share}")
            fits = int(share * host_memory()[1]) // sum(slot_layout(layout)[1] for layout, _ in parts) - 1
            return max(1, min(CPU_CAPACITY, fits))
        return min(capacity_for_memory(slot_layout(layout)[1], share, device) for layout, device in parts)

    @property
    def runner(self) -> StepRunner:
        """The (first) device's step runner."""
        return self.shards[0].runner

    @property
    def symbols(self):
        return self.table.symbols()

    @property
    def step_rows(self) -> tuple[int, ...]:
        """Rows of the captured shapes of several requests a symbol: a step of those is padded to the next."""
        return tuple(sorted({shape.rows for shape in self.shapes if shape.max_rows > 1}))

    @property
    def weight_bytes(self) -> int:
        return sum(shard.runner.weight_bytes for shard in self.shards)

    @property
    def state_bytes(self) -> int:
        """Bytes of state per symbol (the padding-free row of the state table)."""
        return self.table.bytes_per_slot

    def describe(self):
        return {"device": ", ".join(map(str, self.devices)), "graphs": self.graphed is not None,
                "towers": {str(shard.device): shard.runner.tower_names for shard in self.shards},
                "precision": {k: str(v).removeprefix("torch.") for k, v in self.runner.precision.as_dict().items()},
                "state_dtype": self.state_storage.spec,
                "state_rounding": self.state_storage.rounding if self.state_storage.sixteen_bit else None,
                "weight_bytes": self.weight_bytes,
                "state_bytes_per_symbol": self.state_bytes, "capacity": self.table.capacity,
                "host_symbols": self.table.host_capacity, "host_bytes": self.table.host_bytes,
                "host_pin_s": self.table.pin_s, "reserve": self.table.reserve, "max_batch": self.max_batch,
                "max_rows_per_symbol": self.max_rows_per_symbol, "step_shapes": len(self.shapes),
                "compile": self.runner.compiled, "compile_s": self.compile_s,
                "startup_s": getattr(self, "startup_s", None)}

    def unplaceable(self, symbols) -> dict[str, str]:
        """{symbol: why} for the symbols of a step that the state table cannot hold (no side effects). A step runs
        as parts of at most max_batch (<= capacity) symbols: only the room in the tiers limits it."""
        # a lone string, iterated, was a symbol per character: "AAPL" held, and A, P and L said to have no room
        rejected = self.table.unplaceable(symbol_list(symbols), at_once=False)
        return dict.fromkeys(rejected, str(self.table.capacity_error(rejected))) if rejected else {}

    @_on_own_device
    def state_layout(self) -> dict:
        """A symbol's slot bytes, part by part (one per device): its components with their byte offsets in it (the
        gaps between them are zeros); the state storage's dtypes (and stochastic rounding's step counter) are
        among them. Asked by whoever will export: the exports' buffers are allocated here, not in play."""
        for part in self.table.parts:
            part.ready_exports()
        parts = [{"bytes": part.slot_bytes,
                  "components": [[name, list(shape), str(dtype).removeprefix("torch."), part.offsets[name]]
                                 for name, (shape, dtype, _) in part.layout.items()]} for part in self.table.parts]
        return {"engine": self.name, "bytes": sum(part["bytes"] for part in parts), "parts": parts}

    @_on_own_device
    def export_state(self, symbol) -> PendingStep:
        """On a GPU the state's copy is on its way when this returns (StateTable.export): result() waits for it."""
        return self.table.export(state_symbol(symbol), self.step_streams)

    @_on_own_device
    def import_state(self, symbol, data) -> None:
        data = state_data(data, sum(part.slot_bytes for part in self.table.parts))
        slot = self.table.slots_for([state_symbol(symbol)], self.step_streams)[0]
        with _current(self.step_streams):  # ordered with the steps (a copy of its own: the caller's may go)
            self.table.write(slot, torch.from_numpy(data.copy()))

    @_on_own_device
    def release(self, symbols) -> None:
        """Forget these symbols' states (they left); their slots go to other symbols."""
        self.table.release(symbol_list(symbols))

    def expired(self) -> list[str]:
        return self.table.take_expired()

    @property
    def moves_states(self) -> bool:
        """Whether a state may leave the GPU (a host tier behind the state table): prefetch and ready have nothing to
        do otherwise."""
        return self.table.host_capacity > 0

    @_on_own_device
    def prefetch(self, symbols) -> None:
        """Requests for these symbols arrived: start their states' way to the GPU now (thread-safe; returns at
        once, the copies run on the table's copy streams)."""
        self.table.prefetch(symbol_list(symbols))

    @_on_own_device
    def ready(self, symbol) -> bool:
        """False while the symbol's state is still on its way to the GPU (thread-safe)."""
        return self.table.ready(symbol)

    @_on_own_device
    def slots_for(self, symbols) -> torch.Tensor:
        return torch.tensor(self.table.slots_for(symbols), dtype=torch.int32).to(self.device, non_blocking=True)

    @_on_own_device
    @torch.no_grad()
    def step_slots(self, slot_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predictions [B, 4] on the (first) device for one request of each slot (distinct); valid until the next
        call (graph outputs are reused)."""
        return self.step_plan(StepPlan.one_row_each(slot_ids), features)

    @_on_own_device
    @torch.no_grad()
    def step_plan(self, plan: StepPlan, features: torch.Tensor) -> torch.Tensor:
        """Predictions [R, 4] on the (first) device for a step whose plan and features are on the device."""
        if len(self.shards) > 1:
            parts = []
            for shard in self.shards:
                moved = StepPlan(plan.seq_slots.to(shard.device), plan.seq_starts.to(shard.device), plan.max_rows)
                rows = features.to(shard.device)
                parts.append(shard.graphed(moved, rows) if shard.graphed else shard.runner(moved, rows))
            out = torch.empty(features.shape[0], NUM_TOWERS, device=self.device)
            for shard, part in zip(self.shards, parts):
                out[:, shard.columns] = part.to(self.device)
            return out
        if self.graphed is not None:
            return self.graphed(plan, features)
        return self.runner(plan, features)

    def step(self, symbols, features):
        return self.submit(symbols, features).result()

    @_on_own_device
    @torch.no_grad()
    def submit(self, symbols, features, *, joinable=False) -> PendingStep:
        """Enqueue a step on each device's current CUDA stream and return at once; result() waits for its
        predictions. A symbol may appear several times (its requests in arrival order): the step advances its
        state through them in order. Symbols that fit in no tier of the state table raise CapacityError before
        anything changes. joinable: a step of one request a symbol queued behind one still running is launched
        with room for JOIN_ROOM more and returned as a JoinableStep (on one GPU, with graphs); its predictions
        may then differ from the same step's at its own shape in the last bits, as any padded step's.

        Without CUDA the step runs synchronously. A step of more than max_batch symbols or max_rows_per_symbol
        requests of a symbol runs as several, in order. Not thread-safe: submit (and step) from one thread;
        result() may be called from another.
        """
        symbols = symbol_list(symbols)
        features = check_step_inputs(symbols, features)
        if not symbols:
            return PendingStep.completed(np.zeros((0, NUM_TOWERS), dtype=np.float32))
        parts = self._split(Sequences(symbols))
        if len(parts) == 1:
            return self._submit_part(*parts[0], features, joinable)
        # Each part's placement checks only its own symbols: a later part's refusal would come after the earlier
        # parts had advanced their states, so the whole step's room is checked, and held, before any part runs
        rejected = self.table.hold_room(symbols)
        if rejected:
            raise self.table.capacity_error(rejected)
        try:
            pending = [(rows, self._submit_part(part, rows, features)) for part, rows in parts]
        finally:
            self.table.release_room()

        def gather():
            out = np.empty((len(symbols), NUM_TOWERS), dtype=np.float32)
            for rows, step in pending:
                out[rows] = step.result()
            return out
        return PendingStep(gather, poll=lambda: all(step.done() for _, step in pending))

    def _split(self, sequences: Sequences):
        """[(Sequences of a part, its rows of the step)]: parts of at most max_batch symbols and
        max_rows_per_symbol requests of a symbol, in an order that keeps each symbol's requests in order."""
        if len(sequences.symbols) <= self.max_batch and sequences.max_length <= self.max_rows_per_symbol:
            return [(sequences, np.arange(len(sequences.order)))]
        runs, start = [], 0  # [(symbol, its rows in order)]
        for symbol, length in zip(sequences.symbols, sequences.lengths):
            runs.append((symbol, sequences.order[start:start + length]))
            start += length
        parts, k = [], self.max_rows_per_symbol
        for chunk in range(0, sequences.max_length, k):
            live = [(symbol, rows[chunk:chunk + k]) for symbol, rows in runs if len(rows) > chunk]
            for first in range(0, len(live), self.max_batch):
                group = live[first:first + self.max_batch]
                rows = np.concatenate([r for _, r in group])
                parts.append((Sequences([symbol for symbol, r in group for _ in r]), rows))
        return parts

    def _submit_part(self, sequences: Sequences, rows, features, joinable=False) -> PendingStep:
        """One step of at most max_batch symbols and max_rows_per_symbol requests each: `rows` of `features`."""
        grouped = features[rows[sequences.order]]  # each symbol's rows together, in order
        if self._ring is None:
            return PendingStep.completed(self._step_now(sequences, grouped)[_restore(sequences.order)])
        index, staging = self._next, self._ring[self._next]
        ahead = self._ring[index - 1]  # the staging of the step submitted last, which this one queues behind
        self._next = (self._next + 1) % len(self._ring)
        if staging.step is not None:
            # Its previous step may still be reading these inputs, or its result not yet be copied out of
            # `outs`: finish it (its PendingStep keeps the copy for whoever collects it later).
            staging.step.result()
        total, symbols = len(grouped), len(sequences.symbols)
        shape = shape_for(self.shapes, total, symbols, sequences.max_length)
        room = None
        if joinable and sequences.max_length == 1 and len(self.shards) == 1 and self.graphed is not None \
                and ahead.step is not None and not ahead.done[0].query():
            # queued behind a step still running: launched with room for requests that arrive before it starts
            wanted = min(total + JOIN_ROOM, self.max_batch)
            room = next((s for s in self.shapes if s.max_rows == 1 and s.rows >= wanted and s.rows > total), None)
            shape = room or shape
        with _current(self.step_streams):
            self._launch(sequences, grouped, staging, index, shape)
        restore = _restore(sequences.order)  # after the launch: only the answer needs it
        if room is None:
            staging.step = PendingStep(lambda: staging.read_back(total, self.step_times)[restore], poll=staging.ended)
        else:
            staging.step = JoinableStep(self, staging, sequences.symbols, restore, shape.sequences, ahead)
        return staging.step

    @_on_own_device
    def queued(self, staging, ahead) -> bool:
        """Whether `staging`'s step is the last submitted and the one `ahead` of it still runs (so it has not
        started: the stream runs them in order)."""
        return self._ring[self._next - 1] is staging and not ahead.done[0].query()

    def _launch(self, sequences, grouped, staging, index, shape):
        """Place the step's symbols and launch it on each GPU's current stream, its predictions copied into the
        staging's outs."""
        for taken in staging.taken_views:
            taken[:] = -1
        streams = self.step_streams  # current on their devices (_current): named, not asked for (~10 us each)
        if staging.started is not None:  # before slots_for: a step's time includes its waits for copies
            for started, stream in zip(staging.started, streams):
                started.record(stream)
        staging.inputs.fill(self.table.slots_for(sequences.symbols, streams), sequences.lengths, grouped)
        total = len(grouped)
        for shard, host_out, done, stream in zip(self.shards, staging.outs, staging.done, streams):
            with _on_device(shard.device):
                if shard.graphed is not None:
                    shard.graphed.replay_staged(index, shape, total)  # copies in, step, predictions out
                else:
                    plan = staging.inputs.plan(shape)
                    plan = StepPlan(plan.seq_slots.to(shard.device, non_blocking=True),
                                    plan.seq_starts.to(shard.device, non_blocking=True), plan.max_rows)
                    rows_in = staging.inputs.features[:shape.rows].to(shard.device, non_blocking=True)
                    host_out[:total].copy_(shard.runner(plan, rows_in)[:total], non_blocking=True)
                done.record(stream)

    def _step_now(self, sequences: Sequences, grouped):
        """A step run at once (no CUDA): the grouped rows' predictions [R, 4]."""
        slots = self.table.slots_for(sequences.symbols)
        starts = np.concatenate([[0], np.cumsum(sequences.lengths)])
        plan = StepPlan(torch.tensor(slots, dtype=torch.int32, device=self.device),
                        torch.tensor(starts, dtype=torch.int32, device=self.device), sequences.max_length)
        return self.step_plan(plan, torch.from_numpy(grouped).to(self.device)).cpu().numpy()


def _restore(order):
    """The inverse permutation of a step's grouped row order: row i of the answer is grouped row restore[i]."""
    restore = np.empty_like(order)
    restore[order] = np.arange(len(order))
    return restore


# The calls under torch.cuda.set_stream and current_stream, by stream id (torch's private API: where a build lacks
# them, _current takes torch.cuda.stream() instead)
_STREAM_BY_ID = hasattr(torch._C, "_cuda_getCurrentStream") and hasattr(torch._C, "_cuda_setStream")


@contextlib.contextmanager
def _current(streams):
    """Each stream current on its device for the block. One stream on the current device (one GPU) is set and put
    back by its id: torch.cuda.stream() and current_stream() build Stream objects under device guards, ~55 us on a
    step's launch path (bench/LOG.md section 58)."""
    if _STREAM_BY_ID and len(streams) == 1 and streams[0].device_index == torch.cuda.current_device():
        stream = streams[0]
        previous = torch._C._cuda_getCurrentStream(stream.device_index)  # (stream id, device index, device type)
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type)
        try:
            yield
        finally:
            torch._C._cuda_setStream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
        return
    with contextlib.ExitStack() as on_streams:
        for stream in streams:
            on_streams.enter_context(torch.cuda.stream(stream))
        yield


def _checked_devices(devices) -> list[torch.device]:
    """The devices, each GPU with its index ("cuda" is the current one: every thread's CUDA calls are then made on
    the engine's GPU, _on_device), or ValueError saying why they cannot serve."""
    kinds = {d.type for d in devices}
    if len(kinds) != 1 or not kinds <= {"cuda", "cpu"}:
        raise ValueError(f"devices must all be CUDA GPUs or all the CPU, got {', '.join(map(str, devices))}")
    if "cuda" not in kinds:
        return devices
    if not torch.cuda.is_available():
        raise ValueError("a CUDA device was asked for but CUDA is not available; use --device cpu")
    devices = [torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index) for d in devices]
    present = torch.cuda.device_count()
    missing = [str(d) for d in devices if d.index >= present]
    if missing:
        raise ValueError(f"{', '.join(missing)} asked for, but this machine has {present} GPU(s)")
    indices = [d.index for d in devices]
    if len(set(indices)) != len(indices):
        raise ValueError(f"each GPU may appear once, got {', '.join(map(str, devices))}")
    return devices

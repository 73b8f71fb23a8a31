"""What the benchmark's sections share: how much each measures (Counts), the timer, the step-time measurement,
and the Bench that builds the reference model, the accuracy suite and the engine once, when first needed."""
import gc
import math
import platform
import time
from dataclasses import dataclass

import numpy as np
import torch

from client.accuracy import Suite
from client.model.config import NUM_FEATURES

BATCH_SIZES = (1, 2, 4, 8, 16, 20, 32, 40, 64)
MAX_BATCH = max(BATCH_SIZES)
SHORT_BATCHES = (1, 20, 64)  # step times of the engine variants (precisions, state dtypes, GPU counts)
E2E_RATE, E2E_SYMBOLS = 400.0, 20
MAXRATE_SYMBOLS = 64
P99_LIMIT_MS = 50.0
# The served sections' options given as lists, each taken in turn from run to run (run i: value i mod its length),
# in this order: option -> the runtime's setting it gives (Bench.forming_ms)
IN_TURN = {"late_after_ms": "late_after_ms", "form_margin_ms": "form_margin_ms",
           "punctual_late_after_ms": "punctual_late_after_ms", "join": "join_queued", "inline_steps": "inline_steps"}
# The e2e section's options that, given as "alternate", take every second run (scripts/benchmarks/e2e.py)
ALTERNATING = ("awake_cpus", "ws_compression", "tls", "journal")


def runs_in_turn(args, alternating=False) -> int:
    """How many runs it takes the options given in turn (IN_TURN) to come round again; alternating: the e2e
    section's alternating options (ALTERNATING) too."""
    runs = math.lcm(*(len(getattr(args, option) or [0]) for option in IN_TURN))
    if alternating and any(getattr(args, option) == "alternate" for option in ALTERNATING):
        runs = math.lcm(runs, 2)
    return runs


def taken_in_turn(args, alternating=False) -> list[str]:
    """The options of runs_in_turn that take several runs, as given on the command line."""
    given = [f"--{option.replace('_', '-')}" for option in IN_TURN if len(getattr(args, option) or []) > 1]
    if alternating:
        given += [f"--{option.replace('_', '-')} alternate" for option in ALTERNATING
                  if getattr(args, option) == "alternate"]
    return given


@dataclass
class Counts:
    """How much each section measures; --quick shrinks everything for a smoke run."""
    copy_bytes: int
    copy_repeats: int
    step_warmup: int
    step_iters: int
    baseline_warmup: int
    baseline_iters: int
    family_symbols: int  # accuracy suite: symbols per input family
    family_steps: int
    family_seeds: int  # accuracy suite: input seeds the families run with (each family judged by its worst)
    long_symbols: int
    long_steps: int
    e2e_requests: int
    e2e_runs: int  # e2e sessions in a row, each reported (the tail varies from run to run)
    rates: list
    k1_rates: list  # maxrate with one request per symbol per step (today's rule before several per step)
    rate_seconds: float
    new_symbols: int  # capacity section: symbols arriving mid-stream (on the CPU also its GPU tier's size)
    arrival_seconds: float
    arrival_rate: float  # capacity and backlog: requests/s (the event's load; a smoke run's CPU cannot serve it)
    churn_symbols: int
    churn_capacity: int
    churn_steps: int
    cpu_host_symbols: int  # capacity and swap sections on the CPU: the host tier (a GPU takes the defaults)
    swap_hot_symbols: int  # swap section: hot symbols at swap_hot_rate req/s, cold ones at swap_cold_rate
    swap_hot_rate: float
    swap_cold_rate: float
    swap_seconds: float


FULL = Counts(copy_bytes=1 << 30, copy_repeats=20, step_warmup=20, step_iters=200, baseline_warmup=5,
              baseline_iters=20, family_symbols=4, family_steps=1000, family_seeds=3, long_symbols=4,
              long_steps=10_000, e2e_requests=4000, e2e_runs=3,
              rates=[2000, 5000, 8000, 11000, 14000, 15000, 16000, 17000, 20000, 23000, 26000, 30000],
              k1_rates=[3000, 4000, 5000, 6000, 7000, 8000], rate_seconds=1.5, new_symbols=200, arrival_seconds=10.0,
              arrival_rate=E2E_RATE, churn_symbols=24, churn_capacity=8, churn_steps=200, cpu_host_symbols=400,
              swap_hot_symbols=20, swap_hot_rate=400.0, swap_cold_rate=50.0, swap_seconds=20.0)
QUICK = Counts(copy_bytes=64 << 20, copy_repeats=5, step_warmup=1, step_iters=4, baseline_warmup=2,
               baseline_iters=5, family_symbols=2, family_steps=20, family_seeds=1, long_symbols=2,
               long_steps=60, e2e_requests=200, e2e_runs=1, rates=[50, 100], k1_rates=[50], rate_seconds=1.0,
               new_symbols=12, arrival_seconds=2.0, arrival_rate=100.0,
               churn_symbols=6, churn_capacity=3, churn_steps=30, cpu_host_symbols=32, swap_hot_symbols=4,
               swap_hot_rate=100.0, swap_cold_rate=20.0, swap_seconds=2.0)


class Timer:
    """Milliseconds of one call: CUDA events on a GPU (the queue drained first, so a call is timed alone,
    launch included), perf_counter on the CPU where ops run synchronously."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def time_ms(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self._start.record()
            fn()
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1000.0


def median_p99(times_ms):
    times = np.asarray(times_ms, dtype=np.float64)
    return float(np.median(times)), float(np.percentile(times, 99))


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def measure_copy(device, counts, timer):
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), and the median copy's ms."""
    src = torch.ones(counts.copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    median_ms, _ = median_p99([timer.time_ms(lambda: dst.copy_(src)) for _ in range(counts.copy_repeats)])
    return 2 * src.numel() * src.element_size() / (median_ms / 1000.0), median_ms


# Each section steps symbols of its own: the engine keeps every state it holds, and the served sections
# need states that match the reference's.
def step_symbols():
    return [f"STEP_{i:03d}" for i in range(MAX_BATCH)]


def measure_steps(engine, bench, bandwidth, batches=BATCH_SIZES):
    """{B: {median, p99, floor}} in ms; the floor moves the weights once and each row's state in and out (on
    several GPUs, the slowest GPU's: its towers' weights and state)."""
    symbols = step_symbols()
    generator = torch.Generator(device=bench.device).manual_seed(bench.args.seed)
    counts, timer = bench.counts, bench.timer
    results = {}
    for batch in batches:
        slots = engine.slots_for(symbols[:batch])
        features = torch.randn(batch, NUM_FEATURES, generator=generator, device=bench.device)
        for _ in range(counts.step_warmup):
            engine.step_slots(slots, features)
        median, p99 = median_p99([timer.time_ms(lambda: engine.step_slots(slots, features))
                                  for _ in range(counts.step_iters)])
        if len(engine.shards) > 1:
            floor = max(shard.runner.weight_bytes + 2 * batch * part.slot_bytes
                        for shard, part in zip(engine.shards, engine.table.parts)) / bandwidth * 1000.0
        else:
            floor = (engine.weight_bytes + 2 * batch * engine.state_bytes) / bandwidth * 1000.0
        results[str(batch)] = {"median": median, "p99": p99, "floor": floor}
        bench.progress(f"step B={batch}: median {median:.3f} ms, p99 {p99:.3f} ms, floor {floor:.3f} ms "
                       f"({median / floor:.2f}x)")
    engine.release(symbols)
    return results


def measure_step_room(engine, bench, batches=(1, 2, 4), rooms=(1, 2)):
    """{"B+R": {rows, median, p99}} in ms: a step of B symbols launched with room for R joins (padding rows at
    the padding slot, as a step queued behind another is: JoinableStep), through the engine's graphs; and
    {"B staged": {rows, median, p99}}: the step of B symbols through its staged graph, the inputs' copies in and
    the predictions' out included (what a submitted step runs). None without graphs on one GPU."""
    from client.engine.fast.layers import StepPlan
    from client.engine.fast.runner import PAD_SLOT, shape_for

    graphed = getattr(engine, "graphed", None)
    if graphed is None or len(engine.shards) > 1:
        return None
    symbols = step_symbols()
    generator = torch.Generator(device=bench.device).manual_seed(bench.args.seed + 2)
    results = {}

    def timed(key, rows, step):
        for _ in range(bench.counts.step_warmup):
            step()
        median, p99 = median_p99([bench.timer.time_ms(step) for _ in range(bench.counts.step_iters)])
        results[key] = {"rows": rows, "median": median, "p99": p99}
        bench.progress(f"step {key} ({rows} rows): median {median:.3f} ms, p99 {p99:.3f} ms")

    for batch in batches:
        slots = engine.slots_for(symbols[:batch])
        for room in rooms:
            shape = shape_for(engine.shapes, batch + room, batch + room, 1)
            seq_slots = torch.full((shape.sequences,), PAD_SLOT, dtype=torch.int32, device=bench.device)
            seq_slots[:batch] = slots
            starts = torch.full((shape.sequences + 1,), batch, dtype=torch.int32, device=bench.device)
            starts[:batch + 1] = torch.arange(batch + 1, dtype=torch.int32, device=bench.device)
            features = torch.randn(shape.rows, NUM_FEATURES, generator=generator, device=bench.device)
            timed(f"{batch}+{room}", shape.rows,
                  lambda: engine.step_plan(StepPlan(seq_slots, starts, 1), features))
        staging = engine._ring[0]
        features = torch.randn(batch, NUM_FEATURES, generator=generator, device=bench.device)
        staging.inputs.fill(slots.cpu().numpy(), [1] * batch, features.cpu().numpy())
        shape = shape_for(engine.shapes, batch, batch, 1)
        timed(f"{batch} staged", shape.rows, lambda: graphed.replay_staged(0, shape, batch))
    engine.release(symbols)
    return results


ROWS_PER_SYMBOL = (1, 2, 4, 6, 8)  # the step table of several requests a symbol (64 x 6: the midpoint shape)
ROW_TABLE_SYMBOLS = (1, 20, 64)


def measure_step_rows(engine, bench, bandwidth):
    """{"GxK": {symbols, rows, median, p99, floor}} in ms: steps of G symbols carrying k requests each (up to
    the engine's max_rows_per_symbol), through the engine's graphs; the floor moves the weights once and each
    symbol's state in and out once, whatever its rows."""
    from client.engine.fast.layers import StepPlan

    symbols = step_symbols()
    generator = torch.Generator(device=bench.device).manual_seed(bench.args.seed + 1)
    counts, timer = bench.counts, bench.timer
    results = {}
    for g in ROW_TABLE_SYMBOLS:
        slots = engine.slots_for(symbols[:g])
        for k in (k for k in ROWS_PER_SYMBOL if k <= engine.max_rows_per_symbol):
            plan = StepPlan(slots, torch.arange(0, g * k + 1, k, dtype=torch.int32, device=bench.device), k)
            features = torch.randn(g * k, NUM_FEATURES, generator=generator, device=bench.device)
            for _ in range(counts.step_warmup):
                engine.step_plan(plan, features)
            median, p99 = median_p99([timer.time_ms(lambda: engine.step_plan(plan, features))
                                      for _ in range(counts.step_iters)])
            floor = (engine.weight_bytes + 2 * g * engine.state_bytes) / bandwidth * 1000.0
            results[f"{g}x{k}"] = {"symbols": g, "rows": g * k, "median": median, "p99": p99, "floor": floor}
            bench.progress(f"step {g} symbols x {k} requests: median {median:.3f} ms, p99 {p99:.3f} ms, floor "
                           f"{floor:.3f} ms; {1000 * g * k / median:.0f} requests/s at this shape")
    engine.release(symbols)
    return results


class Bench:
    """What the sections share: the run's options, counts, report and progress, and the reference model, the
    accuracy suite, the copy bandwidth and the engine, each made once, when first needed; sections that need
    other engines build and drop their own."""

    def __init__(self, args, report, progress):
        self.args, self.counts, self.device = args, args.counts, args.device
        self.report, self.progress = report, progress
        self.timer = Timer(self.device)
        self._model = self._engine = self._suite = self._bandwidth = self._tiered = None
        self.host_memory_before_tiers = None  # (total, available) host bytes when the tiered engine was built
        self.gpu_free_before_tiers = None  # free GPU bytes when the tiered engine was built (None on the CPU)

    def forming_ms(self, run=0) -> dict:
        """The step clock's settings given for a served section's run `run`, in milliseconds ({late_after_ms,
        form_margin_ms, punctual_late_after_ms}, each of --late-after-ms, --form-margin-ms and
        --punctual-late-after-ms in turn), join_queued (--join in turn) and inline_steps (--inline-steps in turn);
        those not given are left out: the runtime's defaults."""
        given = {key: getattr(self.args, option) for option, key in IN_TURN.items()}
        return {key: values[run % len(values)] for key, values in given.items() if values}

    def forming(self, run=0) -> dict:
        """forming_ms as serve_stream's keyword arguments (late_after_s, form_margin_s, punctual_late_after_s in
        seconds; join_queued, inline_steps)."""
        given = {}
        for key, value in self.forming_ms(run).items():
            if key.endswith("_ms"):
                key, value = key[:-len("_ms")] + "_s", value / 1000.0
            given[key] = value
        return given

    @property
    def model(self):
        if self._model is None:
            from client.model import load_model

            begin = time.monotonic()
            self._model, fingerprint = load_model(self.args.preset, seed=self.args.seed, device=self.device)
            self.report.update(weights_fingerprint=fingerprint)
            self.progress(f"reference model {self.args.preset} loaded in {time.monotonic() - begin:.1f} s")
        return self._model

    @property
    def suite(self) -> Suite:
        """The accuracy suite's inputs and reference predictions, shared by every engine measured."""
        if self._suite is None:
            counts = self.counts
            self._suite = Suite(self.model, self.device, symbols_per_family=counts.family_symbols,
                                steps=counts.family_steps, long_symbols=counts.long_symbols,
                                long_steps=counts.long_steps,
                                seeds=[self.args.seed + i for i in range(counts.family_seeds)],
                                progress=self.progress)
        return self._suite

    def copy_bandwidth(self) -> float:
        """This run's copy bandwidth (bytes/s), measured and reported once: the step floors divide by it."""
        if self._bandwidth is None:
            self._bandwidth, median_ms = measure_copy(self.device, self.counts, self.timer)
            self.report.update(copy_gb_per_s=self._bandwidth / 1e9)
            self.progress(f"copy: {self.counts.copy_bytes / 2**20:.0f} MiB in {median_ms:.3f} ms, "
                          f"{self._bandwidth / 1e9:.1f} GB/s")
        return self._bandwidth

    def record(self, key, result):
        """A section's result under `key` in the report, and in the progress log."""
        self.report.update(**{key: result})
        self.progress(f"{key}: {result}")

    def build_engine(self, model=None, **options):
        """A fast engine of the run's settings, `options` on top (capacity: symbols it holds on the GPU; no host
        tier unless host_symbols says: a host tier pins in the background, FastEngine.wait_pinned); from the
        reference model, or `model` (a loader: FastEngine's)."""
        from client.engine.fast import FastEngine

        settings = {"max_batch": MAX_BATCH, "max_rows_per_symbol": self.args.max_requests_per_symbol,
                    "precision": self.args.precision, "state_storage": self.args.state_dtype,
                    "capacity": MAX_BATCH, "host_symbols": 0, "progress": False, **options}
        begin = time.monotonic()
        engine = FastEngine(self.model if model is None else model, self.device, **settings)
        self.progress(f"engine built in {time.monotonic() - begin:.1f} s: {engine.describe()}")
        return engine

    def free_gpu(self):
        """Give the GPU memory of the engines let go back (the caller has dropped its references): collected (an
        engine's threads and closures hold cycles), then, once the bench holds no engine whose CUDA graphs may have
        one baked in, the cuBLAS workspaces (one per handle and stream, from the caching allocator, kept for the
        process's life: 2.15 GiB after a full-preset engine on an H200, bench/LOG.md section 65)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if self._engine is None and self._tiered is None and clear is not None:
                clear()
            torch.cuda.empty_cache()

    @property
    def engine(self):
        """The engine of the step, accuracy, e2e and maxrate sections; each releases its symbols when done."""
        if self._engine is None:
            capacity = max(MAX_BATCH, MAXRATE_SYMBOLS, E2E_SYMBOLS,
                           self.suite.symbols if "accuracy" in self.args.sections else 0)
            self._engine = self.build_engine(capacity=capacity)
            self.report.update(engine=self._engine.describe(), weight_bytes=self._engine.weight_bytes,
                               state_bytes=self._engine.state_bytes)
        return self._engine

    def close_engine(self):
        if self._engine is not None:
            self._engine = None
            self.free_gpu()

    def tiered_engine(self):
        """The engine of the capacity and swap sections, built once (its host tier takes a while to pin): on a GPU
        with the default tiers (the GPU's share of the memory free now, the host tier's rule, the reserve; its host
        tier pinned before it is returned), on the CPU with small ones (room for new_symbols beside the reserve,
        cpu_host_symbols in the host tier); transfers timed. Its steps are not: the sections read them from the
        runtime's step log, as served, with no timing event on the step's stream (bench/LOG.md section 48). As in the
        team client, the engine loads the model itself and drops it once its weights are converted, and the
        reference model is let go meanwhile (loaded again when a later section needs it): the tiers' shares of the
        free memory leave out both."""
        if self._tiered is None:
            from client.engine.fast import RESERVE
            from client.engine.fast.state_table import host_memory
            from client.model import ModelLoader

            self._engine = self._model = None  # the budgets are shares of the memory free now
            self.free_gpu()
            cuda = self.device.type == "cuda"
            self.host_memory_before_tiers = host_memory()
            self.gpu_free_before_tiers = torch.cuda.mem_get_info(self.device)[0] if cuda else None
            self._tiered = self.build_engine(ModelLoader(self.args.preset, seed=self.args.seed, device=self.device),
                                             capacity=None if cuda else self.counts.new_symbols + RESERVE,
                                             host_symbols=None if cuda else self.counts.cpu_host_symbols,
                                             time_copies=True)
            # The engine serves while its host tier pins; these sections measure the whole tier.
            self._tiered.wait_pinned(progress=False)
            if self._tiered.table.pin_s is not None:
                self.progress(f"host tier pinned in the background in {self._tiered.table.pin_s:.1f} s")
        return self._tiered

    def close_tiered_engine(self):
        if self._tiered is not None:
            self._tiered = None
            self.free_gpu()

    def symbols_at_budget(self, engine, share) -> int:
        """Symbols the engine's state table would hold at `share` of the memory free without it."""
        if self.device.type != "cuda":
            return engine.table.capacity
        slot_bytes = sum(part.slot_bytes for part in engine.table.parts)
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(share * (free + (engine.table.capacity + 1) * slot_bytes)) // slot_bytes - 1

    def gpu_counts(self):
        present = torch.cuda.device_count() if self.device.type == "cuda" else 2
        counts = self.args.gpus or sorted({1, present})
        if max(counts) > present:
            raise ValueError(f"--gpus {max(counts)} asked for, but this machine has {present} GPU(s)")
        return counts

    def devices(self, gpus) -> list:
        """The devices of `gpus` GPUs of this machine (on the CPU, the CPU that many times)."""
        return [f"cuda:{i}" for i in range(gpus)] if self.device.type == "cuda" else ["cpu"] * gpus

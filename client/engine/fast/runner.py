"""How a step runs: the four towers over the state table, eagerly or as CUDA graphs per step shape.

A step's rows are grouped in sequences, one per symbol (layers.StepPlan); its shape (rows, sequences, max_rows)
is padded up to a captured one: steps of one row per symbol (the light load's case) to a bucket of B rows and
B sequences, steps carrying several requests of a symbol to a bucket of rows, as many sequences as a step of
that many rows can have (at most max_batch), and the engine's max_rows_per_symbol as the bound on any symbol's
rows (the sLSTM's recurrent maps take one launch per row position).
"""
import functools
import os
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from client.engine.cuda_streams import own_stream, reset_graphs_when_dropped
from client.engine.precision import DEFAULT_PRECISION, FP32_STATE, fp32_products
from client.model.config import TOWER_NAMES

from kernels._jit import compile_only, forget_compiled, jit_kernels
from kernels.copy_words import copy_words
from kernels.state_rounding import StochasticRounding

from .layers import BLOCKS, Linear, StepPlan, live_rows
from .state_table import PAD_SLOT

# CUDA stream priorities (lower runs first; captured into the graphs' kernels). The xLSTM tower is the longest
# chain of small kernels: ahead of the other towers' products its kernels wait less for a free SM (bench/LOG.md
# section 23: B=1 -65 us, B=64 -165 us; other assignments gained less or lost).
STREAM_PRIORITY = {"xlstm": -1}
BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # rows = symbols, one row each
STEP_COUNTER = "steps"  # the state table's per-slot step counter (stochastic rounding of 16-bit state)
# Weight dtypes whose products run through kernels/skinny_matmul.py at B <= 64 (bench/LOG.md, section 11).
SKINNY_DTYPES = (torch.float32,)


class Tower:
    def __init__(self, sd, index, name, cfg, precision, device, state_dtype=torch.float32):
        prefix = f"towers.{index}."
        self.name = name

        def dtype_of(group):
            return precision.dtype_of(name, group)

        # its input, relu(input_up(features)), carries the features' scale (a feed's columns: 1e-3 .. 1e5)
        self.input_down = Linear(sd[prefix + "input_down.weight"], sd[prefix + "input_down.bias"],
                                 dtype_of("input_down"), device, wide_input=True)
        # an fp64 input path has its own input_up in fp64 (the others share the runner's fp32 product)
        self.input_up = (Linear(sd[prefix + "input_up.weight"], sd[prefix + "input_up.bias"], torch.float64, device)
                         if self.input_down.dtype == torch.float64 else None)
        block = BLOCKS[name]
        self.blocks = [block(sd, f"{prefix}blocks.{i}.", cfg, dtype_of, device) for i in range(cfg.depth)]
        self.steps = self.blocks  # what runs each block: the block, or its compiled step (compiled.py)
        self.layout = {f"{name}.{i}.{k}": v for i in range(cfg.depth)
                       for k, v in block.state_layout(cfg, state_dtype).items()}

    def block_states(self, table, counter=None):
        """Each block's view of the state table: {component: tensor, "rounding": how its 16-bit matrix state is
        stored}: to nearest (None), or stochastically seeded by the slots' step `counter` and a salt per block."""
        tower = TOWER_NAMES.index(self.name)
        return [{**{k[len(prefix):]: v for k, v in table.items() if k.startswith(prefix)},
                 "rounding": None if counter is None else StochasticRounding(counter, 64 * tower + i)}
                for i, prefix in enumerate(f"{self.name}.{i}." for i in range(len(self.blocks)))]

    def __call__(self, up, block_states, plan, hand_fused=False):
        """up: relu(input_up(features)) of this tower (fp64 where its input path is)."""
        # x starts at zero with input_down's output pending: the first norm1 adds it (see layers.Block)
        x = torch.zeros(up.shape[0], self.input_down.weight.shape[0], device=up.device)
        if self.input_up is not None:  # the fp64 input path, rounded to fp32 once
            delta, bias = self.input_down(up).float(), None
        else:
            delta, bias = self.input_down.product(up), self.input_down.bias
        for step, states in zip(self.blocks if hand_fused else self.steps, block_states):
            delta, bias = step(x, delta, bias, states, plan)
        return x + (delta if bias is None else delta + bias)  # bias to the product first, as the reference


class StepRunner:
    """One fused step of some towers (all four by default): runner(plan, features [R, 79]) -> predictions
    [R, towers] in this runner's tower order, row i the prediction after the step's request i (layers.StepPlan
    says which symbol's state each row advances). The state lives in a StateTable made from `layout` and handed
    over with attach()."""

    def __init__(self, model, device, precision=DEFAULT_PRECISION, *, towers=TOWER_NAMES, state_storage=FP32_STATE,
                 streams=None, skinny=SKINNY_DTYPES, compile=False):
        self.device = torch.device(device)
        self.precision = precision
        unknown = [name for name in towers if name not in TOWER_NAMES]
        if unknown or not towers:
            raise ValueError(f"towers must be some of {', '.join(TOWER_NAMES)}, got {list(towers)}")
        cfg = model.cfg
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        indices = [TOWER_NAMES.index(name) for name in towers]
        self.tower_names = [TOWER_NAMES[t] for t in indices]
        self.proj, self.num_features = cfg.proj, cfg.features
        self.towers = [Tower(sd, t, TOWER_NAMES[t], cfg, precision, self.device,
                             state_storage.dtype_of(TOWER_NAMES[t])) for t in indices]
        # the fp32 input paths' input_up as one product
        shared = [t for t, tower in zip(indices, self.towers) if tower.input_up is None]
        self.input_up = Linear([sd[f"towers.{t}.input_up.weight"] for t in shared],
                               torch.cat([sd[f"towers.{t}.input_up.bias"] for t in shared]), torch.float32,
                               self.device) if shared else None
        self.output_w = sd["output_proj.weight"][0].to(self.device)
        self.output_b = sd["output_proj.bias"].to(self.device)
        self.set_skinny(skinny)
        self.set_gemv(True)
        self.layout = {k: v for tower in self.towers for k, v in tower.layout.items()}
        # 16-bit matrix state rounded stochastically needs fresh random bits every step: a step counter per slot,
        # part of the symbol's state (so a symbol's rounding does not depend on its slot or its neighbours)
        self.stochastic = (state_storage.rounding == "stochastic"
                           and any(dtype != torch.float32 for _, dtype, _ in self.layout.values()
                                   if dtype.is_floating_point))
        if self.stochastic:
            self.layout[STEP_COUNTER] = ((), torch.int32, 0)
        self.counter = None
        self.tower_states = None  # per tower, per block, the views of the state table (attach)
        # Towers are independent: on CUDA each runs on its own stream so their small kernels overlap.
        use_streams = self.device.type == "cuda" if streams is None else streams
        self.streams = [own_stream(self.device, priority=STREAM_PRIORITY.get(tower.name, 0))
                        for tower in self.towers] if use_streams else None
        self.compiled = compile
        if compile:
            from .compiled import compile_towers
            compile_towers(self)

    def attach(self, tensors):
        """Run on the state table whose component views (for this runner's layout) are `tensors`."""
        if self.stochastic:
            self.counter = tensors[STEP_COUNTER]
        self.tower_states = [tower.block_states(tensors, self.counter) for tower in self.towers]

    def _input_linears(self):
        return [lin for lin in [self.input_up] + [lin for t in self.towers for lin in (t.input_up, t.input_down)]
                if lin is not None]

    @property
    def weight_bytes(self):
        total = sum(lin.nbytes for lin in self._input_linears())
        return total + sum(part.nbytes for tower in self.towers for block in tower.blocks for part in block.parts())

    def linears(self):
        parts = self._input_linears()
        parts += [part for tower in self.towers for block in tower.blocks for part in block.parts()]
        return [part for part in parts if isinstance(part, Linear)]

    def tower_inputs(self, features):
        """relu(input_up(features)) of each tower, in tower order: the fp32 ones from one product, an fp64 input
        path's from its own."""
        shared = iter(torch.relu(self.input_up(features)).split(self.proj, dim=1) if self.input_up else ())
        return [next(shared) if tower.input_up is None else tower.input_up.relu(features) for tower in self.towers]

    def set_skinny(self, dtypes):
        """Products of weights in `dtypes` run through the skinny kernel, the others through cuBLAS (graphs
        captured before must be captured again)."""
        for linear in self.linears():
            linear.use_skinny(linear.dtype in tuple(dtypes))

    def set_gemv(self, on):
        """A step's one row through kernels/gemv.py (on) or as set_skinny routes them (graphs captured
        before must be captured again)."""
        for linear in self.linears():
            linear.use_gemv(on)

    def __call__(self, plan: StepPlan, features, hand_fused=False):
        """hand_fused: run the blocks themselves even where compile() routed them through torch.compile."""
        # eager steps and graph captures alike: the fp32 parts must be true fp32 products; a two-row step's products
        # multiply its second row only where a request took it
        with fp32_products(), live_rows(plan.seq_starts[-1:]):
            return self._step(plan, features, hand_fused)

    def _step(self, plan, features, hand_fused):
        chunks = self.tower_inputs(features)
        # Each tower's prediction is its own product with output_proj (the same shapes whichever towers share
        # this runner, so a runner of some towers gives bit for bit a runner of all four's columns)
        if self.streams is None:
            predictions = [torch.mv(tower(chunk, states, plan, hand_fused), self.output_w)
                           for tower, chunk, states in zip(self.towers, chunks, self.tower_states)]
        else:
            main = torch.cuda.current_stream(self.device)
            # Every tower waits for the step's start, not for what `main` holds when its turn comes: a caller may
            # launch a step on a tower's own stream, and that tower's kernels then go on it, ahead of the towers
            # after it. Waiting on `main` put RetNet and Hawk behind Mamba2's whole chain (bench/LOG.md section 60).
            start = torch.cuda.Event()
            start.record(main)
            predictions = []
            for tower, chunk, states, stream in zip(self.towers, chunks, self.tower_states, self.streams):
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    predictions.append(torch.mv(tower(chunk, states, plan, hand_fused), self.output_w))
            for stream in self.streams:
                main.wait_stream(stream)
        if self.counter is not None:  # every tower has stored its state: each slot advances by its rows
            self.counter.index_add_(0, plan.seq_slots, plan.seq_starts[1:] - plan.seq_starts[:-1])
        return torch.stack(predictions, dim=1) + self.output_b  # [B, towers]


class StepShape(NamedTuple):
    """A captured step's size: rows, sequences (symbols) and the bound on any sequence's rows."""
    rows: int
    sequences: int
    max_rows: int


def step_shapes(max_batch, max_rows_per_symbol) -> list[StepShape]:
    """Every shape the engine captures: one row per symbol up to max_batch symbols (the light load's steps, at
    the bucket sizes that keep their padding small), then steps of up to max_rows_per_symbol rows a symbol at
    row counts a power of two apart up to max_batch of them, with the midpoint of the two largest once a step may
    carry four requests a symbol. Each shape costs startup (its Triton
    specialisations compile, its graphs capture: bench/LOG.md section 36), so the several-rows family is coarse:
    a backlog's steps are long, and a row of padding costs them little."""
    shapes = [StepShape(b, b, 1) for b in (*(b for b in BUCKETS if b < max_batch), max_batch)]
    if max_rows_per_symbol > 1:
        k, top = max_rows_per_symbol, max_batch * max_rows_per_symbol
        rows = [k << i for i in range(top.bit_length()) if (k << i) < top] + [top]
        if top >= 4 * max_batch and len(rows) > 1:
            # and the midpoint of the two largest, where a loaded engine's steps sit: at K = 8 over 64 symbols
            # 15,000 req/s ran steps of ~340 rows padded to 512 (22.2 ms served, 256 rows 17.2; bench/LOG.md
            # sections 48, 52)
            rows.insert(-1, (rows[-2] + top) // 2)
        shapes += [StepShape(r, min(r, max_batch), k) for r in rows]
    return shapes


def shape_for(shapes, rows, sequences, max_rows) -> StepShape:
    """The smallest captured shape that holds a step (shapes as step_shapes gives them, each family ascending)."""
    fits = [s for s in shapes if s.max_rows >= max_rows and s.rows >= rows and s.sequences >= sequences]
    if not fits:
        raise ValueError(f"a step of {rows} rows over {sequences} symbols, up to {max_rows} of a symbol, exceeds "
                         f"every captured shape")
    return min(fits, key=lambda s: (s.max_rows, s.rows))


def padding_plan(shape, device) -> StepPlan:
    """A plan of `shape` whose sequences all lie at the padding slot: for runs that compile or capture."""
    starts = torch.full((shape.sequences + 1,), shape.max_rows, dtype=torch.int32, device=device)
    starts[0] = 0
    return StepPlan(torch.full((shape.sequences,), PAD_SLOT, dtype=torch.int32, device=device), starts,
                    shape.max_rows)


def precompile(runner, shapes) -> None:
    """Compile the step's Triton kernels for every step shape before anything is captured or timed: one eager
    step of each shape on the padding slot, the shapes side by side in threads, each under kernels/_jit.compile_only
    (its kernel calls compile what they would launch and launch nothing). A kernel compiles at its first call
    with new constexprs (a shape's BLOCK_M) or specialised sizes; the LLVM and ptxas stages, most of a compile,
    release the GIL, so the threads' compiles overlap where, one after another, they took most of a cold start
    (bench/LOG.md section 35). The hand-fused blocks run even where torch.compile will run the step: its custom
    ops launch the same state kernels and products (its glue kernels, traced as their PyTorch references, are
    compiled here for nothing). Nothing to compile without CUDA.

    Then every shape's step runs again, one at a time: the kernels' first launches (each builds its launcher and
    loads its binary) happen here, in one thread. Launched side by side, a first launch failed twice in hundreds
    of warm starts on Triton 3.6 with a launcher of other arguments than its kernel's, kept for the process
    (bench/LOG.md sections 45, 67). A shape that still fails there is run once more after every compiled kernel
    was dropped from Triton's in-process caches (kernels/_jit.forget_compiled), and says so on stderr with its
    traceback; an error that is the step's own raises again in that run.

    The threads share the towers' streams, so one step's intermediate buffers may be reused by another thread's
    kernels while still in use: harmless here, where every sequence is the padding slot's and every output is
    dropped, and the reason this is no way to run live rows."""
    if runner.device.type != "cuda" or runner.tower_states is None:
        return
    device = runner.device
    features = torch.zeros(max(s.rows for s in shapes), runner.num_features, device=device)
    start = torch.cuda.current_stream(device)

    def step(shape):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(start)
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            runner(padding_plan(shape, device), features[:shape.rows], hand_fused=True)
        return stream

    kernels = jit_kernels()

    def compile_step(shape):
        with compile_only(kernels):
            return step(shape)

    with ThreadPoolExecutor(max_workers=min(len(shapes), os.cpu_count() or 1)) as pool:
        futures = [pool.submit(compile_step, shape) for shape in shapes]
    raised = [future.exception() for future in futures if future.exception() is not None]
    if raised:  # each such shape compiles, or raises, in its launch below
        sys.stderr.write(f"[fast engine] {len(raised)} step shape(s) failed to compile side by side; their launches "
                         f"compile them one at a time. The first failure: {raised[0]!r}\n")
    for future in futures:
        if future.exception() is None:
            start.wait_stream(future.result())
    for shape in shapes:
        try:
            start.wait_stream(step(shape))
        except Exception as error:
            sys.stderr.write(f"[fast engine] the first launches of step shape {tuple(shape)} failed; running it again "
                             f"with Triton's compiled kernels loaded afresh (an error of the step's own raises there "
                             f"again). The failure:\n"
                             f"{''.join(traceback.format_exception(error))}")
            forget_compiled(kernels)
            start.wait_stream(step(shape))
    torch.cuda.synchronize(device)


class StepInputs:
    """A step's inputs carved from one byte buffer: seq_slots (int32 [max_sequences]), seq_starts (int32
    [max_sequences + 1]), then features (float32 [max_rows, F]) at a 16-byte boundary; so one copy of its first
    nbytes(R) bytes delivers a step of R rows. Sequences past the step's are empty (at the padding slot, starting
    at the step's last row), so a graph of more sequences than the step's reads them as nothing to do."""

    def __init__(self, buffer, max_sequences, max_rows, num_features):
        self.buffer, self.max_sequences, self.num_features = buffer, max_sequences, num_features
        self.seq_slots = buffer[:4 * max_sequences].view(torch.int32)
        self.seq_starts = buffer[4 * max_sequences:4 * (2 * max_sequences + 1)].view(torch.int32)
        self.offset = -(-4 * (2 * max_sequences + 1) // 16) * 16
        self.features = buffer[self.offset:self.offset + 4 * max_rows * num_features].view(torch.float32).view(
            max_rows, num_features)
        self.words = buffer.view(torch.int32)  # what copy_words moves

    @staticmethod
    def bytes_for(max_sequences, max_rows, num_features):
        return -(-4 * (2 * max_sequences + 1) // 16) * 16 + 4 * max_rows * num_features

    def nbytes(self, rows):
        """Bytes that carry a step of `rows` rows: every sequence entry, the step's features."""
        return self.offset + 4 * rows * self.num_features

    def plan(self, shape) -> StepPlan:
        return StepPlan(self.seq_slots[:shape.sequences], self.seq_starts[:shape.sequences + 1], shape.max_rows)

    @functools.cached_property
    def host_views(self):
        """numpy views of seq_slots, seq_starts and features (a host buffer's), made once: a step's host work is on
        the latency path, and each tensor's numpy() costs microseconds."""
        return tuple(t.numpy() for t in (self.seq_slots, self.seq_starts, self.features))

    def fill(self, slots, lengths, features):
        """Write a step into a host buffer: sequence s of lengths[s] rows at slots[s]; features [R, F] (numpy) in
        sequence order."""
        seq_slots, seq_starts, host_features = self.host_views
        n, rows = len(slots), features.shape[0]
        seq_slots[:n] = slots
        seq_slots[n:] = PAD_SLOT
        seq_starts[0] = 0
        np.cumsum(lengths, out=seq_starts[1:n + 1])
        seq_starts[n + 1:] = rows
        host_features[:rows] = features

    def join(self, sequence, slot, features):
        """Add one request at `slot` as sequence `sequence` (row `sequence`) of a step of one row a symbol already
        filled with `sequence` sequences and rows, while a device copy of this buffer may be under way.

        The slot is written last, after a fence: a staged graph copies the sequence slots before the rest
        (GraphedStep._capture_staged), so a copy that read this slot also reads the row and the starts written
        before it, and one that read the padding slot leaves the request out (its sequence then covers padding rows
        only, at the padding slot). The later sequences stay empty from the row after it on."""
        seq_slots, seq_starts, host_features = self.host_views
        host_features[sequence] = features
        seq_starts[sequence + 1:] = sequence + 1
        _store_fence()
        seq_slots[sequence] = slot

    @property
    def slots_bytes(self):
        """The leading bytes that hold seq_slots (copied first by a staged graph)."""
        return 4 * self.max_sequences

    def fill_padding(self):
        """Every sequence empty at the padding slot (for the startup runs of the graphs)."""
        self.seq_slots.fill_(PAD_SLOT)
        self.seq_starts.fill_(0)


_FENCE = threading.Lock()


def _store_fence():
    """Make the stores before it visible to a device's reads before the stores after it: a lock's atomic
    read-modify-write orders them on x86, numpy's streaming stores included (other stores are seen in order there
    anyway)."""
    with _FENCE:
        pass


class GraphedStep:
    """CUDA graphs of the step for its shapes (step_shapes), replayed with the step's plan and features copied
    into persistent input buffers (StepInputs); rows and sequences past the step's are padding, which touches no
    state. The state table is allocated once, so the graphs stay valid for the engine's life.

    For each pinned host staging triple (inputs laid out like self.inputs, out [max rows, towers], taken int32
    [max sequences]), the shapes of one row per symbol (the latency-critical light load) get a second set of graphs
    that also carries the copies: host inputs to device, predictions back to the host's out. A submitted step is
    then one launch instead of two copies and a launch from the host (bench/LOG.md, sections 17, 24). Larger steps
    copy around their graph. The staged inputs are read when the stream reaches the step, not when it is launched:
    the sequence slots first, copied back into `taken` as read, then the rest, so that a request joined to a step
    queued behind another (StepInputs.join) is in it exactly when `taken` shows its slot.
    """

    def __init__(self, runner: StepRunner, shapes, progress=None, staging=()):
        self.runner, self.shapes = runner, sorted(shapes, key=lambda s: (s.max_rows, s.rows))
        self.max_sequences = max(s.sequences for s in self.shapes)
        self.max_rows = max(s.rows for s in self.shapes)
        size = StepInputs.bytes_for(self.max_sequences, self.max_rows, runner.num_features)
        self.inputs = StepInputs(torch.zeros(size, dtype=torch.uint8, device=runner.device), self.max_sequences,
                                 self.max_rows, runner.num_features)
        self.staging = [(StepInputs(host, self.max_sequences, self.max_rows, runner.num_features), out, taken)
                        for host, out, taken in staging]
        self.graphs, self.outputs, self.staged_graphs = {}, {}, {}
        reset_graphs_when_dropped(self, runner.device, self.graphs, self.staged_graphs)
        self.progress = progress
        self._taken_stream = own_stream(runner.device) if self.staging else None
        # The engine's own (a GEMM captured on a stream keeps that stream's cuBLAS workspace: cuda_streams.py), on
        # the runner's device (torch.cuda.graph's default capture stream is made once, on the device current then)
        self._capture_stream = own_stream(runner.device)

    def capture(self):
        """Capture every shape (largest first, so smaller graphs reuse its memory pool), then the staged sets."""
        self.graphs.clear(), self.outputs.clear(), self.staged_graphs.clear()
        self.inputs.fill_padding()  # the warm-up runs below must touch no live slot
        pool = torch.cuda.graph_pool_handle()
        warm = torch.cuda.Stream(self.runner.device)
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):  # warm-up outside capture: Triton compiles, cuBLAS picks algorithms
            for shape in self.shapes:
                self.runner(self.inputs.plan(shape), self.inputs.features[:shape.rows])
            for _, _, host_taken in self.staging[:1]:  # copy_words compiled (once for every copy) before capture
                copy_words(host_taken[:1], self.inputs.seq_slots[:1])
        torch.cuda.current_stream().wait_stream(warm)
        jobs = [(shape, index) for shape in sorted(self.shapes, key=lambda s: -s.rows)
                for index in (None, *(range(len(self.staging)) if shape.max_rows == 1 else ()))]
        for done, (shape, index) in enumerate(jobs, 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self._capture_stream):
                plan, features = self.inputs.plan(shape), self.inputs.features[:shape.rows]
                if index is None:
                    self.outputs[shape] = self.runner(plan, features)
                    self.graphs[shape] = graph
                else:
                    self._capture_staged(index, shape, plan, features)
                    self.staged_graphs[index, shape] = graph
            if self.progress:
                self.progress(done, len(jobs))
        self._upload()

    def _capture_staged(self, index, shape, plan, features):
        """The staged graph's work: the sequence slots copied in (and back into `taken` on a side branch, which
        only the graph's end waits for), then the rest of the inputs, the step, its predictions out. Every copy goes
        by kernel (copy_words), beside the copy engines' moves of states."""
        host_inputs, host_out, host_taken = self.staging[index]
        head, n = self.inputs.slots_bytes // 4, self.inputs.nbytes(shape.rows) // 4
        copy_words(self.inputs.words[:head], host_inputs.words[:head])
        main, side = torch.cuda.current_stream(), self._taken_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            copy_words(host_taken[:shape.sequences], self.inputs.seq_slots[:shape.sequences])
        copy_words(self.inputs.words[head:n], host_inputs.words[head:n])
        copy_words(host_out[:shape.rows], self.runner(plan, features))
        main.wait_stream(side)

    def _upload(self):
        """Launch every graph once, on the padding slot: a graph's first launch uploads it to the device, which
        takes milliseconds for a step's ~600 nodes and must not fall on a live request (bench/LOG.md section 27)."""
        for host_inputs, _, _ in self.staging:
            host_inputs.fill_padding()
        self.inputs.fill_padding()
        for graph in (*self.graphs.values(), *self.staged_graphs.values()):
            graph.replay()
        torch.cuda.current_stream(self.runner.device).synchronize()

    def shape_for(self, rows, sequences, max_rows) -> StepShape:
        return shape_for(self.shapes, rows, sequences, max_rows)

    def __call__(self, plan: StepPlan, features):
        """The step of a plan already on the device: copied into the graph's inputs, replayed; the predictions
        (valid until the next replay of that shape)."""
        rows, sequences = features.shape[0], plan.seq_slots.shape[0]
        shape = self.shape_for(rows, sequences, plan.max_rows)
        inputs = self.inputs
        inputs.seq_slots[:sequences].copy_(plan.seq_slots, non_blocking=True)
        inputs.seq_slots[sequences:].fill_(PAD_SLOT)
        inputs.seq_starts[:sequences + 1].copy_(plan.seq_starts, non_blocking=True)
        inputs.seq_starts[sequences + 1:].fill_(rows)
        inputs.features[:rows].copy_(features, non_blocking=True)
        self.graphs[shape].replay()
        return self.outputs[shape][:rows]

    def replay_staged(self, index, shape, rows):
        """Launch the step of `rows` rows staged in self.staging[index] (its plan filled by StepInputs.fill) at
        `shape`; its predictions land in that pair's host out once the stream reaches this point. A shape without a
        staged graph (several rows a symbol) copies its inputs in one piece and writes no `taken`: no request joins
        such a step (JoinableStep takes shapes of one row a symbol, each with its staged graphs)."""
        graph = self.staged_graphs.get((index, shape))
        if graph is not None:
            graph.replay()
            return
        host_inputs, host_out, _ = self.staging[index]
        n = self.inputs.nbytes(shape.rows) // 4
        copy_words(self.inputs.words[:n], host_inputs.words[:n])
        self.graphs[shape].replay()
        copy_words(host_out[:rows], self.outputs[shape][:rows])

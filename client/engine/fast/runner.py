"""How a step runs: the four towers over the state table, eagerly or as CUDA graphs per batch-size bucket."""
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from client.engine.precision import TOWER_PARTS, fp32_products, resolve_precision
from client.model.config import TOWER_NAMES

from kernels.state_rounding import StochasticRounding

from .layers import BLOCKS, Linear
from .state_table import PAD_SLOT

# CUDA stream priorities (lower runs first; captured into the graphs' kernels). The xLSTM tower is the longest
# chain of small kernels: ahead of the other towers' products its kernels wait less for a free SM (bench/LOG.md
# section 23: B=1 -65 us, B=64 -165 us; other assignments gained less or lost).
STREAM_PRIORITY = {"xlstm": -1}
BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
STEP_COUNTER = "steps"  # the state table's per-slot step counter (stochastic rounding of 16-bit state)
# Weight dtypes whose products run through kernels/skinny_matmul.py at B <= 64 (bench/LOG.md, section 11).
SKINNY_DTYPES = (torch.float32,)


class Tower:
    def __init__(self, sd, index, name, cfg, precision, device, state_dtype=torch.float32):
        prefix = f"towers.{index}."
        self.name = name

        def dtype_of(part):
            if part not in TOWER_PARTS[name]:
                raise KeyError(f"{name} has no weight group {part!r} in client.engine.precision.TOWER_PARTS")
            return precision.get(f"{name}.{part}", precision[name])

        self.input_down = Linear(sd[prefix + "input_down.weight"], sd[prefix + "input_down.bias"],
                                 dtype_of("input_down"), device)
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

    def __call__(self, up, block_states, slots, hand_fused=False):
        # x starts at zero with input_down's output pending: the first norm1 adds it (see layers.Block)
        x = torch.zeros(up.shape[0], self.input_down.weight.shape[0], device=up.device)
        delta, bias = self.input_down.product(up), self.input_down.bias
        for step, states in zip(self.blocks if hand_fused else self.steps, block_states):
            delta, bias = step(x, delta, bias, states, slots)
        return x + delta + bias


class StepRunner:
    """One fused step of some towers (all four by default): step(slots [B] int32, features [B, 79]) ->
    predictions [B, towers] in this runner's tower order. The state lives in a StateTable made from `layout`
    and handed over with attach()."""

    def __init__(self, model, device, precision=None, *, towers=TOWER_NAMES, state_dtype=torch.float32,
                 state_rounding="stochastic", streams=None, skinny=SKINNY_DTYPES, compile=False):
        self.device = torch.device(device)
        self.precision = resolve_precision(precision)
        unknown = [name for name in towers if name not in TOWER_NAMES]
        if unknown or not towers:
            raise ValueError(f"towers must be some of {', '.join(TOWER_NAMES)}, got {list(towers)}")
        cfg = model.cfg
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        indices = [TOWER_NAMES.index(name) for name in towers]
        self.tower_names = [TOWER_NAMES[t] for t in indices]
        # the towers' input_up as one product
        self.input_up = Linear([sd[f"towers.{t}.input_up.weight"] for t in indices],
                               torch.cat([sd[f"towers.{t}.input_up.bias"] for t in indices]), torch.float32,
                               self.device)
        self.proj, self.num_features = cfg.proj, cfg.features
        # state_dtype: one dtype for the matrix states, or {tower: dtype} (towers not named keep fp32)
        tower_state = (state_dtype if isinstance(state_dtype, dict) else dict.fromkeys(TOWER_NAMES, state_dtype))
        self.towers = [Tower(sd, t, TOWER_NAMES[t], cfg, self.precision, self.device,
                             tower_state.get(TOWER_NAMES[t], torch.float32)) for t in indices]
        self.output_w = sd["output_proj.weight"][0].to(self.device)
        self.output_b = sd["output_proj.bias"].to(self.device)
        self.set_skinny(skinny)
        self.layout = {k: v for tower in self.towers for k, v in tower.layout.items()}
        if state_rounding not in ("nearest", "stochastic"):
            raise ValueError(f"state rounding must be nearest or stochastic, got {state_rounding!r}")
        # 16-bit matrix state rounded stochastically needs fresh random bits every step: a step counter per slot,
        # part of the symbol's state (so a symbol's rounding does not depend on its slot or its neighbours)
        self.stochastic = (state_rounding == "stochastic"
                           and any(dtype != torch.float32 for _, dtype, _ in self.layout.values() if dtype.is_floating_point))
        if self.stochastic:
            self.layout[STEP_COUNTER] = ((), torch.int32, 0)
        self.counter = self._ones = None
        self.tower_states = None  # per tower, per block, the views of the state table (attach)
        # Towers are independent: on CUDA each runs on its own stream so their small kernels overlap.
        use_streams = self.device.type == "cuda" if streams is None else streams
        self.streams = [torch.cuda.Stream(self.device, priority=STREAM_PRIORITY.get(tower.name, 0))
                        for tower in self.towers] if use_streams else None
        self.compiled = compile
        if compile:
            from .compiled import compile_towers
            compile_towers(self)

    def attach(self, tensors):
        """Run on the state table whose component views (for this runner's layout) are `tensors`."""
        if self.stochastic:
            self.counter = tensors[STEP_COUNTER]
            self._ones = torch.ones(BUCKETS[-1], dtype=torch.int32, device=self.device)
        self.tower_states = [tower.block_states(tensors, self.counter) for tower in self.towers]

    @property
    def weight_bytes(self):
        linears = [self.input_up] + [t.input_down for t in self.towers]
        total = sum(lin.nbytes for lin in linears)
        return total + sum(part.nbytes for tower in self.towers for block in tower.blocks for part in block.parts())

    def linears(self):
        parts = [self.input_up] + [t.input_down for t in self.towers]
        parts += [part for tower in self.towers for block in tower.blocks for part in block.parts()]
        return [part for part in parts if isinstance(part, Linear)]

    def set_skinny(self, dtypes):
        """Products of weights in `dtypes` run through the skinny kernel, the others through cuBLAS (graphs
        captured before must be captured again)."""
        for linear in self.linears():
            linear.use_skinny(linear.dtype in tuple(dtypes))

    def __call__(self, slots, features, hand_fused=False):
        """hand_fused: run the blocks themselves even where compile() routed them through torch.compile."""
        with fp32_products():  # eager steps and graph captures alike: the fp32 parts must be true fp32 products
            return self._step(slots, features, hand_fused)

    def _step(self, slots, features, hand_fused):
        up = torch.relu(self.input_up(features))  # [B, towers * proj]
        chunks = up.split(self.proj, dim=1)
        # Each tower's prediction is its own product with output_proj (the same shapes whichever towers share
        # this runner, so a runner of some towers gives bit for bit a runner of all four's columns)
        if self.streams is None:
            predictions = [torch.mv(tower(chunk, states, slots, hand_fused), self.output_w)
                           for tower, chunk, states in zip(self.towers, chunks, self.tower_states)]
        else:
            main = torch.cuda.current_stream(self.device)
            predictions = []
            for tower, chunk, states, stream in zip(self.towers, chunks, self.tower_states, self.streams):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    predictions.append(torch.mv(tower(chunk, states, slots, hand_fused), self.output_w))
            for stream in self.streams:
                main.wait_stream(stream)
        if self.counter is not None:  # every tower has stored its state: the rows' slots advance a step
            self.counter.index_add_(0, slots, self._ones[:slots.shape[0]])
        return torch.stack(predictions, dim=1) + self.output_b  # [B, towers]


def precompile(runner, buckets) -> None:
    """Compile the step's Triton kernels for every batch bucket before anything is captured or timed: one eager
    step of each bucket on the padding slot, the buckets side by side in threads. A kernel compiles at its first
    call with new constexprs (a bucket's BLOCK_M) or specialised sizes; the LLVM and ptxas stages, most of a
    compile, release the GIL, so the threads' compiles overlap where, one after another, they took most of a cold
    start (bench/LOG.md section 35). The hand-fused blocks run even where torch.compile will run the step: its
    custom ops launch the same state kernels and products (its glue kernels, traced as their PyTorch
    references, are compiled here for nothing). Nothing to compile without CUDA.

    The threads share the towers' streams, so one step's intermediate buffers may be reused by another thread's
    kernels while still in use: harmless here, where every row is the padding slot and every output is
    dropped, and the reason this is no way to run live rows."""
    if runner.device.type != "cuda" or runner.tower_states is None:
        return
    device, batch = runner.device, max(buckets)
    slots = torch.full((batch,), PAD_SLOT, dtype=torch.int32, device=device)
    features = torch.zeros(batch, runner.num_features, device=device)
    start = torch.cuda.current_stream(device)

    def step(rows):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(start)
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            runner(slots[:rows], features[:rows], hand_fused=True)
        return stream

    with ThreadPoolExecutor(max_workers=min(len(buckets), os.cpu_count() or 1)) as pool:
        streams = list(pool.map(step, buckets))
    for stream in streams:
        start.wait_stream(stream)
    torch.cuda.synchronize(device)


def input_views(buffer, max_batch, num_features):
    """A step's inputs carved from one byte buffer: slot ids (int32 [max_batch]), then features (float32
    [max_batch, F]); so one copy of its first input_bytes(B, ...) bytes delivers a batch of B."""
    slots = buffer[:4 * max_batch].view(torch.int32)
    features = buffer[4 * max_batch:4 * max_batch * (1 + num_features)].view(torch.float32)
    return slots, features.view(max_batch, num_features)


def input_bytes(batch, max_batch, num_features):
    """Bytes of an input buffer that carry a batch of `batch` rows: every slot id, the batch's features."""
    return 4 * (max_batch + batch * num_features)


class GraphedStep:
    """CUDA graphs of the step for batch-size buckets, replayed with slots and features copied into persistent
    input buffers; rows past the batch point at the padding slot. The state table is allocated once, so the
    graphs stay valid for the engine's life.

    For each pinned host staging pair (inputs laid out like self.inputs, out [max_batch, 4]) a second set of
    graphs also carries the copies: host inputs to device, predictions back to the host's out. A submitted
    step is then one launch instead of two copies and a launch from the host (bench/LOG.md, sections 17, 24).
    """

    def __init__(self, runner: StepRunner, buckets=BUCKETS, progress=None, staging=()):
        self.runner, self.buckets = runner, tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        self.inputs = torch.zeros(input_bytes(self.max_batch, self.max_batch, runner.num_features),
                                  dtype=torch.uint8, device=runner.device)
        self.slots, self.features = input_views(self.inputs, self.max_batch, runner.num_features)
        self.staging = list(staging)
        self.graphs, self.outputs, self.staged_graphs = {}, {}, {}
        self.progress = progress

    def capture(self):
        """Capture every bucket (largest first, so smaller graphs reuse its memory pool), then the staged sets."""
        self.graphs.clear(), self.outputs.clear(), self.staged_graphs.clear()
        self.slots.fill_(PAD_SLOT)  # the warm-up runs below must only ever touch the padding slot
        pool = torch.cuda.graph_pool_handle()
        warm = torch.cuda.Stream(self.runner.device)
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):  # warm-up outside capture: Triton compiles, cuBLAS picks algorithms
            for b in self.buckets:
                self.runner(self.slots[:b], self.features[:b])
        torch.cuda.current_stream().wait_stream(warm)
        jobs = [(b, index) for b in reversed(self.buckets) for index in (None, *range(len(self.staging)))]
        # torch.cuda.graph's default capture stream is made once, on the device current then: on a second GPU the
        # capture needs a stream of its own device
        capture_stream = torch.cuda.Stream(self.runner.device)
        for done, (b, index) in enumerate(jobs, 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                if index is None:
                    self.outputs[b] = self.runner(self.slots[:b], self.features[:b])
                    self.graphs[b] = graph
                else:
                    host_inputs, host_out = self.staging[index]
                    n = input_bytes(b, self.max_batch, self.runner.num_features)
                    self.inputs[:n].copy_(host_inputs[:n], non_blocking=True)
                    host_out[:b].copy_(self.runner(self.slots[:b], self.features[:b]), non_blocking=True)
                    self.staged_graphs[index, b] = graph
            if self.progress:
                self.progress(done, len(jobs))
        self._upload()

    def _upload(self):
        """Launch every graph once, on the padding slot: a graph's first launch uploads it to the device, which
        takes milliseconds for a step's ~600 nodes and must not fall on a live request (bench/LOG.md section 27)."""
        for host_inputs, _ in self.staging:
            input_views(host_inputs, self.max_batch, self.runner.num_features)[0].fill_(PAD_SLOT)
        for graph in (*self.graphs.values(), *self.staged_graphs.values()):
            graph.replay()
        torch.cuda.current_stream(self.runner.device).synchronize()

    def _bucket(self, B):
        if B > self.max_batch:
            raise ValueError(f"batch of {B} exceeds the largest captured bucket ({self.max_batch})")
        return next(b for b in self.buckets if b >= B)

    def __call__(self, slots, features):
        B = slots.shape[0]
        bucket = self._bucket(B)
        self.slots[:B].copy_(slots, non_blocking=True)
        self.slots[B:bucket].fill_(PAD_SLOT)
        self.features[:B].copy_(features, non_blocking=True)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:B]

    def replay_staged(self, index, B):
        """Launch the step of a batch of B staged in self.staging[index] (slot ids past B already the padding
        slot); its predictions land in that pair's host out once the stream reaches this point."""
        self.staged_graphs[index, self._bucket(B)].replay()

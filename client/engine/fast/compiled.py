"""The step through torch.compile: each block's glue compiled by Inductor, its Triton kernels as custom ops.

Each block (layers.py) is compiled as it is: kernels/custom_ops.py has Dynamo trace the glue ops (norms, residual
adds, gates) as their PyTorch references, which Inductor fuses, and the state kernels and skinny products as
opaque custom ops. The unit is one block, not a tower: the blocks of a tower have the same code, shapes and
guards (no guard on an object's identity), so a tower compiles one block and reuses it for its other blocks, and
so does a second engine of the same preset and precision. The batch dimension goes dynamic on the second batch
size seen (Dynamo's automatic dynamic shapes), and the state tables' slot dimension is marked dynamic before the
first compile, so that the table growing compiles nothing. Graphs per block type: B = 1 (specialised) and
B >= 2, or B = 2 and B >= 3 apart where a product's route depends on B > 2 (the skinny kernel's fp32 products on a
GPU: layers.skinny_pays); each compiles at its first call, which warm_up() makes before any graph capture. The
towers' streams stay outside the compiled code (Dynamo does not trace stream switches); the compiled code launches
on the current stream.
"""
import sys
import time

import torch
import torch._dynamo

from client.engine.precision import fp32_products

from .runner import padding_plan

# Graphs per block type and precision are two or three, but a process may build engines of several precisions or
# presets (a benchmark), and every engine's blocks of a type share one code object's cache (Dynamo's default: 8).
RECOMPILE_LIMIT = 64
# Batch sizes whose first calls compile every graph a step can need (see the module docstring).
WARM_UP_BATCHES = (1, 2, 3)
_COMPILE_RUNS = set()  # devices where check_compile's probe compiled and ran


class CompileUnavailable(ValueError):
    """torch.compile cannot run here (torch too old, no working backend); the message is one line."""


def check_compile(device):
    """Raise CompileUnavailable unless this torch has the APIs of the compiled step and torch.compile runs on
    `device` (on a CPU, Inductor needs a C++ compiler; on a GPU, Triton); checked once per device. Imports
    kernels/custom_ops.py, which registers the custom ops and how Dynamo traces the kernels."""
    device = torch.device(device)
    if device in _COMPILE_RUNS:
        return
    needed = (("torch.library.custom_op", torch.library, "custom_op"),
              ("torch.compiler.substitute_in_graph", torch.compiler, "substitute_in_graph"),
              ("torch._dynamo.config.recompile_limit", torch._dynamo.config, "recompile_limit"))
    missing = [name for name, holder, attribute in needed if not hasattr(holder, attribute)]
    if missing:
        raise CompileUnavailable(f"--compile needs torch >= 2.7 ({', '.join(missing)}); this is torch "
                                 f"{torch.__version__}: run without --compile")
    import kernels.custom_ops  # noqa: F401  (registration)
    try:
        probe = torch.compile(lambda t: torch.relu(t) * 2 + 1, fullgraph=True)
        probe(torch.ones(8, device=device))
    except Exception as exc:  # any backend failure: no compiler, no Triton, a broken toolchain
        reason = " ".join(str(exc).split())[:300]
        raise CompileUnavailable(f"torch.compile does not run on {device} ({type(exc).__name__}: {reason}); "
                                 f"run without --compile") from exc
    _COMPILE_RUNS.add(device)


def compile_towers(runner):
    """Route every block of the runner's towers through torch.compile (fullgraph: a graph break is an error).
    Nothing compiles until a block's first call; warm_up() makes those calls."""
    check_compile(runner.device)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for tower in runner.towers:
        tower.steps = [_compiled_step(block) for block in tower.blocks]


def _compiled_step(block):
    compiled = torch.compile(block.__call__, fullgraph=True)

    # Dynamo guards on the grad mode: one mode for every call, whoever calls (GraphedStep captures without
    # no_grad, FastEngine's steps run under it), so that none of them compiles again.
    @torch.no_grad()
    def step(x, delta, bias, states, slots):
        return compiled(x, delta, bias, states, slots)
    return step


def warm_up(runner, shapes, progress=True) -> float:
    """Compile every graph the step can need for the engine's step shapes (runner.step_shapes), tower by tower,
    on the padding slot; progress on stderr. Returns the seconds it took. Per bound on a symbol's rows (a
    Python int the sLSTM's launches specialise on): its family's first shapes and its largest."""
    for block_states in runner.tower_states:
        for states in block_states:
            for table in states.values():
                if isinstance(table, torch.Tensor):
                    torch._dynamo.mark_dynamic(table, 0)
    families = {}
    for shape in sorted(shapes, key=lambda s: s.rows):
        families.setdefault(shape.max_rows, []).append(shape)
    warm = [shape for family in families.values()
            for shape in dict.fromkeys([*family[:len(WARM_UP_BATCHES)], family[-1]])]
    start = time.perf_counter()
    jobs = [(tower, states, shape) for tower, states in zip(runner.towers, runner.tower_states) for shape in warm]
    live = sys.stderr.isatty()  # a line rewritten in place on a terminal; in a log, a line each
    rewrite, end = ("\r", "   ") if live else ("", "\n")
    for done, (tower, states, shape) in enumerate(jobs):
        if progress:
            sys.stderr.write(f"{rewrite}[fast engine] compiling the {tower.name} blocks for {shape.rows} rows "
                             f"({done}/{len(jobs)}, {time.perf_counter() - start:.0f} s){end}")
            sys.stderr.flush()
        with fp32_products():  # the flags the step runs under (StepRunner.__call__): Dynamo guards on them
            tower(torch.zeros(shape.rows, runner.proj, device=runner.device), states,
                  padding_plan(shape, runner.device))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    if progress:
        sys.stderr.write(f"{rewrite}[fast engine] compiled {len(jobs)} tower steps in {seconds:.1f} s"
                         f"{' ' * 30 if live else ''}\n")
    return seconds

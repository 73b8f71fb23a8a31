"""How exact the skinny kernel's fp32 (split) products are on this GPU, with the partial sums promoted and not, beside
cuBLAS's fp32, on the engine's fp32 product shapes (bench/LOG.md section 54).

    python -m scripts.matmul_error --json matmul_error.json
    python -m scripts.matmul_error --rows 256 --config 128,128,64,4,8,1   # one tile config against the default

Per (kind, N, K) and rows M: the largest and mean error against the product in fp64, each over its row's largest
|exact| (rows spread over 1e-3..1e1 in scale), and the kernel time (triton.testing.do_bench, median). A GPU's
tensor cores accumulate an MMA's products into its running sum less exactly than fp32 FMAs; promoted, each BLOCK_K
chunk is summed from zero and added in fp32 (kernels/skinny_matmul.py PROMOTE_PARTIALS). Needs a CUDA GPU.
"""
import argparse
import json
import sys

import torch

from client import cli
from kernels.skinny_matmul import default_config, skinny_matmul, split_fp16

PROG = "scripts/matmul_error.py"
# The engine's fp32 products (full preset): RetNet's fused q/k/v/g, o_proj, fc1 and fc2 / input_down; the mixed
# product whose first 8,192 rows are split (xLSTM's x_proj beside gate_proj)
SHAPES = (("fp32", 8192, 2048), ("fp32", 2048, 2048), ("fp32", 4096, 2048), ("fp32", 2048, 4096),
          ("fp32+fp16", 8448, 2048))
SPLIT_ROWS = 8192  # the mixed product's split rows


def errors(y, exact, rows):
    """(max, mean) over the first `rows` columns of |y - exact| / each row's largest |exact|."""
    err = ((y.double() - exact).abs() / exact.abs().amax(1, keepdim=True).clamp_min(1e-300))[:, :rows]
    return err.max().item(), err.mean().item()


def measure(shapes, row_counts, config=None, seed=0):
    import triton.testing

    g = torch.Generator(device="cuda").manual_seed(seed)
    result = []
    for kind, N, K in shapes:
        w = torch.randn(N, K, device="cuda", generator=g) / K**0.5
        hi, lo = split_fp16(w)
        split_rows = SPLIT_ROWS if kind == "fp32+fp16" else N
        weights = {"weight": hi, "weight_lo": lo[:split_rows].contiguous()}
        for M in row_counts:
            x = torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-3, 1, M, device="cuda")[:, None]
            exact = x.double() @ w.double().t()
            row = {"kind": kind, "N": N, "K": K, "M": M, "config": list(config or default_config(M, N, K, True))}
            for name, promote in (("unpromoted", False), ("promoted", True)):
                def product():
                    return skinny_matmul(x, **weights, config=config, promote=promote)
                row[name] = dict(zip(("max", "mean"), errors(product(), exact, split_rows)),
                                 us=triton.testing.do_bench(product, return_mode="median") * 1000)
            row["cublas"] = dict(zip(("max", "mean"), errors(x @ w.t(), exact, split_rows)),
                                 us=triton.testing.do_bench(lambda: x @ w.t(), return_mode="median") * 1000)
            result.append(row)
    return result


def table(result) -> str:
    lines = [f"{'kind':9s} {'N':>5s} {'K':>5s} {'M':>4s}  {'max error: unpromoted / promoted / cuBLAS':42s} "
             f"us: unpromoted / promoted / cuBLAS"]
    for r in result:
        u, p, c = r["unpromoted"], r["promoted"], r["cublas"]
        lines.append(f"{r['kind']:9s} {r['N']:5d} {r['K']:5d} {r['M']:4d}  "
                     f"{u['max']:.1e} / {p['max']:.1e} / {c['max']:.1e}{'':18s} "
                     f"{u['us']:.1f} / {p['us']:.1f} / {c['us']:.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=cli.positive_ints, default=[1, 64, 65, 128, 256, 384, 512],
                    help="rows M, comma list (default 1,64,65,128,256,384,512)")
    ap.add_argument("--config", type=cli.positive_ints,
                    help="BLOCK_M,BLOCK_N,BLOCK_K,num_stages,num_warps[,SPLIT_K] for every product instead of "
                         "kernels.skinny_matmul.default_config")
    ap.add_argument("--json", type=cli.output_file, help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise cli.CliError(f"needs a CUDA GPU (it measures the kernel's tensor-core sums), and this torch "
                           f"({torch.__version__}) sees none")
    torch.backends.cuda.matmul.allow_tf32 = False
    result = measure(SHAPES, args.rows, tuple(args.config) if args.config else None)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": result}, f, indent=1)
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))

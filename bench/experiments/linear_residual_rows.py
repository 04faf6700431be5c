"""Writes the "rows" experiment candidate (BENCHMARKS.md 10n; not adopted: equal in the H200 step,
with or without early reads): kernelsearch/kernels/linear_residual.py with a "rows" variant added,
to be searched as a candidate with `hwtune search linear_residual --source OUT`
(bench/experiments/rows_gpu.sh, rows_early_gpu.sh).

    python3 bench/experiments/linear_residual_rows.py OUT [--only-k1]

The variant: BLOCK_N whole weight rows a program (1, 2 or 4: BLOCK_N 1 and 2 join SPACE, for rows
only), all of K (its next power of two) in one load issued first, then each row of x in turn
against the tile in registers. BLOCK_K (1024 by convention), SPLIT_K, PIPE, REDUCE and num_stages
do not apply and take one value each. Tiles over ROWS_TILE_BYTES_PER_THREAD a thread are refused
at launch. CONFIGS gains K1-K5 at its head (SPACE order); --only-k1 keeps K1 alone (BLOCK_N 1,
4 warps). Every edit is a text replacement that must match the template exactly once, so a
changed template stops this script instead of producing something else.
"""
from __future__ import annotations

import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[2] / "kernelsearch" / "kernels" / "linear_residual.py"

ROWS_KERNEL = '@triton.jit\ndef _rows_kernel(x_ptr, w_ptr, r_ptr, ws_ptr, c_ptr, cnt_ptr, M, N, K, split_steps,\n                 s_xm, s_xk, s_wn, s_wk, s_rm, s_rn, s_cm, s_cn,\n                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):\n    # "rows": BLOCK_N whole weight rows a program, all of K (BLOCK_K = K\'s next power of two)\n    # in one load, issued first; then each row of x in turn against the tile in registers.\n    # (ws_ptr, cnt_ptr and split_steps: the other kernels\' signature, unused: one split.)\n    pid_n = tl.program_id(0)\n    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)\n    rk = tl.arange(0, BLOCK_K)\n    # Features past N re-read valid rows (wrap): the weight load is masked along K only.\n    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * s_wn + rk[None, :] * s_wk\n    if EVEN_K:\n        w = tl.load(w_ptrs, eviction_policy="evict_first")\n    else:\n        w = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0, eviction_policy="evict_first")\n    n_ok = rn < N\n    wf = w.to(tl.float32)\n    for m in range(0, M):\n        if EVEN_K:\n            x = tl.load(x_ptr + m * s_xm + rk * s_xk)\n        else:\n            x = tl.load(x_ptr + m * s_xm + rk * s_xk, mask=rk < K, other=0.0)\n        acc = tl.sum(wf * x.to(tl.float32)[None, :], axis=1)\n        res = tl.load(r_ptr + m * s_rm + rn * s_rn, mask=n_ok, other=0.0)\n        tl.store(c_ptr + m * s_cm + rn * s_cn, (acc + res.to(tl.float32)).to(c_ptr.dtype.element_ty),\n                 mask=n_ok)\n\n\n'

EDITS = [
    ('    "variant": ["gemv", "splitk", "swapab"],\n',
     '    "variant": ["gemv", "splitk", "swapab", "rows"],\n'),
    ('    "BLOCK_N": [4, 8, 16, 32, 64, 128],\n',
     '    "BLOCK_N": [1, 2, 4, 8, 16, 32, 64, 128],  # 1 and 2: rows only\n'),
    ("GEMV_MAX_ROWS = 8                      # gemv: BLOCK_M is a cap; more rows go to tl.dot (splitk)\n",
     "GEMV_MAX_ROWS = 8                      # gemv: BLOCK_M is a cap; more rows go to tl.dot (splitk)\n"
     "ROWS_TILE_BYTES_PER_THREAD = 256       # rows: the weight tile a thread holds (bf16 K=4096, 1 row,\n"
     "                                       # 4 warps: 64); larger tiles are refused at launch\n"),
    ('def _valid(p: dict) -> bool:\n    if p["variant"] == "gemv":\n',
     'def _valid(p: dict) -> bool:\n'
     '    if p["variant"] == "rows":\n'
     '        # K is taken whole: BLOCK_K (1024 by convention), SPLIT_K, PIPE, REDUCE and num_stages\n'
     '        # do not apply and take one value each, so that each tile is one point of SPACE\n'
     '        return (p["BLOCK_N"] <= 4 and p["BLOCK_K"] == 1024 and p["BLOCK_M"] == GEMV_MAX_ROWS\n'
     '                and p["SPLIT_K"] == 1 and p["UNROLL"] == 1 and not p["PIPE"]\n'
     '                and p["REDUCE"] == "last" and p["num_stages"] == 2)\n'
     '    if p["BLOCK_N"] < 4:  # 1 and 2 are rows tiles\n'
     '        return False\n'
     '    if p["variant"] == "gemv":\n'),
    ("CONFIGS = [\n    # batch 1-8: the GEMV (rows per program = next power of two of M, at most 8)\n",
     "CONFIGS = [\n"
     "    # batch 1-8: whole weight rows a program, K in one load\n"
     '    _cfg("rows", 8, 1, 1024, 1, 4, 2),                          # K1\n'
     '    _cfg("rows", 8, 1, 1024, 1, 8, 2),                          # K2\n'
     '    _cfg("rows", 8, 2, 1024, 1, 4, 2),                          # K3\n'
     '    _cfg("rows", 8, 2, 1024, 1, 8, 2),                          # K4\n'
     '    _cfg("rows", 8, 4, 1024, 1, 8, 2),                          # K5\n'
     "    # batch 1-8: the GEMV (rows per program = next power of two of M, at most 8)\n"),
    ('@triton.jit(do_not_specialize=["split_steps"])\ndef _splitk_kernel(',
     ROWS_KERNEL + '@triton.jit(do_not_specialize=["split_steps"])\ndef _splitk_kernel('),
    ('    if variant not in ("gemv", "splitk", "swapab"):',
     '    if variant not in ("gemv", "splitk", "swapab", "rows"):'),
    ("    cnt = _arrival_counters(x.device, grid[0] * grid[2]) if last else ws\n"
     "    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), residual.stride(0),\n"
     "               residual.stride(1), out.stride(0), out.stride(1))\n",
     "    cnt = _arrival_counters(x.device, grid[0] * grid[2]) if last else ws\n"),
    ("    even_k = K % BLOCK_K == 0\n    rows = triton.next_power_of_2(M)\n",
     "    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), residual.stride(0),\n"
     "               residual.stride(1), out.stride(0), out.stride(1))\n"
     '    if variant == "rows":\n'
     "        # BLOCK_K, SPLIT_K, REDUCE, PIPE, num_stages: unused (K whole, one split, no loop to pipe)\n"
     "        block_k = triton.next_power_of_2(K)\n"
     "        if BLOCK_N * block_k * 2 > ROWS_TILE_BYTES_PER_THREAD * 32 * num_warps:\n"
     '            raise ValueError(f"linear_residual rows: a {BLOCK_N} x {block_k} weight tile is more than "\n'
     '                             f"{ROWS_TILE_BYTES_PER_THREAD} bytes a thread at {num_warps} warps")\n'
     "        _rows_kernel[(triton.cdiv(N, BLOCK_N),)](x, weight, residual, out, out, out, M, N, K, 1,\n"
     "                                                 *strides, BLOCK_N=BLOCK_N, BLOCK_K=block_k,\n"
     "                                                 EVEN_K=block_k == K, num_warps=num_warps,\n"
     "                                                 num_stages=1)\n"
     "        return out\n"
     "    even_k = K % BLOCK_K == 0\n    rows = triton.next_power_of_2(M)\n"),
]


def candidate(only_k1: bool = False) -> str:
    text = TEMPLATE.read_text()
    for old, new in EDITS:
        if text.count(old) != 1:
            raise SystemExit(f"{TEMPLATE} changed: {old[:60]!r} is not there exactly once")
        text = text.replace(old, new)
    if only_k1:
        text += '\nCONFIGS = [p for p in CONFIGS if p["variant"] == "rows" and p["BLOCK_N"] == 1 and p["num_warps"] == 4]\n'
    return text


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--only-k1"):
        raise SystemExit(__doc__.strip().splitlines()[5].strip())
    Path(sys.argv[1]).write_text(candidate(len(sys.argv) == 3))

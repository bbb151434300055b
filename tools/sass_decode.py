"""Static SASS counts of the quantized decode variants for sm_90, compiled here without a GPU.

`python tools/sass_decode.py VARIANT [BLOCK_N WARPS STAGES]` (run from the repo root with the
venv's python) compiles triton_decode_quant_fast's kernel for the 8B shape (GQA 4, head_dim
128, block 16, 8 KV heads, unsplit) and prints the instruction mix of the key loop: warp
instructions per byte of K/V read, and the opcodes that dominate. The counts only rank; the
device measures (docs/gpu-notes.md).
"""
from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvyard.workers.attention import triton_decode_quant_fast as fast  # noqa: E402

ARGS = ["q_ptr", "k_ptr", "v_ptr", "kf_ptr", "vf_ptr", "bt_ptr", "lens_ptr", "o_ptr", "part_ptr", "lse_ptr",
        "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_bt", "stride_wb", "stride_wt", "stride_wh",
        "stride_pb", "stride_ph", "stride_lb", "stride_lh", "scale_log2"]
DIV16 = {"q_ptr", "k_ptr", "v_ptr", "kf_ptr", "vf_ptr", "bt_ptr", "lens_ptr", "o_ptr", "part_ptr", "lse_ptr",
         "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_bt", "stride_wb", "stride_pb", "stride_ph"}


def compile_variant(variant: str, block_n: int, warps: int, stages: int) -> str:
    kernel = fast._KERNELS.get(variant) or fast.decode_quant_kernel
    words = variant in ("asm", "win", "words")
    types = {"q_ptr": "*bf16", "k_ptr": "*i32" if words else "*u8", "v_ptr": "*i32" if words else "*u8",
             "kf_ptr": "*i32" if words else "*fp32", "vf_ptr": "*i32" if words else "*fp32", "bt_ptr": "*i32",
             "lens_ptr": "*i32", "o_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "scale_log2": "fp32"}
    names = list(kernel.arg_names)
    const = dict(G=4, GP=16, HD=128, BS=16, BLOCK_N=block_n, NUM_SPLITS=1, PREC="tf32", FMT=2, F16=True,
                 VM=512.0, ASM=True)
    if "TRANS" in names:
        const["TRANS"] = variant == "bytes_t"
    sig = {n: (types.get(n, "i32") if n not in const else "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_body(sass: str) -> list[str]:
    """The instructions of the largest backward branch's body (the key loop)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    best = (0, 0)
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ln)
        t = re.search(r"\.L_x_(\d+)", ln)
        if "BRA" in ln and m:
            target = int(m.group(1), 16) if m.group(1) else None
            if target is None and t:
                lab = f".L_x_{t.group(1)}:"
                j = next((k for k, l2 in enumerate(sass.splitlines()) if l2.strip().startswith(lab)), None)
                target = None
            if target is not None and target < addr[i] and i - addr.index(target) > best[1] - best[0]:
                best = (addr.index(target), i)
    return lines[best[0]:best[1] + 1]


def main() -> None:
    variant = sys.argv[1]
    block_n, warps, stages = (int(x) for x in (sys.argv[2:5] if len(sys.argv) > 4 else (64, 4, 2)))
    sass = compile_variant(variant, block_n, warps, stages)
    body = loop_body(sass)
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)?)", ln).group(1)
                              for ln in body if re.search(r"\*/\s+(?:@!?U?P\w+\s+)?[A-Z]", ln))
    nbytes = 2 * block_n * (128 + 4)
    n = sum(ops.values())
    print(f"{variant} BLOCK_N={block_n} warps={warps} stages={stages}: loop {n} instructions, "
          f"{n * warps / nbytes:.3f} warp instructions per byte")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common(18)))


if __name__ == "__main__":
    main()

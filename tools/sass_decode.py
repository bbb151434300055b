"""Static SASS counts of the quantized decode kernels for sm_90, compiled here without a GPU.

`python tools/sass_decode.py VARIANT [BLOCK_N WARPS STAGES]` (repo root, the venv's python)
compiles one decode kernel for the 8B shape (GQA 4, head_dim 128, block 16, unsplit, bf16 q)
and prints the key loop's instruction mix: warp instructions per byte of K/V read and the
opcodes that dominate. VARIANT: a scaled-format kernel of triton_decode_quant_fast (words,
asm, bytes, bytes_t, win), `bf16` (triton_decode's own), `bare-bytes`, `bare-words`,
`bare-mixed` (fp8_e4m3's, triton_decode_bare) or `gluon` (its Gluon kernel, gluon_decode_bare).
The counts only rank; the device measures (docs/gpu-notes.md).
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
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvyard.workers.attention import triton_decode, triton_decode_bare  # noqa: E402
from kvyard.workers.attention import triton_decode_quant_fast as fast  # noqa: E402

SHAPE = dict(G=4, GP=16, HD=128, BS=16, NUM_SPLITS=1)
# strides and pointers that are multiples of 16 elements in the 8B layout (Triton's specialisation)
DIV16 = ("q_ptr", "k_ptr", "v_ptr", "kf_ptr", "vf_ptr", "kw_ptr", "vw_ptr", "bt_ptr", "lens_ptr", "o_ptr",
         "part_ptr", "lse_ptr", "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_bt", "stride_wb",
         "stride_cb", "stride_ct", "stride_ch", "stride_pb", "stride_ph")


def kernel_for(variant: str) -> tuple[object, dict, dict, int]:
    """(kernel, pointer types, constexprs, bytes a key row of K or V takes)."""
    ptr = {"q_ptr": "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*bf16", "part_ptr": "*fp32",
           "lse_ptr": "*fp32", "scale_log2": "fp32"}
    if variant == "bf16":
        ptr.update(k_ptr="*bf16", v_ptr="*bf16", kf_ptr="*fp32", vf_ptr="*fp32")
        return triton_decode._decode_kernel, ptr, dict(PREC="tf32", FMT=0), 256
    if variant == "gluon":
        from kvyard.workers.attention import gluon_decode_bare
        ptr.update(k_ptr="*u8", v_ptr="*u8")
        return gluon_decode_bare.decode_bare_gluon_kernel, ptr, {"STAGES": None}, 128   # None: the STAGES argument
    if variant.startswith("bare-"):
        ptr.update(k_ptr="*u8", v_ptr="*u8", kw_ptr="*i32", vw_ptr="*i32")
        name = variant.removeprefix("bare-")
        return (triton_decode_bare.decode_bare_kernel, ptr,
                dict(PREC="tf32", F16=True, ASM=True, ALIGNED=True, WORDS=triton_decode_bare.VARIANTS[name]), 128)
    words = variant in ("asm", "win", "words")
    t = "*i32" if words else "*u8"
    ptr.update(k_ptr=t, v_ptr=t, kf_ptr="*i32" if words else "*fp32", vf_ptr="*i32" if words else "*fp32")
    const = dict(PREC="tf32", FMT=2, F16=True, VM=512.0, ASM=True)
    kernel = fast._KERNELS.get(variant) or fast.decode_quant_kernel
    if "TRANS" in kernel.arg_names:
        const["TRANS"] = variant == "bytes_t"
    return kernel, ptr, const, 132


def compile_sass(variant: str, block_n: int, warps: int, stages: int) -> tuple[str, int]:
    kernel, ptr, const, row = kernel_for(variant)
    names = list(kernel.arg_names)
    const = {k: stages if v is None else v for k, v in {**SHAPE, "BLOCK_N": block_n, **const}.items() if k in names}
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in names}
    source = GluonASTSource if variant == "gluon" else ASTSource
    c = triton.compile(source(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout, row


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the key loop)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    where = {a: i for i, a in enumerate(addr)}
    best = (0, -1)
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", ln)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < addr[i] and target in where and i - where[target] > best[1] - best[0]:
            best = (where[target], i)
    return lines[best[0]:best[1] + 1]


def opcodes(body: list[str]) -> collections.Counter:
    pat = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)?)")
    return collections.Counter(m.group(1) for m in map(pat.search, body) if m)


def main() -> None:
    variant = sys.argv[1]
    block_n, warps, stages = (int(x) for x in (sys.argv[2:5] if len(sys.argv) > 4 else (64, 4, 2)))
    sass, row = compile_sass(variant, block_n, warps, stages)
    ops = opcodes(loop_body(sass))
    n = sum(ops.values())
    print(f"{variant} BLOCK_N={block_n} warps={warps} stages={stages}: loop {n} instructions, "
          f"{n * warps / (2 * block_n * row):.3f} warp instructions per byte")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common(18)))


if __name__ == "__main__":
    main()

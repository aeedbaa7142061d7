"""Compile the kernels for a GPU target without a GPU: every launch configuration class the backend uses.

``python -m kvpage.ops.backends.triton.aot [--arch 90]`` (``TRITON_INTERPRET`` unset) runs Triton's whole
pipeline down to a cubin with the ``ptxas`` its wheel ships, so an error that only the GPU compiler sees (a
type, a layout, an op the interpreter tolerates) shows up on a CPU-only machine. It does not run anything:
numbers come from the interpreter tests and, on a GPU, from the device check. Imports triton.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvpage.formats import get_format
from kvpage.formats.kivi import SealedFormat, value_group_size
from kvpage.ops.backends.triton import paged_attention, seal, sealed_attention, write
from kvpage.ops.backends.triton.step import BLOCK_N, num_warps, tile_shape

# storage pointer type per encoding (.codes: float32, bfloat16 bits, float16, int8, e4m3)
_KV_PTR = {0: "*fp32", 1: "*i16", 2: "*fp16", 3: "*u8", 4: "*u8"}
_ATTN_ARGS = {
    "out_ptr": "*fp32", "lse_ptr": "*fp32", "q_ptr": "*fp32", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
    "kc_ptr": "*fp32", "vc_ptr": "*fp32", "block_tables_ptr": "*i64", "seq_lens_ptr": "*i32",
    "qstart_ptr": "*i32", "items_ptr": "*i32", "num_tokens": "i32", "num_heads": "i32", "kv_heads": "i32",
    "head_dim": "i32", "block_size": "i32", "bt_stride": "i32", "sm_scale": "fp32", "softcap": "fp32",
    "window": "i32", "tiles_per_split": "i32",
}
_WRITE_ARGS = {"x_ptr": "*fp32", "slots_ptr": "*i64", "codes_ptr": "*u8", "scales_ptr": "*fp16",
               "chan_ptr": "*fp32", "num_rows": "i32", "kv_heads": "i32", "head_dim": "i32", "qmax": "fp32",
               "limit": "fp32"}


_SEALED_ARGS = {
    "out_ptr": "*fp32", "lse_ptr": "*fp32", "q_ptr": "*fp32", "k_ptr": "*u8", "ks_ptr": "*u8", "kz_ptr": "*i8",
    "v_ptr": "*u8", "vs_ptr": "*u8", "vz_ptr": "*i8", "sk_ptr": "*u8", "sks_ptr": "*fp16", "sv_ptr": "*u8",
    "svs_ptr": "*fp16", "kind_ptr": "*u8", "idx_ptr": "*i64", "sink_ptr": "*i64", "seq_lens_ptr": "*i32",
    "qstart_ptr": "*i32", "items_ptr": "*i32", "num_tokens": "i32", "num_heads": "i32", "kv_heads": "i32",
    "head_dim": "i32", "block_size": "i32", "src_stride": "i32", "sink_rows": "i32", "sm_scale": "fp32",
    "tiles_per_split": "i32",
}


_SEAL_ARGS = {"ids_ptr": "*i64", "codes_ptr": "*u8", "scale_ptr": "*u8", "zero_ptr": "*i8", "block_size": "i32",
              "kv_heads": "i32", "head_dim": "i32", "num_groups": "i32", "group_size": "i32", "packed": "i32",
              "qmax": "fp32", "max_error": "fp32"}
_UNSEAL_ARGS = {"out_ptr": "*fp32", "ids_ptr": "*i64", "codes_ptr": "*u8", "scale_ptr": "*u8", "zero_ptr": "*i8",
                "block_size": "i32", "kv_heads": "i32", "head_dim": "i32", "num_groups": "i32", "group_size": "i32"}


@dataclass(frozen=True)
class Build:
    """One compiled configuration: the kernel, its constexprs, the cubin's size and how long it took."""

    kernel: str
    config: dict[str, object]
    cubin_bytes: int
    seconds: float


def _compile(fn: object, args: dict[str, str], consts: dict[str, object], warps: int, arch: int,
             fp_fusion: bool = True) -> Build:
    signature = {**args, **{k: "constexpr" for k in consts}}
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "enable_fp_fusion": fp_fusion})
    return Build(getattr(fn, "__name__", str(fn)), consts, len(k.asm["cubin"]), time.perf_counter() - t0)


def configurations(full: bool) -> Iterator[tuple[int, int, int, int, int, bool]]:
    """``(encoding, scale source, head_dim, group, max query length, knobs)`` to compile: every encoding and scale
    source at head_dim 128 for decode and runs; with ``full`` also head_dim 64 and 256 and other GQA groups."""
    codecs = [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (3, 2), (4, 2)]
    dims = (64, 128, 256) if full else (128,)
    groups = (1, 4, 8) if full else (4,)
    for (enc, scale), d, g, qlen, knobs in itertools.product(codecs, dims, groups, (1, 16), (False, True)):
        yield enc, scale, d, g, qlen, knobs


def sealed_configurations(full: bool) -> Iterator[tuple[int, int, int, int, int, bool, bool]]:
    """``(bits, tail encoding, head_dim, group, max query length, split, has_value)`` of the int4/int2 kernel to
    compile: both bit widths and 16-bit tail encodings, decode and runs, split or not, at head_dim 128 and GQA 4
    (a key-only layer once); with ``full`` also head_dim 64 and 256 and GQA 1 and 8."""
    dims = (64, 128, 256) if full else (128,)
    groups = (1, 4, 8) if full else (4,)
    for bits, tail, d, g, qlen, split in itertools.product((4, 2), (1, 2), dims, groups, (1, 16), (False, True)):
        yield bits, tail, d, g, qlen, split, True
    yield 4, 1, 128, 4, 1, False, False


def seal_configurations(full: bool) -> Iterator[tuple[str, bool, int, int, int]]:
    """``(format, is key, head_dim, block_size, row encoding)`` of the seal kernel to compile: int4, int3 and int2
    (each with its own step search) for keys and values, head_dim 128, blocks of 32, bfloat16 rows; with ``full``
    also head_dim 64, 96 and 256, blocks of 16 and float32/float16 rows."""
    dims = (64, 96, 128, 256) if full else (128,)
    sizes = (16, 32) if full else (32,)
    encs = (0, 1, 2) if full else (1,)
    for name, key, d, bs, enc in itertools.product(("int4", "int3", "int2"), (True, False), dims, sizes, encs):
        yield name, key, d, bs, enc


def _seal_build(name: str, key: bool, d: int, bs: int, enc: int, arch: int) -> Build:
    fmt = get_format(name)
    assert isinstance(fmt, SealedFormat)
    per = 8 if fmt.bits == 3 else 8 // fmt.bits
    group = d if key else value_group_size(d)
    consts: dict[str, object] = dict(
        ENC=enc, IS_KEY=key, BITS=fmt.bits, LIMITED=fmt.max_error is not None, STEP_LO=fmt.step_search.start,
        NUM_STEPS=len(fmt.step_search), BLOCK_T=triton.next_power_of_2(bs),
        BLOCK_G=triton.next_power_of_2(d // group), BLOCK_W=triton.next_power_of_2(-(-group // per)), PER=per)
    args = {"x_ptr": _KV_PTR[enc], **_SEAL_ARGS}
    return _compile(seal._seal_blocks_kernel, args, consts, seal.seal_warps(bs, d), arch, fp_fusion=False)


def compile_all(arch: int = 90, *, full: bool = False) -> list[Build]:
    """Compile the attention kernel for :func:`configurations`, the int4/int2 kernel for
    :func:`sealed_configurations`, the seal kernel for :func:`seal_configurations` and the unseal kernel for each
    width and kind, the write kernel for each 8-bit code and scale source, and the split merge, for ``sm_{arch}``.

    Raises:
        triton.CompilationError (or another error of Triton's pipeline): a configuration does not compile.
    """
    builds = []
    for enc, scale, d, g, qlen, knobs in configurations(full):
        block_q, block_m = tile_shape(g, qlen, d)
        consts: dict[str, object] = dict(
            GROUP=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(d),
            ENC=enc, SCALE=scale, HAS_WINDOW=knobs, HAS_CAP=knobs, SPLIT=knobs)
        args = {**_ATTN_ARGS, "k_ptr": _KV_PTR[enc], "v_ptr": _KV_PTR[enc]}
        builds.append(_compile(paged_attention._paged_attention_kernel, args, consts, num_warps(block_m, d), arch))
    for bits, tail, d, g, qlen, split, has_value in sealed_configurations(full):
        block_q, block_m = tile_shape(g, qlen, d)
        gs = value_group_size(d)
        consts = dict(GROUP=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(d),
                      BITS=bits, PACKED=-(-d * bits // 8), GROUPS=d // gs, GROUP_SIZE=gs, TAIL_ENC=tail,
                      HAS_VALUE=has_value, SPLIT=split)
        args = {**_SEALED_ARGS, "tk_ptr": _KV_PTR[tail], "tv_ptr": _KV_PTR[tail]}
        builds.append(_compile(sealed_attention._sealed_attention_kernel, args, consts, num_warps(block_m, d), arch))
    for enc, scale in ((3, 1), (4, 1), (3, 2), (4, 2)):
        builds.append(_compile(write._write_rows_kernel, _WRITE_ARGS,
                               dict(ENC=enc, SCALE=scale, BLOCK_R=write.ROWS_PER_PROGRAM, BLOCK_D=128), 4, arch))
    for name, key, d, bs, enc in seal_configurations(full):
        builds.append(_seal_build(name, key, d, bs, enc, arch))
    for bits, key in itertools.product((4, 3, 2), (True, False)):
        consts = dict(IS_KEY=key, BITS=bits, PACKED=-(-128 * bits // 8), BLOCK_T=16, BLOCK_D=128)
        builds.append(_compile(seal._unseal_blocks_kernel, _UNSEAL_ARGS, consts, 4, arch))
    merge_args = {"out_ptr": "*fp32", "part_ptr": "*fp32", "lse_ptr": "*fp32", "rows": "i32", "head_dim": "i32",
                  "num_splits": "i32"}
    builds.append(_compile(paged_attention._merge_splits_kernel, merge_args, dict(BLOCK_R=16, BLOCK_D=128), 4, arch))
    return builds


def main(argv: list[str] | None = None) -> int:
    """Command line: compile and print one line per configuration; exit status 0 when all compiled."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90 (H100/H200)")
    p.add_argument("--full", action="store_true", help="every head_dim and GQA group, not only head_dim 128")
    a = p.parse_args(argv)
    for b in compile_all(a.arch, full=a.full):
        print(f"{b.kernel} {b.config} cubin {b.cubin_bytes} B {b.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

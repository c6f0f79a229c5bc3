"""The fused CPU kernels of `csrc/decode_ops.c` and Tercel's integer matmuls (`csrc/q4_matmul.c`
for int4 weights, `csrc/q4k_matmul.c` for Q4_K blocks, `csrc/q8_matmul.c` for 5-, 6- and 8-bit
ones), built on first use into one library and called through ctypes.

The library is compiled for the machine it runs on (`cc -O3 -march=native`, or the ISA
cap's of `verifier.cpu.machine`; under half a second) into the Tercel cache, keyed by the source,
the compiler and the CPU's flags, and loaded after torch so that its OpenMP calls share torch's runtime (the same libgomp, the
same threads). Without a C compiler `available()` is False and the quantized target is not
offered (see `verifier.quantized.quantize`).

Every wrapper takes contiguous CPU tensors of the dtypes its comment names; bf16 data is
passed as its bit pattern.
"""
from __future__ import annotations

import ctypes
import hashlib
from array import array
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from verifier.cpu.cache import cache_root
from verifier.cpu.machine import cache_bytes, machine_key, march

log = logging.getLogger("tercel.cpu_ops")
CSRC = Path(__file__).parent / "csrc"      # the C/C++ sources, compiled on first use
DECODE_OPS, Q4_MATMUL, Q8_MATMUL, Q4K_MATMUL, MIXED_MATMUL, DRAFT_LAYER, REPACK, LORA = SOURCES = [
    CSRC / "decode_ops.c", CSRC / "q4_matmul.c", CSRC / "q8_matmul.c", CSRC / "q4k_matmul.c", CSRC / "mixed_matmul.c",
    CSRC / "draft_layer.c", CSRC / "repack.c", CSRC / "lora.c"]
INTEGER_MATMULS = [Q4_MATMUL, Q8_MATMUL, Q4K_MATMUL, MIXED_MATMUL]   # one runner (mixed_matmul.c) over the layouts' tiles
# included by the sources: part of the library's cache key
HEADERS = [CSRC / "bf16.h", CSRC / "act_quant.h", CSRC / "q4_nibbles.h", CSRC / "attention_tiles.h"]


def sources_digest(paths: list[Path] | None = None) -> str:
    """The kernels' sources as a timing's cache key (a timing taken on other kernels is stale):
    `paths`, or every C/C++ source and header."""
    paths = paths or sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".cpp", ".h"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in paths)).hexdigest()[:16]


FLAGS = ["-O3", f"-march={march()}", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "repack_q4x16": [_P, _I, _I, _I, _P],
    "repack_q4k": [_P, _I, _I, _P],
    "repack_q6k": [_P, _I, _I, _I, _I, _P],
    "q6k_fits_5_bits": [_P, _I, _I],
    "unpack_q6k": [_P, _I, _I, _P, _P],
    "scan_int4_from_int8": [_P, _P, _I, _I, _I, _P],
    "unpack_q4k_table": [_P, _I, _I, _P, _P, _P, _P, _P],
    "add_rms_norm": [_P, _P, _P, _F, _I, _I, _P],
    "rms_norm_rows": [_P, _P, _P, _F, _I, _I, _P],
    "silu_mul": [_P, _I, _I, _P],
    "gelu_tanh_mul": [_P, _I, _I, _P],
    "soft_cap_f32": [_P, _I, _F],
    "scan_topk": [_P, _I, _I, _I, _P, _P],
    "embed_int8": [_P, _I, _P, _P, _I, _I, _P],
    "rescore_int8": [_P, _P, _P, _P, _I, _I, _I, _I, _P, _I],
    "rope_store": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P],
    "rows_per_unit": [_I],
    "row_lists": [_I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P],
    "attend": [_P, _P, _P, _P, _P, _P],
    "attention_tiles": [],
    "attention": [_P, _P, _P, _P, _P, _P, _P, _P],
    "prefetch_kv": [_P, _P, _P, _P],
    "flush_lines": [_P, _I],
    "lora_add": [_P, _P, _P, _I, _I, _I, _P],
    "argmax_f32": [_P, _I],
    "apply_bitmask": [_P, _P, _I, _I],
    "q4_matmul": [_P, _I, _I, _P, _I, _P],
    "q4_matmul_ref": [_P, _I, _I, _P, _I, _P],
    "q4_isa": [],
    "q8_plane_masks": [],
    "q8_matmul": [_P, _I, _I, _I, _I, _P, _I, _P],
    "q8_matmul_ref": [_P, _I, _I, _I, _I, _P, _I, _P],
    "mixed_matmul": [_P, _P, _I, _I, _I, _P, _I, _P],
    "mixed_matmul_ref": [_P, _P, _I, _I, _I, _P, _I, _P],
    "draft_layer": [_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P, _P],
}
_RETURNS = {"flush_lines": _I, "lora_add": _I, "q6k_fits_5_bits": _I, "row_lists": _I, "attention_tiles": _I,
            "rows_per_unit": _I, "argmax_f32": _I,
            "q4_matmul": _I, "q4_matmul_ref": _I, "q4_isa": _I, "q8_plane_masks": _I, "q8_matmul": _I, "q8_matmul_ref": _I,
            "mixed_matmul": _I, "mixed_matmul_ref": _I, "draft_layer": _I}
PARALLEL_FROM = 1025        # attention's threads until a measurement says otherwise (Heads.parallel_from)
_lib: ctypes.CDLL | None = None
_tried = False
_error = ""                 # why the library is not there (the compiler's messages), once tried


def available() -> bool:
    return _library() is not None


def build_error() -> str:
    """Why the kernels did not build ("" where they did or were not tried)."""
    return _error


def _library() -> ctypes.CDLL | None:
    global _lib, _tried, _error
    if not _tried:
        _tried = True
        try:
            _lib = _load(_build())
        except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
            _error = f"{e}\n{(getattr(e, 'stderr', None) or b'').decode(errors='replace')}"
            log.warning("the fused CPU kernels could not be built (%s); quantized CPU weights are off", e)
    return _lib


def _build() -> Path:
    return compile_library(SOURCES, [*FLAGS, "-lm"], ("CC", "cc", "gcc"), headers=HEADERS)


def compile_library(sources: list[Path], args: list[str], compilers: tuple[str, ...], salt: str = "",
                    headers: list[Path] = ()) -> Path:
    """`sources` compiled into one shared library in the Tercel cache, once per (sources and the
    `headers` they include, `args`, compiler version, CPU flags, `salt`). `compilers`: an
    environment variable naming one, then the names to look for on PATH. FileNotFoundError
    without one; CalledProcessError if it fails."""
    env, *names = compilers
    cc = os.environ.get(env) or next(filter(None, map(shutil.which, names)), None)
    if cc is None:
        raise FileNotFoundError(f"no compiler ({' or '.join(names)}) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *headers]) + " ".join(args).encode()
                         + version.encode() + machine_key()["flags"].encode() + salt.encode()).hexdigest()[:16]
    out = cache_root() / "cpu_kernels" / f"{sources[0].stem}-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        subprocess.run([cc, *map(str, sources), "-o", str(tmp), *args], check=True, capture_output=True)
        tmp.replace(out)
    return out


def _load(path: Path, strict: bool = True) -> ctypes.CDLL:
    """The library at `path` with its functions' signatures set; `strict` False skips functions
    it does not have (an older revision's, loaded by bench/attention_kernel.py)."""
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        if not strict and not hasattr(lib, name):
            continue
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = _RETURNS.get(name)
    return lib


class Heads(ctypes.Structure):
    """A model's attention heads as the kernels read them (`Heads` in decode_ops.c); it
    keeps the rope tables it points to alive (`keep`). `parallel_from`: the work (rows x
    longest key list x query heads) from which attention runs on all threads; the kernels read
    it at each call (`verifier.quantized.attention_tuning` sets it from a measurement). `prefetch_bytes`:
    how much of a layer's KV `prefetch_kv` requests ahead of its attention (a quarter of L2: the
    qkv weights stream through the rest meanwhile; 0 where the system does not say). `softcap`:
    scores soft-capped at it where > 0 (Gemma 2)."""
    _fields_ = [("nh", _I), ("nkv", _I), ("d", _I), ("scale", _F), ("cos", _P), ("sin", _P),
                ("parallel_from", _I), ("prefetch_bytes", _I), ("softcap", _F)]


class Rows(ctypes.Structure):
    """One forward's rows as the kernels read them (`Rows` in decode_ops.c): int64 arrays of
    each row's RoPE position, the KV slot it writes, its key count and where its key list
    starts in `keys` (KV slots in logical order), and each unit's first row and row count (a
    unit: rows of one sequence attended together). It keeps the array it points into alive
    (`keep`). Built by `verifier.quantized.cpu_forward.row_plan`."""
    _fields_ = [("rows", _I), ("units", _I), ("longest", _I), ("pos", _P), ("slot", _P), ("count", _P),
                ("start", _P), ("keys", _P), ("unit_first", _P), ("unit_width", _P), ("tiles", _I)]


def heads(nh: int, nkv: int, d: int, scale: float, cos: torch.Tensor, sin_signed: torch.Tensor,
          softcap: float = 0.0) -> Heads:
    hd = Heads(nh, nkv, d, scale, cos.data_ptr(), sin_signed.data_ptr(), PARALLEL_FROM, cache_bytes(2) // 4,
               softcap)
    hd.keep = (cos, sin_signed)
    return hd


class LoraSegment(ctypes.Structure):
    """One part of a projection's LoRA pair (`LoraSegment` in csrc/lora.c): output columns
    [off, off + n) get (x A^T) B^T; a [rank, K], bt [rank, n] (B^T, scaled), fp32 or bf16."""
    _fields_ = [("rank", _I), ("off", _I), ("n", _I), ("a", _P), ("bt", _P)]


class LoraTable(ctypes.Structure):
    """One projection's adapters (`LoraTable` in csrc/lora.c): slot s's segments are
    segs[first[s - 1] .. first[s]). It keeps the arrays and tensors it points into alive (`keep`)."""
    _fields_ = [("segs", _P), ("first", _P), ("slots", _I), ("bf16", _I)]


def lora_table(per_slot: list[list[tuple[int, torch.Tensor, torch.Tensor]]], dtype: torch.dtype) -> LoraTable:
    """A table from, per slot 1.., its segments (off, a [rank, K], bt [rank, n]), held in `dtype`
    (torch.float32 or torch.bfloat16)."""
    flat = [(off, a.to(dtype).contiguous(), bt.to(dtype).contiguous()) for segs in per_slot for off, a, bt in segs]
    segs = (LoraSegment * max(1, len(flat)))(*(LoraSegment(a.shape[0], off, bt.shape[1], a.data_ptr(), bt.data_ptr())
                                               for off, a, bt in flat))
    first = array("q", [0])
    for s in per_slot:
        first.append(first[-1] + len(s))
    table = LoraTable(ctypes.addressof(segs), first.buffer_info()[0], len(per_slot), int(dtype == torch.bfloat16))
    table.keep = (segs, first, flat)
    return table


def lora_add(table: LoraTable, slots: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """y bf16 [T, N] += each row's adapter's product over x bf16 [T, K] (`slots` int64 [T]), in place."""
    if _library().lora_add(ctypes.byref(table), slots.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], y.shape[1],
                           y.data_ptr()):
        raise MemoryError("lora_add: out of memory")


def can_flush() -> bool:
    """Whether this build pushes lines out of the caches (`flush`): x86-64."""
    return bool(_library().flush_lines(None, 0))


def flush(t: torch.Tensor) -> None:
    """Push a contiguous tensor's bytes out of every cache level (where `can_flush`)."""
    _library().flush_lines(t.data_ptr(), t.numel() * t.element_size())


def prefetch_kv(hd: Heads, rows: Rows, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Request from memory the K and V rows one layer's attention over `rows` reads (up to
    hd.prefetch_bytes), before the layer's first matmul; changes no result."""
    _library().prefetch_kv(ctypes.byref(hd), ctypes.byref(rows), k_cache.data_ptr(), v_cache.data_ptr())


def rows_per_unit(group: int) -> int:
    """Rows of one sequence attended together, for `group` query heads per KV head."""
    return _library().rows_per_unit(group)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None) -> None:
    """x fp32 [T, H] += y (bf16 [T, H], or None); out bf16 [T, H] = rms_norm(x) * w (None: skip)."""
    rows, h = x.shape
    _library().add_rms_norm(x.data_ptr(), _ptr(y), w.data_ptr(), eps, rows, h, _ptr(out))


def rms_norm_rows(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 rms_norm(x[rows]) * w: x fp32 [T, H], rows int64 [N] -> [N, H]."""
    out = torch.empty(rows.shape[0], x.shape[1])
    _library().rms_norm_rows(x.data_ptr(), rows.data_ptr(), w.data_ptr(), eps, rows.shape[0], x.shape[1],
                             out.data_ptr())
    return out


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> None:
    """out bf16 [T, I] = silu(gate) * up for gu bf16 [T, 2I] = [gate | up]."""
    rows, inter = out.shape
    _library().silu_mul(gu.data_ptr(), rows, inter, out.data_ptr())


def gelu_tanh_mul(gu: torch.Tensor, out: torch.Tensor) -> None:
    """out bf16 [T, I] = gelu_tanh(gate) * up for gu bf16 [T, 2I] = [gate | up] (Gemma's GeGLU)."""
    rows, inter = out.shape
    _library().gelu_tanh_mul(gu.data_ptr(), rows, inter, out.data_ptr())


def soft_cap(x: torch.Tensor, cap: float) -> None:
    """x fp32 (contiguous) = cap * tanh(x / cap) in place, element by element; -inf stays -inf."""
    _library().soft_cap_f32(x.data_ptr(), x.numel(), cap)


def scan_topk(scan: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scan bf16 [M, V] (k <= 64, k <= V) -> (the same in fp32, int64 [M, k] the indices of each
    row's k largest entries, in no order)."""
    rows, v = scan.shape
    if not 0 < k <= min(64, v):             # the kernel keeps the k best in a 64-entry buffer
        raise ValueError(f"scan_topk takes 0 < k <= min(64, V), got k={k}, V={v}")
    out, top = torch.empty(rows, v), torch.empty(rows, k, dtype=torch.int64)
    _library().scan_topk(scan.data_ptr(), rows, v, k, out.data_ptr(), top.data_ptr())
    return out, top


def argmax(x: torch.Tensor) -> int | None:
    """The first index of the largest entry of x (fp32, contiguous, on the CPU), as
    torch.argmax; None where x holds a NaN."""
    i = _library().argmax_f32(x.data_ptr(), x.numel())
    return None if i < 0 else i


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """logits fp32 [N, V] (contiguous, CPU) = -inf where the int32 bitmasks [N, ceil(V / 32)]
    (contiguous) have a zero bit, in place."""
    _library().apply_bitmask(logits.data_ptr(), masks.data_ptr(), logits.shape[0], logits.shape[1])


def embed_int8(ids: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of the int8 table w = q * scale (q int8 [V, H], scale fp32
    [V, H / g]) -> fp32 [T, H]."""
    h = q.shape[1]
    out = torch.empty(ids.shape[0], h)
    _library().embed_int8(ids.data_ptr(), ids.shape[0], q.data_ptr(), scale.data_ptr(), h, h // scale.shape[1],
                          out.data_ptr())
    return out


def rescore_int8(x: torch.Tensor, top: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 logits: torch.Tensor) -> None:
    """logits[m, top[m, j]] = x[m] . w[top[m, j]] for the int8 table w = q * scale: x fp32 [M, H],
    top int64 [M, k], q int8 [V, H], scale fp32 [V, H / g] (H and g multiples of 8)."""
    (rows, k), (v, h) = top.shape, q.shape
    _library().rescore_int8(x.data_ptr(), top.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, k, h,
                            h // scale.shape[1], logits.data_ptr(), v)


def rope_store(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin_signed: torch.Tensor,
               positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               q: torch.Tensor) -> None:
    """q fp32 [T, NH, D] = rope(q heads of qkv); k (rotated) and v heads written into the bf16
    caches [.., NKV, D] at `slots` (int64 [T]). qkv bf16 [T, (NH + 2 NKV) D] (+ bias fp32);
    `positions` int64 [T] index the rope tables fp32 [P, D] (sin with its sign folded in)."""
    rows, nh, d = q.shape
    _library().rope_store(qkv.data_ptr(), _ptr(bias), cos.data_ptr(), sin_signed.data_ptr(), positions.data_ptr(),
                          slots.data_ptr(), rows, nh, k_cache.shape[-2], d, q.data_ptr(), k_cache.data_ptr(),
                          v_cache.data_ptr())


def row_lists(seqs: array, tables: array, masks: array, block_size: int, per_unit: int, out: array,
              rows: int) -> int:
    """Fill a forward's slots, key lists and units (see `row_lists` in decode_ops.c). seqs: int64
    [5, B] (each sequence's first row, new tokens, cached tokens, first entry in `tables`, first
    entry in `masks` or -1); tables int32; masks uint8; out int64 [6 T + keys] gets the rows'
    positions (left as they are), slots, key counts, list starts, the units' first rows and
    widths, then the key lists. Returns the units."""
    b, at, o = len(seqs) // 5, seqs.buffer_info()[0], out.buffer_info()[0]
    seq = [at + 8 * b * i for i in range(5)]
    pos, slot, count, start, first, width, keys = (o + 8 * rows * i for i in range(7))
    return _library().row_lists(b, seq[0], seq[1], seq[2], seq[3], tables.buffer_info()[0], seq[4],
                                masks.buffer_info()[0], block_size, per_unit, slot, count, start, keys, first, width)


def attend(hd: Heads, rows: Rows, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor) -> None:
    """out bf16 [T, NH * D] = attention of q fp32 [T, NH, D] over the bf16 caches [.., NKV, D]."""
    _library().attend(ctypes.byref(hd), ctypes.byref(rows), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      out.data_ptr())


def attention_tiles() -> bool:
    """Whether prompt rows' attention runs on AMX tiles here (`csrc/attention_tiles.h`: built
    for a CPU with AMX-BF16, and the kernel lets the process use them); else on vectors."""
    return bool(_library().attention_tiles())


def attention(hd: Heads, rows: Rows, qkv: torch.Tensor, bias: torch.Tensor | None, q_ws: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """One layer's attention from its qkv projection: `rope_store` into q_ws fp32 [T, NH, D]
    and the caches, then `attend` into out bf16 [T, NH * D]."""
    _library().attention(ctypes.byref(hd), ctypes.byref(rows), qkv.data_ptr(), _ptr(bias), q_ws.data_ptr(),
                         k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())


def q4_isa() -> int:
    """The instructions `q4_matmul` runs on in this build: 512 (AVX-512 VNNI), 256 (AVX2), or
    0 (the scalar reference: no faster than torch's kernel, so the engine does not offer it)."""
    return _library().q4_isa()


def q8_plane_masks() -> bool:
    """Whether `q8_matmul` reads the 5- and 6-bit layouts' higher bits as masks (AVX-512 builds)
    rather than planes (`verifier.quantized.own_kernels.q8x16.pack_q8`)."""
    return bool(_library().q8_plane_masks())


def q4_matmul(packed: torch.Tensor, n: int, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) @ W.T -> bf16 [M, n], for W as
    `verifier.quantized.own_kernels.q4x16.pack_q4` lays it out; `reference`: through the scalar
    code every path must match bit for bit."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"q4_matmul takes contiguous bf16 activations, got {x.dtype}, strides {x.stride()}")
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16)
    fn = _library().q4_matmul_ref if reference else _library().q4_matmul
    if fn(packed.data_ptr(), n, k, x.data_ptr(), m, out.data_ptr()):
        raise ValueError(f"q4_matmul takes K a multiple of 32 (got {k}), or ran out of memory")
    return out


def q8_matmul(packed: torch.Tensor, bits: int, group: int, n: int, x: torch.Tensor,
              reference: bool = False) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) @ W.T -> bf16 [M, n], for W of `bits` (5, 6 or 8) with a scale per
    `group` (16 or 32; 256: int8 scales per 16 under an fp16 d per 256, Q6_K's) weights as
    `verifier.quantized.own_kernels.q8x16.pack_q8` lays it out;
    `reference`: through the scalar code."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"q8_matmul takes contiguous bf16 activations, got {x.dtype}, strides {x.stride()}")
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16)
    fn = _library().q8_matmul_ref if reference else _library().q8_matmul
    if fn(packed.data_ptr(), bits, group, n, k, x.data_ptr(), m, out.data_ptr()):
        raise ValueError(f"q8_matmul takes K a multiple of 32 (got {k}), 5, 6 or 8 bits (got {bits}) and "
                         f"groups of 16, 32 or 256 (got {group}; K a multiple of 256 for 256), or ran out of memory")
    return out


def mixed_matmul(packed: torch.Tensor, parts: torch.Tensor, n: int, x: torch.Tensor,
                 reference: bool = False) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) @ W.T -> bf16 [M, n], for W whose row blocks sit in their own
    kernels' layouts one after another, `parts` int64 [P, 3] their (rows, bits, group)
    (`verifier.quantized.own_kernels.mixed.pack_parts`); `reference`: through the scalar code."""
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"mixed_matmul takes contiguous bf16 activations, got {x.dtype}, strides {x.stride()}")
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16)
    fn = _library().mixed_matmul_ref if reference else _library().mixed_matmul
    if fn(packed.data_ptr(), parts.data_ptr(), parts.shape[0], n, k, x.data_ptr(), m, out.data_ptr()):
        raise ValueError(f"mixed_matmul takes K a multiple of 32 (got {k}) and up to 8 parts of 4, 5, 6 or 8 "
                         f"bits (K a multiple of 256 for 4 bits in groups of 256) whose rows add up to {n} "
                         f"(got {parts.tolist()}), or ran out of memory")
    return out


def _rows(address: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows' addresses, rows, blocks or super-blocks per row, out) as csrc/repack.c takes them."""
    return address.data_ptr(), address.shape[0], out.shape[1], out.data_ptr()


def repack_q4x16(address: torch.Tensor, affine: bool, out: torch.Tensor) -> None:
    """Q4_0 (`affine` False) or Q4_1 rows at `address` (int64 [N]) -> out uint8 [ceil(N / 16), K / 32, 320]
    in q4x16's layout (`verifier.quantized.own_kernels.from_file`)."""
    at, rows, blocks, o = _rows(address, out)
    _library().repack_q4x16(at, rows, blocks, int(affine), o)


def repack_q4k(address: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K rows at `address` (int64 [N]) -> out uint8 [ceil(N / 16), K / 256, 2368] in q4k's layout."""
    at, rows, supers, o = _rows(address, out)
    _library().repack_q4k(at, rows, supers, o)


def q6k_fits_5_bits(address: torch.Tensor, supers: int) -> bool:
    """Whether every weight of the Q6_K rows at `address` (int64 [N], `supers` super-blocks each) fits 5 bits."""
    return bool(_library().q6k_fits_5_bits(address.data_ptr(), address.shape[0], supers))


def repack_q6k(address: torch.Tensor, bits: int, masks: bool, out: torch.Tensor) -> None:
    """Q6_K rows at `address` (int64 [N]) -> out uint8 [ceil(N / 16), K / 256, 32 + 8 (288 + 64 (bits - 4))]
    in q8x16's layout of `bits` (5 or 6) with Q6_K's own scales, its higher bits as `masks` or planes."""
    at, rows, supers, o = _rows(address, out)
    _library().repack_q6k(at, rows, supers, bits, int(masks), o)


def unpack_q6k(address: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows at `address` (int64 [N]) -> (q int8 [N, cols], scale fp32 [N, cols / 16]): the int8 form."""
    rows = address.shape[0]
    q, scale = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, cols // 16)
    _library().unpack_q6k(address.data_ptr(), rows, cols // 256, q.data_ptr(), scale.data_ptr())
    return q, scale


def unpack_q4k_table(address: torch.Tensor, cols: int) -> dict[str, torch.Tensor]:
    """Q4_K rows at `address` (int64 [N]) -> an embedding table's fields (`QuantEmbedding` over
    `Int4KWeight`): q uint8 [N, cols / 2] two to a byte in weight order, sc and mn uint8
    [N, cols / 32], d and dmin fp32 [N, cols / 256]."""
    rows, supers = address.shape[0], cols // 256
    out = {"q": torch.empty(rows, cols // 2, dtype=torch.uint8), "sc": torch.empty(rows, 8 * supers, dtype=torch.uint8),
           "mn": torch.empty(rows, 8 * supers, dtype=torch.uint8), "d": torch.empty(rows, supers),
           "dmin": torch.empty(rows, supers)}
    _library().unpack_q4k_table(address.data_ptr(), rows, supers, *(out[f].data_ptr() for f in ("q", "sc", "mn", "d",
                                                                                                 "dmin")))
    return out


def scan_int4_from_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 table (q int8 [N, K], scale fp32 [N, K / g], g 16 or 32, contiguous) requantized
    to int4 groups of 32 (`quantize_int4`'s bits) in q4x16's layout: uint8 [ceil(N / 16), K / 32, 320]."""
    (rows, cols), group = q.shape, q.shape[1] // scale.shape[1]
    out = torch.empty(-(-rows // 16), cols // 32, 320, dtype=torch.uint8)
    _library().scan_int4_from_int8(q.data_ptr(), scale.data_ptr(), rows, cols, group, out.data_ptr())
    return out


class DraftLayer(ctypes.Structure):
    """An EAGLE-3 head's decoder layer as csrc/draft_layer.c reads it: its sizes, flags and rope
    table length, its norms' fp32 weights, its projections packed for q8_matmul (8 bits, groups
    of 32), its rope tables. The caller keeps the tensors alive."""
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("norm_before_residual", _I), ("norm_output", _I), ("positions", _I), ("eps", _F),
                ("hidden_norm", _P), ("input_norm", _P), ("post_norm", _P), ("final_norm", _P),
                ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P), ("cos_tab", _P), ("sin_tab", _P)]


def draft_layer(layer: DraftLayer, emb: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor,
                kc: torch.Tensor, vc: torch.Tensor, ctx: int, kt: torch.Tensor, vt: torch.Tensor, ntmp: int,
                mask: torch.Tensor) -> torch.Tensor:
    """The layer over T rows -> fp32 [T, H]: emb, hid fp32 [T, H]; pos int64 [T]; context K/V fp32
    [>= ctx, NKV, D], every slot seen; tree K/V fp32 [>= ntmp, NKV, D], slot j seen where mask
    uint8 [T, ntmp] is 1; the rows' own keys and values go to tree slots [ntmp - T, ntmp)."""
    out = torch.empty_like(emb)
    rc = _library().draft_layer(ctypes.byref(layer), emb.shape[0], emb.data_ptr(), hid.data_ptr(), pos.data_ptr(),
                                kc.data_ptr(), vc.data_ptr(), ctx, kt.data_ptr(), vt.data_ptr(), ntmp,
                                mask.data_ptr(), out.data_ptr())
    if rc == 3:
        raise IndexError(f"a position of {pos.tolist()} is past the rope tables' {layer.positions}")
    if rc:
        raise MemoryError("draft_layer ran out of memory") if rc == 1 else ValueError(
            "draft_layer's projections must be 8-bit int8 groups of 32 with widths a multiple of 32")
    return out

"""The decoder layers of a quantized CPU target in one native call (`csrc/decode_loop.cpp`).

`verifier.quantized.cpu_forward.forward_rows` drives four matmuls and four fused kernels per layer
from Python; for the sampled rows (decode steps and tree nodes, the rows every step has)
`NativeLayers.run` makes the same calls, in the same order, from C++. Its results are
bitwise the Python loop's, which stays as the fallback.

The library links against the running torch (its headers and libtorch_cpu), so it is
compiled on first use (`c++ -O2`, a few seconds) into the Tercel cache, keyed by the source,
the compiler, the torch build and the CPU's flags. Without a C++ compiler, or where the build
fails, `native_layers` returns None and the Python loop runs: slower, the same bits.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import weakref
from pathlib import Path

import torch

from verifier.attention.kv_cache import KVCache
from verifier.cpu import cpu_ops
from verifier.quantized.qlinear import QuantLinear, RescoredHead

log = logging.getLogger("tercel.cpu_loop")
SOURCE = cpu_ops.CSRC / "decode_loop.cpp"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ERR = 512                      # bytes for a C++ exception's message


class LinearSpec(ctypes.Structure):
    """One QuantLinear as the loop reads it (`LinearSpec` in decode_loop.cpp): its own kernel's
    fields (`verifier.quantized.own_kernels.base.LoopFields`: kind 4 torch's int4, 16 q4x16,
    8 torch's int8, 32 q8x16, 64 mixed), tensors as TensorImpl addresses, n the output features."""
    _fields_ = [("kind", _I), ("w", _I), ("s", _I), ("group", _I), ("n", _I), ("bits", _I)]


_SIGNATURES = {
    "tercel_model_new": ([_I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P], _P),
    "tercel_model_free": ([_P], None),
    "tercel_model_set_layer": ([_P, _I, _P, _F, _P, _F, _P, ctypes.POINTER(LinearSpec), ctypes.c_char_p, _I], _I),
    "tercel_model_set_head": ([_P, _P, _F, ctypes.POINTER(LinearSpec), _I, _I, _I, _I, _P, _P, _P, ctypes.c_char_p,
                               _I], _I),
    "tercel_model_set_lora": ([_P, _P, _P, ctypes.c_char_p, _I], _I),
    "tercel_forward": ([_P, _P, _I, _I, _P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _P, _P, _P, _P, ctypes.c_char_p, _I],
                       _I),
    "tercel_clock": ([_I, ctypes.POINTER(ctypes.c_double)], None),
}
_lib: ctypes.CDLL | None = None
_tried = False


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _flags() -> list[str]:
    td = _torch_dir()
    return ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{td / 'include'}", f"-L{td / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{td / 'lib'}"]


def _build() -> Path:
    return cpu_ops.compile_library([SOURCE], _flags(), ("CXX", "c++", "g++"), salt=torch.__version__)


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("TERCEL_NATIVE_LOOP", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
            for name, (args, ret) in _SIGNATURES.items():
                getattr(lib, name).argtypes, getattr(lib, name).restype = args, ret
            _lib = lib
        except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
            detail = e.stderr[-400:] if isinstance(e, subprocess.CalledProcessError) else e
            log.warning("the native decode loop could not be built (%s); the Python loop runs instead", detail)
    return _lib


def _spec(lin: QuantLinear) -> LinearSpec:
    f = lin.loop_fields()
    return LinearSpec(f.kind, f.w._cdata, 0 if f.s is None else f.s._cdata, f.group, lin.out_features, f.bits)


def _kernels(*names: str) -> list[ctypes.c_void_p]:
    """The fused C kernels' addresses (verifier.cpu.cpu_ops's library), for the loop to call."""
    return [ctypes.cast(getattr(cpu_ops._library(), n), _P) for n in names]


def _check(status: int, err: ctypes.Array) -> None:
    if status:
        raise RuntimeError(f"native decode loop: {err.value.decode(errors='replace')}")


class NativeLayers:
    """The model's layers held by the C++ loop (`layers`: `verifier.quantized.cpu_forward.CpuLayer`s, whose
    weights it references for as long as it lives), and its final norm and LM head where the
    head is a RescoredHead over an int8 table (`has_head`; the default GGUF's)."""

    def __init__(self, lib: ctypes.CDLL, cfg, heads: cpu_ops.Heads, layers, norm=None, head=None) -> None:
        # The C++ model points at `heads` and at the layers' norm weights: both are kept alive here.
        self._lib, self._heads, self._layers, self._norm = lib, heads, layers, norm
        self._model = lib.tercel_model_new(len(layers), cfg.hidden_size, cfg.num_heads, cfg.head_dim,
                                           cfg.intermediate_size, ctypes.addressof(heads),
                                           *_kernels("add_rms_norm", "silu_mul", "attention", "prefetch_kv",
                                                    "q4_matmul", "q8_matmul", "mixed_matmul"))
        self._free = weakref.finalize(self, lib.tercel_model_free, self._model)
        err = ctypes.create_string_buffer(_ERR)
        for i, l in enumerate(layers):
            specs = (LinearSpec * 4)(*(_spec(lin) for lin in (l.qkv, l.o, l.gate_up, l.down)))
            bias = None if l.qkv.bias is None else l.qkv.bias.data_ptr()
            _check(lib.tercel_model_set_layer(self._model, i, l.in_norm.data_ptr(), l.in_eps, l.post_norm.data_ptr(),
                                              l.post_eps, bias, specs, err, _ERR), err)
        self.has_head = isinstance(head, RescoredHead) and head._c_rescore and norm is not None
        if self.has_head:
            self._k, self._vocab = head.RESCORE_K, head.scan.out_features
            table = head.table
            _check(lib.tercel_model_set_head(self._model, norm.weight.data_ptr(), norm.eps, ctypes.byref(_spec(head.scan)),
                                             table.q._cdata, table.scale._cdata,
                                             table.embedding_dim // table.scale.shape[1], self._k,
                                             *_kernels("rms_norm_rows", "scan_topk", "rescore_int8"), err, _ERR), err)
        self._kv: KVCache | None = None
        self._kv_ptrs: tuple[ctypes.Array, ctypes.Array] | None = None
        self._err = ctypes.create_string_buffer(_ERR)    # one engine thread calls run: one buffer
        self._lora: list = []                            # the LoRA tables the C++ model points at, kept alive

    def set_lora(self, tables: list) -> None:
        """LoRA tables (`cpu_ops.LoraTable` or None) of every layer's qkv, o, gate_up and down, in
        order: the projections of rows given a slot (`run`'s lora_slots) add their products. The
        tables must live until the next call."""
        ptrs = (_P * len(tables))(*(None if t is None else ctypes.addressof(t) for t in tables))
        _check(self._lib.tercel_model_set_lora(self._model, *_kernels("lora_add"), ptrs, self._err, _ERR), self._err)
        self._lora = tables

    def _caches(self, kv: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        if kv is not self._kv:              # the pool is allocated once; its layer pointers with it
            n = len(self._layers)
            self._kv_ptrs = tuple((_P * n)(*(kv.layer(i)[side].data_ptr() for i in range(n))) for side in (0, 1))
            self._kv = kv
        return self._kv_ptrs

    def run(self, plan: cpu_ops.Rows, x: torch.Tensor, kv: KVCache, capture_layers: tuple[int, ...],
            logits_rows: torch.Tensor | None = None,
            logits_tokens: list[torch.Tensor | None] | None = None,
            lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor | None, dict]:
        """Every layer over x fp32 [T, H] in place (up to the last residual add, before the final
        norm) -> (logits fp32 [len(logits_rows), V] of those rows through the final norm and the
        head, or None: no rows asked, or no head here; taps: layer -> x as that layer sees it,
        for the layers below the last). `logits_tokens`: per logits row, int64 ids whose logits
        alone it needs (exact; -inf elsewhere), or None. `lora_slots`: int64 [T], each row's LoRA
        adapter slot (`set_lora`), or None."""
        k_ptrs, v_ptrs = self._caches(kv)
        tapped = sorted(i for i in set(capture_layers) if i < len(self._layers))
        taps = {i: torch.empty_like(x) for i in tapped}
        tap_layer = (_I * len(tapped))(*tapped) if tapped else None
        tap_impl = (_I * len(tapped))(*(taps[i]._cdata for i in tapped)) if tapped else None
        m = 0 if logits_rows is None or not self.has_head else logits_rows.shape[0]
        logits = torch.empty(m, self._vocab) if m else None
        top = torch.empty(m, self._k, dtype=torch.int64) if m else None
        sparse = _sparse_rows(logits_tokens) if m else None
        _check(self._lib.tercel_forward(self._model, ctypes.byref(plan), x.shape[0], x._cdata, k_ptrs, v_ptrs,
                                        len(tapped), tap_layer, tap_impl, m, logits_rows.data_ptr() if m else None,
                                        logits._cdata if m else 0, top._cdata if m else 0,
                                        *(sparse.args() if sparse else (0, None, None, None)),
                                        None if lora_slots is None else lora_slots.data_ptr(), self._err, _ERR),
               self._err)
        return logits, taps


class _SparseRows:
    """The rows of a forward whose logits are needed at a few tokens only, as the loop reads
    them: their indices among the logits rows, where each one's tokens start, the tokens."""

    def __init__(self, logits_tokens: list[torch.Tensor | None]):
        rows = [i for i, t in enumerate(logits_tokens) if t is not None]
        lists = [logits_tokens[i].to(torch.int64) for i in rows]
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.start = torch.tensor([0, *torch.tensor([len(t) for t in lists]).cumsum(0).tolist()], dtype=torch.int64)
        self.tokens = torch.cat(lists).contiguous()

    def args(self) -> tuple:
        return len(self.rows), self.rows.data_ptr(), self.start.data_ptr(), self.tokens.data_ptr()


def _sparse_rows(logits_tokens: list[torch.Tensor | None] | None) -> _SparseRows | None:
    return None if logits_tokens is None or all(t is None for t in logits_tokens) else _SparseRows(logits_tokens)


def step_clock(on: bool) -> dict[str, float]:
    """Seconds the native loop spent, since the last call, in its matmul calls, its attention
    (with the KV prefetch) and its calls as a whole; the clocks then restart, running if `on`
    (they cost two clock reads per timed call, so bench/step_profile.py alone turns them on)."""
    sums = (ctypes.c_double * 3)()
    lib = _library()
    if lib is not None:
        lib.tercel_clock(int(on), sums)
    return dict(zip(("matmul", "attention", "call"), sums))


def native_layers(cfg, heads: cpu_ops.Heads, layers, norm=None, head=None) -> NativeLayers | None:
    """The C++ loop over `layers` (and `norm` and `head`, see NativeLayers), or None: no
    compiler, a failed build, a layer with a bias outside qkv (which the Python loop adds;
    no Llama-family checkpoint has one), q/k norms (Qwen3), experts (Mixtral, Qwen3-MoE) or Gemma
    (`verifier.quantized.gemma_cpu`)."""
    if cfg.gemma is not None:          # its extra norms, GeGLU, windows and caps
        return None
    if any(l.moe is not None for l in layers):          # the experts run in the Python loop
        return None
    if any(lin.bias is not None for l in layers for lin in (l.o, l.gate_up, l.down)):
        return None
    if any(l.q_norm is not None for l in layers):       # Qwen3's q/k norms run in the Python loop
        return None
    lib = _library()
    return None if lib is None else NativeLayers(lib, cfg, heads, layers, norm, head)

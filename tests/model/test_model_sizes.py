"""A GGUF is served from its own blocks: no converted copy on disk, no dense copy in memory, a
model that will not fit refused at start with the numbers. A tiny model in a real model's form
(`bench.model_shapes`: Llama layout, random weights, the default tokenizer)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from bench.model_shapes import Shape, write
from verifier.cpu import cpu_ops
from verifier.memory import check_fits, tensor_bytes
from verifier.model.loader import ALIASES, DEFAULT_MODEL
from verifier.quantized.qlinear import QuantEmbedding, QuantLinear
from verifier.target import TargetModel

TINY = Shape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, vocab=49152)
METADATA = {"config.json", "gguf_blocks.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "special_tokens_map.json"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / "tiny-Q4_0.gguf"
    write(path, TINY, "Q4_0", ALIASES[DEFAULT_MODEL]())
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this module's own (what a load writes is counted), holding the kernels the
    session has compiled: compiling them again would only cost time."""
    import shutil

    from verifier.cpu.cache import cache_root
    out = tmp_path_factory.mktemp("cache")
    if (built := cache_root() / "cpu_kernels").is_dir():
        shutil.copytree(built, out / "cpu_kernels")
    return out


def pin_torch_int4(mp: pytest.MonkeyPatch) -> None:
    """Every load takes torch's int4 kernel (built everywhere), whatever this machine's timings
    would choose: two loads compared, or a byte count read, cannot differ by machine kind."""
    from verifier.quantized.matmul_paths import KernelPlan, KernelTimings
    mp.setattr(KernelTimings, "plan", lambda self, owns: KernelPlan("int4" if "int4" in owns else owns[0]))


@pytest.fixture(scope="module")
def served(tiny_gguf, cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TERCEL_CACHE", str(cache))
        pin_torch_int4(mp)
        yield TargetModel(str(tiny_gguf), quantization="auto")


def test_the_load_writes_metadata_only(served, cache):
    """The cache holds the file's config, tokenizer and tensor index: no weights, in any format."""
    (folder,) = (cache / "models").iterdir()
    assert {p.name for p in folder.iterdir()} <= METADATA
    assert not [p for p in cache.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".npy")]


def test_files_sharing_a_tokenizer_convert_it_once(tiny_gguf, tmp_path, monkeypatch):
    """A GGUF's tokenizer is converted once per tokenizer, not per file: a file of the same
    family (other shapes and quantization, the same tokenizer fields) takes the converted files
    without transformers; a file whose tokenizer differs (more tokens) is converted anew."""
    from verifier.model import gguf_convert
    from verifier.model.loader import resolve_model_dir
    monkeypatch.setenv("TERCEL_CACHE", str(tmp_path / "cache"))
    first = resolve_model_dir(str(tiny_gguf))
    sibling, other = tmp_path / "sibling-Q8_0.gguf", tmp_path / "other-Q4_0.gguf"
    write(sibling, replace(TINY, layers=1), "Q8_0", ALIASES[DEFAULT_MODEL]())
    write(other, replace(TINY, vocab=TINY.vocab + 64), "Q4_0", ALIASES[DEFAULT_MODEL]())
    converted, convert = [], gguf_convert._convert_tokenizer
    monkeypatch.setattr(gguf_convert, "_convert_tokenizer", lambda r, path, out: (converted.append(path),
                                                                                  convert(r, path, out)))
    second = resolve_model_dir(str(sibling))
    assert converted == [] and second != first
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    resolve_model_dir(str(other))
    assert converted == [other]


def test_no_dense_copy_of_a_projection_is_made(served, tiny_gguf):
    """The decoder's projections are QuantLinears holding their packed kernel layout, about the
    file's bytes (Q4_0: 4.5 bits a weight, int4 packed: 5); what the model holds as tensors is norms."""
    assert served.quantization == "int4"
    layer = served.net.model.layers[0]
    assert all(isinstance(m, QuantLinear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj))
    h, kv = TINY.hidden, TINY.hidden // TINY.heads * TINY.kv_heads
    weights = TINY.layers * (h * (h + 2 * kv) + h * h + 3 * h * TINY.ffn)
    memory = served.memory()
    assert weights * 4.5 / 8 <= memory.weights <= 1.15 * weights * 4.5 / 8
    assert memory.weights < weights                      # a bf16 copy would be 2 bytes a weight
    assert memory.other == tensor_bytes(served.net.parameters()) < weights // 10     # the norms


def test_dense_serving_dequantizes_in_memory(tiny_gguf, cache, monkeypatch):
    """`quantization="none"` reads the same file into fp32 in memory, and still writes nothing."""
    monkeypatch.setenv("TERCEL_CACHE", str(cache))
    dense = TargetModel(str(tiny_gguf), quantization="none", load_tokenizer_files=False)
    w = dense.net.model.layers[1].mlp.down_proj.weight
    assert w.dtype == torch.float32 and w.shape == (TINY.hidden, TINY.ffn) and w.abs().max() > 0
    assert not list(cache.rglob("*.safetensors"))


def test_a_model_that_will_not_fit_is_refused_with_the_numbers(tiny_gguf, cache, monkeypatch):
    with pytest.raises(ValueError, match=r"needs about 2\.00 GB of memory and this machine has 1\.00 GB"):
        check_fits("model x", 2 * 10**9, available=10**9)
    monkeypatch.setenv("TERCEL_CACHE", str(cache))
    monkeypatch.setattr("verifier.memory.available_bytes", lambda: 1000)
    with pytest.raises(ValueError, match="will not fit"):
        TargetModel(str(tiny_gguf), quantization="auto", load_tokenizer_files=False)


def test_the_header_reader_reads_what_gguf_py_reads(tiny_gguf):
    """Every field and tensor of the file as gguf-py's GGUFReader gives them; a string array
    (the 49,152 tokens) by its length only."""
    import gguf

    from verifier.model.gguf_header import GGUFHeader, StringCount
    want, got = gguf.GGUFReader(str(tiny_gguf)), GGUFHeader(str(tiny_gguf))
    assert [k for k in want.fields if not k.startswith("GGUF.")] == list(got.fields)
    for key, field in got.fields.items():
        value = field.contents()
        expected = want.fields[key].contents()
        assert len(value) == len(expected) if isinstance(value, StringCount) else value == pytest.approx(expected), key
    assert len(got.fields["tokenizer.ggml.tokens"].contents()) == TINY.vocab
    assert [(t.name, t.tensor_type, list(t.shape), int(t.data_offset), int(t.n_bytes)) for t in want.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in got.tensors]


def test_the_sizes_bench_runs_a_file(tiny_gguf, capsys):
    """`python -m bench.model_sizes`: each engine in its own process, one table row per engine and
    load (the first load's own), figures that add up."""
    from bench.model_sizes import main
    main(["--files", str(tiny_gguf), "--engines", "tercel", "--rounds", "1", "--prefill-tokens", "16",
          "--prompt-tokens", "8", "--new-tokens", "4", "--bandwidth-gb", "0.05"])
    rows = [[c.strip() for c in line.strip(" |").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tiny")]
    assert len(rows) == 1 and rows[0][1] == "tercel, first load"
    load, peak, disk, prefill, decode, _, stream = (float(v) for v in rows[0][2:9])
    assert load > 0 and 0 < peak < 8 and disk < 0.1 and prefill > 0 and decode > 0 and stream > 0


@pytest.mark.slow
def test_the_first_loads_bench_loads_in_each_cache_state(tiny_gguf):
    """`python -m bench.first_loads`: a first load, a later one, another file of the family and
    one with its tokenizer converted anew, each timed in its own process under one fresh cache
    (which holds the model's and the tokenizer's folders after the loads that write them)."""
    import os

    from bench.first_loads import STATES, one_round, table
    before = os.environ.get("TERCEL_CACHE")
    seconds = one_round(str(tiny_gguf), threads=2)
    assert list(seconds) == list(STATES) and all(s > 0 for s in seconds.values())
    assert os.environ.get("TERCEL_CACHE") == before
    row = table({"tiny": [seconds]}).splitlines()[-1]
    assert row.startswith("| tiny |") and row.count("(") == len(STATES)


def test_a_small_model_drafts_for_it_and_the_tokens_are_its_own(tiny_gguf, cache, monkeypatch):
    """The speculative pair people run (a small model of the family drafting for a larger one):
    the default model drafts for this GGUF target (their vocabularies are one), at T=0 the tokens
    are plain decoding's, and the KV pool is whole after."""
    from spec import LLM, SamplingParams
    from spec.adaptive import AdaptiveConfig
    import functools

    from verifier.quantized import attention_tuning
    monkeypatch.setenv("TERCEL_CACHE", str(cache))
    pin_torch_int4(monkeypatch)            # both loads, and the draft's, on one kernel
    # the draft's attention timed once, not as medians: its choice is not what this tests
    monkeypatch.setattr(attention_tuning, "measure", functools.partial(attention_tuning.measure, rounds=1, calls=1))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 300, 4000, 9], [70, 71, 72]]
    plain = LLM(model=str(tiny_gguf), max_num_seqs=2, num_kv_blocks=64)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    # the draft's KV pool has as many blocks as the target's: 64 of the 135M model's, not a tiny pool's count
    pair = LLM(model=str(tiny_gguf), max_num_seqs=2, num_kv_blocks=64, drafter="small:smollm2-135m-instruct",
               adaptive=AdaptiveConfig(enabled=False))          # whole drafts: the rule is tested, not the cost
    got = pair.generate(prompts, greedy)
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.verify_steps for o in got) > 0 and pair.engine.blocks.num_used_blocks == 0


def _random_blocks(kind: str, rows: int, cols: int, gen: np.random.Generator, narrow: bool = False) -> np.ndarray:
    """Random blocks of `kind` with small finite fp16 scales: [rows, row bytes]. `narrow`: Q6_K
    weights that all fit 5 bits (q8x16 holds such a tensor in 5)."""
    weights, size, at, count = {"Q4_0": (32, 18, 0, 1), "Q4_1": (32, 20, 0, 2), "Q4_K": (256, 144, 0, 2),
                                "Q6_K": (256, 210, 208, 1)}[kind]
    blocks = gen.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
    scales = (gen.random((rows, cols // weights, count)) * 0.01).astype(np.float16)
    blocks[..., at:at + 2 * count] = scales.view(np.uint8)
    if narrow:
        blocks[..., :192] = _q6k_bits(gen.integers(16, 48, (rows, cols // weights, 256), dtype=np.uint8))
    return blocks.reshape(rows, -1)


def _q6k_bits(u: np.ndarray) -> np.ndarray:
    """6-bit values [..., 256] -> Q6_K's 128 bytes of low nibbles and 64 of high bit pairs: weight
    128 h + 32 k + l in byte 64 h + 32 (k & 1) + l's nibble k >> 1, bits 2 k of byte 128 + 32 h + l."""
    u = u.reshape(*u.shape[:-1], 2, 4, 32)                          # [.., h, k, l]
    low = (u[..., [0, 1], :] & 15) | ((u[..., [2, 3], :] & 15) << 4)
    high = sum((u[..., k, :] >> 4) << (2 * k) for k in range(4))
    return np.concatenate([low.reshape(*u.shape[:-3], 128), high.reshape(*u.shape[:-3], 64)], -1)


KERNEL_OF = {"Q4_0": "q4x16", "Q4_1": "q4x16", "Q4_K": "q4k", "Q6_K": "q8x16"}


def _file_rows(kind: str, raw: np.ndarray, cols: int):
    from verifier.model.gguf_quant import file_rows
    return file_rows(kind, cols, raw)


def _served(kind: str, raws: list[np.ndarray], cols: int):
    """The parts' served forms packed as a load without csrc/repack.c packs them."""
    from verifier.model.gguf_blocks import read_block_tensor
    from verifier.quantized import quantize
    from verifier.quantized.own_kernels import KERNELS
    from verifier.quantized.qlinear import served_weights
    parts = [read_block_tensor(k, r, r.shape[0], cols) for k, r in zip(kind.split("+"), raws)]
    w = quantize._fused(parts) if len(parts) > 1 else parts[0]
    return KERNELS["mixed" if len(parts) > 1 else KERNEL_OF[kind]].pack(served_weights(w))


def _same(got, want) -> bool:
    return got.bits == want.bits and all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                                         for a, b in zip(got.args, want.args, strict=True))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q6_K narrow", "Q4_K+Q6_K+Q4_0"])
def test_blocks_packed_from_the_file_are_the_served_forms_packing(kind):
    """csrc/repack.c gives the bytes that reading the served form and packing it give: each format,
    Q6_K in 6 bits and in 5, a fused projection of three formats (the mixed kernel), rows not a
    multiple of the 16-channel tile."""
    from verifier.quantized.own_kernels import from_file
    if not cpu_ops.q4_isa():
        pytest.skip("the own kernels are not built for this CPU")
    gen, kind, narrow = np.random.default_rng(0), kind.split()[0], kind.endswith("narrow")
    for rows in (48, 40):
        raws = [_random_blocks(k, rows - 8 * i, 512, gen, narrow) for i, k in enumerate(kind.split("+"))]
        own, got = from_file.packed([_file_rows(k, r, 512) for k, r in zip(kind.split("+"), raws)], "gguf", "q4x16")
        assert own == ("mixed" if "+" in kind else KERNEL_OF[kind]) and _same(got, _served(kind, raws, 512))
        assert "+" in kind or kind != "Q6_K" or got.bits == (5 if narrow else 6)


@pytest.mark.parametrize("masks", [False, True])
def test_q6k_packs_both_layouts_of_the_higher_bits(masks):
    """Planes (AVX2 builds) and masks (AVX-512 builds) alike, whichever this library reads."""
    from verifier.model.gguf_blocks import read_block_tensor
    from verifier.quantized.own_kernels.q8x16 import pack_q8
    if not cpu_ops.available():
        pytest.skip("no C compiler")
    raw = _random_blocks("Q6_K", 24, 512, np.random.default_rng(1))
    out = torch.empty(2, 2, 32 + 8 * (256 + 128 + 32), dtype=torch.uint8)
    cpu_ops.repack_q6k(torch.from_numpy(_file_rows("Q6_K", raw, 512).address), 6, masks, out)
    assert torch.equal(out, pack_q8(read_block_tensor("Q6_K", raw, 24, 512), 6, masks))


def test_the_heads_table_and_scan_from_the_file_are_the_python_paths():
    """csrc/repack.c's Q6_K table (int8 q, fp32 d * sc per 16), the head's int4 scan requantized
    from an int8 table (Q6_K's groups of 16, Q8_0's of 32) and a Q4_K embedding table (q two to a
    byte) equal numpy's and torch's, bit for bit."""
    from verifier.model.gguf_blocks import read_block_tensor
    from verifier.model.quant import quantize_int8
    from verifier.quantized.modes import REGISTRY
    from verifier.quantized.own_kernels import KERNELS
    from verifier.quantized.qlinear import served_weights
    if not cpu_ops.q4_isa():
        pytest.skip("the own kernels are not built for this CPU")
    raw = _random_blocks("Q6_K", 40, 512, np.random.default_rng(2))
    q, scale = cpu_ops.unpack_q6k(torch.from_numpy(_file_rows("Q6_K", raw, 512).address), 512)
    q6k = read_block_tensor("Q6_K", raw, 40, 512).as_grouped()
    assert torch.equal(q, q6k.q) and torch.equal(scale, q6k.scale)
    for table in (q6k, quantize_int8(torch.randn(40, 512, generator=torch.Generator().manual_seed(0)), 32)):
        want = KERNELS["q4x16"].pack(served_weights(REGISTRY["int4"].serve(table))).args[0]
        assert torch.equal(cpu_ops.scan_int4_from_int8(table.q, table.scale), want)
    raw = _random_blocks("Q4_K", 40, 512, np.random.default_rng(3))
    embedding = QuantEmbedding(read_block_tensor("Q4_K", raw, 40, 512))
    fields = cpu_ops.unpack_q4k_table(torch.from_numpy(_file_rows("Q4_K", raw, 512).address), 512)
    assert all(torch.equal(fields[name], buffer) for name, buffer in embedding.named_buffers())


def test_a_load_packs_from_the_file_what_reading_would_pack(tiny_gguf, cache, monkeypatch):
    """Layers after the first take the direct packers (their q and k rows back in HF's order
    first): every projection's packed bytes equal those of the served-form path."""
    from verifier.quantized import quantize
    from verifier.quantized.matmul_paths import KernelPlan, KernelTimings
    if not cpu_ops.q4_isa():
        pytest.skip("q4x16 is not built for this CPU")
    monkeypatch.setenv("TERCEL_CACHE", str(cache))
    monkeypatch.setattr(KernelTimings, "plan", lambda self, owns: KernelPlan("q4x16"))

    def packed(target):
        return [a for lin in target.runner.decoder for a in lin._packed[lin.own].args if isinstance(a, torch.Tensor)]
    direct = TargetModel(str(tiny_gguf), quantization="int4", load_tokenizer_files=False)
    monkeypatch.setattr(quantize.from_file, "packed", lambda *a: None)
    read = TargetModel(str(tiny_gguf), quantization="int4", load_tokenizer_files=False)
    assert all(lin.own == "q4x16" for lin in direct.runner.decoder)
    assert all(torch.equal(a, b) for a, b in zip(packed(direct), packed(read), strict=True))


def test_a_later_load_of_a_file_recalls_its_plan_and_serves_the_same_bits(tiny_gguf, tmp_path, monkeypatch,
                                                                          neighbours):
    """The first load packs the first layer for every kernel, chooses (the choice pinned) and
    notes the plan for the file; the next packs that layer for the plan alone, without choosing
    (`plan_memo`), and gives the same logits. Another file of the same shapes chooses again."""
    import shutil

    from bench.model_shapes import write
    from verifier.cpu.cache import cache_root
    from model_cases import logits
    from verifier.quantized import runner
    if (built := cache_root() / "cpu_kernels").is_dir():
        shutil.copytree(built, tmp_path / "cache" / "cpu_kernels")
    monkeypatch.setenv("TERCEL_CACHE", str(tmp_path / "cache"))
    pin_torch_int4(monkeypatch)
    tunes, tune = [], runner.tune
    monkeypatch.setattr(runner, "tune", lambda *a, **k: tunes.append(a[0]) or tune(*a, **k))
    ids = list(range(100, 130))         # within logits()' two blocks
    first = TargetModel(str(tiny_gguf), quantization="int4", load_tokenizer_files=False)
    assert len(tunes) == 1
    later = TargetModel(str(tiny_gguf), quantization="int4", load_tokenizer_files=False)
    assert len(tunes) == 1 and later.runner.plan == first.runner.plan
    assert later.runner.timings == first.runner.timings
    assert torch.equal(logits(later, ids), logits(first, ids))
    other = tmp_path / "other-Q4_1.gguf"
    write(other, TINY, "Q4_1", ALIASES[DEFAULT_MODEL]())
    TargetModel(str(other), quantization="int4", load_tokenizer_files=False)
    assert len(tunes) == 2


def test_the_kv_pool_stays_within_the_memory_left_after_the_load(monkeypatch):
    """The pool asked for, or nine tenths of what is free when less is: a pool past the memory
    would meet the OOM killer mid-request instead of a full pool's preemption."""
    from types import SimpleNamespace

    from spec import preparation
    cpu = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(preparation, "available_bytes", lambda: 10 * 10**9)
    assert preparation.kv_pool_bytes(cpu, 2 * 10**9) == 2 * 10**9
    monkeypatch.setattr(preparation, "available_bytes", lambda: 10**9)
    assert preparation.kv_pool_bytes(cpu, 2 * 10**9) == 9 * 10**8

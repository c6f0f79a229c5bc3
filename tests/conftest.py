"""Shared fixtures. Tests run on the CPU; the default model is loaded once per session."""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The public prompt sets and conversations (README, "Benchmark data"): outside the repository.
SHARED_DATA = Path(os.environ.get("TERCEL_DATA", ROOT.parent / "shared" / "data"))
FIXTURES = ROOT / "tests" / "data"          # the few prompts every test may read (tests/data/README.md)
BENCH_PROMPTS = FIXTURES / "bench_prompts.jsonl"
MTBENCH_HEAD = FIXTURES / "mtbench_head.jsonl"


GPU_SUITE = ROOT / "tests" / "gpu"


@pytest.fixture(autouse=True)
def _threads_left_by_neighbours():
    """Each test's torch work, engines' loads and steps included, on the CPUs of the budget other
    processes left free over the tests before it: beside a busy process, work on every CPU waits
    at each barrier for a thread the kernel has descheduled (docs/performance.md, "Shared CPUs")."""
    import torch

    from verifier.cpu.cpus import cpu_budget, free_cpus
    torch.set_num_threads(free_cpus(cpu_budget().threads))
    yield


def _glibc():
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None     # musl has none
    except OSError:
        return None


_LIBC = _glibc()


@pytest.hookimpl(optionalhook=True)         # pytest-xdist's hooks: plain pytest runs without it
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (`make test`): one worker per CPU of the budget, as many as the free memory holds."""
    from verifier.cpu.cpus import cpu_budget
    from verifier.memory import available_bytes
    from workers import worker_count
    return worker_count(cpu_budget().threads, available_bytes())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (`make test`): the heavy files first, on one worker (tests/workers.py)."""
    if config.getoption("dist") == "loadfile":
        from workers import HeavyFirst
        return HeavyFirst(config, log)
    return None


@pytest.fixture(autouse=True, scope="module")
def _heap_returned_after_each_module():
    """After a module's engines are dropped, glibc keeps their freed heap pages mapped for the
    next allocation (most of a dropped engine's resident memory, measured: docs/performance.md,
    "Test suite"); the suite's peak is then every module's high-water mark stacked. Handing the
    pages back keeps it at the largest module's."""
    yield
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class FakeNeighbours:
    """A `verifier.cpu.cpus.NeighbourMeter` stand-in that always reads `others` CPUs busy."""

    def __init__(self, others: float, cpus: int = 2):
        self.others, self.cpus = others, cpus

    def __call__(self) -> float:
        return self.others


@pytest.fixture
def neighbours(monkeypatch):
    """Sets what the kernel timings' cache reads of other processes (`others` CPUs busy; 0: a
    quiet machine), so that a test of caching does not depend on what else runs beside it."""
    from verifier.cpu import machine

    def set_busy(others: float, cpus: int = 2) -> None:
        monkeypatch.setattr(machine, "_neighbour_meter", lambda: FakeNeighbours(others, cpus))
        monkeypatch.setattr(machine, "QUIET_WINDOW", 0.0)
    set_busy(0.0)
    return set_busy


@pytest.fixture
def quick_timings(monkeypatch, tmp_path):
    """The kernel and attention timings taken once per case instead of as medians of several: for
    tests of what is timed and how it is reported, never of what the timings chose. They are
    cached under a test-private TERCEL_CACHE, never where a server would read them."""
    import functools

    from verifier.quantized import attention_tuning, quantize
    monkeypatch.setenv("TERCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(attention_tuning, "measure",
                        functools.partial(attention_tuning.measure, rounds=1, calls=1))
    monkeypatch.setattr(quantize, "time_paths", functools.partial(quantize.time_paths, repeats=1))


def _gpu_suite_skip() -> str | None:
    import torch
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter is on in this process: run `make test-gpu`"
    return None


def pytest_collection_modifyitems(config, items):
    """tests/gpu skips test by test, not module by module, where it cannot run: its tests are
    collected, so `make test-gpu` exits 0 without a GPU and lists the skips."""
    gpu = [item for item in items if GPU_SUITE in Path(item.path).resolve().parents]
    reason = _gpu_suite_skip() if gpu else None
    for item in gpu if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session):
    """What the test modules' imports loaded (torch, transformers, the engine's modules) lives as
    long as the process: out of the cyclic GC's reach, so that its full collections walk only the
    tests' own objects (docs/performance.md, "Engine step"). Engines are built later, unfrozen,
    so that a dropped one is collected; unfrozen at exit, so that triton's bindings (transformers
    imports them) are collected before nanobind counts its leaks."""
    from spec.engine import freeze_loaded_objects
    freeze_loaded_objects()


def shared_data(relative: str) -> Path:
    """A path in the shared data folder; the calling test skips where it is absent (a clone
    without ../shared beside it), saying how to point at it."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not found: set TERCEL_DATA to the shared data folder (Spec-Bench, MT-bench, "
                    "training conversations; README, \"Benchmark data\")")
    return path


def question_rows(path: Path) -> list[dict]:
    """The rows of a question file (`{"question_id", "category", "turns"}` per line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_prompts(n: int) -> list[str]:
    """The first turns of the first `n` MT-bench questions, from the copy in tests/data (8 of them)."""
    rows = question_rows(MTBENCH_HEAD)
    if n > len(rows):
        raise ValueError(f"tests/data holds {len(rows)} MT-bench questions; read more with shared_data()")
    return [r["turns"][0] for r in rows[:n]]


def arithmetic_conversations(n: int) -> list[dict]:
    """`n` word problems with worked replies, in the common conversation schema: training data
    written here, so that training tests need no data set."""
    names, things = ("Ava", "Ben", "Chloe", "Dev", "Ema", "Femi"), ("apples", "stamps", "marbles", "books")
    rows = []
    for i in range(n):
        who, what = names[i % len(names)], things[i % len(things)]
        a, b, c = 5 + 7 * i % 23, 2 + 5 * i % 11, 1 + 3 * i % 5
        question = (f"{who} has {a} {what}. {who} buys {b} more, then gives {c} to a friend. "
                    f"How many {what} does {who} have now?")
        reply = (f"{who} starts with {a} {what}. After buying {b} more, {who} has {a} + {b} = {a + b} {what}. "
                 f"After giving {c} away, {who} has {a + b} - {c} = {a + b - c} {what}. The answer is {a + b - c}.")
        rows.append({"id": f"arith-{i}", "source": "tests/arithmetic",
                     "conversations": [{"role": "user", "content": question},
                                       {"role": "assistant", "content": reply}]})
    return rows


def slow_marked(cases, slow) -> list:
    """Parametrize values: the names in `slow` marked slow (run by `make test-slow` only)."""
    return [pytest.param(c, marks=pytest.mark.slow) if c in slow else c for c in cases]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, converted from its GGUF into the cache once."""
    from verifier.model.loader import DEFAULT_MODEL, resolve_model_dir
    return resolve_model_dir(DEFAULT_MODEL)


def make_tiny_model(out: Path, tokenizer_dir: Path | None, model_type: str = "llama",
                    seed: int = 0, **overrides) -> Path:
    """A random-weight HF checkpoint (config.json + safetensors), built with transformers.

    With tokenizer_dir, the SmolLM2 tokenizer files are copied in (vocab 49152) so the
    whole engine, detokenization included, runs on it."""
    import shutil

    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
               "phi3": transformers.Phi3Config}[model_type]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "phi3": transformers.Phi3ForCausalLM}[model_type]
    kw = dict(vocab_size=49152 if tokenizer_dir else 256, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float().eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_dir:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
    return out


def make_random_eagle_head(target_dir: Path, out: Path, draft_vocab: int = 512, seed: int = 0) -> Path:
    """A random-weight EAGLE-3 head for the checkpoint in target_dir, saved in the EAGLE layout."""
    from drafters.eagle3 import save_head
    from verifier.target import load_config
    save_head(random_eagle_head(load_config(target_dir), draft_vocab, seed), out)
    return out


def random_eagle_head(target_cfg, draft_vocab: int = 512, seed: int = 0):
    """A random-weight EAGLE-3 head (in memory) shaped for a target config."""
    import torch

    from drafters.eagle3 import Eagle3Config, Eagle3Head
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target_cfg, draft_vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    head.set_vocab_map(torch.sort(torch.randperm(target_cfg.vocab_size)[:draft_vocab]).values)
    head.init_rotary()
    return head


@pytest.fixture(scope="session")
def tiny_eagle_head(tmp_path_factory, tiny_llama_dir) -> Path:
    return make_random_eagle_head(tiny_llama_dir, tmp_path_factory.mktemp("tiny_eagle"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Tiny random Llama with the SmolLM2 tokenizer: fast engine tests."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), smollm2_dir)


IDENTITY_ALONE = 2      # prompts the T=0 identity tests also run one at a time (the batch runs all 8)


def spec_drafters() -> dict:
    """Every drafter kind on SmolLM2, as the T=0 identity tests run them: name -> (drafter
    spec, SpecConfig or None). {corpus} (a datastore corpus) is filled in by the test."""
    from drafters.config import SpecConfig
    return {
        "ngram": ("ngram", SpecConfig(num_speculative_tokens=4)),
        "small": ("small:smollm2-135m-instruct", SpecConfig(num_speculative_tokens=3)),
        "tree": ("tree:small:smollm2-135m-instruct+ngram", SpecConfig(num_speculative_tokens=3, topk=2, budget=8)),
        "eagle3": ("eagle3", None),                  # the shipped head, default dynamic tree
        "datastore": ("datastore:{corpus}", None),   # its default best-first tree of 5 nodes
        "suffix": ("suffix", None),                  # its default tree of 16 nodes
    }


def write_reply_corpus(path: Path, llm, replies: list[list[int]]) -> Path:
    """Replies (token ids) as a conversation file: a datastore drafter's corpus."""
    with open(path, "w") as f:
        for ids in replies:
            reply = llm.tokenizer.decode(ids, skip_special_tokens=True)
            f.write(json.dumps({"conversations": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": reply}]}) + "\n")
    return path


def drive_random_requests(engine, rng, total: int, make_request, add_p: float, abort_p: float) -> tuple[int, int]:
    """Add `total` requests at random steps (make_request(i) -> (prompt ids, params)), abort live
    ones at random, check the block pool after every step. Returns (finished, preemptions seen)."""
    from spec.request import Submission
    added, finished, preemptions, live = 0, 0, 0, set()
    while added < total or engine.has_unfinished:
        while added < total and rng.random() < add_p:
            engine.add_request(f"r{added}", Submission(*make_request(added)))
            live.add(f"r{added}")
            added += 1
        if live and rng.random() < abort_p:
            engine.abort(rng.choice(sorted(live)))
        preemptions += sum(r.num_preemptions for r in engine.requests.values())
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        engine.check_integrity()
    return finished, preemptions

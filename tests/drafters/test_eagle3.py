"""EAGLE-3 head: both public layouts, refusal of heads that do not fit, serving and training
agree on what the head computes, and T=0 output identical to plain decoding."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_model, random_eagle_head
from drafters.base import DraftRequest, TargetHidden
from drafters.config import SpecConfig
from drafters.eagle3 import HeadMismatchError, load_head, save_head
from drafters.eagle3.drafter import Eagle3Drafter
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams
from training.ttt import Batch, ttt_forward
from verifier.batch import ForwardBatch, SeqInput
from verifier.target import TargetModel


random_head = random_eagle_head


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir):
    return TargetModel(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def head_dir(tiny_eagle_head):
    return tiny_eagle_head


@pytest.mark.parametrize("style", ["eagle", "speculators"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layouts_round_trip_bit_identical(tmp_path, tiny_target, style, dtype):
    head = random_head(tiny_target.config)
    save_head(head, tmp_path / "a", style=style, dtype=dtype)
    loaded = load_head(tmp_path / "a", tiny_target.config)
    save_head(loaded, tmp_path / "b", style=style)     # keeps the dtype it was loaded from
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            ta, tb = a.get_tensor(k), b.get_tensor(k)
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), k
    for name, t in head.state_dict().items():
        want = t.to(dtype).to(t.dtype) if t.is_floating_point() else t
        assert torch.equal(loaded.state_dict()[name], want), name
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == \
        json.loads((tmp_path / "b" / "config.json").read_text())


def test_public_layout_names(tmp_path, tiny_target):
    head = random_head(tiny_target.config)
    save_head(head, tmp_path / "e", style="eagle")
    save_head(head, tmp_path / "s", style="speculators")
    with safe_open(str(tmp_path / "e" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    with safe_open(str(tmp_path / "s" / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in f.keys() and "midlayer.norm" not in f.keys()
        assert f.get_tensor("layers.0.self_attn.q_proj.weight").shape[1] == 2 * head.cfg.hidden_size
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["algorithm"] == "eagle3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    eagle_cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert eagle_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.cfg.aux_layer_ids)


def test_d2t_maps_draft_ids_to_target_ids(tiny_target):
    head = random_head(tiny_target.config, draft_vocab=64)
    ids = head.draft_to_target
    assert torch.equal(torch.nonzero(head.t2d).flatten(), ids)
    assert torch.equal(ids, torch.arange(64) + head.d2t)


def test_head_for_another_target_is_refused(tmp_path, smollm2_dir, tiny_target):
    wide = make_tiny_model(tmp_path / "wide", smollm2_dir, hidden_size=96, num_attention_heads=4)
    other = TargetModel(str(wide))
    save_head(random_head(other.config), tmp_path / "h")
    with pytest.raises(HeadMismatchError, match="fc.weight"):
        load_head(tmp_path / "h", tiny_target.config)
    # Right widths, wrong vocabulary: the vocabulary-sized tensor is named.
    small_vocab = make_tiny_model(tmp_path / "sv", None)
    save_head(random_head(TargetModel(str(small_vocab)).config, draft_vocab=32), tmp_path / "v")
    with pytest.raises(HeadMismatchError, match="t2d|vocab"):
        load_head(tmp_path / "v", tiny_target.config)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_head(tmp_path / "missing", tiny_target.config)


def test_drafter_matches_the_training_unroll(tiny_target, head_dir):
    """The tree the drafter expands (serving) and the training-time-test unroll (training)
    compute the same draft logits for the same chain: training teaches what serving runs."""
    head = load_head(head_dir, tiny_target.config)
    head.use_target_embedding(tiny_target.net.model.embed_tokens)
    torch.manual_seed(1)
    ctx = torch.randint(0, 49152, (20,)).tolist()
    tiny_target.allocate_kv(8, 16)
    layers = head.cfg.aux_layer_ids
    fwd = tiny_target.forward(ForwardBatch([SeqInput(ctx[:-1], 0, list(range(8)), logits_indices=[])],
                                           capture_layers=tuple(sorted(set(layers)))))
    aux = torch.cat([fwd.hidden[i] for i in layers], -1)            # positions 0..18
    drafter = Eagle3Drafter(head)
    drafter.observe([TargetHidden(0, 0, aux[:10]), TargetHidden(0, 10, aux[10:])])
    req = DraftRequest(0, ctx, SamplingParams(temperature=0), None, max_depth=4, max_nodes=4, topk=1)
    chain = drafter.propose([req])[0].tree
    drafted = [chain.tokens[i] for i in range(1, chain.num_nodes)]
    assert len(drafted) == 4
    # Unroll over context + drafted tokens: step s at index 18 (the root's pair) must predict
    # drafted[s] as its argmax, exactly as the drafter chose it.
    ids = torch.tensor(ctx + drafted)[None]
    T = ids.shape[1]
    pad_aux = torch.cat([aux, aux.new_zeros(T - len(aux), aux.shape[1])])[None]
    # Loss only near the end, so the unroll crops the prompt for steps >= 1 (a path of its own).
    loss_mask = torch.arange(T)[None] >= 17
    in_vocab = torch.full((1, T), int(head.draft_to_target[0]))
    batch = Batch(ids, torch.ones(1, T, dtype=torch.bool), loss_mask, pad_aux, torch.zeros(1, T, 64), in_vocab)
    preds = _unroll_argmax(head, batch, steps=4, index=len(ctx) - 2)
    assert preds == drafted


def _unroll_argmax(head, batch, steps, index) -> list[int]:
    """Target ids of the unroll's argmax at one index, per step (hooking the head's logits)."""
    seen = []
    orig = head.draft_logits

    def spy(out):
        logits = orig(out)
        seen.append(logits)
        return logits
    head.draft_logits = spy
    try:
        with torch.no_grad():
            ttt_forward(head, batch, torch.zeros(head.cfg.draft_vocab_size, 64), steps=steps)
    finally:
        del head.draft_logits
    T = batch.input_ids.shape[1]
    out = []
    for logits in seen:
        rows = logits.view(-1, logits.shape[-1])
        d = int(rows[index - (T - len(rows))].argmax())     # steps >= 1 may start at a cropped index
        out.append(d + int(head.d2t[d]))
    return out


@pytest.mark.parametrize("topk,budget", [(1, 4), (3, 10)])
def test_greedy_output_identical_with_random_head(tiny_llama_dir, head_dir, topk, budget):
    prompts = [torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 17, 40, 33)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4,
              drafter=f"eagle3:{head_dir}", adaptive=WHOLE_TREES,      # its drafts verified, whatever a row costs
              speculation=SpecConfig(num_speculative_tokens=4, topk=topk, budget=budget))
    alone = [llm.generate(p, params)[0] for p in prompts]
    batch = llm.generate(prompts, params)
    assert [o.token_ids for o in alone] == ref
    assert [o.token_ids for o in batch] == ref
    assert sum(o.stats.draft_tokens for o in batch) > 0
    assert llm.engine.blocks.num_used_blocks == 0
    assert llm.engine.drafter.state == {}



def test_a_target_without_a_shipped_head_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="no EAGLE-3 head is shipped for the target.*eagle3:PATH"):
        LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=16, drafter="eagle3")


def test_a_missing_alias_package_leaves_the_clear_error(tiny_llama_dir, monkeypatch):
    """Where the default model's package is not installed, `eagle3` on another target still
    says that no head is shipped for it (the alias is skipped, not raised)."""
    import drafters.eagle3.drafter as eagle_drafter

    def missing(alias):
        raise ValueError(f"model {alias!r} needs a package")
    monkeypatch.setattr(eagle_drafter, "resolve_model_dir", missing)
    with pytest.raises(ValueError, match="no EAGLE-3 head is shipped for the target"):
        eagle_drafter.shipped_head(tiny_llama_dir)


def test_the_shipped_head_is_the_default_models_and_fits_in_git(smollm2_dir):
    """`eagle3` with no path on the default model: the head in drafters/eagle3/heads, at most
    16 MB with its LM head taken from the target, and its card beside it."""
    from drafters.eagle3.drafter import shipped_head
    path = shipped_head(smollm2_dir)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 16 * 2 ** 20
    assert (path / "README.md").is_file()
    target = TargetModel(str(smollm2_dir), load_tokenizer_files=False)
    head = load_head(path, target.config, target_head=target.output_table)
    assert head.cfg.lm_head_from_target and head.cfg.draft_vocab_size >= 8192
    assert torch.equal(head.lm_head.weight, target.output_table()[head.draft_to_target])

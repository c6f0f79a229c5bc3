"""EAGLE-3 layout flags (issue 17, item 6): `norm_output` against a reference forward written
here from the public definition, which layers explicit `eagle_aux_hidden_state_layer_ids`
tap under vLLM's and SGLang's readings and in which order, and refusal of config flags the
head's forward does not implement. CPU only; no target model is built."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from conftest import random_eagle_head
from drafters.base import DraftRequest, TargetHidden
from drafters.eagle3 import Eagle3Config, HeadMismatchError, load_head, save_head
from drafters.eagle3.drafter import Eagle3Drafter
from spec import SamplingParams
from verifier.model.config import ModelConfig

# A 32-layer target shape (only its config: the drafter is fed hidden states directly).
TARGET = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=32,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position=1024)
PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
_DROP = object()                # a config edit that removes the key


def _saved_head(tmp_path, style: str = "eagle", **config_edits):
    """A random head saved in `style`, its config.json edited; -> its directory."""
    root = save_head(random_eagle_head(TARGET, draft_vocab=64), tmp_path / style, style=style)
    cfg = json.loads((root / "config.json").read_text())
    for key, value in config_edits.items():
        _set(cfg, key, value)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, key = dotted.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
    if value is _DROP:
        cfg.pop(key, None)
    else:
        cfg[key] = value


# ---- the reference: the speculators / EAGLE-3 definition, one position at a time ------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos: int, theta: float):
    """HF's rotate-half RoPE on x [heads, D] at one position."""
    d = x.shape[-1]
    ang = pos / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([ang, ang]).cos().float(), torch.cat([ang, ang]).sin().float()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


class _Reference:
    """Eagle3FirstLayerMixin.forward + Eagle3DraftModel.forward (speculators), read from the
    checkpoint file by its public tensor names. `step` returns (logits, hidden for the next
    step): h is the decoder layer's output, logits = lm_head(norm(h)), and the next step gets
    norm(h) if norm_output else h."""

    def __init__(self, root, style: str, cfg: Eagle3Config, norm_output: bool, norm_before_residual: bool):
        t = load_file(str(root / "model.safetensors"))
        self.w = {k.replace(PREFIX[style], "layer."): v.float() for k, v in t.items()}
        self.cfg, self.norm_output, self.norm_before_residual = cfg, norm_output, norm_before_residual
        self.keys, self.values = [], []

    def fuse(self, aux):
        return aux @ self.w["fc.weight"].T

    def step(self, hid, emb, pos: int):
        c, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        residual = hid
        hid = _rms(hid, w["layer.hidden_norm.weight"], eps)
        if self.norm_before_residual:
            residual = hid
        x = torch.cat([_rms(emb, w["layer.input_layernorm.weight"], eps), hid])           # [2H]
        q = _rope((x @ w["layer.self_attn.q_proj.weight"].T).view(c.num_heads, -1), pos, c.rope.theta)
        self.keys.append(_rope((x @ w["layer.self_attn.k_proj.weight"].T).view(c.num_kv_heads, -1),
                               pos, c.rope.theta))
        self.values.append((x @ w["layer.self_attn.v_proj.weight"].T).view(c.num_kv_heads, -1))
        rep = c.num_heads // c.num_kv_heads
        k = torch.stack(self.keys).repeat_interleave(rep, 1)                            # [S, nh, D]
        v = torch.stack(self.values).repeat_interleave(rep, 1)
        p = (torch.einsum("hd,shd->hs", q, k) * c.head_dim ** -0.5).softmax(-1)
        h = residual + torch.einsum("hs,shd->hd", p, v).reshape(-1) @ w["layer.self_attn.o_proj.weight"].T
        m = _rms(h, w["layer.post_attention_layernorm.weight"], eps)
        h = h + (F.silu(m @ w["layer.mlp.gate_proj.weight"].T) * (m @ w["layer.mlp.up_proj.weight"].T)) \
            @ w["layer.mlp.down_proj.weight"].T
        normed = _rms(h, w["norm.weight"], eps)
        return normed @ w["lm_head.weight"].T, (normed if self.norm_output else h)


def _reference_logits(ref: _Reference, aux, ctx, chain, embed) -> torch.Tensor:
    """Logits at the root and after each drafted token of `chain` (teacher-forced) [k, Vd].
    Pair t = (target hidden t, token t+1) sits at position t; chain step k at root + k."""
    with torch.no_grad():
        for t in range(len(ctx) - 1):
            logits, hid = ref.step(ref.fuse(aux[t]), embed(torch.tensor(ctx[t + 1])), t)
        out = [logits]
        for k, tok in enumerate(chain[:-1], start=1):
            logits, hid = ref.step(hid, embed(torch.tensor(tok)), len(ctx) - 2 + k)
            out.append(logits)
    return torch.stack(out)


def _drafter_chain(head, aux, ctx, depth: int):
    """A greedy chain from the drafter -> (drafted target ids, the draft logits it computed)."""
    seen, orig = [], head.draft_logits
    head.draft_logits = lambda out: seen.append(orig(out)) or seen[-1]
    try:
        drafter = Eagle3Drafter(head)
        drafter.observe([TargetHidden(0, 0, aux[:7]), TargetHidden(0, 7, aux[7:])])
        req = DraftRequest(0, ctx, SamplingParams(temperature=0), None, max_depth=depth,
                           max_nodes=depth, topk=1)
        tree = drafter.propose([req])[0].tree
    finally:
        del head.draft_logits
    return [tree.tokens[i] for i in range(1, tree.num_nodes)], torch.cat(seen)


@pytest.mark.parametrize("style", ["eagle", "speculators"])
@pytest.mark.parametrize("norm_output", [False, True])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_multi_step_drafts_match_the_reference_forward(tmp_path, style, norm_output, norm_before_residual):
    """Every draft step's logits (root and three chain steps) equal the public definition's,
    for both `norm_output` settings read from either layout. With the flag ignored (the
    reference run the other way on the same tokens) the first step still matches but the
    later ones do not: the test would catch it."""
    root = _saved_head(tmp_path, style, norm_output=norm_output, norm_before_residual=norm_before_residual)
    head = load_head(root, TARGET)
    assert (head.cfg.norm_output, head.cfg.norm_before_residual) == (norm_output, norm_before_residual)
    torch.manual_seed(3)
    embed = nn.Embedding(TARGET.vocab_size, TARGET.hidden_size)
    head.use_target_embedding(embed)
    ctx = torch.randint(0, TARGET.vocab_size, (16,)).tolist()
    aux = torch.randn(len(ctx) - 1, 3 * TARGET.hidden_size)               # target states 0..n-2
    chain, got = _drafter_chain(head, aux, ctx, depth=4)
    assert len(chain) == 4 and got.shape == (4, 64)

    def ref(flag):
        r = _Reference(root, style, head.cfg, flag, norm_before_residual)
        return _reference_logits(r, aux, ctx, chain, embed)
    want = ref(norm_output)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    drafted = want.argmax(-1) + head.d2t[want.argmax(-1)]
    assert drafted.tolist() == chain
    ignored = ref(not norm_output)
    torch.testing.assert_close(ignored[0], got[0], rtol=1e-3, atol=1e-3)
    assert ((ignored[1:] - got[1:]).abs().amax(-1) > 0.1).all()      # every later step diverges


@pytest.mark.parametrize("style", ["eagle", "speculators"])
def test_norm_output_survives_save_and_load(tmp_path, style):
    head = load_head(_saved_head(tmp_path, style, norm_output=True), TARGET)
    save_head(head, tmp_path / "again", style=style)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["norm_output"] is True
    assert load_head(tmp_path / "again", TARGET).cfg.norm_output


# ---- tapped layers ----------------------------------------------------------------------
VLLM_IDS = [2, 15, 29]          # inputs of layers 2, 15, 29 (= HF hidden_states[i])
SGLANG_IDS = [1, 14, 28]        # the same states as outputs of layers 1, 14, 28


@pytest.mark.parametrize("style", ["eagle", "speculators"])
def test_sglang_ids_tap_the_same_layers_as_vllm_ids(tmp_path, style):
    """vLLM taps the input of layer i; SGLang's set_eagle3_layers_to_capture taps layer i + 1.
    A head in SGLang's count, said in its config or told to the loader, taps what the vLLM
    config taps; the drafter captures those layers."""
    ids = "eagle_config.eagle_aux_hidden_state_layer_ids" if style == "eagle" else "eagle_aux_hidden_state_layer_ids"
    conv = ids.replace("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids_convention")
    vllm = load_head(_saved_head(tmp_path / "v", style, **{ids: VLLM_IDS, conv: _DROP}), TARGET)
    said = load_head(_saved_head(tmp_path / "s", style, **{ids: SGLANG_IDS, conv: "sglang"}), TARGET)
    told = load_head(_saved_head(tmp_path / "t", style, **{ids: SGLANG_IDS, conv: _DROP}), TARGET,
                     aux_layer_convention="sglang")
    named = load_head(_saved_head(tmp_path / "n", style, **{ids: SGLANG_IDS, conv: "layer_output"}), TARGET)
    assert vllm.cfg.aux_layer_ids == (2, 15, 29)
    for head in (said, told, named):
        assert head.cfg.aux_layer_ids == vllm.cfg.aux_layer_ids
        assert Eagle3Drafter(head).capture_layers == (2, 15, 29)
    # Written back in Tercel's (vLLM's) count, and said so.
    save_head(told, tmp_path / "w", style=style)
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    nested = cfg.get("eagle_config", cfg)
    assert nested["eagle_aux_hidden_state_layer_ids"] == VLLM_IDS
    assert nested["aux_hidden_state_layer_ids_convention"] == "layer_input"


def test_unsorted_ids_are_tapped_in_ascending_layer_order(tmp_path):
    """vLLM and SGLang collect the taps while walking the layers upwards, so fc sees them in
    ascending layer order whatever order the config lists; Tercel's capture order (which the
    engine concatenates in) is the same."""
    head = load_head(_saved_head(tmp_path, **{"eagle_config.eagle_aux_hidden_state_layer_ids": [29, 2, 15]}),
                     TARGET)
    assert head.cfg.aux_layer_ids == (2, 15, 29)
    assert Eagle3Drafter(head).capture_layers == (2, 15, 29)
    with pytest.raises(ValueError, match="ascending"):
        dataclasses.replace(head.cfg, aux_layer_ids=(29, 2, 15))


def test_layer_id_conflicts_are_refused(tmp_path):
    """Two different id lists (top level vs eagle_config), or a config's convention against
    the loader's, are ambiguous: refused, not resolved silently."""
    both = _saved_head(tmp_path / "a", **{"eagle_aux_hidden_state_layer_ids": [3, 15, 29]})
    with pytest.raises(HeadMismatchError, match="eagle_aux_hidden_state_layer_ids"):
        load_head(both, TARGET)
    with pytest.raises(HeadMismatchError, match="sglang"):
        load_head(_saved_head(tmp_path / "b"), TARGET, aux_layer_convention="sglang")
    with pytest.raises(HeadMismatchError, match="convention"):
        load_head(_saved_head(tmp_path / "c", **{"eagle_config.aux_hidden_state_layer_ids_convention": "hf"}),
                  TARGET)


def test_empty_id_list_means_default_taps(tmp_path):
    """ModelOpt writes `[]` for "no explicit taps"; vLLM then uses its default (2, n/2, n-3)."""
    head = load_head(_saved_head(tmp_path, **{"eagle_config.eagle_aux_hidden_state_layer_ids": []}), TARGET)
    assert head.cfg.aux_layer_ids == (2, 16, 29)


# ---- flags the forward does not implement ---------------------------------------------------
REFUSED = [
    ("eagle", "norm_before_fc", True),
    ("eagle", "eagle_config.norm_before_fc", True),
    ("eagle", "fc_norm", True),
    ("eagle", "eagle_config.use_aux_hidden_state", False),
    ("eagle", "eagle_config.use_mtp_layernorm", True),
    ("eagle", "eagle_config.parallel_draft_step", 2),
    ("eagle", "eagle_config.some_new_switch", 0),             # unknown key in the EAGLE sub-config
    ("eagle", "attention_bias", True),
    ("eagle", "mlp_bias", True),
    ("eagle", "hidden_act", "gelu"),
    ("eagle", "num_hidden_layers", 2),
    ("eagle", "logit_scale", 2.0),
    ("eagle", "use_sliding_window", True),                   # an unknown flag set to true
    ("speculators", "norm_before_fc", True),
    ("speculators", "fc_norm", True),
    ("speculators", "some_new_flag", True),
    ("speculators", "speculators_model_type", "eagle"),
    ("speculators", "speculators_config.algorithm", "mtp"),
    ("speculators", "transformer_layer_config.model_type", "qwen3"),
    ("speculators", "transformer_layer_config.num_hidden_layers", 3),
    ("speculators", "transformer_layer_config.attention_bias", True),
]


@pytest.mark.parametrize("style,key,value", REFUSED)
def test_unimplemented_flags_are_refused_by_name(tmp_path, style, key, value):
    """A key that would change the forward, set to something the head does not compute, is a
    load error naming the key (the layout the head came from decides nothing else)."""
    with pytest.raises(HeadMismatchError, match=key.split(".")[-1]):
        load_head(_saved_head(tmp_path, style, **{key: value}), TARGET)


HARMLESS = {
    "torch_dtype": "bfloat16", "transformers_version": "4.46.0", "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama", "use_cache": True, "tie_word_embeddings": True, "output_hidden_states": True,
    "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "pretraining_tp": 1,
    "attention_dropout": 0.0, "rope_scaling": None, "target_vocab_size": 256, "attention_bias": False,
    "embed_requires_grad": True, "enable_sp_ulysses": True, "speculators_version": "0.3.0",
    "logit_scale": 1, "norm_before_fc": False, "fc_norm": False,
}
HARMLESS_NESTED = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                   "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                   "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 0}


@pytest.mark.parametrize("style", ["eagle", "speculators"])
def test_harmless_keys_load(tmp_path, style):
    """What ordinary HF, speculators, SpecForge and ModelOpt configs carry loads unchanged."""
    edits = dict(HARMLESS, **{f"eagle_config.{k}": v for k, v in HARMLESS_NESTED.items()})
    if style == "speculators":
        edits.update({f"transformer_layer_config.{k}": v for k, v in HARMLESS.items()
                      if k not in ("architectures", "model_type")})
    plain = load_head(_saved_head(tmp_path / "plain", style), TARGET)
    busy = load_head(_saved_head(tmp_path / "busy", style, **edits), TARGET)
    assert busy.cfg == plain.cfg


@pytest.mark.parametrize("style", ["eagle", "speculators"])
def test_lm_head_from_target_is_not_stored_and_comes_from_the_target(tmp_path, style):
    head = random_eagle_head(TARGET, draft_vocab=64)
    head.cfg = dataclasses.replace(head.cfg, lm_head_from_target=True)
    root = save_head(head, tmp_path / style, style=style)
    assert not any(k.endswith("lm_head.weight") for k in load_file(str(root / "model.safetensors")))
    table = torch.randn(TARGET.vocab_size, TARGET.hidden_size)
    loaded = load_head(root, TARGET, target_head=lambda: table)
    assert loaded.cfg.lm_head_from_target
    assert torch.equal(loaded.lm_head.weight, table[head.draft_to_target])
    with pytest.raises(HeadMismatchError, match="lm_head_from_target.*target_head"):
        load_head(root, TARGET)
    with pytest.raises(HeadMismatchError, match=r"\(256, 32\)"):
        load_head(root, TARGET, target_head=lambda: table[:, :32])
    tensors = load_file(str(root / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": table[:64].clone()}, str(root / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="one or the other"):
        load_head(root, TARGET, target_head=lambda: table)

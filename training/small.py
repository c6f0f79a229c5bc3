"""`train-drafter --kind small`: distil a few-layer Llama draft model from the target.

The student is the target's architecture with `--small-layers` decoder layers, started
from evenly spaced target layers plus the target's embeddings, final norm and LM head,
and trained by KL(target || student) on the target's logits at assistant tokens. The
target's logits come online from Tercel's own forward (a vocabulary-sized row per token
is too large to cache). The student trains on the CPU (its autocast is the CPU's). The
result is an HF directory (config.json, safetensors, the target's tokenizer files) that
`small:PATH` loads.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from training import precision
from training.config import TrainConfig
from training.data import TokenizedExample
from training.loop import StepResult, Trainer, make_accelerator, shard
from verifier.batch import ForwardBatch, SeqInput

log = logging.getLogger("tercel.training")


def train_small(cfg: TrainConfig, target, examples: list[TokenizedExample], rank: int = 0, world: int = 1) -> dict:
    """Trains on this process's shard of the examples (`rank` of `world`, training/loop.py)."""
    student, picked = build_student(target, cfg.small_layers)
    log.info("student: %d layers from target layers %s", cfg.small_layers, picked)
    mine = shard(examples, rank, world)

    def loss(batch_idx: list[int], autocast) -> StepResult:
        exs = [mine[i] for i in batch_idx]
        teacher = _teacher_logprobs(target, exs)                     # [sum T, V]
        ids, attn, mask = _pad(exs)
        with autocast:
            logits = student(input_ids=ids, attention_mask=attn).logits.float()   # [B, T, V]
        flat = logits[attn.bool()]                                     # rows in teacher order
        keep = mask[attn.bool()]
        if not keep.any():
            return StepResult(flat.sum() * 0.0, int(attn.sum()), {})
        t, s = teacher[keep], flat[keep].log_softmax(-1)
        kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
        acc = float((s.argmax(-1) == t.argmax(-1)).float().mean())
        return StepResult(kl, int(attn.sum()), {"acc": acc})

    params = [p for p in student.parameters() if p.requires_grad]
    probe = precision.probe_example([len(e.input_ids) for e in mine])
    dtype = precision.choose(cfg.dtype, "cpu", lambda d: loss(probe, precision.autocast("cpu", d)).loss, params)
    accelerator = make_accelerator(dtype, cfg.grad_accum, cpu=True)

    def step(batch_idx: list[int]) -> StepResult:
        return loss(batch_idx, accelerator.autocast())

    def save(path: Path) -> None:
        save_student(student, target, path)

    def load(path: Path) -> None:
        student.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)

    student.train()
    lengths = [[len(e.input_ids) for e in shard(examples, r, world)] for r in range(world)]
    trainer = Trainer(cfg, accelerator, params, step, lengths, save, load)
    if cfg.resume:
        trainer.resume()
    state = trainer.run()
    if accelerator.is_main_process:
        save_student(student, target, Path(cfg.output))
    return {"kind": "small", "target": cfg.target, "examples": len(examples), "layers": cfg.small_layers,
            "init_layers": picked, "steps": state.step, "tokens_seen": state.tokens,
            "train_seconds": round(state.seconds, 1), "dtype": precision.label(dtype), "lr": cfg.lr,
            "batch_tokens": cfg.batch_tokens, "grad_accum": cfg.grad_accum, "processes": world}


def build_student(target, num_layers: int):
    """An HF Llama with `num_layers` layers copied from evenly spaced target layers."""
    import transformers  # lazy: ~0.4 s over the training imports, and only --kind small builds a student
    tc = target.config
    if num_layers > tc.num_layers:
        raise ValueError(f"--small-layers {num_layers} exceeds the target's {tc.num_layers} layers")
    hf_cfg = json.loads((Path(target.model_dir) / "config.json").read_text())
    hf_cfg.update(num_hidden_layers=num_layers, model_type="llama", architectures=["LlamaForCausalLM"])
    config = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k not in ("transformers_version",)})
    student = transformers.LlamaForCausalLM(config).float()
    picked = [round(i * (tc.num_layers - 1) / max(1, num_layers - 1)) for i in range(num_layers)]
    net = target.net
    with torch.no_grad():
        sm = student.model
        sm.embed_tokens.weight.copy_(net.model.embed_tokens.weight)
        sm.norm.weight.copy_(net.model.norm.weight)
        if not config.tie_word_embeddings:
            student.lm_head.weight.copy_(net.lm_head.weight)
        for dst, src_i in zip(sm.layers, picked):
            src = net.model.layers[src_i]
            q, k, v = src.self_attn.qkv_proj.weight.split([tc.q_size, tc.kv_size, tc.kv_size])
            dst.self_attn.q_proj.weight.copy_(q)
            dst.self_attn.k_proj.weight.copy_(k)
            dst.self_attn.v_proj.weight.copy_(v)
            if tc.attention_bias:
                raise ValueError("--kind small supports Llama-style targets without attention bias")
            dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
            gate, up = src.mlp.gate_up_proj.weight.chunk(2)
            dst.mlp.gate_proj.weight.copy_(gate)
            dst.mlp.up_proj.weight.copy_(up)
            dst.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight)
            dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
    return student, picked


def save_student(student, target, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(str(path), safe_serialization=True)
    for f in Path(target.model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)


@torch.inference_mode()
def _teacher_logprobs(target, exs: list[TokenizedExample]) -> torch.Tensor:
    bs, seqs, nxt = 16, [], 0
    need = sum(-(-len(e.input_ids) // bs) for e in exs)
    if target.kv is None or target.kv.num_blocks < need:
        target.allocate_kv(need, bs)
    for e in exs:
        n = -(-len(e.input_ids) // bs)
        seqs.append(SeqInput(list(e.input_ids), 0, list(range(nxt, nxt + n)),
                             logits_indices=list(range(len(e.input_ids)))))
        nxt += n
    logits = target.forward(ForwardBatch(seqs)).logits
    return logits.log_softmax(-1).clone()


def _pad(exs: list[TokenizedExample]):
    B, T = len(exs), max(len(e.input_ids) for e in exs)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, e in enumerate(exs):
        n = len(e.input_ids)
        ids[b, :n] = torch.tensor(e.input_ids)
        attn[b, :n] = 1
        # Row t predicts token t+1: it carries loss when token t+1 is an assistant token.
        mask[b, :n - 1] = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
    return ids, attn, mask

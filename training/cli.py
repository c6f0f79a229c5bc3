"""`train-drafter`: train an EAGLE-3 head (`--kind eagle3`) or distil a small draft model
(`--kind small`) for a target, on JSONL conversations.

    train-drafter --kind eagle3 --data ../shared/data/train --output heads/mine \\
        --limit-per-source 300 --regenerate --eval-data ../shared/data/heldout
    train-drafter --data ../shared/data/train --output runs/all --regenerate-only   # replies only, resumable
    accelerate launch --multi_gpu --num_processes 8 $(which train-drafter) --kind eagle3 ...   # data parallel
    torchrun --nproc_per_node 2 $(which train-drafter) ...                    # the same on CPUs

The loop runs on accelerate (training/loop.py); under its launcher every process trains on its
shard of the examples, the main process regenerates replies, evaluates and writes the result.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState

from drafters.conversations import load_conversations
from training.card import write_card
from training.config import TrainConfig
from training.data import load_prompts, tokenize_conversation
from training.eagle3 import train_eagle3
from training.evaluate import evaluate_drafter
from training.regenerate import regenerate
from training.small import train_small
from verifier.target import TargetModel

log = logging.getLogger("tercel.training")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train-drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["eagle3", "small"], default="eagle3")
    p.add_argument("--target", default=TrainConfig.target, help="alias, .gguf or HF directory")
    p.add_argument("--data", nargs="+", required=True, help="JSONL files or directories of them")
    p.add_argument("--output", required=True, help="directory for the trained drafter")
    p.add_argument("--limit-per-source", type=int, default=None,
                   help="seeded sample of at most N conversations per source")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per conversation")
    p.add_argument("--regenerate", action="store_true",
                   help="replace the replies by the target's own (self-distillation, Tercel's engine)")
    p.add_argument("--regenerate-only", action="store_true",
                   help="regenerate the replies into OUTPUT/regenerated.jsonl and stop, in a seeded order mixing the "
                        "sources (a run cut short leaves a uniform sample; the next picks up where it stopped): "
                        "a CPU's share of a job whose training runs elsewhere")
    p.add_argument("--regen-max-tokens", type=int, default=256)
    p.add_argument("--regen-temperature", type=float, default=0.0)
    p.add_argument("--regen-batch", type=int, default=TrainConfig.regen_batch, help="replies generated at once")
    p.add_argument("--feature-cache", default=None, help="directory to cache target features (fp16)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="eagle3: draft vocabulary size")
    p.add_argument("--ttt-steps", type=int, default=7, help="eagle3: training-time-test steps")
    p.add_argument("--step-decay", type=float, default=0.8, help="eagle3: loss weight decay per step")
    p.add_argument("--no-init-from-target", dest="init_from_target", action="store_false",
                   help="eagle3: start from random weights instead of the target's last layer")
    p.add_argument("--lm-head-from-target", action="store_true",
                   help="eagle3: the LM head is the target's rows of the draft vocabulary, frozen and not "
                        "saved (a head half the size; Tercel loads it with the target)")
    p.add_argument("--small-layers", type=int, default=4, help="small: decoder layers")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many trained tokens")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimiser step, per process (accelerate's gradient accumulation)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=float, default=0.03, help="share of steps warming up")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--quantization", default="auto",
                   help="the target as it will serve: replies, features and the evaluation come from it")
    p.add_argument("--dtype", choices=["fp32", "bf16", "auto"], default="auto",
                   help="training precision; auto: whichever runs a probe step faster here (bf16 on AMX)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="optimiser steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-data", default=None,
                   help="held-out JSONL (conversations, or MT-bench / Spec-Bench questions): report the "
                        "mean accepted length")
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    fields = {k: v for k, v in vars(args).items() if k != "log_level"}
    fields["data"] = tuple(fields["data"])
    try:
        cfg = TrainConfig(**fields)
        summary = train(cfg, command=shlex.join(["train-drafter", *(sys.argv[1:] if argv is None else argv)]))
    except (ValueError, FileNotFoundError) as e:
        print(f"train-drafter: error: {e}", file=sys.stderr)
        return 2
    if summary.get("main_process", True):
        print(json.dumps(summary, indent=2))
    return 0


def train(cfg: TrainConfig, command: str | None = None) -> dict:
    """Run one training job; `command` (the command line) goes into the model card. Under
    accelerate's launcher this is one process of several (see the module docstring)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    convs, report = load_conversations(list(cfg.data), cfg.limit_per_source, cfg.seed)
    log.info("data: %s", report.summary())
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    # the small student trains on the CPU; an EAGLE-3 head where the launcher puts its process
    procs = PartialState(cpu=cfg.kind == "small" or not torch.cuda.is_available())
    if cfg.regenerate or cfg.regenerate_only:
        convs = _regenerate(cfg, convs, out, procs)
    if cfg.regenerate_only:
        return {"regenerated": len(convs), "output": str(out / "regenerated.jsonl"),
                "wall_seconds": round(time.perf_counter() - start, 1), "main_process": procs.is_main_process}
    target = TargetModel(cfg.target, device=str(procs.device) if procs.device.type == "cuda" else None)
    examples = [ex for c in convs if (ex := tokenize_conversation(target.tokenizer, c, cfg.max_len))]
    if not examples:
        raise ValueError("no conversation has trainable assistant tokens after templating")
    log.info("%d examples, %d tokens (%d assistant)", len(examples), sum(len(e.input_ids) for e in examples),
             sum(sum(e.loss_mask) for e in examples))
    if cfg.kind == "eagle3":
        summary = train_eagle3(cfg, target, examples, procs.process_index, procs.num_processes)
        drafter = f"eagle3:{out}"
    else:
        summary = train_small(cfg, target, examples, procs.process_index, procs.num_processes)
        drafter = f"small:{out}"
    if not procs.is_main_process:
        return {**summary, "main_process": False}
    summary["data"] = {"files": report.files, "conversations": report.conversations,
                       "skipped_lines": len(report.skipped), "regenerated": cfg.regenerate}
    summary["wall_seconds"] = round(time.perf_counter() - start, 1)
    if cfg.eval_data:
        summary["heldout"] = _evaluate(cfg, drafter)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_card(out, summary, command=command)
    return summary


def _regenerate(cfg: TrainConfig, convs, out: Path, procs):
    """The main process writes the replies (resumably); the others wait for them."""
    path = out / "regenerated.jsonl"
    if procs.is_main_process:
        order = random.Random(cfg.seed).sample(convs, len(convs))    # the sources mixed: a partial run is a sample
        regenerate(order, cfg.target, str(path), max_new_tokens=cfg.regen_max_tokens,
                   temperature=cfg.regen_temperature, batch_size=cfg.regen_batch, seed=cfg.seed,
                   quantization=cfg.quantization)
    procs.wait_for_everyone()
    regen, _ = load_conversations([str(path)])
    wanted = {c.id for c in convs}
    return [c for c in regen if c.id in wanted]


def _evaluate(cfg: TrainConfig, drafter: str) -> dict:
    res = evaluate_drafter(cfg.target, drafter, load_prompts(cfg.eval_data, cfg.eval_prompts), cfg.eval_tokens,
                           quantization=cfg.quantization)
    log.info("held-out: mean accepted length %.2f over %d prompts", res.mean_accepted_length, res.prompts)
    return res.as_dict()


if __name__ == "__main__":
    sys.exit(main())

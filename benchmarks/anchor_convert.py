"""The anchor side by side (benchmarks/anchor.sh): move eaglepipe's hidden states into speculators' offline trainer
and its trained draft back into eaglepipe's checkpoint format, so one evaluator (eaglepipe.evaluate) and one engine
(vLLM) score both drafts.

    # our shards -> speculators' data folder (a datasets save_to_disk table + hidden_states/hs_<i>.safetensors)
    python benchmarks/anchor_convert.py to-speculators --target T --out DATA [--vocab-from DRAFT] \
        --train results/hidden_states/train/*.safetensors --val results/hidden_states/eval/*.safetensors \
        [--data-fraction 0.25 --seed 0]
    # speculators' checkpoint -> eaglepipe's draft folder (config.json + model.safetensors, vLLM's Eagle-3 form)
    python benchmarks/anchor_convert.py to-eaglepipe --target T --checkpoint CKPT --aux-layer-ids 2 15 27 --out DIR

What speculators (0.9.0) reads, from speculators/train/data.py and hs_connectors/transfer.py:
  DATA/                    datasets.save_to_disk table, torch format, one row per sequence: input_ids (int64),
                           loss_mask (int64), seq_len (int); row i's states are DATA/hidden_states/hs_<i>.safetensors
  hs_<i>.safetensors       token_ids int64 [T]; hidden_states [T, 4, H]: the 3 aux layers, then the verifier's
                           last hidden state BEFORE its final norm (the trainer applies the verifier's norm and
                           lm_head to it to make the distillation target).
  DATA/d2t-<Vd>.npy, t2d-<Vd>.npy   the draft vocabulary, found by --draft-vocab-size Vd.
eaglepipe's shards hold the final state AFTER the norm (final = w * h / rms(h)). RMSNorm is scale-invariant, so
final / w (= h / rms(h)) normed again gives back w * h / rms(h) = final: that is what we store as the last layer.
The trainer splits train/val by one ratio of the same table, so the val rows (our eval split) go last and the
ratio that puts the boundary exactly between them is written to DATA/anchor.json (pass it as --train-data-ratio).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.draft import DraftConfig, Eagle3Draft, save_checkpoint  # noqa: E402
from eaglepipe.formats import read_hidden_shard  # noqa: E402


def target_tensor(target_dir: Path, suffix: str) -> torch.Tensor:
    """The target's tensor named *suffix outside its decoder layers (shortest name wins)."""
    found = []
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found += [(len(k), k, path) for k in f.keys()
                      if (k == suffix or k.endswith("." + suffix)) and ".layers." not in k]
    if not found:
        raise SystemExit(f"{target_dir}: no tensor *{suffix} outside the decoder layers in its *.safetensors; "
                         "pass the target's Hugging Face checkpoint folder as --target")
    _, name, path = min(found)
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def to_speculators(args) -> None:
    from datasets import Dataset  # speculators' own dependency; only this subcommand needs it

    target, out = Path(args.target), Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; remove it or choose another --out")
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    norm_w = target_tensor(target, "norm.weight").float()
    if bool((norm_w.abs() < 1e-6).any()):
        raise SystemExit(f"{target}: its final norm has (near-)zero weights; final / weight cannot undo the norm")
    target_cfg = json.loads((target / "config.json").read_text())
    head = target_tensor(target, "embed_tokens.weight" if target_cfg.get("tie_word_embeddings") else "lm_head.weight")
    head = head.float()
    eps = target_cfg.get("rms_norm_eps", 1e-6)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    counts = {"train": 0, "val": 0}
    tokens = {"train": 0, "val": 0}
    agree = total = 0
    layer_ids = None
    train_paths = sorted(args.train)
    kept = None
    if args.data_fraction < 1:  # the same seeded subset that train.data_fraction (and tools/scaling) trains on
        from eaglepipe.batches import sequence_lengths
        from eaglepipe.train import kept_sequences
        kept = kept_sequences([sequence_lengths(p) for p in train_paths],
                              {"data_fraction": args.data_fraction, "seed": args.seed})
    for split, paths in (("train", train_paths), ("val", sorted(args.val or []))):
        for index, path in enumerate(paths):
            shard, meta = read_hidden_shard(path)
            if layer_ids is None:
                layer_ids = meta.get("layer_ids")
            elif meta.get("layer_ids") != layer_ids:
                raise SystemExit(f"{path}: layer_ids {meta.get('layer_ids')} differ from the first shard's {layer_ids}")
            cu = shard["cu_seqlens"].tolist()
            keep = range(len(cu) - 1) if kept is None or split == "val" else kept[index]
            for s in keep:
                a, b = cu[s], cu[s + 1]
                if b - a < 2:
                    continue
                ids = shard["input_ids"][a:b].long()
                final = shard["final"][a:b].float()
                last = (final / norm_w).to(torch.bfloat16)
                if total < 20000:  # the round trip keeps the target's greedy token (bf16 rounding aside)
                    back = last.float() * torch.rsqrt(last.float().pow(2).mean(-1, keepdim=True) + eps) * norm_w
                    agree += int(((back @ head.T).argmax(-1) == (final @ head.T).argmax(-1)).sum())
                    total += b - a
                hs = torch.cat([shard["aux"][a:b], last[:, None]], 1).contiguous()
                save_file({"token_ids": ids.contiguous(), "hidden_states": hs},
                          str(hs_dir / f"hs_{len(rows['seq_len'])}.safetensors"))
                rows["input_ids"].append(ids.tolist())
                rows["loss_mask"].append(shard["loss_mask"][a:b].long().tolist())
                rows["seq_len"].append(b - a)
                counts[split] += 1
                tokens[split] += b - a
    if counts["train"] == 0 or counts["val"] == 0:
        raise SystemExit(f"need sequences in both --train and --val (got {counts}); speculators always validates")
    n = counts["train"] + counts["val"]
    ratio = (counts["train"] + 0.5) / n  # int(n * ratio) == counts["train"]
    assert int(n * ratio) == counts["train"]
    table = Dataset.from_dict(rows)
    table.set_format(type="torch")
    table.save_to_disk(str(out))
    vocab = None
    if args.vocab_from:
        state = load_file(str(Path(args.vocab_from) / "model.safetensors"))
        d2t, t2d = state["d2t"].long(), state["t2d"].bool()
        vocab = int(d2t.numel())
        np.save(out / f"d2t-{vocab}.npy", d2t.numpy())
        np.save(out / f"t2d-{vocab}.npy", t2d.numpy())
    info = {"data_fraction": args.data_fraction, "seed": args.seed, "sequences": counts, "tokens": tokens,
            "train_data_ratio": ratio, "layer_ids": layer_ids,
            "draft_vocab_size": vocab, "greedy_round_trip_agreement": agree / max(total, 1),
            "round_trip_positions": total}
    (out / "anchor.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


# speculators' Eagle-3 parameter name -> eaglepipe's (= vLLM's LlamaForCausalLMEagle3 checkpoint names)
RENAMES = {"layers.0.": "midlayer."}
DROP = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")


def find_weights(ckpt: Path) -> Path:
    files = sorted(ckpt.glob("*.safetensors"))
    if len(files) != 1:
        raise SystemExit(f"{ckpt}: expected one *.safetensors (a speculators checkpoint folder), found {files}")
    return files[0]


def to_eaglepipe(args) -> None:
    ckpt, target = Path(args.checkpoint), Path(args.target)
    cfg = json.loads((ckpt / "config.json").read_text())
    # Our draft (and vLLM's default Eagle-3 layer) has none of speculators' extra norms: refuse a draft that has them.
    extra = {k: cfg.get(k) for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
             if cfg.get(k)}
    if extra:
        raise SystemExit(f"{ckpt}/config.json: {extra}; eaglepipe's draft has none of these norms. Train with "
                         "--no-norm-before-fc --no-norm-output --no-norm-before-residual (see benchmarks/anchor.sh)")
    layers = cfg.get("transformer_layer_config", {}).get("num_hidden_layers", 1)
    if layers != 1:
        raise SystemExit(f"{ckpt}: {layers} draft layers; eaglepipe's draft has one")
    state = load_file(str(find_weights(ckpt)))
    ours = {}
    for name, tensor in state.items():
        if name.startswith(DROP):
            continue
        for old, new in RENAMES.items():
            name = name.replace(old, new)
        ours[name] = tensor
    target_cfg = json.loads((target / "config.json").read_text())
    lm_rows = ours["lm_head.weight"].shape[0]
    config = DraftConfig.from_target(target_cfg, draft_vocab_size=lm_rows, aux_layer_ids=args.aux_layer_ids)
    model = Eagle3Draft(config)
    expected = set(model.state_dict())
    if "d2t" not in ours:  # a full-vocabulary draft: identity mapping
        ours["d2t"] = torch.zeros(lm_rows, dtype=torch.int64)
        ours["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    missing, unexpected = expected - set(ours), set(ours) - expected
    if missing or unexpected:
        raise SystemExit(f"{ckpt}: weights do not map onto eaglepipe's draft: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    model.load_state_dict({k: v if v.dtype in (torch.int64, torch.bool) else v.float() for k, v in ours.items()})
    if bool(model.t2d.any()) and int(model.t2d.sum()) != lm_rows:
        raise SystemExit(f"{ckpt}: t2d marks {int(model.t2d.sum())} tokens for a {lm_rows}-row lm_head")
    save_checkpoint(model, args.out)
    print(f"wrote {args.out} ({len(ours)} tensors, draft vocab {lm_rows}, aux layers {args.aux_layer_ids})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-speculators")
    a.add_argument("--target", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--train", nargs="+", required=True, help="our train-split hidden-state shards")
    a.add_argument("--val", nargs="+", required=True, help="our eval-split shards (speculators' val rows)")
    a.add_argument("--vocab-from", help="an eaglepipe draft folder whose d2t/t2d the anchor reuses")
    a.add_argument("--data-fraction", type=float, default=1.0,
                   help="train on this share of each train shard's sequences, the subset train.data_fraction picks")
    a.add_argument("--seed", type=int, default=0, help="train.seed of the recipe the subset is compared with")
    b = sub.add_parser("to-eaglepipe")
    b.add_argument("--target", required=True)
    b.add_argument("--checkpoint", required=True, help="a speculators checkpoint folder (config.json + safetensors)")
    b.add_argument("--aux-layer-ids", type=int, nargs=3, required=True)
    b.add_argument("--out", required=True)
    args = p.parse_args(argv)
    {"to-speculators": to_speculators, "to-eaglepipe": to_eaglepipe}[args.cmd](args)


if __name__ == "__main__":
    main()

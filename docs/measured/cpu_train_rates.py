"""CPU fp32 draft-training rate (train.run's CPU path: merged attention, chunked loss) for the SmolLM2-shaped draft,
on packed batches whose loss rows are the response share of each sequence (as in real traces), several settings in
one process so that their ratios share one machine load. Batch builder and timer: eaglepipe.bench_train."""
import json, sys, time
import torch
from eaglepipe.batches import collate
from eaglepipe.bench_train import PRESETS, measure
from eaglepipe.draft import DraftConfig

torch.set_num_threads(2)
target, cpu = PRESETS["smollm2-135m"], torch.device("cpu")


def batch_for(c, tokens, seq, response_share, steps):
    gen = torch.Generator().manual_seed(0)
    n = tokens // seq
    t, h = n * seq, c.target_hidden_size
    mask = torch.zeros(n, seq, dtype=torch.bool)
    mask[:, seq - int(seq * response_share):] = True  # the response: the tail of each conversation
    shard = {"input_ids": torch.randint(c.draft_vocab_size, (t,), generator=gen), "loss_mask": mask.flatten(),
             "aux": torch.randn(t, 3, h, generator=gen).to(torch.bfloat16),
             "final": torch.randn(t, h, generator=gen).to(torch.bfloat16), "cu_seqlens": torch.arange(0, t + 1, seq)}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[:c.draft_vocab_size] = True
    return collate(shard, list(range(n)), seq, torch.float32, cpu, t2d=t2d, steps=steps)


CONFIGS = [(8192, 3, 256, 0.32, "merged", "chunked"),   # today's default: 96-token responses, 32 % of tokens
           (8192, 3, 512, 0.55, "merged", "chunked"),   # 256-token responses, ~55 % of tokens
           (4096, 3, 512, 0.55, "merged", "chunked"),
           (8192, 4, 512, 0.55, "merged", "chunked"),
           (4096, 4, 512, 0.55, "merged", "chunked")]
rows = []
# round 0 warms the process up (its first minute runs several times slower); rounds 1 and 2 are the figures
for rnd, (vocab, ttt, seq, share, att, loss) in [(0, CONFIGS[0])] * 1 + [(r, x) for r in (1, 2) for x in CONFIGS]:
    c = DraftConfig.from_target(target, draft_vocab_size=vocab, aux_layer_ids=[2, 4, 5])
    b = batch_for(c, 1024, seq, share, ttt)
    r = measure(c, cpu, b, ttt, 12 if rnd == 0 else int(sys.argv[1]), 0, precision="fp32", attention=att, loss=loss)
    row = {"round": rnd, "draft_vocab": vocab, "ttt_steps": ttt, "seq_len": seq, "response_share": share, "attention": att,
           "loss": loss, "tokens": b.tokens, "ms_per_step": round(r["ms_per_step"]), "tok_s": round(r["tok_s"]),
           "at": time.strftime("%H:%M:%S")}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(sys.argv[2], "w"), indent=1)

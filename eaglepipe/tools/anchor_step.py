"""speculators' EAGLE-3 training step, the anchor that `python -m eaglepipe.tools.bench_train --anchor` times beside
ours: built as its trainer (`python -m speculators.train`, speculators 0.9.0) builds it for a draft of the same shape,
and run on random tensors of one packed row.

What its trainer does, reproduced here: a one-layer Llama draft (`Eagle3DraftModel`) with the verifier's sizes,
flex attention over document ids on CUDA (eager elsewhere: flex's backward needs CUDA), fp32 master weights under
bf16 autocast, its targets from the verifier's last hidden states through the frozen verifier lm_head inside the
forward, the KL loss over `ttt_steps` unrolled steps, Muon on the matrices and AdamW on the norms with linear warm-up
schedules, the gradient clipped to norm 1. Its forward is compiled by torch.compile when CUDA is available at import,
as in its own runs. The frozen embedding and lm_heads get random values (its trainer loads them from the verifier;
the timing does not depend on them).

Needs `pip install speculators==0.9.0` (it pulls `hs-connectors` and `datasets`); not a dependency of eaglepipe.
"""

from __future__ import annotations

from importlib import metadata

import torch

from ..draft import DraftConfig

VERSION = "0.9.0"


def check() -> None:
    """Exit with the install command unless speculators VERSION is importable: called before anything is measured."""
    try:
        import speculators.models.eagle3  # noqa: F401
        import speculators.train.trainer  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--anchor times speculators' trainer: pip install speculators=={VERSION} ({e})") from e
    installed = metadata.version("speculators")
    if installed != VERSION:
        raise SystemExit(f"--anchor is written against speculators {VERSION}; this is {installed}: "
                         f"pip install speculators=={VERSION}")


def stepper(config: DraftConfig, device: torch.device, tokens: int, seq_len: int, ttt_steps: int, seed: int):
    """Its training step on one packed row of `tokens` tokens in sequences of seq_len: step(keep_grad=False) -> (the
    loss, None), as bench_train's own steppers."""
    check()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import LlamaConfig, get_linear_schedule_with_warmup

    torch.manual_seed(seed)
    layer = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                        head_dim=config.head_dim, hidden_act="silu", rms_norm_eps=config.rms_norm_eps,
                        max_position_embeddings=max(config.max_position_embeddings, seq_len + ttt_steps + 1),
                        tie_word_embeddings=False, layer_types=["full_attention"])
    layer.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    layer._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "eager"
    spec = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=config.draft_vocab_size, norm_before_residual=False,
        norm_before_fc=False, fc_norm=False, norm_output=False, embed_requires_grad=False,
        eagle_aux_hidden_state_layer_ids=list(config.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(spec)
    with torch.no_grad():  # its trainer loads these from the verifier; they start as NaN
        for module in (model.embed_tokens, model.lm_head, model.verifier_lm_head):
            module.weight.normal_(0, 0.02)
    model.to(device).train()
    optimizers = build_optimizers(model, TrainerConfig(lr=1e-3, num_epochs=2, save_path="unused", optimizer="muon",
                                                       muon_lr=1e-3))
    schedules = [get_linear_schedule_with_warmup(o, num_warmup_steps=10, num_training_steps=1000) for o in optimizers]
    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                    ttt_steps=ttt_steps, ttt_step_loss_decay=1.0)
    gen = torch.Generator().manual_seed(seed)
    at = torch.arange(tokens)
    batch = {  # what its collate function yields for one packed row (positions from 1, as its shift leaves them)
        "hidden_states": torch.randn(1, tokens, len(config.aux_layer_ids) * config.target_hidden_size, generator=gen),
        "verifier_last_hidden_states": torch.randn(1, tokens, config.target_hidden_size, generator=gen),
        "input_ids": torch.randint(0, config.vocab_size, (1, tokens), generator=gen),
        "loss_mask": torch.ones(1, tokens, dtype=torch.long),
        "position_ids": (at % seq_len + 1)[None],
        "document_ids": (at // seq_len)[None],
    }
    batch = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).to(device) for k, v in batch.items()}
    batch["error_records"] = 0
    params = [p for p in model.parameters() if p.requires_grad]

    def step(keep_grad: bool = False):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss, _ = model(**batch, **kwargs)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for o in optimizers:
            o.step()
        for s in schedules:
            s.step()
        return loss.detach(), None
    return step

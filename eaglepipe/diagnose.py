"""Diagnosis of a served acceptance shortfall: re-serve the draft with the documented integration faults undone.

Two causes collapse served acceptance while the draft itself is fine (REFERENCE section 4): aux layer ids off by one
(engines number layers differently) and a chat template at serving time that differs from the one the traces used.
On a few prompts at one k, the draft is served with its layer ids shifted by one each way (a variant config.json in a
temporary folder beside the same weights) and the prompts rendered in template variants; a variant whose served tau
recovers by more than the tolerance names the cause.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from .chat import render_chat

log = logging.getLogger(__name__)


def counted(before: dict, after: dict) -> tuple[float, int, list[int]]:
    """Between two readings of an engine's spec-decode counters: served tau pooled over the verify steps, the drafts
    behind it and the drafts with at least i+1 tokens accepted, per position i."""
    drafts = after["drafts"] - before["drafts"]
    per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] or
                                     [0] * len(after["accepted_per_pos"]))]
    return 1 + (after["accepted_tokens"] - before["accepted_tokens"]) / max(drafts, 1), drafts, per_pos


def served_tau(eng, prompts: list[list[int]], sampling) -> tuple[float, int, float]:
    """Mean acceptance length over `prompts` from the engine's counters, the drafts behind it and its standard error."""
    before = eng.spec_counters()
    eng.generate(prompts, sampling)
    tau, drafts, per_pos = counted(before, eng.spec_counters())
    return tau, drafts, std_error(per_pos, drafts)


def std_error(accepted_per_pos: list[int], drafts: int) -> float:
    """Standard error of the mean accepted length; per_pos[i] counts drafts with at least i+1 tokens accepted."""
    if drafts < 2:
        return float("inf")
    mean = sum(accepted_per_pos) / drafts
    second = sum((2 * i + 1) * n for i, n in enumerate(accepted_per_pos)) / drafts  # E[X^2] = sum (2i-1) P(X >= i)
    return max(second - mean * mean, 0.0) ** 0.5 / drafts ** 0.5


TRACED = "prompt ids the traces used"


def skipped_variants(multi_turn: str) -> dict[str, str]:
    """Template variants not comparable with what is served under this generation.multi_turn, each with why."""
    if multi_turn == "all":
        # The stored prompt ids hold the target's regenerated earlier turns, the served prompts the given ones: they
        # differ whatever the template, so serving them would blame the template wrongly.
        return {TRACED: "not tried: generation.multi_turn is 'all', so the traces' prompt ids hold regenerated "
                        "earlier turns, not the conversation served"}
    return {}


def template_variants(tokenizer, conversations: list[list[dict]], template_kwargs: dict,
                      traced: list[list[int]] | None, target_tokenizer=None,
                      multi_turn: str = "last") -> dict[str, list[list[int]]]:
    """Prompt ids per rendering that differs from the served one: traces' own ids (not under multi_turn `all`), the
    target's own template (when an override template is served), system prompt, generation prompt, template kwargs."""
    def render(tok, messages, kwargs, generation_prompt=True):
        return render_chat(tok, messages, kwargs, generation_prompt=generation_prompt)

    served = [render(tokenizer, m, template_kwargs) for m in conversations]
    variants = {
        TRACED: traced,
        "the target's own chat template": None if target_tokenizer is None else
        [render(target_tokenizer, m, template_kwargs) for m in conversations],
        "without add_generation_prompt": [render(tokenizer, m, template_kwargs, False) for m in conversations],
        # An empty system turn suppresses a template's default system prompt (SmolLM2's ChatML template has one).
        "empty system prompt": [
            render(tokenizer, m if m[0]["role"] == "system" else [{"role": "system", "content": ""}, *m],
                   template_kwargs) for m in conversations],
        "system turns dropped": [render(tokenizer, [t for t in m if t["role"] != "system"] or m, template_kwargs)
                                 for m in conversations],
        "without template kwargs": [render(tokenizer, m, {}) for m in conversations] if template_kwargs else None,
    }
    skipped = skipped_variants(multi_turn)
    return {name: ids for name, ids in variants.items() if ids is not None and ids != served and name not in skipped}


def shifted_draft(draft_dir: Path, folder: Path, shift: int) -> tuple[Path, list[int]]:
    """A draft folder whose config has every aux layer id moved by `shift`; the weights are the same file."""
    config = json.loads((draft_dir / "config.json").read_text())
    ids = [k + shift for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    out = folder / f"shift{shift:+d}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "model.safetensors").symlink_to((draft_dir / "model.safetensors").resolve())
    return out, ids


def layer_shifts(open_engine, settings, draft_dir: Path, *, k: int, prompts: list[list[int]], sampling,
                 num_layers: int) -> list[dict]:
    """Served tau of the draft with its aux layer ids moved by -1 and +1 (ids outside the target are not served)."""
    draft_dir, results = Path(draft_dir), []
    folder = Path(tempfile.mkdtemp(prefix="eaglepipe-diagnose-"))
    try:
        for shift in (-1, 1):
            path, shifted = shifted_draft(draft_dir, folder, shift)
            if min(shifted) < 0 or max(shifted) >= num_layers:
                log.info("diagnosis: layer ids %s fall outside the target's %d layers; not served", shifted, num_layers)
                continue
            with open_engine(replace(settings, draft=str(path), num_speculative_tokens=k)) as eng:
                tau, n, se = served_tau(eng, prompts, sampling)
            log.info("diagnosis k=%d: aux layer ids %s -> served tau %.3f (%d drafts)", k, shifted, tau, n)
            results.append({"variant": f"aux layer ids {shift:+d}", "kind": "layer_ids", "shift": shift,
                            "layer_ids": shifted, "served_tau": tau, "drafts": n, "std_error": se})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def name_cause(results: list[dict], *, offline: float, tolerance: float) -> str | None:
    """The variant that recovers served tau by more than the tolerance and twice the noise of the difference (few
    prompts, so chance alone moves tau), said in words; None when none does."""
    base = results[0]
    best = max(results[1:], key=lambda r: r["served_tau"], default=None)
    if best is None:
        return None
    gain, noise = best["served_tau"] - base["served_tau"], 2 * (base["std_error"] ** 2 + best["std_error"] ** 2) ** 0.5
    if gain <= tolerance * offline or gain <= noise:
        return None
    recovered = (f"served tau recovers to {best['served_tau']:.3f} (from {base['served_tau']:.3f}; "
                 f"offline {offline:.3f})")
    if best["kind"] == "layer_ids":
        # Serving with ids moved by `shift` recovers, so the config's ids are off by -shift.
        return (f"aux layer ids off by {-best['shift']:+d}: draft config has {base['layer_ids']}, {recovered} "
                f"with {best['layer_ids']}")
    return (f"chat template at serving differs from the traces': {recovered} with the prompts rendered as "
            f"'{best['variant']}'")

